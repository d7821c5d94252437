"""Reference computations with plain HF transformers, for checking the engine against."""

import contextlib
import json
import math
import shutil

import pytest
import torch


def model_variant(src: str, dst, **config) -> str:
    """A copy of model directory `src` at `dst` with `config` written over its config.json's fields."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(config)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool = False) -> list[int]:
    """HF `generate` on one prompt alone (no padding), greedy."""
    kwargs = {"min_new_tokens": max_new_tokens} if ignore_eos else {}
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False, **kwargs
        )
    return out[0, len(prompt_ids) :].tolist()


def hf_logprobs(model, prompt_ids: list[int], completion: list[int], temperature: float = 1.0) -> list[float]:
    """log_softmax(logits / T) of each completion token under a full HF forward on prompt + completion."""
    ids = torch.tensor([prompt_ids + completion])
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return lp.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1).tolist()


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    # skip ids 0-2 (special tokens) so prompts look like text
    return [torch.randint(3, vocab, (L,), generator=g).tolist() for L in lens]


# fp32's unit roundoff: the relative error of one rounded operation.
U32 = 2.0 ** -24


def activation_magnitude(model, ids: list[int]) -> float:
    """The largest |value| on the way through the model (residual stream and logits) for `ids`."""
    with torch.inference_mode():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return max(max(h.abs().max().item() for h in out.hidden_states), out.logits.abs().max().item())


def fp32_logprob_tolerance(config, magnitude: float, statistic: str = "max") -> float:
    """How far two fp32 computations of one token's logprob may differ through rounding alone
    (engine vs HF, packed vs padded batches, one CPU or thread count vs another), derived
    from the arithmetic rather than from digits seen on one machine:

    - each of the 2L sublayers adds to the residual stream sums of at most K products (K the
      widest inner dimension); a sum's rounding error is a random walk of K steps of u·M, so
      about sqrt(K)·u·M, and the 2L sublayers add up the same way: sqrt(2L·K)·u·M, where M is the
      largest magnitude a value takes (`activation_magnitude`) and u = 2^-24;
    - x2: both computations carry such an error; x2: a logprob z_t - logsumexp(z) moves by at
      most twice the largest logit error;
    - "max" over up to a few thousand tokens: x4 (a normal's maximum over that many draws stays
      within 4 standard deviations); "mean" of absolute differences: x1.
    Real faults (wrong weights or versions, shifted positions, a wrong temperature) move
    logprobs by 1e-2 and more, far above this."""
    k = max(config.hidden_size, config.intermediate_size, config.num_attention_heads * (
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads))
    sigma = math.sqrt(2 * config.num_hidden_layers * k) * U32 * magnitude
    return 2 * 2 * sigma * (4 if statistic == "max" else 1)


@contextlib.contextmanager
def torch_threads(n: int):
    """Run a block with torch on `n` threads (results differ in the last bits across counts)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def assert_logprobs_are_hfs(llm, hf, prompts: list[list[int]], max_tokens: int = 16) -> None:
    """Greedy completions' logprobs against HF's forward over each whole sequence at once (no cache),
    within fp32's rounding bound (fp32_logprob_tolerance)."""
    from engine import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0, ignore_eos=True),
                        use_tqdm=False)
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        tol = fp32_logprob_tolerance(hf.config, activation_magnitude(hf, p + c.token_ids))
        ours = [lp if isinstance(lp, float) else next(iter(lp.values())).logprob for lp in c.logprobs]
        assert ours == pytest.approx(hf_logprobs(hf, p, c.token_ids), abs=tol)


def assert_greedy_is_hfs_fresh_and_after_a_prefix_hit(llm, hf, prompts: list[list[int]], max_tokens: int = 16) -> None:
    """Greedy tokens == HF's generate for `prompts` prefilled fresh, then for each prompt with 5 of its
    tokens appended, prefilled on its cached prefix."""
    from engine import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    expected = [hf_greedy(hf, p, max_tokens, ignore_eos=True) for p in prompts]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == expected
    longer = [p + e[:5] for p, e in zip(prompts, expected)]
    outs = llm.generate(longer, greedy, use_tqdm=False)
    assert all(o.num_cached_tokens > 0 for o in outs)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, max_tokens, ignore_eos=True) for p in longer]
