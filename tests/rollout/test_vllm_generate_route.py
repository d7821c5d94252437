"""vLLM's token-in token-out POST /inference/v1/generate on the sidecar's front: greedy equals HF `generate`,
every answer parses as vLLM's own response models (its pydantic classes, from the installed vLLM), a stream's
chunks add up to the whole answer, and bad requests are 400s that name the field."""

import httpx
import msgspec
import pytest

from tests.engine.helpers import hf_greedy
from tests.rollout.sidecar import TOKEN, Sidecar

protocol = pytest.importorskip("vllm.entrypoints.scale_out.token_in_token_out.protocol")

pytestmark = pytest.mark.timeout(300)

AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPT = [5, 17, 33, 41, 9, 12]


@pytest.fixture(scope="module")
def front(qwen2_dir):
    s = Sidecar(qwen2_dir, "--http-port", "0", "--served-model-name", "policy")
    yield s
    s.stop()


def _post(front, body, **kw):
    return httpx.post(front.http_url + "/inference/v1/generate", headers=AUTH, json=body, timeout=120, **kw)


def test_greedy_tokens_equal_hf_and_the_answer_is_vllms_shape(front, hf_models):
    body = {"token_ids": PROMPT, "return_token_ids": True, "request_id": "r1",
            "sampling_params": {"temperature": 0, "max_tokens": 12, "ignore_eos": True, "logprobs": 0,
                                "detokenize": False, "skip_special_tokens": True}}  # a field we do not know: ignored
    r = _post(front, body)
    assert r.status_code == 200, r.text
    answer = protocol.GenerateTokensResponse.model_validate(r.json())
    (c,) = answer.choices
    assert c.token_ids == hf_greedy(hf_models["qwen2"], PROMPT, 12, ignore_eos=True)
    assert answer.request_id == "r1" and answer.prompt_token_ids == PROMPT and c.finish_reason == "length"
    assert [(s.version, s.start, s.end) for s in c.weight_versions] == [("0", 0, 12)]
    assert [x.token_id for x in c.logprobs.content] == c.token_ids and all(x.logprob <= 0 for x in c.logprobs.content)


def test_a_stream_adds_up_to_the_whole_answer(front):
    params = {"temperature": 1.0, "seed": 7, "max_tokens": 20, "ignore_eos": True, "n": 2}
    whole = _post(front, {"token_ids": PROMPT, "sampling_params": params}).json()
    got: dict[int, list[int]] = {0: [], 1: []}
    with httpx.stream("POST", front.http_url + "/inference/v1/generate", headers=AUTH, timeout=120,
                      json={"token_ids": PROMPT, "sampling_params": params, "stream": True}) as s:
        lines = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    for line in lines[:-1]:
        chunk = protocol.GenerateTokensStreamResponse.model_validate(msgspec.json.decode(line))
        for c in chunk.choices:
            assert [s.start for s in c.weight_versions][:1] in ([], [len(got[c.index])])  # spans index the output
            got[c.index] += c.token_ids
    assert [got[0], got[1]] == [c["token_ids"] for c in whole["choices"]]


def test_bad_requests_are_400s_that_name_the_field(front):
    for body, field in (({"sampling_params": {}}, "token_ids"), ({"token_ids": [-1]}, "token_ids"),
                        ({"token_ids": PROMPT, "output_mode": "text"}, "output_mode"),
                        ({"token_ids": PROMPT, "sampling_params": {"temperature": "hot"}}, "sampling_params"),
                        ({"token_ids": PROMPT, "kv_transfer_params": {"x": 1}}, "kv_transfer_params")):
        r = _post(front, body)
        assert r.status_code == 400 and field in r.json()["error"]["message"], (body, r.text)
    assert _post(front, {"token_ids": PROMPT}).status_code == 200  # and the front serves on
