"""Prompt forms the engine accepts: str, list[int], {"prompt_token_ids": [...]} / {"prompt": str},
or a conversation: a list of {"role", "content"} messages, rendered by the tokenizer's chat
template with the generation prompt appended (as vLLM's `LLM.chat`); and a list of such prompts,
each with its own request id and sampling params."""

from __future__ import annotations

import uuid


def is_conversation(prompt) -> bool:
    return (isinstance(prompt, list) and len(prompt) > 0
            and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt))


def is_single_prompt(prompts) -> bool:
    if isinstance(prompts, (str, dict)) or is_conversation(prompts):
        return True
    return isinstance(prompts, list) and len(prompts) > 0 and all(isinstance(t, int) for t in prompts)


def apply_chat_template(conversation: list[dict], tokenizer) -> tuple[str, list[int]]:
    """(text, ids) of a conversation through the tokenizer's chat template, generation prompt
    appended. The template writes any BOS itself: the ids get no second one."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template: send a string or token ids instead")
    text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    return text, list(ids["input_ids"] if not isinstance(ids, list) else ids)


def tokenize_prompt(prompt, tokenizer) -> tuple[str | None, list[int]]:
    """Returns (prompt text or None, prompt token ids)."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            prompt = list(prompt["prompt_token_ids"])
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("a dict prompt needs 'prompt_token_ids' or 'prompt'")
    if is_conversation(prompt):
        return apply_chat_template(prompt, tokenizer)
    if isinstance(prompt, str):  # as the tokenizer does by default: BOS where the model expects one
        return prompt, tokenizer(prompt)["input_ids"]
    if isinstance(prompt, (list, tuple)):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("prompt token ids must be ints")
        return None, list(prompt)
    raise ValueError("prompt must be a str, a list of token ids, a dict or a conversation (a list of "
                     f"{{'role', 'content'}} messages), got {type(prompt).__name__}")


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


def validate_params(params, vocab_size: int, max_logprobs: int) -> None:
    """What a request's sampling parameters must satisfy on this engine (its vocabulary, its
    max_logprobs); the frontend checks before sending, the core again (an in-process caller)."""
    outside = params.token_ids_outside(vocab_size)
    if outside:
        raise ValueError(outside)
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and k > max_logprobs:
            raise ValueError(f"{name}={k} is above this engine's max_logprobs ({max_logprobs})")


def is_prompt_list(prompt) -> bool:
    """Several prompts (strs, token-id lists, conversations, dicts), not one prompt of token ids
    or one conversation; an empty or malformed list counts as one prompt, to fail as one."""
    return (isinstance(prompt, (list, tuple)) and len(prompt) > 0 and not is_single_prompt(prompt)
            and all(isinstance(p, (str, dict, list, tuple)) for p in prompt))


def check_one_request(sampling_params, request_id) -> None:
    """A single prompt's request id and sampling params are single too."""
    if isinstance(request_id, (list, tuple)):
        raise ValueError(f"{len(request_id)} request ids for one prompt: a list of request ids goes with "
                         "a list of prompts")
    if isinstance(sampling_params, (list, tuple)):
        raise ValueError("a list of sampling params goes with a list of prompts")


def request_lists(prompts: list, sampling_params, request_id) -> tuple[list, list, list[str]]:
    """A list of prompts' (prompts, one sampling params each, distinct request ids): one params
    object is shared, no request ids get fresh ones; lists of the wrong length raise ValueError."""
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
    return prompts, params, ids
