"""Conversations as prompts: the tokenizer's chat template, exactly as `apply_chat_template`."""

import shutil

import pytest

from engine import LLM, EngineConfig, SamplingParams

CONV = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def llm(qwen2_dir):
    return LLM(EngineConfig(model=qwen2_dir, max_model_len=256))


def _template_ids(tokenizer, conv):
    return list(tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)["input_ids"])


def test_chat_applies_the_template_exactly(llm):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    (out,) = llm.chat(CONV, greedy, use_tqdm=False)
    ids = _template_ids(llm.tokenizer, CONV)
    assert out.prompt_token_ids == ids
    assert out.prompt == llm.tokenizer.apply_chat_template(CONV, add_generation_prompt=True, tokenize=False)
    assert out.prompt.endswith("<|im_start|>assistant\n")  # the generation prompt is there
    # the same as sending the template's ids, and a list of conversations keeps its order
    (by_ids,) = llm.generate([ids], greedy, use_tqdm=False)
    assert out.outputs[0].token_ids == by_ids.outputs[0].token_ids
    second = [{"role": "user", "content": "And 4 + 4?"}]
    outs = llm.chat([CONV, second], greedy, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [ids, _template_ids(llm.tokenizer, second)]


def test_strings_are_tokenized_as_the_tokenizer_does_by_default(llm):
    (out,) = llm.generate(["Q: 2 + 2? A:"], SamplingParams(max_tokens=1), use_tqdm=False)
    assert out.prompt_token_ids == llm.tokenizer("Q: 2 + 2? A:")["input_ids"]


def test_bad_conversations_are_clear_errors(llm, qwen2_dir, tmp_path):
    with pytest.raises(ValueError, match="conversation"):
        llm.chat([{"role": "user"}], use_tqdm=False)  # no content: not a conversation
    with pytest.raises(ValueError, match="conversation"):
        llm.chat([], use_tqdm=False)
    plain = tmp_path / "no_template"
    shutil.copytree(qwen2_dir, plain)
    (plain / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="no chat template"):
        LLM(EngineConfig(model=str(plain), max_model_len=128)).chat(CONV, use_tqdm=False)
