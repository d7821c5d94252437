"""VllmEngine: vLLM's own AsyncLLM behind the surface of engine.AsyncEngine that the rollout
manager, its supervisor, the HTTP front and weight sync use (`rollout.serve --engine vllm`).

vLLM is imported only by engine/vllm_*.py (this adapter, how it starts: vllm_start.py, and the
conversions: vllm_convert.py) and the vLLM-side weight receiver, and only when an engine is built.
Requests, pauses and control calls go to AsyncLLM as they are; what differs is converted in one
place (vllm_convert.py) and gathered by our own RequestState, so outputs mean what our engine's
mean: output_kind delta / cumulative / final, `.logprobs` one float per token from the sampling
distribution (logprobs_mode "processed_logprobs"), finish reason "abort" for cut requests, and
the weight version of every token, as vLLM's core stamped it.

Death, as engine.AsyncEngine: once vLLM's core or a worker dies, `errored` is true, every
request raises our EngineDeadError with `.partial` (its output so far: none for a "final"
request, whose tokens vLLM holds until it finishes, so it is resubmitted from its prompt) and
every control call in flight raises it too (vLLM leaves those waiting).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from engine.config import EngineConfig
from engine.tokenizer import load_tokenizer
from engine.errors import EngineDeadError, EngineGenerateError
from engine.inputs import tokenize_prompt, validate_params, validate_prompt_ids
from engine.messages import PAUSE_MODES, PauseMode, error_for
from engine.output_processor import RequestState
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.vllm_convert import (
    INITIAL_VERSION, completion_deltas, prompt_logprobs_of, sample_params, to_vllm_params, token_versions,
    version_spans,
)
from engine.vllm_start import CoreProcess, start_vllm

log = logging.getLogger(__name__)

# vLLM passes a worker's failure on as text, "Call to <method> method failed: <message>"; our
# receiver starts each message with its exception's class
_DEATH_POLL_S = 0.2  # how often a control call in flight checks that the engine still lives
_DEFERRED_POLL_S = 0.01  # how often a deferred worker answer is asked for (collective_rpc)


class _Request:
    """One request: our RequestState, and one vLLM request per sample (vLLM refuses n > 1 with
    greedy sampling; ours takes it), whose outputs their pumps put on `inbox`."""

    def __init__(self, state: RequestState, params: SamplingParams):
        self.state = state
        self.params = params
        self.children: list = []  # vLLM's output collectors; .request_id is vLLM's internal id
        self.pumps: list[asyncio.Task] = []
        self.inbox: asyncio.Queue = asyncio.Queue()  # (sample index, vLLM output or exception, spans)
        self.finish_sent: set[int] = set()  # samples whose end a delta output handed out already


def _only_news(out: RequestOutput, finish_sent: set[int]) -> bool:
    """Keep in a delta output only the samples with something new (vLLM's delta semantics: its
    samples end at different steps, and a sample's end is handed out once); whether any is left."""
    out.outputs = [c for c in out.outputs if c.token_ids or (c.finish_reason and c.index not in finish_sent)]
    finish_sent.update(c.index for c in out.outputs if c.finish_reason)
    return bool(out.outputs) or out.finished


async def _pump(req: _Request, index: int, collector, processor) -> None:
    """Moves sample `index`'s outputs from vLLM's collector to the request's inbox, each with
    its version spans read now: vLLM's state of a request lives until it finishes, and an output
    that finished carries its spans itself."""
    try:
        while True:
            out = collector.get_nowait() or await collector.get()
            running = processor.request_states.get(collector.request_id)
            req.inbox.put_nowait((index, out, version_spans(out.outputs[0], running)))
            if out.finished:
                return
    except Exception as e:  # noqa: BLE001 - handed to the request's consumer
        req.inbox.put_nowait((index, e, None))


class VllmEngine:
    def __init__(self, cfg: EngineConfig, tensor_parallel_size: int = 1, log_level: str = "WARNING",
                 standby=None):
        """Starts vLLM's engine core (and its workers) on `cfg`. `standby` is our engine's warm
        core process and is not used here (the sidecar does not spawn one for vLLM)."""
        del log_level, standby  # vLLM's logging comes from VLLM_LOGGING_LEVEL (apply_env_defaults)
        from vllm.platforms import current_platform

        self.cfg = cfg
        self.prefix_cache_keyed_by_version = False  # vLLM's is not: a commit resets it (EngineClient)
        self.tensor_parallel_size = tensor_parallel_size
        self.num_workers = tensor_parallel_size  # ranks in a weight-sync group (weight_sync.engine_side.engines)
        self.on_cpu = current_platform.is_cpu()
        if self.on_cpu != (cfg.device == "cpu"):
            raise ValueError(f"device {cfg.device!r} but the installed vLLM is its "
                             f"{'CPU' if self.on_cpu else current_platform.device_name} build")
        self.tokenizer = load_tokenizer(cfg.tokenizer)
        self._llm = start_vllm(cfg, tensor_parallel_size, self.on_cpu)
        self.vocab_size = self._llm.model_config.get_vocab_size()
        self.proc = CoreProcess(self._llm.engine_core.resources.engine_manager.processes[0])
        self.requests: dict[str, _Request] = {}
        self.version = INITIAL_VERSION
        self.dead_reason = ""
        self._shutdown_called = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._aborts: set[asyncio.Task] = set()  # aborts sent as requests end, held until done

    # -- lifecycle ----------------------------------------------------------------------------
    @property
    def errored(self) -> bool:
        if self._shutdown_called or self._llm.errored or self.proc.poll() is not None:
            if not self.dead_reason:
                code = self.proc.poll()
                self.dead_reason = ("engine was shut down" if self._shutdown_called else
                                    f"vLLM engine core died (exit code {code})" if code is not None else
                                    "vLLM engine core or one of its workers died")
            return True
        return False

    def _check_alive(self) -> None:
        if self.errored:
            raise EngineDeadError(self.dead_reason)
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif loop is not self._loop:
            raise RuntimeError("VllmEngine is bound to the event loop it was first used in")

    stop_grace_s = 30.0  # a sidecar's stop waits this long for vLLM's processes (vllm_start.WORKER_EXIT_S within)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop vLLM's core and workers; whoever still waits on this engine hears it is gone."""
        if self._shutdown_called:
            return
        self.errored  # noqa: B018 - records why, if it died before
        self._shutdown_called = True
        self._llm.shutdown(timeout=timeout)
        if self.proc.poll() is None:  # vLLM's own shutdown waits on its workers; ours is bounded
            self.proc.kill()
            self.proc.wait(5.0)
        self._llm = _Gone()  # released now, not at interpreter exit (where vLLM's __del__ fails)
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._fail_all)
            except RuntimeError:  # the loop closed meanwhile: nobody waits any more
                pass

    def _fail_all(self) -> None:
        """Wake every request still waiting on vLLM (whose output task is cancelled by now)."""
        from vllm.v1.engine.exceptions import EngineDeadError as VllmDead

        for req in self.requests.values():
            req.inbox.put_nowait((0, VllmDead(), None))

    # -- requests -----------------------------------------------------------------------------
    async def generate(self, prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Outputs of one request (its n completions), as engine.AsyncEngine.generate streams
        them. Bad input (a parameter vLLM cannot take included) raises ValueError; a dead
        engine raises EngineDeadError with `.partial`. Leaving early aborts the request."""
        self._check_alive()
        params = sampling_params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        text, ids = tokenize_prompt(prompt, self.tokenizer)
        validate_prompt_ids(ids, self.cfg.max_model_len, self.vocab_size)
        validate_params(params, self.vocab_size, self.cfg.max_logprobs)
        children = [to_vllm_params(p, self.on_cpu) for p in sample_params(params)]
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        req = _Request(RequestState(request_id, text, ids, params, self.tokenizer), params)
        self.requests[request_id] = req
        try:
            for i, child in enumerate(children):
                req.children.append(await self._add(req, f"{request_id}-{i}", ids, child))
                req.pumps.append(asyncio.ensure_future(_pump(req, i, req.children[i], self._llm.output_processor)))
            while True:
                self._apply(req, *await req.inbox.get())
                if params.output_kind == "final" and not req.state.finished:
                    continue
                out = req.state.make_output(self.tokenizer, delta=params.output_kind == "delta")
                if params.output_kind == "delta" and not _only_news(out, req.finish_sent):
                    continue
                yield out
                if out.finished:
                    return
        finally:
            self._release(request_id, req)

    def _release(self, request_id: str, req: _Request) -> None:
        """A request's end, however it ended: its pumps stopped, its unfinished samples aborted.
        Nothing here awaits: a caller cancelled again while it closes the stream (an HTTP client
        gone) must not skip the abort, nor its own bookkeeping after the close."""
        self.requests.pop(request_id, None)
        for t in req.pumps:
            t.cancel()
        unfinished = [q.request_id for q, o in zip(req.children, req.state.outputs) if o.finish_reason is None]
        if unfinished and not self.errored:
            task = asyncio.ensure_future(self._llm.abort(unfinished, internal=True))
            self._aborts.add(task)
            task.add_done_callback(self._aborts.discard)
        for q in req.children:
            q.close()

    async def _add(self, req: _Request, request_id: str, ids: list[int], vllm_params):
        from vllm.inputs.engine import tokens_input

        try:
            return await self._llm.add_request(request_id, tokens_input(ids), vllm_params)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - vLLM's dead-engine error, or a failure to add
            raise self._dead(req) if self.errored else EngineGenerateError(f"{type(e).__name__}: {e}") from e

    def _dead(self, req: _Request) -> EngineDeadError:
        error = EngineDeadError(self.dead_reason or "vLLM engine died")
        error.partial = req.state.make_output(self.tokenizer)  # for a resubmission elsewhere
        return error

    def _apply(self, req: _Request, index: int, out, spans: list[tuple[int, int]] | None) -> None:
        """Gather one vLLM output of sample `index` (deltas since the last, perhaps merged),
        its tokens tagged by `spans` ((first token index, version) pairs)."""
        if isinstance(out, Exception):  # vLLM's EngineDeadError, or its failure of this request
            if self.errored or type(out).__name__ == "EngineDeadError":
                raise self._dead(req) from out
            raise EngineGenerateError(f"{type(out).__name__}: {out}") from out
        state, [c] = req.state, out.outputs
        if c.finish_reason == "error":
            raise EngineGenerateError(f"vLLM failed request {state.request_id} (finish reason 'error')")
        mine = state.outputs[index]
        fallback = mine.weight_versions[-1] if mine.weight_versions else self.version
        versions = token_versions(spans, len(mine.token_ids), len(c.token_ids), fallback)
        c.index = index
        deltas = completion_deltas(state.request_id, c, versions, req.params.logprobs is not None)
        if out.prompt_logprobs:
            deltas[0].prompt_logprobs = prompt_logprobs_of(out)
        deltas[0].num_cached_tokens = out.num_cached_tokens or 0
        for d in deltas:
            state.apply(d)

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort requests: each generator ends with finish_reason "abort" and its tokens so far."""
        self._check_alive()
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        children = [q.request_id for rid in ids if rid in self.requests for q in self.requests[rid].children]
        if children:
            await self._llm.abort(children, internal=True)

    # -- control ------------------------------------------------------------------------------
    async def _call(self, coro, timeout: float | None = None) -> Any:
        """Await a call into vLLM, raising EngineDeadError as soon as the engine dies (vLLM
        leaves a call in flight waiting forever then) and TimeoutError after `timeout`."""
        try:
            self._check_alive()
        except BaseException:
            coro.close()
            raise
        task = asyncio.ensure_future(coro)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=_DEATH_POLL_S)
                if done:
                    return _result(task, self)
                if self.errored:
                    raise EngineDeadError(self.dead_reason)
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"vLLM engine call timed out after {timeout}s")
        finally:
            task.cancel()

    async def pause_generation(self, mode: PauseMode = "abort", clear_cache: bool = True) -> None:
        """abort: end in-flight requests now (finish_reason "abort"); wait: let them finish;
        keep: freeze them in place. New requests wait until resume_generation()."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        await self._call(self._llm.pause_generation(mode=mode, clear_cache=clear_cache))

    async def resume_generation(self) -> None:
        await self._call(self._llm.resume_generation())

    async def is_paused(self) -> bool:
        return await self._call(self._llm.is_paused())

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                             kwargs: dict | None = None) -> list:
        """`method` on every vLLM worker (its worker_extension_cls included); one result each.

        vLLM sends a worker's answer as soon as its method returns, so a worker whose answer must
        wait (our engine's workers return a Future) answers `{"deferred": method, "args",
        "pending"}` instead: that method is asked between steps until it answers something other
        than `pending`, and that answer is the result (the one poll on this side of the seam)."""
        if not isinstance(method, str):
            raise TypeError("collective_rpc takes a method name")
        deadline = None if timeout is None else time.monotonic() + timeout
        results = _raised(await self._call(self._llm.collective_rpc(method, timeout, tuple(args), kwargs or {})))
        while any(_deferred(r) for r in results):
            ask = next(r for r in results if _deferred(r))
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"vLLM workers did not answer {method} within {timeout}s")
            await asyncio.sleep(_DEFERRED_POLL_S)
            answers = _raised(await self._call(self._llm.collective_rpc(ask["deferred"], timeout, tuple(ask["args"]), {})))
            results = [a if _deferred(r) and a != r["pending"] else r for r, a in zip(results, answers)]
        return results

    async def set_weight_version(self, version: int) -> int:
        """Tag every token sampled from now on with `version`: vLLM's core stamps each step's
        outputs with it, so tokens it sampled before (read later or not) keep theirs."""
        await self._call(self._llm.update_weight_version(str(int(version))))
        self.version = int(version)
        return self.version

    async def reset_prefix_cache(self) -> bool:
        return await self._call(self._llm.reset_prefix_cache())

    async def sleep(self, level: int = 1) -> None:
        """vLLM's sleep: in-flight requests are aborted (vLLM's CPU build frees nothing)."""
        await self._call(self._llm.sleep(level))

    async def wake_up(self) -> None:
        await self._call(self._llm.wake_up())

    async def check_health(self, timeout: float = 30.0) -> dict:
        """Raises EngineDeadError if vLLM's core is gone, TimeoutError if it does not answer a
        round trip in `timeout`; returns {"ok", "problems", "weight_version"} as our engine does."""
        if self.errored:
            raise EngineDeadError(self.dead_reason)
        await self._call(self._llm.is_paused(), timeout=timeout)
        return {"ok": True, "problems": [], "weight_version": self.version}

    async def get_stats(self) -> dict:
        return {"engine": "vllm", "weight_version": self.version, "running_requests": len(self.requests),
                "paused": await self.is_paused()}


class _Gone:
    """Stands for the AsyncLLM of an engine shut down: nothing to reach any more."""

    errored = True

    def __getattr__(self, name):
        raise EngineDeadError("engine was shut down")


def _raised(answers: list) -> list:
    """The workers' answers, or the first error one of them answered as data (weight_sync/
    vllm_receiver.py: vLLM passes a raised error on as text only), raised as our engine raises it."""
    for a in answers:
        if isinstance(a, dict) and set(a) == {"error", "error_kind"}:
            raise error_for(a["error_kind"], a["error"])
    return answers


def _deferred(answer) -> bool:
    return isinstance(answer, dict) and "deferred" in answer and "pending" in answer


def _result(task: asyncio.Task, engine: VllmEngine):
    """A finished vLLM call's result; its failure as ours: EngineDeadError when the engine
    died, ValueError kept, anything else a RuntimeError (a bad call fails, the engine serves)."""
    try:
        return task.result()
    except (ValueError, TypeError, TimeoutError, asyncio.CancelledError):
        raise
    except Exception as e:  # noqa: BLE001 - vLLM's errors, to our kinds
        if engine.errored or type(e).__name__ == "EngineDeadError":
            raise EngineDeadError(engine.dead_reason or str(e)) from e
        raise RuntimeError(f"{type(e).__name__}: {e}") from e
