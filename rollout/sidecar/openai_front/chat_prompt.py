"""A chat request's messages -> prompt token ids, through the model's chat template.

The multi-turn contract. An agent sends the whole conversation back each turn; re-tokenising an
assistant turn from its text may not give the ids the model sampled (a BPE merge across the turn's
edge, a stop string cut mid-token, special tokens), and the trainer would then learn from a
sequence the policy never produced. So an assistant message may carry `token_ids`: the
`choices[i].token_ids` this server returned for it (its `content` unchanged). Such turns are
spliced in as exactly those ids; the text around them (earlier turns, the template's markers,
later turns) is tokenised from the template's rendering. The template must render the turn's
content verbatim, and everything before it the same whatever follows: otherwise the request is
refused (400), never silently re-tokenised. Without `token_ids` a message is plain text.

A turn that called tools and comes back with `token_ids` goes to the template as what the model
wrote (its ids decoded: the content and the `<tool_call>` text), not as its `tool_calls`: those
are the parser's reading of that text, and re-rendering them would not give the sampled ids back.
Without `token_ids`, `tool_calls` go to the template with their arguments as objects (vLLM's rule:
HF templates expect a mapping; a string that is not a JSON object becomes {}).
"""

from __future__ import annotations

import json


class ChatPromptError(ValueError):
    """The messages cannot become a prompt (a 400)."""


def message_dicts(messages) -> list[dict]:
    """pydantic messages -> the dicts a chat template takes (text parts joined; no token ids)."""
    out = []
    for m in messages:
        d = m.model_dump(exclude_none=True, exclude={"token_ids"})
        content = d.get("content")
        if content is None:  # vLLM's rule: an absent content is "" (templates such as SmolLM2's add it to text)
            d["content"] = ""
        elif isinstance(content, list):
            if any(part.get("type") != "text" for part in content):
                raise ChatPromptError("only text content parts are served (no images or audio)")
            d["content"] = "".join(part.get("text", "") for part in content)
        if not d.get("tool_calls"):
            d.pop("tool_calls", None)  # [] would take a template off its plain assistant path
        for call in d.get("tool_calls", ()):
            call["function"]["arguments"] = _as_object(call["function"].get("arguments"))
        out.append(d)
    return out


def _as_object(arguments) -> dict:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:  # history an agent cannot fix: the turn still renders (vLLM coerces the same)
            return {}
    return arguments if isinstance(arguments, dict) else {}


def _as_sampled(tokenizer, messages, dicts: list[dict]) -> None:
    """Assistant turns that called tools and carry token_ids: rendered as the text of their ids."""
    for j, m in enumerate(messages):
        if m.role == "assistant" and m.token_ids and m.tool_calls:
            text = tokenizer.decode(m.token_ids, skip_special_tokens=True)
            if not text.startswith(dicts[j].get("content") or ""):
                raise ChatPromptError(f"messages[{j}]: token_ids do not decode to the message's content: send the "
                                      "content and the token_ids exactly as this server returned them")
            dicts[j]["content"] = text
            del dicts[j]["tool_calls"]


def _render(tokenizer, messages: list[dict], generation_prompt: bool, tools, kwargs: dict) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                         tokenize=False, **kwargs)  # kwargs may hold chat_template


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []  # the template wrote any BOS


def chat_prompt_ids(messages, tokenizer, tools=None, template_kwargs=None, add_generation_prompt=True,
                    chat_template: str | None = None) -> list[int]:
    """`chat_template`: the server's --chat-template, in place of the tokenizer's."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ChatPromptError("this model's tokenizer has no chat template: use /v1/completions")
    if tools and "tools" not in template:
        raise ChatPromptError("this model's chat template does not take tools")
    kwargs = dict(template_kwargs or {}, **({"chat_template": chat_template} if chat_template else {}))
    dicts = message_dicts(messages)
    _as_sampled(tokenizer, messages, dicts)
    try:
        full = _render(tokenizer, dicts, add_generation_prompt, tools, kwargs)
    except Exception as e:  # a template's own raise_exception ("roles must alternate", ...)
        raise ChatPromptError(f"the chat template refused these messages: {e}") from e
    ids: list[int] = []
    pos = 0  # how much of `full` is in `ids` already
    for j, m in enumerate(messages):
        if m.role != "assistant" or not m.token_ids:
            continue
        content = dicts[j].get("content") or ""
        if not tokenizer.decode(m.token_ids, skip_special_tokens=True).startswith(content):
            raise ChatPromptError(f"messages[{j}]: token_ids do not decode to the message's content: send the "
                                  "content and the token_ids exactly as this server returned them")
        before = _render(tokenizer, dicts[:j], True, tools, kwargs)
        if not full.startswith(before) or not full.startswith(content, len(before)) or len(before) < pos:
            raise ChatPromptError(
                f"messages[{j}]: the chat template does not render this assistant turn's content verbatim after "
                "the turns before it, so its token_ids cannot be spliced in; send it without token_ids, or "
                "build the prompt yourself and use /v1/completions with token ids")
        ids += _encode(tokenizer, full[pos:len(before)]) + list(m.token_ids)
        pos = len(before) + len(content)
        last = tokenizer.decode(m.token_ids[-1:])  # an end-of-turn token the model sampled is in the ids:
        if m.token_ids[-1] in tokenizer.all_special_ids and last and full.startswith(last, pos):  # not twice
            pos += len(last)
    return ids + _encode(tokenizer, full[pos:])
