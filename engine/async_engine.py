"""AsyncEngine: the asyncio frontend (after vLLM v1's AsyncLLM). The engine core runs in a
background process; requests go in over ZMQ ROUTER -> DEALER, outputs come back PUSH -> PULL,
all msgpack. Per-request collectors merge outputs when the consumer is slow; a dead core fails
every waiter with EngineDeadError."""

from __future__ import annotations

import asyncio
import atexit
import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from dataclasses import asdict
from typing import Any, AsyncGenerator

import zmq

from engine.config import EngineConfig
from engine.core import load_tokenizer
from engine.errors import EngineDeadError, EngineGenerateError, EngineUnhealthyError
from engine.inputs import tokenize_prompt, validate_prompt_ids
from engine.messages import (
    INVALID, AbortRequests, AddRequest, CallResult, EngineOutput, Ready, RequestError, Shutdown, StepOutputs,
    UtilityCall,
)
from engine.output_processor import RequestState
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.serial import Decoder, Encoder

log = logging.getLogger(__name__)


class _Collector:
    """One request's accumulated state; `event` wakes its consumer, who reads everything new."""

    def __init__(self, state: RequestState):
        self.state = state
        self.event = asyncio.Event()
        self.error: RequestError | None = None


class AsyncEngine:
    def __init__(self, cfg: EngineConfig, log_level: str = "WARNING", start_timeout: float = 300.0):
        self.cfg = cfg
        self.tokenizer = load_tokenizer(cfg.tokenizer)
        self._dir = tempfile.mkdtemp(prefix="engine-")
        in_addr, out_addr = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._zctx = zmq.Context()
        self._in = self._zctx.socket(zmq.ROUTER)
        self._in.setsockopt(zmq.SNDHWM, 0)  # a ROUTER drops at its high-water mark: never drop
        self._in.setsockopt(zmq.LINGER, 0)
        self._in.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._in.bind(in_addr)
        self._out_sync = self._zctx.socket(zmq.PULL)
        self._out_sync.setsockopt(zmq.LINGER, 0)
        self._out_sync.bind(out_addr)
        self._identity = uuid.uuid4().hex.encode()
        self._encoder, self._decoder = Encoder(), Decoder(EngineOutput)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine.core_proc", "--config-json", json.dumps(asdict(cfg)),
             "--input-addr", in_addr, "--output-addr", out_addr, "--identity", self._identity.decode(),
             "--parent-pid", str(os.getpid()), "--log-level", log_level],
            env={**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])},
        )
        self._shutdown_called = False
        self._reader: threading.Thread | None = None
        self._stop_reading = False
        atexit.register(_kill_quietly, weakref.ref(self))
        try:
            ready = self._handshake(start_timeout)
        except BaseException:
            self.shutdown()
            raise
        self.vocab_size = ready.vocab_size
        self.num_kv_blocks = ready.num_kv_blocks
        self.requests: dict[str, _Collector] = {}
        self.calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.dead = False
        threading.Thread(target=self._watch_process, daemon=True, name="engine-watch").start()

    # -- lifecycle ----------------------------------------------------------------------------
    def _handshake(self, timeout: float) -> Ready:
        deadline = time.monotonic() + timeout
        poller = zmq.Poller()
        poller.register(self._in, zmq.POLLIN)
        poller.register(self._out_sync, zmq.POLLIN)
        got_identity, ready = False, None
        while not (got_identity and ready):
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine core process exited with code {self.proc.returncode} during startup")
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine core not ready after {timeout:.0f}s")
            for sock, _ in poller.poll(200):
                if sock is self._in:
                    identity, *_ = self._in.recv_multipart()
                    got_identity = identity == self._identity
                else:
                    msg = self._decoder.decode(self._out_sync.recv_multipart())
                    if isinstance(msg, Ready):
                        ready = msg
        return ready

    def _watch_process(self) -> None:
        self.proc.wait()
        if self._shutdown_called:
            return
        code = self.proc.returncode
        # Exit code 0 is an exit the core chose (SIGTERM, a Shutdown): not an error, but gone all the same.
        log.log(logging.INFO if code == 0 else logging.ERROR, "engine core process %s (exit code %s)",
                "exited" if code == 0 else "died", code)
        self.dead = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._fail_all)
            except RuntimeError:
                pass

    def _fail_all(self) -> None:
        for c in self.requests.values():
            c.event.set()
        for fut in self.calls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError("engine core process died"))

    def _ensure_started(self) -> None:
        if self.dead or self.proc.poll() is not None:
            self.dead = True
            raise EngineDeadError("engine core process is dead")
        if self._shutdown_called:
            raise EngineDeadError("engine was shut down")
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            self._reader = threading.Thread(target=self._read_outputs, daemon=True, name="engine-outputs")
            self._reader.start()
        elif loop is not self._loop:
            raise RuntimeError("AsyncEngine is bound to the event loop it was first used in")

    def _read_outputs(self) -> None:
        """Output thread: receives and decodes the core's messages and hands them to the event
        loop. A thread rather than a zmq.asyncio socket so that nothing of ours stays registered
        with the loop after shutdown (a later engine's socket may reuse the file descriptor)."""
        poller = zmq.Poller()
        poller.register(self._out_sync, zmq.POLLIN)
        while not self._stop_reading:
            if not poller.poll(100):
                continue
            frames = self._out_sync.recv_multipart(copy=False)
            try:
                msg = self._decoder.decode([f.buffer for f in frames])
            except Exception as e:
                log.error("undecodable output from the engine core: %s", e)
                continue
            try:
                self._loop.call_soon_threadsafe(self._dispatch, msg)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                return

    def _dispatch(self, msg) -> None:
        if isinstance(msg, StepOutputs):
            for d in msg.deltas:
                c = self.requests.get(d.request_id)
                if c is not None:
                    c.state.apply(d)
                    c.event.set()
        elif isinstance(msg, CallResult):
            fut = self.calls.pop(msg.call_id, None)
            if fut is not None and not fut.done():
                if msg.ok:
                    fut.set_result(msg.value)
                else:
                    fut.set_exception((ValueError if msg.error_kind == INVALID else RuntimeError)(msg.error))
        elif isinstance(msg, RequestError):
            c = self.requests.get(msg.request_id)
            if c is not None:
                c.error = msg
                c.event.set()

    def _send(self, msg) -> None:
        try:
            self._in.send_multipart([self._identity, *self._encoder.encode(msg)], copy=False)
        except zmq.ZMQError as e:
            self.dead = True
            raise EngineDeadError(f"cannot reach the engine core: {e}") from e

    @property
    def errored(self) -> bool:
        return self.dead or self.proc.poll() is not None

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the core process and release every socket; leaves no process behind."""
        if self._shutdown_called:
            return
        self._shutdown_called = True
        if self.proc.poll() is None:
            try:
                self._in.send_multipart([self._identity, *self._encoder.encode(Shutdown())], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._stop_reader()
        self._in.close(0)
        self._out_sync.close(0)
        self._zctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _stop_reader(self) -> None:
        self._stop_reading = True
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout=2.0)

    # -- requests -----------------------------------------------------------------------------
    async def generate(
        self, prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream outputs of one request (n completions). Closing or cancelling the generator
        aborts the request. Bad input raises ValueError; a dead core raises EngineDeadError."""
        self._ensure_started()
        params = sampling_params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        text, ids = tokenize_prompt(prompt, self.tokenizer)
        validate_prompt_ids(ids, self.cfg.max_model_len, self.vocab_size)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        collector = _Collector(RequestState(request_id, text, ids, params))
        self.requests[request_id] = collector
        finished = False
        try:
            self._send(AddRequest(request_id, ids, params.to_dict()))
            delta = params.output_kind == "delta"
            while True:
                await collector.event.wait()
                collector.event.clear()
                if collector.error is not None:
                    e = collector.error
                    raise (ValueError if e.error_kind == INVALID else EngineGenerateError)(e.error)
                if self.dead and not collector.state.finished:
                    raise EngineDeadError("engine core process died")
                out = collector.state.make_output(self.tokenizer, delta=delta)
                finished = out.finished
                if finished or params.output_kind != "final":
                    yield out
                if finished:
                    return
        finally:
            self.requests.pop(request_id, None)
            if not finished and not self.dead and not self._shutdown_called:
                try:
                    self._send(AbortRequests([request_id]))
                except EngineDeadError:
                    pass

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort requests; their generators end with finish_reason "abort" and the partial tokens."""
        self._ensure_started()
        self._send(AbortRequests([request_id] if isinstance(request_id, str) else list(request_id)))

    async def _call(self, method: str, *args, timeout: float | None = None, **kwargs) -> Any:
        self._ensure_started()
        call_id = next(self._call_ids)
        fut = self._loop.create_future()
        self.calls[call_id] = fut
        try:
            self._send(UtilityCall(call_id, method, list(args), kwargs))
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"engine call {method!r} timed out after {timeout}s") from None
        finally:
            self.calls.pop(call_id, None)

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """abort: end in-flight requests now (finish_reason "abort"); wait: let them finish;
        keep: freeze them in place. New requests wait until resume_generation()."""
        await self._call("pause", mode=mode, clear_cache=clear_cache)

    async def resume_generation(self) -> None:
        await self._call("resume")

    async def is_paused(self) -> bool:
        return await self._call("is_paused")

    async def collective_rpc(
        self, method: str, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None
    ) -> list:
        """Call `method` on every worker; returns one result per worker. Only the worker's RPC
        methods and those of its extension class are callable."""
        if not isinstance(method, str):
            raise TypeError("collective_rpc takes a method name (callables would need pickle)")
        return await self._call("collective_rpc", method, list(args), kwargs or {}, timeout=timeout)

    async def set_weight_version(self, version: int) -> int:
        """Tag every token sampled from now on with `version`."""
        return await self._call("set_weight_version", version)

    async def reset_prefix_cache(self) -> bool:
        return await self._call("reset_prefix_cache")

    async def sleep(self, level: int = 1) -> None:
        """Level 1 frees the KV cache, level 2 the weights too. In-flight requests are aborted."""
        await self._call("sleep", level)

    async def wake_up(self) -> None:
        await self._call("wake_up")

    async def check_health(self, timeout: float = 30.0) -> dict:
        """Raises EngineDeadError if the core is gone, EngineUnhealthyError (with the problems:
        weights released, no KV cache, a fixed-input forward failing or not finite, a broken
        extension state) if it cannot serve, TimeoutError if it does not answer in `timeout`.
        Returns the worker's report ({"ok", "problems", "weight_version"})."""
        if self.errored:
            raise EngineDeadError("engine core process is dead")
        report = await self._call("check_health", timeout=timeout)
        if not report["ok"]:
            raise EngineUnhealthyError(report["problems"])
        return report

    async def get_stats(self) -> dict:
        return await self._call("stats")


def _kill_quietly(ref) -> None:
    engine = ref()
    if engine is not None and engine.proc.poll() is None:
        engine.proc.kill()
