"""AsyncEngine: the asyncio frontend (after vLLM v1's AsyncLLM). The engine core runs in a
background process reached through a `CoreConnection` (engine/core_connection.py: ZMQ, msgpack);
per-request collectors (engine/output_collector.py) merge outputs when the consumer is slow; a
dead core fails every waiter with EngineDeadError. Nothing but the event loop's own references
keeps an engine alive: one that is garbage-collected shuts its core down (a finalizer, as vLLM's
AsyncLLM)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import subprocess
import uuid
import weakref
from contextlib import aclosing
from typing import Any, AsyncGenerator

import zmq

from engine.config import EngineConfig
from engine.core_connection import CoreConnection
from engine.errors import EngineDeadError, EngineGenerateError, EngineUnhealthyError
from engine.inputs import (
    check_one_request, is_prompt_list, request_lists, tokenize_prompt, validate_params, validate_prompt_ids,
)
from engine.messages import (
    INVALID, AbortRequests, AddRequest, CallResult, Fatal, RequestError, PauseMode, StepOutputs, UtilityCall,
    error_for,
)
from engine.output_collector import RequestCollector, interleave
from engine.output_processor import RequestState
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


class AsyncEngine:
    num_workers = 1  # one worker on one device: one rank in a weight-sync group (EngineClient)

    def __init__(self, cfg: EngineConfig, log_level: str = "WARNING", start_timeout: float = 300.0,
                 standby: subprocess.Popen | None = None):
        """Starts the core process, or hands `standby` (from `engine.standby.spawn_standby`, still
        alive) its arguments instead."""
        self.cfg = cfg
        self.prefix_cache_keyed_by_version = True  # a commit keeps the cache (engine/block_manager.py)
        self._core = CoreConnection(cfg, log_level, standby)
        self.proc = self._core.proc
        self._shutdown_called = False
        # The finalizer holds the connection, which never refers back to the engine: an engine
        # dropped without shutdown() is still collected and its core stopped.
        self._finalizer = weakref.finalize(self, self._core.close)
        try:
            self.tokenizer = load_tokenizer(cfg.tokenizer)  # while the core starts, not before
            ready = self._core.handshake(start_timeout)
        except BaseException:
            self.dead_reason = self._core.fatal
            self.shutdown()
            raise
        self.vocab_size = ready.vocab_size
        self.num_kv_blocks = ready.num_kv_blocks
        self.quantized_bytes = ready.quantized_bytes  # the 8-bit copy's memory (cfg.quantization)
        self.requests: dict[str, RequestCollector] = {}
        self.calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.dead = False
        self.dead_reason = ""  # what the core said before it died (a Fatal), if anything
        self._core.watch(weakref.WeakMethod(self._on_core_exit))

    # -- lifecycle ----------------------------------------------------------------------------
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
            self._core.start_reader(weakref.WeakMethod(self._dispatch), loop)
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
            self._core.send(msg)
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
        self._core.close(timeout)
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
        if not is_prompt_list(prompt):
            check_one_request(sampling_params, request_id)
            return self._generate_one(prompt, sampling_params, request_id)
        return self._generate_many(*request_lists(list(prompt), sampling_params, request_id))

    async def _generate_many(self, prompts: list, params: list, ids: list[str]) -> AsyncGenerator[RequestOutput, None]:
        """Several requests as one stream (output_collector.interleave); leaving it aborts them all."""
        self._ensure_started()
        streams = [self._generate_one(p, sp, rid) for p, sp, rid in zip(prompts, params, ids)]
        async with aclosing(interleave(streams)) as outs:
            async for out in outs:
                yield out

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
        collector = RequestCollector(RequestState(request_id, text, ids, params, self.tokenizer))
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

