"""Reference computations with plain HF transformers, for checking the engine against."""

import torch


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
