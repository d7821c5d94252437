"""AsyncEngine: the asyncio frontend (after vLLM v1's AsyncLLM). The engine core runs in a
background process; requests go in over ZMQ ROUTER -> DEALER, outputs come back PUSH -> PULL,
all msgpack. Per-request collectors merge outputs when the consumer is slow; a dead core fails
every waiter with EngineDeadError. Nothing but the event loop's own references keeps an engine
alive: one that is garbage-collected shuts its core down (a finalizer, as vLLM's AsyncLLM)."""

from __future__ import annotations

import asyncio
import atexit
import itertools
import json
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
import weakref
from dataclasses import asdict
from typing import Any, AsyncGenerator

import zmq

from engine.config import EngineConfig
from engine.tokenizer import load_tokenizer
from engine.errors import EngineDeadError, EngineGenerateError, EngineUnhealthyError
from engine.inputs import is_single_prompt, tokenize_prompt, validate_params, validate_prompt_ids
from engine.messages import (
    INVALID, AbortRequests, AddRequest, CallResult, EngineOutput, Fatal, Ready, RequestError, Shutdown,
    PauseMode, StepOutputs, UtilityCall, error_for,
)
from engine.output_processor import RequestState
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.serial import Decoder, Encoder
from engine.standby import hand_over, start_core

log = logging.getLogger(__name__)


class _Collector:
    """One request's accumulated state; `event` wakes its consumer, who reads everything new."""

    def __init__(self, state: RequestState):
        self.state = state
        self.event = asyncio.Event()
        self.error: RequestError | None = None


class AsyncEngine:
    num_workers = 1  # one worker on one device: one rank in a weight-sync group (EngineClient)

    def __init__(self, cfg: EngineConfig, log_level: str = "WARNING", start_timeout: float = 300.0,
                 standby: subprocess.Popen | None = None):
        """Starts the core process, or hands `standby` (from `engine.standby.spawn_standby`, still
        alive) its arguments instead."""
        self.cfg = cfg
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
        core_args = ["--config-json", json.dumps(asdict(cfg)), "--input-addr", in_addr, "--output-addr", out_addr,
                     "--identity", self._identity.decode(), "--parent-pid", str(os.getpid()), "--log-level", log_level]
        self.proc = standby if standby is not None and hand_over(standby, core_args) else start_core(core_args)
        self._shutdown_called = False
        self._threads: list[threading.Thread] = []  # the output reader, once started
        self._stop_reading = threading.Event()
        # Everything the finalizer needs, and nothing that refers back to the engine, so that an
        # engine dropped without shutdown() is still collected and its core stopped.
        self._finalizer = weakref.finalize(
            self, _release, self.proc, self._in, self._out_sync, self._zctx, self._identity, self._dir,
            self._stop_reading, self._threads)
        atexit.register(_kill_quietly, weakref.ref(self))
        try:
            self.tokenizer = load_tokenizer(cfg.tokenizer)  # while the core starts, not before
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
        self.dead_reason = ""  # what the core said before it died (a Fatal), if anything
        threading.Thread(target=_watch_process, args=(self.proc, weakref.ref(self)), daemon=True,
                         name="engine-watch").start()

    # -- lifecycle ----------------------------------------------------------------------------
    def _handshake(self, timeout: float) -> Ready:
        deadline = time.monotonic() + timeout
        poller = zmq.Poller()
        poller.register(self._in, zmq.POLLIN)
        poller.register(self._out_sync, zmq.POLLIN)
        got_identity, ready = False, None
        while not (got_identity and ready):
            if self.proc.poll() is not None:
                why = self._last_word()
                raise RuntimeError(f"engine core process exited with code {self.proc.returncode} during startup"
                                   + (f": {why}" if why else ""))
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
                    elif isinstance(msg, Fatal):
                        self.dead_reason = msg.error
        return ready

    def _last_word(self, wait_s: float = 1.0) -> str:
        """What a core that exited during start-up said why (core_proc's Fatal), if it did."""
        deadline = time.monotonic() + wait_s
        while not self.dead_reason and self._out_sync.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            msg = self._decoder.decode(self._out_sync.recv_multipart())
            if isinstance(msg, Fatal):
                self.dead_reason = msg.error
        return self.dead_reason

    def _on_core_exit(self) -> None:
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
                fut.set_exception(EngineDeadError(self._dead_message()))

    def _dead_message(self) -> str:
        return "engine core process died" + (f": {self.dead_reason}" if self.dead_reason else "")

    def _ensure_started(self) -> None:
        if self.dead or self.proc.poll() is not None:
            self.dead = True
            raise EngineDeadError(self._dead_message())
        if self._shutdown_called:
            raise EngineDeadError("engine was shut down")
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            reader = threading.Thread(target=_read_outputs, daemon=True, name="engine-outputs",
                                      args=(weakref.ref(self), self._out_sync, self._decoder, loop, self._stop_reading))
            self._threads.append(reader)
            reader.start()
        elif loop is not self._loop:
            raise RuntimeError("AsyncEngine is bound to the event loop it was first used in")

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
                    fut.set_exception(error_for(msg.error_kind, msg.error))
        elif isinstance(msg, RequestError):
            c = self.requests.get(msg.request_id)
            if c is not None:
                c.error = msg
                c.event.set()
        elif isinstance(msg, Fatal):  # the core is about to exit: it cannot serve any more
            self.dead, self.dead_reason = True, msg.error
            self._fail_all()

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
        self._finalizer.detach()
        _release(self.proc, self._in, self._out_sync, self._zctx, self._identity, self._dir, self._stop_reading,
                 self._threads, timeout)
        # whoever still waits on this engine (a call stuck behind a stalled push) hears it is gone
        # (getattr: a core that failed its start-up is shut down before these exist)
        self.dead, self.dead_reason = True, getattr(self, "dead_reason", "") or "engine was shut down"
        loop = getattr(self, "_loop", None)
        if loop is not None and not loop.is_closed():
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop:
                self._fail_all()
            else:
                try:
                    loop.call_soon_threadsafe(self._fail_all)
                except RuntimeError:
                    pass

    # -- requests -----------------------------------------------------------------------------
    def generate(
        self, prompt, sampling_params: SamplingParams | list[SamplingParams] | None = None,
        request_id: str | list[str] | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream outputs of one request (n completions), or of several when `prompt` is a list of
        prompts (with a list of request ids, or none), their outputs interleaved as they come.
        Closing or cancelling the generator aborts its requests. Bad input raises ValueError; a
        dead core raises EngineDeadError."""
        if not _is_prompt_list(prompt):
            if isinstance(request_id, (list, tuple)):
                raise ValueError(f"{len(request_id)} request ids for one prompt: a list of request ids goes with "
                                 "a list of prompts")
            if isinstance(sampling_params, (list, tuple)):
                raise ValueError("a list of sampling params goes with a list of prompts")
            return self._generate_one(prompt, sampling_params, request_id)
        prompts = list(prompt)
        ids = list(request_id) if isinstance(request_id, (list, tuple)) else None
        if request_id is not None and ids is None:
            raise ValueError(f"{len(prompts)} prompts but one request id: give a list of {len(prompts)}")
        if ids is not None and len(ids) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(ids)} request ids")
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = ids or [uuid.uuid4().hex for _ in prompts]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids must be distinct")
        return self._generate_many(prompts, params, ids)

    async def _generate_many(self, prompts: list, params: list, ids: list[str]) -> AsyncGenerator[RequestOutput, None]:
        """Several requests as one stream: each runs in its own task feeding one queue."""
        self._ensure_started()
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def feed(gen):
            try:
                async for out in gen:
                    queue.put_nowait(out)
                queue.put_nowait(done)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, who re-raises it
                queue.put_nowait(e)

        gens = [self._generate_one(p, sp, rid) for p, sp, rid in zip(prompts, params, ids)]
        tasks = [asyncio.ensure_future(feed(g)) for g in gens]
        try:
            left = len(tasks)
            while left:
                item = await queue.get()
                if item is done:
                    left -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()  # cancelling a feeder closes its generator, which aborts its request
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _generate_one(self, prompt, sampling_params: SamplingParams | None,
                            request_id: str | None) -> AsyncGenerator[RequestOutput, None]:
        self._ensure_started()
        params = sampling_params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        text, ids = tokenize_prompt(prompt, self.tokenizer)
        validate_prompt_ids(ids, self.cfg.max_model_len, self.vocab_size)
        validate_params(params, self.vocab_size, self.cfg.max_logprobs)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        collector = _Collector(RequestState(request_id, text, ids, params, self.tokenizer))
        self.requests[request_id] = collector
        finished = False
        try:
            self._send(AddRequest(request_id, ids, params))
            delta = params.output_kind == "delta"
            while True:
                await collector.event.wait()
                collector.event.clear()
                if collector.error is not None:
                    e = collector.error
                    raise (ValueError if e.error_kind == INVALID else EngineGenerateError)(e.error)
                if self.dead and not collector.state.finished:
                    error = EngineDeadError(self._dead_message())
                    error.partial = collector.state.make_output(self.tokenizer)  # for a resubmission elsewhere
                    raise error
                if params.output_kind == "final" and not collector.state.finished:
                    continue  # nothing to hand out yet: no decode per step
                out = collector.state.make_output(self.tokenizer, delta=delta)
                finished = out.finished
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
        """Abort requests; their generators end with finish_reason "abort" and the partial tokens.
        Final at once, as vLLM's frontend: whatever the core sends for them later is dropped, so a
        request whose last step was running still ends as aborted."""
        self._ensure_started()
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            c = self.requests.get(rid)
            if c is not None:
                c.state.abort()
                c.event.set()
        self._send(AbortRequests(ids))

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

    async def pause_generation(self, mode: PauseMode = "abort", clear_cache: bool = True) -> None:
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


def _is_prompt_list(prompt) -> bool:
    """Several prompts (strs, token-id lists, conversations, dicts), not one prompt of token ids
    or one conversation; an empty or malformed list counts as one prompt, to fail as one."""
    return (isinstance(prompt, (list, tuple)) and len(prompt) > 0 and not is_single_prompt(prompt)
            and all(isinstance(p, (str, dict, list, tuple)) for p in prompt))


def _watch_process(proc: subprocess.Popen, ref) -> None:
    """Thread: waits for the core to exit and tells the engine, if anyone still holds it."""
    proc.wait()
    engine = ref()
    if engine is not None:
        engine._on_core_exit()


def _read_outputs(ref, sock, decoder: Decoder, loop: asyncio.AbstractEventLoop, stop: threading.Event) -> None:
    """Output thread: receives and decodes the core's messages and hands them to the event loop.
    A thread rather than a zmq.asyncio socket so that nothing of ours stays registered with the
    loop after shutdown (a later engine's socket may reuse the file descriptor). It holds the
    engine only by a weak reference, so that a dropped engine is collected."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while not stop.is_set():
        try:
            if not poller.poll(100):
                continue
            frames = sock.recv_multipart(copy=False)
        except zmq.ZMQError:  # closed under us by the finalizer
            return
        try:
            msg = decoder.decode([f.buffer for f in frames])
        except Exception as e:
            log.error("undecodable output from the engine core: %s", e)
            continue
        engine = ref()
        if engine is None:
            return
        try:
            loop.call_soon_threadsafe(engine._dispatch, msg)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            return
        finally:
            del engine


def _release(proc: subprocess.Popen, in_sock, out_sock, zctx, identity: bytes, tmpdir: str, stop: threading.Event,
             threads: list, timeout: float = 2.0) -> None:
    """Stop the core (Shutdown, then SIGKILL after `timeout`) and free the sockets. Called by
    shutdown(), or by the finalizer of an engine nobody holds any more."""
    if proc.poll() is None:
        try:
            in_sock.send_multipart([identity, *Encoder().encode(Shutdown())], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    stop.set()
    for t in threads:
        if t is not threading.current_thread():
            t.join(timeout=2.0)
    in_sock.close(0)
    out_sock.close(0)
    zctx.term()
    shutil.rmtree(tmpdir, ignore_errors=True)


def _kill_quietly(ref) -> None:
    engine = ref()
    if engine is not None and engine.proc.poll() is None:
        engine.proc.kill()
