"""Build tiny HF causal LMs offline: a byte-level BPE tokenizer trained on a built-in corpus,
a Qwen2, Qwen3, Llama, Llama 3 (scaled rope) or Gemma 3 config (or a mixture of experts: qwen3_moe,
qwen2_moe, mixtral, olmoe), seeded random init, saved with `save_pretrained`.

The result is an ordinary model directory: everything downstream loads it exactly as it would a
real checkpoint (`AutoModelForCausalLM.from_pretrained`, `AutoTokenizer.from_pretrained`).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import glob
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

# name -> (hidden, layers, heads, kv_heads, intermediate, vocab target)
SIZES: dict[str, tuple[int, int, int, int, int, int]] = {
    "micro": (64, 2, 4, 2, 128, 512),  # ~0.1M: fixed-overhead benchmarks
    "mini": (128, 4, 4, 2, 384, 2048),  # ~1M: the micro shape of bench/grpo_step.py
    "tiny": (256, 4, 4, 2, 768, 2048),  # ~4M: tests
    "small": (576, 14, 9, 3, 1536, 4096),  # ~50M: benchmarks
    "medium": (1536, 20, 16, 4, 4096, 8192),  # ~500M: weight-sync benchmarks
}
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|bos|>"]
# ChatML, as Qwen2's: conversations go through the same template path a real chat model's do
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
EOS, PAD, BOS = SPECIAL_TOKENS
MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
# llama3: Llama's with Llama 3.1's scaled rope (an original context of 64 positions, so that tests'
# short sequences cross the scaled wavelengths); qwen3: q/k norms per head
# gemma3: Gemma 3's text model (four norms a layer, GELU, q/k norms), a window of 32 keys on three
# layers of four and the global rope on the fourth; its head untied (a tied one, Gemma's sqrt(hidden)
# embedding scale, and a random init only ever repeat the last token) and its norms' weights random
# (HF starts them at 0: each scales by 1 + w); every family's biases (Qwen2's q/k/v) random too
# phi3: Phi-3's fused qkv_proj and gate_up_proj, its head untied, every layer's window 32 keys (Phi-3-mini's
# is 2047) and its head size 96
ARCHS = ("qwen2", "llama", "llama3", "qwen3", *MOE_ARCHS, "gemma3", "phi3")
STAMP = "tiny_model.json"  # the recipe a directory was built with, written last
QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _corpus() -> list[str]:
    """A deterministic built-in corpus: English words, made-up words, numbers and arithmetic,
    varied enough for BPE to learn a few thousand merges."""
    import random

    rng = random.Random(0)
    words = (
        "the a an of to and in is it that for on with as was at by be this from or have not are but "
        "one two three four five six seven eight nine ten zero add sum answer question what how many "
        "plus minus times equals number count letter word reverse copy repeat sort list first last "
        "model policy reward value train step token sample group prompt completion engine weight "
        "hello world python torch rollout cat dog sun moon red blue green apple tree house river"
    ).split()
    syllables = "ka lo mi ne ru sa ti po ve da zu fi go he ja le mo nu pa qui ro se ta vo wi xe yu ze".split()
    words += ["".join(rng.choice(syllables) for _ in range(rng.randint(2, 4))) for _ in range(3000)]
    lines = []
    for i in range(6000):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        w = " ".join(rng.choice(words) for _ in range(8))
        lines.append(f"{w.capitalize()}. {a} + {b} = {a + b}. Q: {rng.choice(words)}? A: {rng.choice(words)}!")
    return lines


def build_tokenizer(vocab_size: int):
    """Train a byte-level BPE on the built-in corpus and wrap it as a `PreTrainedTokenizerFast`."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Qwen2's own normaliser and pre-tokeniser: transformers 5's AutoTokenizer rebuilds a qwen2
    # tokenizer with these whatever tokenizer.json says, so the two must agree.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, bos_token=BOS)


def build_config(arch: str, size: str, vocab_size: int, tokenizer):
    from transformers import LlamaConfig, Qwen2Config

    hidden, layers, heads, kv_heads, inter, _ = SIZES[size]
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=inter,
        max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        initializer_range=0.1,  # a peakier random model than 0.02, so greedy ties are rare
    )
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "llama3":
        return LlamaConfig(**common, rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 64})
    if arch == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(**common, head_dim=hidden // heads)
    if arch in MOE_ARCHS:
        return _moe_config(arch, common)
    if arch == "gemma3":
        from transformers import AutoConfig

        return AutoConfig.for_model("gemma3_text", **{**common, "tie_word_embeddings": False},
                                    head_dim=hidden // heads, query_pre_attn_scalar=hidden // heads, sliding_window=32,
                                    layer_types=["full_attention" if i % 4 == 3 else "sliding_attention"
                                                 for i in range(layers)])
    if arch == "phi3":
        from transformers import Phi3Config

        # head_dim 96, Phi-3-mini's (3072 / 32): not a power of two, a case of its own in the decode kernel
        return Phi3Config(**{**common, "tie_word_embeddings": False}, sliding_window=32, head_dim=96)
    raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")


def _moe_config(arch: str, common: dict):
    """A mixture of experts of the family `arch` at the size's width: 8 experts, 2 a token, each
    expert a quarter of the dense MLP (Qwen3-MoE's proportions); qwen2_moe with its shared expert."""
    from transformers import AutoConfig

    inter = common["intermediate_size"]
    moe = dict(num_experts_per_tok=2, router_aux_loss_coef=0.0)
    if arch in ("qwen3_moe", "qwen2_moe"):
        moe.update(num_experts=8, moe_intermediate_size=inter // 4, norm_topk_prob=arch == "qwen3_moe",
                   head_dim=common["hidden_size"] // common["num_attention_heads"])
    if arch == "qwen2_moe":
        moe.update(shared_expert_intermediate_size=inter // 2)
    if arch == "mixtral":
        moe.update(num_local_experts=8, intermediate_size=inter // 4, sliding_window=None)
    if arch == "olmoe":
        moe.update(num_experts=8, intermediate_size=inter // 4, norm_topk_prob=False)
    return AutoConfig.for_model(arch, **{**common, **moe})


def build_tiny_model(out_dir: str | os.PathLike, size: str = "tiny", arch: str = "qwen2", seed: int = 0) -> Path:
    """Build (or reuse, if already built with the same recipe) a model directory and return its path.

    Safe from several processes at once (torchrun's ranks): under a lock beside `out_dir`, one
    builds into a temporary directory and renames it into place, so `out_dir` is only ever
    absent or whole; the others wait for the lock and reuse its build."""
    return _build(Path(out_dir), size, arch, seed, _write_in_fresh_process)


def build_tiny_models(outs: dict[str, str | os.PathLike], size: str = "tiny", seed: int = 0) -> dict[str, Path]:
    """`build_tiny_model` for several architectures ({arch: out_dir}), those not built yet written by
    one fresh process: its imports (torch, transformers: seconds) are most of a tiny build's time."""
    for arch in outs:
        _check(size, arch)
    paths = {arch: Path(out) for arch, out in outs.items()}
    todo = [arch for arch, out in paths.items() if _stamp_of(out) != _recipe(size, arch, seed)]
    if len(todo) > 1:
        _run_fresh("--size", size, "--seed", str(seed), "--each", *(f"{arch}={paths[arch]}" for arch in todo))
    return {arch: build_tiny_model(out, size, arch, seed) for arch, out in paths.items()}  # reuses, or builds one


def _check(size: str, arch: str) -> None:
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(SIZES)}")
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")


def _build(out: Path, size: str, arch: str, seed: int, write) -> Path:
    _check(size, arch)
    stamp = _recipe(size, arch, seed)
    if _stamp_of(out) == stamp:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(out):
        if _stamp_of(out) == stamp:  # built by another process while this one waited
            return out
        _clear_leftovers(out)
        _set_aside(out)
        tmp = _fresh_dir(out)
        try:
            log.info("building %s %s model in %s", size, arch, out)
            write(tmp, size, arch, seed)
            _rename_into_place(tmp, out, stamp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _recipe(size: str, arch: str, seed: int) -> dict:
    # builder 3: a build by builder 2 under torchrun may be stamped yet lack config.json and weights;
    # builder 4: biases random (they were 0)
    return {"size": size, "arch": arch, "seed": seed, "builder": 4}


def _write_in_fresh_process(out: Path, size: str, arch: str, seed: int) -> None:
    """`_write_model` in a new interpreter (`--into`). NOTE: in a torch.distributed rank other than
    0, save_pretrained silently writes no config and no weights (transformers 5); and the seeded
    init would reset the caller's torch RNG."""
    _run_fresh("--size", size, "--arch", arch, "--seed", str(seed), "--into", str(out))


def _run_fresh(*args: str) -> None:
    """This module's command line in a new interpreter, which finds this repository's packages."""
    root = str(Path(__file__).resolve().parents[2])  # the repository's root
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, "-m", "engine.models.tiny_model", *args], env=env, check=True)


def _write_model(out: Path, size: str, arch: str, seed: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer(SIZES[size][5])
    config = build_config(arch, size, len(tokenizer), tokenizer)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if arch == "gemma3" and name.endswith("norm.weight"):
                p.normal_(0, 0.3)
            elif name.endswith(".bias"):  # HF starts them at 0, where no test could tell a bias dropped
                p.normal_(0, 0.2)
    model.save_pretrained(out)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    # Without this, AutoTokenizer picks a class by model_type (LlamaTokenizer forces Metaspace).
    tok_cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "TokenizersBackend"
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2))
    (out / STAMP).write_text(json.dumps(_recipe(size, arch, seed)))


def _exit_with_parent() -> None:
    """Ends this `--into` build when the process that asked for it dies: it owns the directory."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _stamp_of(out: Path) -> dict | None:
    try:
        return json.loads((out / STAMP).read_text())
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def _build_lock(out: Path) -> Iterator[None]:
    """An exclusive lock on `.<name>.lock` beside `out`; the kernel drops it if its holder dies."""
    with open(out.parent / f".{out.name}.lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process building %s", out)
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _fresh_dir(out: Path) -> Path:
    """A new empty directory beside `out` (same filesystem, so a rename is atomic), named so that
    `_clear_leftovers` finds it if its builder is killed."""
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()  # not tempfile.mkdtemp: its 0700 would become the model directory's mode
    return tmp


def _clear_leftovers(out: Path) -> None:
    """Removes what killed builds of `out` left; only called under the lock, so none is in use."""
    for d in out.parent.glob(f".{glob.escape(out.name)}.tmp-*"):
        shutil.rmtree(d, ignore_errors=True)


def _set_aside(out: Path) -> None:
    """Moves an existing `out` out of the way: an empty directory or another recipe's build. A
    directory that is neither is not ours to delete."""
    if not out.exists():
        return
    if not (out / STAMP).exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not a tiny-model build: remove it or build elsewhere")
    aside = _fresh_dir(out)
    os.rename(out, aside)  # one step, so a kill leaves a leftover, never a part-deleted `out`
    shutil.rmtree(aside)


def _rename_into_place(tmp: Path, out: Path, stamp: dict) -> None:
    try:
        os.rename(tmp, out)
    except OSError:
        # NOTE: a builder on a filesystem without working locks may have won the race: use its build
        if _stamp_of(out) != stamp:
            raise
        log.info("another process built %s first; using its build", out)


def cache_root() -> Path:
    """Where shared builds are cached: $ROLLOUT_CACHE or ~/.cache/rollout-sidecar."""
    return Path(os.environ.get("ROLLOUT_CACHE", Path.home() / ".cache" / "rollout-sidecar"))


def default_model_dir(size: str = "tiny", arch: str = "qwen2") -> Path:
    """The shared build of one tiny model, under `cache_root()`."""
    return cache_root() / f"{arch}-{size}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m recipes.tiny_model",
        description="Build a tiny random-weight HF model directory offline (tokenizer included)."
    )
    p.add_argument("--size", default="tiny", choices=sorted(SIZES), help="model size (default: tiny, ~4M params)")
    p.add_argument("--arch", default="qwen2", choices=ARCHS,
                   help="model architecture (qwen3_moe to olmoe: mixtures of experts, 8 experts, 2 a token; "
                        "gemma3: Gemma 3's text model)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random init")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--out", default=None, help="output directory (default: the shared cache dir)")
    where.add_argument("--into", default=None, help="write into this existing directory as it is: no reuse, lock or "
                       "rename (what build_tiny_model runs in a fresh process)")
    where.add_argument("--each", nargs="+", metavar="ARCH=DIR", default=None,
                       help="build (or reuse) each ARCH into its DIR, here (what build_tiny_models runs)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.into:
        _exit_with_parent()
        _write_model(Path(args.into), args.size, args.arch, args.seed)
        return
    if args.each:
        _exit_with_parent()
        for item in args.each:
            arch, _, out = item.partition("=")
            _build(Path(out), args.size, arch, args.seed, _write_model)  # this process is the fresh one
        return
    out = build_tiny_model(args.out or default_model_dir(args.size, args.arch), args.size, args.arch, args.seed)
    log.info("model ready at %s", out)


if __name__ == "__main__":
    main()
