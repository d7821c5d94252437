"""What vLLM's logits processors (allowed_token_ids, bad_words, min_tokens, logit_bias) cost a
decode step, ours against HF's processors on the same batch, in one run:

  plain:      our sampler with no processor asked (the common case: must cost nothing more);
  processors: our sampler with all four on every row, the host's part included (each row's bans
              from its output tokens, the batch's edit tensors: `step_sampling.logits_edits`' work);
  hf:         HF's `LogitsProcessorList` of the same four (PrefixConstrained, NoBadWords,
              MinNewTokensLength, SequenceBias) on the same logits and histories, then softmax
              and multinomial, as `generate` samples.

Each row has 4096 allowed ids, 16 bad words of 1-3 tokens, min_tokens not
reached, 32 biased tokens. Reports ms per step and the ratios.

    python -m bench.logits_processors            # vocab 49152 (SmolLM2) and 151936 (Qwen), B 64 and 256
"""

from __future__ import annotations

import logging

import torch
from transformers import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from bench.sampler import parse_cases, time_ms
from engine.logits_processors import build_edits, sequence_bans
from engine.sampler import SamplingTensors, sample, uniform_noise

log = logging.getLogger("bench.logits_processors")

PROMPT, OUTPUT = 64, 32  # tokens of each row's history


class Case:
    """One batch's logits, histories and processor settings, shared by all three timings."""

    def __init__(self, batch: int, vocab: int):
        g = torch.Generator().manual_seed(batch + vocab)
        self.logits = torch.randn(batch, vocab, generator=g) * 4
        self.history = torch.randint(3, vocab, (batch, PROMPT + OUTPUT), generator=g)
        self.outputs = [row[PROMPT:].tolist() for row in self.history]
        self.allowed = torch.randperm(vocab, generator=g)[:4096].tolist()
        self.bad_words = [torch.randint(3, vocab, (1 + i % 3,), generator=g).tolist() for i in range(16)]
        self.bias = {int(t): 2.0 for t in torch.randint(0, vocab, (32,), generator=g)}
        self.stops = (0, 1)
        self.min_tokens = OUTPUT + 8  # not reached: the stop tokens are banned
        self.shared = torch.Generator().manual_seed(0)

    def tensors(self, edits=None) -> SamplingTensors:
        rows = self.logits.shape[0]
        return SamplingTensors(torch.ones(rows), uniforms=uniform_noise(self.shared, rows, "cpu"),
                               any_greedy=False, edits=edits)


def plain(case: Case):
    return sample(case.logits, case.tensors())[:2]


def processors(case: Case):
    rows = [(case.allowed, sequence_bans(OUTPUT, case.min_tokens, case.stops, out, case.bad_words), case.bias)
            for out in case.outputs]
    edits = build_edits(rows, case.logits.shape[-1], "cpu")
    return sample(case.logits, case.tensors(edits))[:2]


def hf(case: Case):
    procs = LogitsProcessorList([
        PrefixConstrainedLogitsProcessor(lambda b, ids: case.allowed, num_beams=1),
        NoBadWordsLogitsProcessor(case.bad_words, eos_token_id=list(case.stops)),
        MinNewTokensLengthLogitsProcessor(PROMPT, case.min_tokens, list(case.stops)),
        SequenceBiasLogitsProcessor({(t,): b for t, b in case.bias.items()}),
    ])
    scores = procs(case.history, case.logits.clone())
    probs = torch.softmax(scores, dim=-1)
    tokens = torch.multinomial(probs, 1, generator=case.shared).squeeze(-1)
    return tokens, probs.gather(-1, tokens.unsqueeze(-1)).log()


def main(argv: list[str] | None = None) -> None:
    args = parse_cases(__doc__, argv)
    print(f"\nms per step, torch {torch.__version__}, {torch.get_num_threads()} threads; every row with the four "
          "processors (ours: host work included)")
    print(f"{'vocab':>8}{'batch':>7}{'plain':>9}{'ours':>9}{'hf':>9}{'ours/hf':>9}{'ours/plain':>12}")
    for vocab in (int(v) for v in args.vocabs.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            case = Case(batch, vocab)
            ms = {f.__name__: time_ms(lambda c, _g, _s: f(c), case, None, None, args.reps) for f in (plain, processors, hf)}
            print(f"{vocab:>8}{batch:>7}{ms['plain']:>9.1f}{ms['processors']:>9.1f}{ms['hf']:>9.1f}"
                  f"{ms['processors'] / ms['hf']:>9.2f}{ms['processors'] / ms['plain']:>12.2f}")


if __name__ == "__main__":
    main()
