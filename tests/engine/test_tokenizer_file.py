"""The embedded tiny models' tokenizer read with `tokenizers` alone (engine/tokenizer.py) answers
every call the engine makes as transformers' AutoTokenizer does."""

import random

import pytest
from transformers import AutoTokenizer

from engine.tokenizer import TokenizerFile, load_tokenizer

TEXTS = ["hello world", " a a  a\n\tb", "", "The café naïve — ünïcödé 日本語 🙂", "<|endoftext|>x<|pad|>",
         "<|im_start|>user\nhi<|im_end|>", "12345 + 678 = ?", "  leading and trailing  "]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_the_tiny_tokenizer_file_answers_as_transformers(model_dirs, arch):
    mine, hf = load_tokenizer(model_dirs[arch]), AutoTokenizer.from_pretrained(model_dirs[arch])
    assert isinstance(mine, TokenizerFile)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(mine, name) == getattr(hf, name), name
    assert mine.all_special_ids == sorted(hf.all_special_ids)
    assert mine.chat_template == hf.chat_template
    for text in TEXTS:
        assert mine(text)["input_ids"] == hf(text)["input_ids"], text
        assert mine.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False), text
    rng = random.Random(0)
    vocab = hf.vocab_size + len(hf.all_special_ids)
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
        for skip in (False, True):
            assert mine.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), ids
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2 + 2?"}]
    for prompt in (False, True):
        assert (mine.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=False)
                == hf.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=False))
        ids = hf.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=True)
        assert mine.apply_chat_template(chat, add_generation_prompt=prompt)["input_ids"] == list(ids["input_ids"])
        assert mine.apply_chat_template(chat, add_generation_prompt=prompt, return_dict=False) == list(
            hf.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=True, return_dict=False))


def test_a_model_of_ours_not_built_here_loads_through_transformers(tmp_path, hf_models):
    hf_models["qwen2"].save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(hf_models["qwen2"].name_or_path).save_pretrained(tmp_path)
    assert not isinstance(load_tokenizer(str(tmp_path)), TokenizerFile)
