"""RolloutManager: drives 1..N AsyncEngines for a trainer.

- spreads groups over the engines, least loaded first, keeping a prompt's n samples together;
- returns whole rollouts: a sample cut short by an `abort` pause is resubmitted (prompt + tokens
  so far) and its pieces are joined, with the weight version of every token;
- enforces `max_staleness`: a rollout whose first token is more than that many versions behind
  the newest when it completes is generated again from scratch;
- runs pause -> receive -> commit -> resume across every engine for a weight push;
- survives engine deaths: a request on an engine that dies goes on, from its tokens so far, on
  a live engine, and the engine is restarted (rollout/sidecar/supervision.py);
- keeps the counters the sidecar reports.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import replace

from engine import EngineClient, SamplingParams
from engine.errors import EngineDeadError
from engine.inputs import tokenize_prompt
from engine.messages import RoutedRows
from engine.stop_checker import truncate_at_stop
from rollout.common.protocol import PROTOCOL_VERSION, EngineState, HealthReply
from rollout.sidecar.resubmit import go_on
from rollout.sidecar.state import SidecarState
from rollout.sidecar.supervision import EngineSupervisor, NoEngineError
from rollout.common.types import Rollout
from weight_sync.engine_side.engines import workers_of

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "wait", "keep")


class _Sample:
    """One sample being assembled from one or more engine requests."""

    def __init__(self, index: int):
        self.index = index
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason = None
        self.stale = False  # returned stale after max_stale_restarts regenerations
        self.routed: list = []  # pieces of its routed experts (return_routed_experts), in position order

    def extend(self, c) -> None:
        self.token_ids += c.token_ids
        self.logprobs += c.logprobs
        self.versions += c.weight_versions
        if getattr(c, "routed_experts", None) is not None:
            self.routed.append(c.routed_experts)
        self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason

    def truncate(self, k: int) -> None:
        del self.token_ids[k:], self.logprobs[k:], self.versions[k:]

    def take(self, piece) -> None:
        """A piece of its resubmission (rollout.sidecar.resubmit.Piece)."""
        self.extend(piece.output)
        self.finish_reason = piece.finish or "abort"  # "abort": not ended yet
        if piece.keep is not None:
            self.truncate(piece.keep)


def _routed_rows(s: _Sample, prompt_len: int, params: SamplingParams) -> RoutedRows | None:
    """The sample's routed experts in one piece, cut to its tokens: one row a position from the
    asked prompt start to its last token's input (a stop string cut after a resubmission drops rows)."""
    if not params.return_routed_experts or not s.routed:
        return None
    import numpy as np

    rows = np.concatenate(s.routed)[:max(0, prompt_len - params.routed_experts_prompt_start + len(s.token_ids) - 1)]
    return RoutedRows(rows.tobytes(), rows.shape[1], rows.shape[2], rows.dtype.name)


class RolloutManager:
    def __init__(self, engines: list[EngineClient], max_staleness: int | None = None, pause_mode: str = "keep",
                 max_stale_restarts: int = 3, engine_factory=None, max_restarts: int = 3,
                 restart_window_s: float = 600.0, host_copy: bool = True, spawn_standby=None,
                 state: SidecarState | None = None):
        """`engine_factory(i, standby)` builds engine i afresh: with it, an engine that dies is
        restarted (at most `max_restarts` times in `restart_window_s`), from a warm standby core
        when `spawn_standby` is given; `host_copy` keeps the newest committed weights in /dev/shm
        so that a lone engine catches up without the trainer. `state`: the sidecar's version and
        counters (a fresh one by default), shared with the supervisor and the weight pushes."""
        if not engines:
            raise ValueError("RolloutManager needs at least one engine")
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {PAUSE_MODES}, got {pause_mode!r}")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None, got {max_staleness}")
        if max_stale_restarts < 0:
            raise ValueError(f"max_stale_restarts must be >= 0, got {max_stale_restarts}")
        self.engines = engines
        self.tokenizer = engines[0].tokenizer
        self.max_model_len = engines[0].cfg.max_model_len
        self.vocab_size = engines[0].vocab_size
        self.max_staleness = max_staleness
        self.max_stale_restarts = max_stale_restarts
        self.pause_mode = pause_mode
        self.state = state or SidecarState()
        self.load = [0] * len(engines)  # sequences in flight per engine
        self.requests_per_engine = [0] * len(engines)
        self._ids = itertools.count()
        self.supervisor = EngineSupervisor(engines, self.state, engine_factory, max_restarts, restart_window_s,
                                           host_copy=host_copy, spawn_standby=spawn_standby)

    @property
    def version(self) -> int:
        return self.state.version

    @property
    def counters(self) -> dict:
        return self.state.counters

    def committed(self, version: int) -> None:
        """Every engine that is up committed `version` (a push or a load): served from now on."""
        self.state.committed(version)
        self.supervisor.committed(version)

    def up_engines(self) -> list[EngineClient]:
        """The engines weight sync reaches (live, or restarted and waiting for a push)."""
        return [self.engines[i] for i in self.supervisor.up()]

    def serving_engines(self) -> list[EngineClient]:
        return [self.engines[i] for i in self.supervisor.live()]

    def stop_engines(self, engines: Sequence[EngineClient], why: str) -> None:
        """These engines' processes stopped by the supervisor, which restarts them (rollout.sidecar.supervision)."""
        self.supervisor.stop(engines, why)

    # -- generation ---------------------------------------------------------------------------
    def prepare_prompt(self, prompt) -> list[int]:
        """Token ids of a prompt; raises ValueError for one the engines would refuse."""
        from engine.inputs import validate_prompt_ids

        _, ids = tokenize_prompt(prompt, self.tokenizer)
        validate_prompt_ids(ids, self.max_model_len, self.vocab_size)
        return ids

    async def _stream(self, prompt_ids: list[int], params: SamplingParams):
        """The outputs of one request on the least loaded live engine. If that engine dies, it
        leaves the rotation and EngineDeadError (with the request's output so far) is raised."""
        self.supervisor.start()
        i = min(await self.supervisor.wait_live(), key=self.load.__getitem__)
        self.load[i] += params.n
        self.requests_per_engine[i] += 1
        outputs = self.engines[i].generate(prompt_ids, params, request_id=f"m{next(self._ids)}")
        try:
            async for out in outputs:
                yield out
        except EngineDeadError as e:
            self.supervisor.engine_died(i, str(e))
            raise
        finally:
            await outputs.aclose()  # left early: the engine aborts the request now, not at garbage collection
            self.load[i] -= params.n

    async def _run(self, prompt_ids: list[int], params: SamplingParams):
        """The request's final output. On an engine's death, the output so far with every
        unfinished sample marked "abort", so that `_complete` resubmits it to a live engine (or
        from scratch when nothing came out yet)."""
        while True:
            out = None
            try:
                async for out in self._stream(prompt_ids, params):
                    pass
                return out
            except NoEngineError:
                raise
            except EngineDeadError as e:
                partial = getattr(e, "partial", None) or out
                self.state.count("resubmitted_after_engine_death")
                if partial is None or not any(c.token_ids for c in partial.outputs):
                    continue
                for c in partial.outputs:
                    if c.finish_reason is None:
                        c.finish_reason = "abort"
                return partial

    async def _complete(self, prompt_ids: list[int], params: SamplingParams, sample: _Sample) -> None:
        """An aborted sample goes on (rollout.sidecar.resubmit) until it ends for real. With stop strings
        its pieces come token by token, so that one straddling the cut ends it where it should."""
        if sample.finish_reason != "abort":
            return
        kind = "delta" if params.stop else "final"
        async for piece in go_on(self, prompt_ids, params, sample.index, sample.token_ids, kind):
            sample.take(piece)

    def _stale(self, sample: _Sample) -> bool:
        return (self.max_staleness is not None and bool(sample.versions)
                and self.version - sample.versions[0] > self.max_staleness)

    async def generate_group(self, prompt_ids: list[int], params: SamplingParams) -> list[Rollout]:
        """The n rollouts of one prompt, whole, in index order."""
        with self.state.in_flight("groups_in_flight"):
            first = await self._run(prompt_ids, replace(params, output_kind="final"))
            samples = [_Sample(c.index) for c in first.outputs]
            for s, c in zip(samples, first.outputs):
                s.extend(c)
            await asyncio.gather(*(self._sample_until_fresh(prompt_ids, params, s) for s in samples))
        rollouts = [self._to_rollout(prompt_ids, params, s) for s in samples]
        self.state.count("rollouts", len(rollouts))
        self.state.count("generated_tokens", sum(len(r.token_ids) for r in rollouts))
        return rollouts

    async def _sample_until_fresh(self, prompt_ids: list[int], params: SamplingParams, sample: _Sample) -> None:
        """Complete the sample; regenerate it while it is too stale, at most max_stale_restarts
        times (pushes faster than a sample's generation would otherwise loop forever), then
        return it marked stale."""
        await self._complete(prompt_ids, params, sample)
        restarts = 0
        while self._stale(sample):
            if restarts == self.max_stale_restarts:
                sample.stale = True
                self.state.count("stale_returned")
                return
            restarts += 1
            self.state.count("stale_restarts")
            fresh = _Sample(sample.index)
            seed = None if params.seed is None else params.seed + 104729 * self.state.counter("stale_restarts")
            out = await self._run(prompt_ids, replace(params, n=1, seed=seed, output_kind="final"))
            fresh.extend(out.outputs[0])
            await self._complete(prompt_ids, params, fresh)
            sample.__dict__.update(fresh.__dict__)

    def _to_rollout(self, prompt_ids: list[int], params: SamplingParams, s: _Sample) -> Rollout:
        text = self.tokenizer.decode(s.token_ids, skip_special_tokens=True)
        text = truncate_at_stop(text, s.stop_reason, params.include_stop_str_in_output)
        return Rollout(prompt_ids, s.token_ids, s.logprobs, text, s.finish_reason, s.versions, s.index,
                       s.stop_reason, s.stale, _routed_rows(s, len(prompt_ids), params))

    # -- weights ------------------------------------------------------------------------------
    async def run_paused(self, mode: str | None, work, on_paused=None):
        """pause every engine (mode), await `on_paused()` and `work()`, resume every engine
        whatever happened."""
        mode = mode or self.pause_mode
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self.supervisor.start()
        async with self.state.push_lock:
            t0 = time.monotonic()
            engines = self.up_engines()
            await asyncio.gather(*(e.pause_generation(mode=mode, clear_cache=False) for e in engines))
            # the engines stop after the step they are running (in "wait" mode, once their requests
            # end): that wait is decoding, not a pause, and is counted apart
            t1 = time.monotonic()
            self.state.count("pause_wait_seconds", t1 - t0)
            try:
                if on_paused is not None:
                    await on_paused()
                return await work()
            finally:
                await asyncio.gather(*(e.resume_generation() for e in engines), return_exceptions=True)
                self.state.count("pause_seconds", time.monotonic() - t1)

    # -- health -------------------------------------------------------------------------------
    async def health(self, timeout: float = 30.0, owner: dict | None = None) -> HealthReply:
        """Each live engine checked for real (see AsyncEngine.check_health): one that is gone,
        answers nothing in `timeout` or reports a problem is "dead" here, with the reason; the
        others as the supervisor sees them ("restarting", or "dead" once out of restarts).
        During a weight push the engines are not asked (their cores are receiving): health
        answers at once from the supervisor's view, with `pushing` true. `owner`: the weight-sync
        group's (rollout.sidecar.push_coordinator), reported as is."""
        sup = self.supervisor
        sup.start()
        sup.check()
        live = sup.live()
        pushing = self.state.pushing
        if self.state.push_lock.locked():  # the engines' cores are busy receiving weights: answer now from what is known
            results = [{"weight_version": self.version}] * len(live)
        else:
            results = await asyncio.gather(*(self.engines[i].check_health(timeout) for i in live),
                                           return_exceptions=True)
        checked = dict(zip(live, results))
        for i, r in checked.items():
            if isinstance(r, EngineDeadError):  # died since: the supervisor takes it from here
                sup.engine_died(i, str(r))
                checked[i] = None
        states = []
        for i in range(len(self.engines)):
            state = EngineState(sup.states[i], None, sup.restarts[i], self.engines[i].proc.pid)
            r = checked.get(i)
            if isinstance(r, BaseException):
                state.state, state.reason = "dead", f"{type(r).__name__}: {r}"
            elif r is not None:
                state.version, state.memory = r["weight_version"], r.get("memory")
                state.prefix_cache = r.get("prefix_cache")
            elif sup.reasons[i]:
                state.reason = sup.reasons[i]
            states.append(state)
        serving = sum(s.state == "live" for s in states)
        reason = "; ".join(f"engine {i} {s.state}" + (f": {s.reason}" if s.reason else "")
                           for i, s in enumerate(states) if s.state != "live")
        return HealthReply(ok=serving == len(self.engines), version=self.version, engines=serving,
                           workers=sum(workers_of(self.engines[i]) for i in sup.up()), engine_states=states,
                           protocol=PROTOCOL_VERSION, pushing=pushing, dtype=self.engines[0].cfg.dtype,
                           weight_sync_owner=owner, reason=reason, **self.serving())

    def serving(self) -> dict:
        """What the engines serve from: the precision (EngineConfig.quantization) and its 8-bit copy's
        memory per engine (0: none; the full-precision weights are always there, the truth)."""
        engine = self.engines[0]
        return {"quantization": getattr(engine.cfg, "quantization", "none"),
                "quantized_bytes": getattr(engine, "quantized_bytes", 0)}

    # -- stats --------------------------------------------------------------------------------
    def stats(self) -> dict:
        up = self.state.uptime_s
        c = self.state.counters
        return {
            **c,
            "version": self.version,
            "tokens_per_s": c["generated_tokens"] / up if up > 0 else 0.0,
            "queue_depth": sum(self.load),
            "requests_per_engine": list(self.requests_per_engine),
            "engines": len(self.engines),
            "last_restart": self.supervisor.last_restart,
            # the version a lone engine's restart comes back with (None: none written yet; the
            # copy is written in the background after each push)
            "host_copy_version": self.supervisor.host_copy_version,
            "uptime_s": up,
        }
