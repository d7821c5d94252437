"""The model's tokenizer, loaded where it is used (the engine core and the front end each hold one).

A model's tokenizer is transformers' `AutoTokenizer`, which imports torch and much of transformers
(seconds of a start, see bench.startup). The embedded tiny models are the exception: their
tokenizer is ours, built with the `tokenizers` library (engine/models/tiny_model.py), so it is read back
with that library alone (`TokenizerFile`), and the sidecar's front end starts without torch.
"""

from __future__ import annotations

import json
import os

from engine.models.tiny_model import STAMP  # written beside the embedded tiny models' weights


def load_tokenizer(path: str):
    if os.path.exists(os.path.join(path, STAMP)) and os.path.exists(os.path.join(path, "tokenizer.json")):
        return TokenizerFile(path)
    from transformers import AutoTokenizer  # here: importing it costs seconds (see bench.startup)

    return AutoTokenizer.from_pretrained(path)


class TokenizerFile:
    """The calls the engine makes of a tokenizer, answered from tokenizer.json, tokenizer_config.json
    and chat_template.jinja as transformers answers them for a plain `tokenizers` tokenizer
    (tests/engine/test_tokenizer_file.py compares the two call by call)."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            config = json.load(f)
        if config.get("clean_up_tokenization_spaces"):
            raise ValueError(f"{path}: clean_up_tokenization_spaces is not read here; load it with transformers")
        self.clean_up_tokenization_spaces = False
        self.special_tokens_map = {k: config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                                   if isinstance(config.get(k), str)}
        for name in ("bos", "eos", "pad", "unk"):
            token = self.special_tokens_map.get(f"{name}_token")
            setattr(self, f"{name}_token_id", None if token is None else self._tokenizer.token_to_id(token))
        self.all_special_ids = sorted(i for i, t in self._tokenizer.get_added_tokens_decoder().items() if t.special)
        template = os.path.join(path, "chat_template.jinja")
        if os.path.exists(template):
            with open(template) as f:
                self.chat_template = f.read()
        else:
            self.chat_template = config.get("chat_template")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self.encode(text, add_special_tokens)}

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, conversation: list[dict], tools=None, add_generation_prompt: bool = False,
                            tokenize: bool = True, continue_final_message: bool = False, return_dict: bool = True,
                            chat_template: str | None = None, **kwargs):
        """transformers' own renderer (imports jinja2 and transformers' utilities, not torch); the
        text, or its ids as transformers 5 returns them ({"input_ids": ...}, or the list alone
        with return_dict=False). `chat_template`: one in place of the model's, as transformers takes it."""
        from transformers.utils.chat_template_utils import render_jinja_template

        chat_template = chat_template or self.chat_template
        if not chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible")
        [text], _ = render_jinja_template(conversations=[conversation], tools=tools, chat_template=chat_template,
                                          continue_final_message=continue_final_message,
                                          add_generation_prompt=add_generation_prompt,
                                          **{**self.special_tokens_map, **kwargs})
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return {"input_ids": ids} if return_dict else ids
