"""Prompt forms the engine accepts: str, list[int], or {"prompt_token_ids": [...]} / {"prompt": str}."""

from __future__ import annotations


def is_single_prompt(prompts) -> bool:
    if isinstance(prompts, (str, dict)):
        return True
    return isinstance(prompts, list) and len(prompts) > 0 and all(isinstance(t, int) for t in prompts)


def tokenize_prompt(prompt, tokenizer) -> tuple[str | None, list[int]]:
    """Returns (prompt text or None, prompt token ids)."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            prompt = list(prompt["prompt_token_ids"])
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("a dict prompt needs 'prompt_token_ids' or 'prompt'")
    if isinstance(prompt, str):
        return prompt, tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if isinstance(prompt, (list, tuple)):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("prompt token ids must be ints")
        return None, list(prompt)
    raise ValueError(f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")


def validate_prompt_ids(ids: list[int], max_model_len: int, vocab_size: int) -> None:
    if not ids:
        raise ValueError("prompt is empty")
    if len(ids) >= max_model_len:
        raise ValueError(
            f"prompt has {len(ids)} tokens but max_model_len is {max_model_len} "
            "(room for at least one generated token is needed)"
        )
    bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
