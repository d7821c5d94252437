"""EngineCore: pure engine logic (scheduler + KV cache + model runner), driven step by step.

The offline `LLM` drives it in-process; the async engine wraps it in a process of its own.
"""

from __future__ import annotations

import logging

from engine import grouped_blocks
from engine.config import EngineConfig
from engine.inputs import validate_params, validate_prompt_ids
from engine.messages import PAUSE_MODES, PauseMode, RoutedRows, SeqDelta
from engine.sampling_params import SamplingParams
from engine.scheduler import PauseState, Scheduler
from engine.sequence import Sequence
from engine.stop_checker import check_stop
from engine.tokenizer import load_tokenizer
from engine.worker import make_worker

log = logging.getLogger(__name__)


def eos_token_ids(model, tokenizer) -> frozenset[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset(eos if isinstance(eos, (list, tuple)) else [eos])


class EngineCore:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.tokenizer = load_tokenizer(cfg.tokenizer)
        self.worker = make_worker(cfg)
        self.eos_ids = eos_token_ids(self.runner.model, self.tokenizer)
        self.block_manager = grouped_blocks.for_runner(self.runner, cfg.enable_prefix_caching)
        self.block_manager.hash_root = self._hash_root
        self.block_manager.current_version = lambda: self.worker.weight_version
        self.scheduler = Scheduler(self.block_manager, self.runner.max_num_seqs, cfg.max_num_batched_tokens)
        self.requests: dict[str, list[Sequence]] = {}
        self.num_generated_tokens = 0
        self.asleep = False
        self._paused_before_sleep = False
        log.info(
            "engine core ready: %s on %s (%s), %s KV blocks of %d tokens (windows %s)",
            cfg.model, cfg.device, cfg.dtype, " + ".join(map(str, self.runner.group_blocks)), cfg.block_size,
            self.runner.kv_groups.windows,
        )

    @property
    def runner(self):
        return self.worker.runner

    @property
    def weight_version(self) -> int:
        """The version every token sampled now is tagged with: the worker's weights' version."""
        return self.worker.weight_version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        version = int(version)
        if version <= self.worker.weight_version:  # a number again (or back): blocks keyed by it may be stale
            self.block_manager.reset_prefix_cache()
        self.worker.weight_version = version

    # -- requests -------------------------------------------------------------------------
    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        validate_prompt_ids(prompt_token_ids, self.cfg.max_model_len, self.runner.vocab_size)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        self.validate_prompt(prompt_token_ids)
        validate_params(params, self.runner.vocab_size, self.cfg.max_logprobs)
        if params.return_routed_experts:
            self._check_routing(prompt_token_ids, params)
        seqs = [Sequence(request_id, i, prompt_token_ids, params, self.cfg.block_size) for i in range(params.n)]
        bans = self._min_tokens_bans(params)
        bad_words = params.bad_words_token_ids(self.tokenizer) if params.bad_words else []
        for seq in seqs:
            seq.min_tokens_bans, seq.bad_words = bans, bad_words
        self.requests[request_id] = seqs
        for seq in seqs:
            self.scheduler.add(seq)

    def _check_routing(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not self.runner.sparse_blocks:
            kind = getattr(self.runner.model.config, "model_type", "?")
            raise ValueError(f"return_routed_experts: this model ({kind}) has no mixture-of-experts layers of the "
                             "engine's own (engine/models/moe_model.py), so no token is routed to experts")
        if params.routed_experts_prompt_start > len(prompt_token_ids):
            raise ValueError(f"routed_experts_prompt_start ({params.routed_experts_prompt_start}) is past the "
                             f"prompt's {len(prompt_token_ids)} tokens")

    def _min_tokens_bans(self, params: SamplingParams) -> tuple[int, ...]:
        if not params.min_tokens:
            return ()
        eos = () if params.ignore_eos else tuple(self.eos_ids)
        return tuple(sorted(set(eos) | set(params.stop_token_ids)))

    def abort_requests(self, request_ids: list[str]) -> list[SeqDelta]:
        """Abort; returns a final delta (finish_reason "abort") for each sequence still running."""
        deltas = []
        for rid in request_ids:
            seqs = self.requests.pop(rid, None)
            if seqs is None:
                continue
            live = [s for s in seqs if not s.finished]
            self.scheduler.abort(live)
            deltas += [SeqDelta(rid, s.index, [], [], self.weight_version, "abort") for s in live]
        return deltas

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- pausing (vLLM's pause_scheduler) ----------------------------------------------------
    def pause(self, mode: PauseMode = "abort", clear_cache: bool = True) -> list[SeqDelta]:
        """abort: end what is in flight now (returns their final deltas); wait: keep stepping
        until every request that arrived before the pause finished (see `drained()`); keep:
        freeze in place. Requests added while paused are held until `resume()`."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        deltas = []
        if mode == "abort":
            held = {s.request_id for s in self.scheduler.held}
            deltas = self.abort_requests([r for r in self.requests if r not in held])
        if clear_cache:
            self.reset_prefix_cache()
        if self.asleep:  # stays paused after wake_up
            self._paused_before_sleep = True
            return deltas
        self.scheduler.pause(drain=mode == "wait")
        return deltas

    def drained(self) -> bool:
        """True once paused with nothing left to finish (a "wait" pause is then complete)."""
        return self.scheduler.drained()

    @property
    def is_paused(self) -> bool:
        return self.scheduler.pause_state != PauseState.UNPAUSED

    def resume(self) -> None:
        if self.asleep:  # nothing can step without a KV cache: serve again at wake_up()
            self._paused_before_sleep = False
            return
        self.scheduler.resume()

    def can_step(self) -> bool:
        return self.scheduler.can_step()

    def _hash_root(self, seq) -> bytes:
        """Unmerged LoRA: prefixes are shared only between sequences on the same adapter version
        (the one the sequence has, or, not started yet, the newest it will take)."""
        bank = self.runner.lora_bank
        if bank is None or not bank.active:
            return b""
        version = seq.lora_version if seq.lora_version in bank.versions else bank.newest
        return b"lora:%d" % version

    # -- stepping -------------------------------------------------------------------------
    def step(self) -> list[SeqDelta]:
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            return []
        if not is_prefill:
            seqs = self.runner.decode_order(seqs)
        logits = self.runner.forward(seqs, is_prefill)
        result = self.runner.sample(seqs, logits)
        tokens = result.tokens
        deltas = []
        row_versions = self.runner.row_versions  # unmerged LoRA: each sequence's own adapter version
        for row, (seq, tok, lp) in enumerate(zip(seqs, tokens, result.logprobs)):
            seq.num_computed_tokens = len(seq)
            seq.token_ids.append(tok)
            seq.logprobs.append(lp)
            version = self.weight_version if row_versions is None else row_versions[row]
            seq.versions.append(version)
            delta = SeqDelta(seq.request_id, seq.index, [tok], [lp], version)
            if seq.params.logprobs is not None:
                delta.top_logprobs = [result.top_logprobs[row]]
            if seq.seq_id in self.runner.prompt_logprobs:
                delta.prompt_logprobs = self.runner.prompt_logprobs.pop(seq.seq_id)
            rows = self.runner.routed.get(seq.seq_id)
            if rows is not None:
                delta.routed_experts = RoutedRows(rows.tobytes(), rows.shape[1], rows.shape[2], rows.dtype.name)
            if is_prefill and seq.num_output_tokens == 1:
                delta.num_cached_tokens = seq.num_cached_prompt_tokens
            stop = check_stop(seq, self.eos_ids, self.cfg.max_model_len, self.tokenizer)
            if stop is not None:
                delta.finish_reason, delta.stop_reason = stop
                seq.finish_reason, seq.stop_reason = stop
                self.scheduler.finish(seq)
                self._maybe_forget(seq.request_id)
            deltas.append(delta)
        self.num_generated_tokens += len(tokens)
        return deltas

    def _maybe_forget(self, request_id: str) -> None:
        seqs = self.requests.get(request_id)
        if seqs is not None and all(s.finished for s in seqs):
            del self.requests[request_id]

    def sleep(self, level: int = 1) -> list[SeqDelta]:
        """Free the KV cache (level 1) and the weights too (level 2); aborts what is in flight.
        Requests that arrive while asleep are held (as in a pause) until `wake_up()`."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        deltas = self.abort_requests(list(self.requests))
        self.block_manager.reset_prefix_cache()
        if not self.asleep:
            self._paused_before_sleep = self.is_paused
            self.scheduler.pause(drain=False)
            self.asleep = True
        self.worker.sleep(level)
        return deltas

    def wake_up(self) -> None:
        """Reallocate what sleep freed (weights reloaded from the checkpoint serve as version 0),
        then serve the requests held meanwhile, unless the engine was paused before it slept."""
        self.worker.wake_up()
        if self.asleep and not self._paused_before_sleep:
            self.scheduler.resume()
        self.asleep = False

    def reset_prefix_cache(self) -> None:
        self.block_manager.reset_prefix_cache()

    def prefix_cache_stats(self) -> dict[str, int]:
        """The prefix cache's counters since start (tokens, but blocks_dropped): hits, prompt tokens
        looked up, hits on blocks of another weight version (0 unless a request asked for one:
        SamplingParams.prefix_version) and cached blocks forgotten by resets (a push keeps them)."""
        bm = self.block_manager
        return {"hit_tokens": bm.prefix_hits, "query_tokens": bm.prefix_queries,
                "hit_tokens_other_version": bm.prefix_hits_other_version, "blocks_dropped": bm.prefix_blocks_dropped}

    def stats(self) -> dict:
        bm = self.block_manager
        return {
            "num_waiting": len(self.scheduler.waiting),
            "num_running": len(self.scheduler.running),
            "num_free_blocks": bm.num_free_blocks,
            "num_blocks": len(bm.blocks),
            # each KV cache group's (engine/kv_groups.py; the first's above): the full layers', the windowed ones'
            "num_free_blocks_per_group": [m.num_free_blocks for m in getattr(bm, "managers", [bm])],
            "num_blocks_per_group": [len(m.blocks) for m in getattr(bm, "managers", [bm])],
            **{f"prefix_cache_{k}": v for k, v in self.prefix_cache_stats().items()},
            "num_preemptions": self.scheduler.num_preemptions,
            "num_generated_tokens": self.num_generated_tokens,
            "forward_seconds": self.runner.forward_seconds,
            "weight_version": self.weight_version,
            "paused": self.is_paused,
            "num_held": len(self.scheduler.held),
        }
