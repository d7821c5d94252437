"""A sidecar's start: its engine cores start first, and import torch while the front end imports
its own (bench.startup measures the seconds; this checks the order)."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest


def test_the_engine_cores_start_before_the_front_end_imports_torch(qwen2_dir):
    code = textwrap.dedent(f"""
        import sys
        from rollout.sidecar import main as serve

        args = serve.build_parser().parse_args(["--model", {qwen2_dir!r}, "--num-engines", "2"])
        model, cores = serve.prepare(args)
        assert "torch" not in sys.modules and "transformers" not in sys.modules, "imported before the cores started"
        assert model == {qwen2_dir!r} and len(cores) == 2 and all(c.poll() is None for c in cores)
        for c in cores:
            c.kill()
            c.wait()
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"


def test_prepacked_linears_follow_the_flag(qwen2_dir):
    from rollout.sidecar import main as serve

    on, off = (serve.engine_config(serve.build_parser().parse_args(flags), qwen2_dir, "cpu", 0)
               for flags in (["--max-model-len", "128"], ["--max-model-len", "128", "--prepack-linears", "off"]))
    assert on.prepack_linears and not off.prepack_linears


def test_the_head_dtype_flag_reaches_both_engines(qwen2_dir):
    """--head-dtype float32: our engine's config, and vLLM's engine arguments (its hf_overrides)."""
    from engine.vllm_start import engine_args
    from rollout.sidecar import main as serve

    cfg = serve.engine_config(serve.build_parser().parse_args(["--head-dtype", "float32", "--dtype", "bfloat16", "--max-model-len", "128"]),
                              qwen2_dir, "cpu", 0)
    assert cfg.head_dtype == "float32"
    pytest.importorskip("vllm")
    assert engine_args(cfg, 1, on_cpu=True).hf_overrides == {"head_dtype": "float32"}
    default = serve.engine_config(serve.build_parser().parse_args(["--max-model-len", "128"]), qwen2_dir, "cpu", 0)
    assert default.head_dtype == "auto" and not engine_args(default, 1, on_cpu=True).hf_overrides


def test_vllm_engines_start_no_cores_of_ours():
    from rollout.sidecar import main as serve

    args = serve.build_parser().parse_args(["--engine", "vllm"])
    assert serve.start_cores_early(args, "unused") == []


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollout.serve", "--log-level", "INFO", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})


def test_a_bad_argument_ends_the_sidecar_with_one_line_before_any_engine_starts(qwen2_dir, tmp_path):
    """A bad path, a mistyped name (the names that exist are listed), a value an engine refuses, a
    length past the model's positions, a port in use: one line, exit 1 (argparse's own: 2), and no
    engine core started (it would log; at INFO the sidecar logs its engines' start)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        cases = [
            ((str(tmp_path / "nowhere"),), "no such directory"),
            (("tinyy",), "tiny, small"),
            ((str(tmp_path),), "without config.json"),
            ((qwen2_dir, "--max-num-seqs", "0"), "max_num_seqs must be >= 1"),
            ((qwen2_dir, "--max-model-len", "100000"), "more than the model holds"),
            ((qwen2_dir, "--port", str(busy.getsockname()[1])), "Address already in use"),
        ]
        for (model, *rest), what in cases:
            out = _serve("--model", model, *rest)
            lines = out.stderr.strip().splitlines()
            assert out.returncode == 1 and len(lines) == 1 and what in lines[0], (model, rest, out.stderr)
    out = _serve("--model", qwen2_dir, "--dtype", "float64")
    assert out.returncode == 2 and "invalid choice" in out.stderr.strip().splitlines()[-1]


def test_the_sequence_length_defaults_to_what_the_model_holds(qwen2_dir):
    from rollout.sidecar import main as serve

    args = serve.build_parser().parse_args(["--model", qwen2_dir, "--port", "0"])
    serve._check_or_exit(args, qwen2_dir)
    with open(os.path.join(qwen2_dir, "config.json")) as f:
        assert args.max_model_len == json.load(f)["max_position_embeddings"]


def test_an_engine_that_cannot_start_ends_the_sidecar_with_its_reason(qwen2_dir, tmp_path):
    """Weights that pass the checks (the files are there) but do not load: the sidecar exits 1,
    its last line the engine's reason (the core tells its frontend before it exits), and leaves no
    engine core behind."""
    import shutil
    import time

    broken = tmp_path / "broken"
    shutil.copytree(qwen2_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    out = _serve("--model", str(broken), "--port", "0", "--num-engines", "2")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1, out.stderr[-2000:]
    # the last line names the cause the core met (its own log above keeps the traceback)
    assert lines[-1].startswith("error: an engine could not start: ") and "SafetensorError" in lines[-1], lines[-1]
    time.sleep(1.5)  # an orphaned core would outlive its sidecar: its watchdog ends it within 0.5 s
    assert not _processes_naming(str(broken))


def _processes_naming(text: str) -> list[int]:
    """Live processes whose command line holds `text` (the cores name their model's directory)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found
