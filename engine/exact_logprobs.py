"""The engine's logprobs of given completions, computed where the trainer runs, with the engine's own
arithmetic: the trainer's side of exactly on-policy RL (issue 65 item 2; `--on-policy exact` in the
recipes).

A rollout's logprobs come from two kinds of engine steps: its prompt's prefill (the last row's logits
give the first sampled token's) and one decode step a sampled token (its row's logits give the next).
`ExactLogprobs` runs the same two kinds of steps, on the engine's own model runner and kernels, in the
trainer's process: every prompt prefilled, then every completion position as a decode row (teacher
forcing: the rows of one step write their keys and values into the cache, layer by layer, before any
row attends, so a step may hold many positions of one sequence), then each row's logits turned into
the sampled token's logprob by the sampler's own arithmetic (native_sampler.score_rows). The engine's
steps are batch invariant (tests/engine/test_batch_invariance.py): a row's bits do not depend on what
else shares its step, on the thread count, on a prefix-cache hit, nor on whether a prefill or a decode
step computed it, so these steps give the rollout's bits whatever the sidecar batched with it (a
sequence it preempted and recomputed, an agent's later turn prefilled over an earlier turn's tokens).

The weights are the trainer's as the engine holds them after a push: `load_weights` casts them as a
push's commit does, `load_adapter` merges LoRA factors into the base as an adapter push's commit does
(engine/kernels/lora_merge.py). Gradients are not this module's: the recipes pass them through torch's
own forward of the same weights (recipes/exact_policy.py).

What it does not cover: sampling with anything beyond a temperature (top-k / top-p / min-p, penalties,
processors), a mixture of experts (refused: its routing is not replayed here), an engine with
`batch_invariant` off or unmerged LoRA adapters (`lora_versions`), and the GPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.kernels import native_sampler
from engine.kernels.lora_merge import merge
from engine.kv_groups import MAX_GROUPS
from engine.model_runner import ModelRunner
from engine.sampler import block_size_for
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


@dataclass
class _DecodeRow:
    """One teacher-forced decode row: what a decode step reads of a sequence (its last token, its
    length, its block table; engine/step_inputs.pack_decode), asking nothing more of the step."""

    last: int
    length: int
    block_table: list[int]
    at: tuple[int, int]  # (rollout, completion position) whose logprob its logits give
    params = SamplingParams()  # not a field: the same plain parameters for every row

    @property
    def tables(self) -> list[list[int]]:  # the same blocks in every KV cache group (Sequence.share_table)
        return [self.block_table] * MAX_GROUPS

    @property
    def token_ids(self) -> tuple[int]:
        return (self.last,)

    def __len__(self) -> int:
        return self.length


class ExactLogprobs:
    """`logprobs(prompts, completions, temperature)`: what the engine of `cfg` reports for each sampled
    token, bit for bit, once `load_weights` / `load_adapter` gave it the pushed weights."""

    def __init__(self, cfg: EngineConfig, max_rows: int = 256):
        if cfg.device != "cpu":
            raise ValueError("exact logprobs run on the CPU engine's kernels (device 'cpu')")
        self.cfg = cfg
        self.runner = ModelRunner(cfg)
        if self.runner.sparse_blocks:
            raise ValueError("exact logprobs take dense models: a mixture of experts' routing is not replayed here")
        self.max_rows = max_rows  # decode rows a step
        self._params = dict(self.runner.model.named_parameters(remove_duplicate=False))
        self._w0: dict[str, torch.Tensor] = {}  # an adapter's targets: their weights before any merge

    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    # -- weights --------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> None:
        """The weights a full push of `weights` commits (each cast to the engine's dtype, as a commit
        copies). Every name and shape is checked before any weight changes (ValueError)."""
        pairs = list(weights.items() if isinstance(weights, Mapping) else weights)
        problems = [f"{n}: {why}" for n, t in pairs if (why := self._mismatch(n, t.shape)) is not None]
        if problems:
            raise ValueError("weights refused, nothing changed: " + "; ".join(problems[:5]))
        with torch.no_grad():
            for name, t in pairs:
                self._params[name].copy_(t)
        self._w0 = {}  # a full push is the base of the next adapter

    def load_adapter(self, factors: Mapping[str, tuple[torch.Tensor, torch.Tensor, float]]) -> None:
        """An adapter push's commit: each module's weight `W0 + scale * B @ A` (module name ->
        (A [r, in], B [out, r], scale)), W0 the weight before its first merge; a module an earlier
        adapter targeted and this one does not gets its W0 back."""
        names = {module + ".weight": f for module, f in factors.items()}
        problems = [f"{n}: {why}" for n, (a, b, _) in names.items()
                    if (why := self._mismatch(n, (b.shape[0], a.shape[1]))) is not None]
        if problems:
            raise ValueError("adapter refused, nothing changed: " + "; ".join(problems[:5]))
        with torch.no_grad():
            for name in names:
                self._w0.setdefault(name, self._params[name].detach().clone())
            for name, base in self._w0.items():
                p = self._params[name]
                a, b, scale = names.get(name, (None, None, None))
                p.copy_(base if a is None else merge(base, a.to(p.device), b.to(p.device), float(scale)))

    def _mismatch(self, name: str, shape) -> str | None:
        p = self._params.get(name)
        if p is None:
            return "not a weight of this model"
        return None if tuple(p.shape) == tuple(shape) else f"shape {tuple(shape)}, the model's is {tuple(p.shape)}"

    # -- logprobs -------------------------------------------------------------------------------
    def logprobs(self, prompts: list[list[int]], completions: list[list[int]],
                 temperature: float = 1.0) -> list[torch.Tensor]:
        """Each completion's sampled-token logprobs [len(completion)] (fp32), as the engine reported
        them when it sampled them at `temperature` (> 0, nothing else asked) after its prompt."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions")
        if not temperature > 0:
            raise ValueError(f"exact logprobs are a sampled token's (temperature > 0), got {temperature}")
        vocab, limit = self.runner.vocab_size, self.cfg.max_model_len
        for p, c in zip(prompts, completions):
            if not p:
                raise ValueError("an empty prompt")
            if len(p) + len(c) > limit:
                raise ValueError(f"a rollout of {len(p) + len(c)} tokens, past max_model_len {limit}")
            if any(not 0 <= t < vocab for t in (*p, *c)):
                raise ValueError(f"a token id outside [0, {vocab})")
        out = [torch.empty(len(c), dtype=torch.float32) for c in completions]
        todo = [i for i, c in enumerate(completions) if c]
        for part in self._parts(todo, prompts, completions):
            self._score(part, prompts, completions, temperature, out)
        return out

    def _blocks(self, n_tokens: int) -> int:
        return -(-n_tokens // self.runner.block_size)

    def _parts(self, todo: list[int], prompts, completions) -> list[list[int]]:
        """The rollouts cut into parts whose cache blocks and prompt tokens fit one pass."""
        parts, part, blocks, tokens = [], [], 0, 0
        for i in todo:
            need = self._blocks(len(prompts[i]) + len(completions[i]) - 1)
            full = blocks + need > min(self.runner.group_blocks)
            if part and (full or tokens + len(prompts[i]) > self.cfg.max_num_batched_tokens):
                parts.append(part)
                part, blocks, tokens = [], 0, 0
            part.append(i)
            blocks += need
            tokens += len(prompts[i])
        return parts + ([part] if part else [])

    @torch.inference_mode()
    def _score(self, part: list[int], prompts, completions, temperature: float, out: list[torch.Tensor]) -> None:
        runner, free = self.runner, iter(range(min(self.runner.group_blocks)))  # ids every group has
        tables = {i: [next(free) for _ in range(self._blocks(len(prompts[i]) + len(completions[i]) - 1))]
                  for i in part}
        seqs = []
        for i in part:  # every prompt prefilled, as the engine's first step of the rollout
            seq = Sequence(f"exact-{i}", 0, prompts[i], SamplingParams(), runner.block_size)
            seq.share_table(tables[i])
            seqs.append(seq)
        first = runner.forward(seqs, is_prefill=True)
        self._put(first, [completions[i][0] for i in part], temperature, [(i, 0) for i in part], out)
        # then every completion position as a decode row, earlier positions in earlier or the same steps
        rows = sorted(((j, i) for i in part for j in range(1, len(completions[i]))))
        for start in range(0, len(rows), self.max_rows):
            step = runner.decode_order([_DecodeRow(completions[i][j - 1], len(prompts[i]) + j, tables[i], (i, j))
                                        for j, i in rows[start:start + self.max_rows]])
            logits = runner.forward(step, is_prefill=False)
            self._put(logits, [completions[i][j] for i, j in (r.at for r in step)], temperature,
                      [r.at for r in step], out)

    def _put(self, logits: torch.Tensor, tokens: list[int], temperature: float, where: list[tuple[int, int]],
             out: list[torch.Tensor]) -> None:
        rows = len(tokens)
        lp = native_sampler.score_rows(logits, torch.full((rows,), temperature), torch.tensor(tokens),
                                       block_size_for(logits.shape[-1]))
        if lp is None:
            raise RuntimeError("the sampler's scoring kernel does not run here (no C compiler?): "
                               "exact logprobs need it")
        for (i, j), v in zip(where, lp.tolist()):
            out[i][j] = v
