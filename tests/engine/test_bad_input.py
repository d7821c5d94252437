"""Bad input: a ValueError that says what is wrong, and the engine keeps serving."""

import pytest

from engine import LLM, EngineConfig, SamplingParams


@pytest.fixture(scope="module")
def llm(qwen2_dir):
    return LLM(EngineConfig(model=qwen2_dir, max_model_len=64))


def _still_serves(llm):
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert not llm.core.has_unfinished() and not llm.core.requests


@pytest.mark.parametrize(
    "prompt, match",
    [
        (list(range(3, 70)), "max_model_len"),
        ([], "empty"),
        ("", "empty"),
        ([5, 6, 999999], "outside the vocabulary"),
        ([5, -1], "outside the vocabulary"),
        ([5, "x"], "must be ints"),
        ({"foo": 1}, "prompt_token_ids"),
        (3.5, "prompt must be"),
    ],
)
def test_bad_prompt(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([[5, 6], prompt], SamplingParams(max_tokens=4), use_tqdm=False)
    _still_serves(llm)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"n": 0}, "n must"),
        ({"top_k": -3}, "top_k"),
        ({"stop": [""]}, "stop"),
        ({"output_kind": "nope"}, "output_kind"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"prompt_logprobs": -2}, "prompt_logprobs"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": "0.1"}, "min_p must be a number"),
        ({"temperature": float("nan")}, "temperature must be a number"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_stop_token_ids(llm):
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate([[5, 6]], SamplingParams(stop_token_ids=[10**7]), use_tqdm=False)
    _still_serves(llm)


def test_unknown_sampling_param_name():
    with pytest.raises(ValueError, match="unknown sampling parameters"):
        SamplingParams.from_dict({"temprature": 1.0})


def test_unknown_model_directory(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        EngineConfig(model=str(tmp_path / "nope"))


def test_kv_cache_too_small_for_one_sequence(qwen2_dir):
    with pytest.raises(ValueError, match="num_kv_blocks"):
        LLM(EngineConfig(model=qwen2_dir, max_model_len=256, block_size=16, num_kv_blocks=4))


def test_bad_request_in_the_middle_of_a_running_core(llm):
    """A bad request added while others run fails alone; the others finish."""
    core = llm.core
    core.add_request("ok", [5, 6, 7], SamplingParams(temperature=0, max_tokens=6))
    core.step()
    with pytest.raises(ValueError):
        core.add_request("bad", [5, 10**7], SamplingParams())
    with pytest.raises(ValueError, match="already running"):
        core.add_request("ok", [5], SamplingParams())
    n = 1
    while core.has_unfinished():
        n += sum(len(d.token_ids) for d in core.step())
    assert n == 6 and not core.requests
