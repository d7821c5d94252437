"""A request's tokens and logprobs are the same bits whatever shares its steps (issue 65 item 1):
alone, among 1-255 mixed neighbours (greedy and sampled, short and long prompts, anywhere in the
batch), after a prefix-cache hit, and a thousand times over under changing load; dense and mixture
of experts, fp32 and bf16 (EngineConfig.batch_invariant, on by default)."""

import random

import pytest

from engine import LLM, EngineConfig, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, logprobs=0, ignore_eos=True)


def _engine(model_dir, dtype):
    return LLM(EngineConfig(model=model_dir, dtype=dtype, max_num_seqs=256, max_model_len=512, num_threads=2))


def _bits(out):
    c = out.outputs[0]
    return c.token_ids, c.logprobs


def _mixed(rng, vocab, size, probe):
    """`size` neighbours of random lengths and sampling settings, the probe somewhere among them."""
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(4, 300))] for _ in range(size)]
    params = [SamplingParams(temperature=rng.choice([0.0, 1.0]), max_tokens=rng.randrange(4, 64), ignore_eos=True,
                             seed=rng.randrange(1000)) for _ in range(size)]
    at = rng.randrange(size + 1)
    return prompts[:at] + [probe] + prompts[at:], params[:at] + [GREEDY] + params[at:], at


@pytest.mark.parametrize("arch,dtype", [("qwen2", "float32"), ("qwen2", "bfloat16"), ("qwen3_moe", "float32"),
                                        ("qwen3_moe", "bfloat16"), ("gemma3", "bfloat16"), ("phi3", "bfloat16")])
def test_a_request_has_the_same_bits_alone_in_any_batch_and_after_a_prefix_hit(tiny_dirs, arch, dtype):
    llm = _engine(tiny_dirs[arch], dtype)
    vocab = llm.core.runner.vocab_size
    rng = random.Random(1)
    probe = [rng.randrange(3, vocab) for _ in range(45)]  # two full blocks and more: a hit serves 32 tokens
    alone = _bits(llm.generate([{"prompt_token_ids": probe}], GREEDY, use_tqdm=False)[0])
    for size in (1, 7, 33, 255):  # a lone neighbour, less and more than a step's chunk of rows, a full batch
        llm.core.reset_prefix_cache()  # the probe computes its prompt again, among others
        prompts, params, at = _mixed(rng, vocab, size, probe)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert _bits(outs[at]) == alone, (arch, dtype, size)
    llm.core.reset_prefix_cache()
    llm.generate([{"prompt_token_ids": probe[:40] + [5, 6, 7]}], GREEDY, use_tqdm=False)  # caches probe[:32]
    hit = llm.generate([{"prompt_token_ids": probe}], GREEDY, use_tqdm=False)[0]
    assert hit.num_cached_tokens == 32 and _bits(hit) == alone


def test_a_thousand_repeats_under_changing_load_give_one_completion(model_dirs):
    """Thinking Machines' check: one prompt at temperature 0, 1,000 times, in batches whose size and
    neighbours change from call to call: one distinct completion (and one list of logprobs)."""
    llm = _engine(model_dirs["qwen2"], "float32")
    vocab = llm.core.runner.vocab_size
    rng = random.Random(2)
    probe = [rng.randrange(3, vocab) for _ in range(20)]
    seen, count = set(), 0
    while count < 1000:
        copies = min(rng.randrange(50, 200), 1000 - count)
        neighbours = [[rng.randrange(3, vocab) for _ in range(rng.randrange(4, 120))] for _ in range(rng.randrange(0, 40))]
        prompts = [probe] * copies + neighbours
        rng.shuffle(prompts)
        params = [GREEDY if p is probe else SamplingParams(max_tokens=rng.randrange(2, 40), ignore_eos=True)
                  for p in prompts]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for p, o in zip(prompts, outs):
            if p is probe:
                seen.add((tuple(o.outputs[0].token_ids), tuple(o.outputs[0].logprobs)))
        count += copies
    assert len(seen) == 1


def test_the_flag_reaches_every_sparse_block(tiny_dirs):
    for flag in (True, False):
        llm = LLM(EngineConfig(model=tiny_dirs["qwen3_moe"], max_model_len=128, batch_invariant=flag))
        blocks = [m for m in llm.core.runner.model.modules() if hasattr(m, "batch_invariant")]
        assert blocks and all(b.batch_invariant is flag for b in blocks)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_sampled_row_keeps_its_bits_whatever_its_neighbours_ask(tiny_dirs, dtype):
    """A row sampled at its temperature alone takes the same token and logprob next to rows that are
    greedy, filtered, penalised or asking for top logprobs (those steps go through torch's sampler;
    the plain row still through the native one)."""
    llm = _engine(tiny_dirs["qwen2"], dtype)
    probe = {"prompt_token_ids": [5, 9, 17, 33, 2, 8, 40]}
    sampled = SamplingParams(temperature=1.0, max_tokens=24, seed=7, ignore_eos=True)
    alone = _bits(llm.generate([probe], sampled, use_tqdm=False)[0])
    neighbours = [SamplingParams(temperature=0.0), SamplingParams(top_p=0.9), SamplingParams(top_k=5),
                  SamplingParams(min_p=0.1), SamplingParams(logprobs=3), SamplingParams(presence_penalty=0.5),
                  SamplingParams(logit_bias={3: 2.0}), SamplingParams(min_tokens=10, stop_token_ids=[4])]
    for nb in neighbours:
        nb.max_tokens, nb.ignore_eos = 30, True
        outs = llm.generate([probe, {"prompt_token_ids": [7, 7, 7]}], [sampled, nb], use_tqdm=False)
        assert _bits(outs[0]) == alone, nb


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_row_has_the_same_bits_in_a_prefill_as_in_a_decode_and_after_any_prefix_hit(tiny_dirs, dtype):
    """Every attention row goes through the decode kernel, prefill rows too, and fp32 norms and silu run
    the C loop's: a token's next-token logprob is the same computed by a decode step, by a prefill of
    the text so far (a recompute after preemption, an agent's next turn), and after a prefix hit of any
    length (SDPA's blocked prefill had moved bf16 bits at hits of 80 and 129 tokens on SmolLM2)."""
    llm = LLM(EngineConfig(model=tiny_dirs["qwen2"], dtype=dtype, max_model_len=512, num_threads=2))
    rng = random.Random(4)
    vocab = llm.core.runner.vocab_size
    one = SamplingParams(temperature=0.0, max_tokens=1, logprobs=0)
    prompt = [rng.randrange(3, vocab) for _ in range(37)]
    decoded = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0].outputs[0]
    for j in (1, 5, 11, 23):
        again = llm.generate([{"prompt_token_ids": prompt + decoded.token_ids[:j]}], one, use_tqdm=False)[0]
        assert again.outputs[0].logprobs[0] == decoded.logprobs[j], j
    for length in (33, 48, 65, 80, 129, 200):
        text = [rng.randrange(3, vocab) for _ in range(length)]
        llm.core.reset_prefix_cache()
        whole = llm.generate([{"prompt_token_ids": text}], one, use_tqdm=False)[0]
        hit = llm.generate([{"prompt_token_ids": text}], one, use_tqdm=False)[0]
        assert hit.num_cached_tokens == length - 1 - (length - 1) % 16 and _bits(hit) == _bits(whole), length
