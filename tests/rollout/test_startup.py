"""A sidecar's start: its engine cores start first, and import torch while the front end imports
its own (bench.startup measures the seconds; this checks the order)."""

import os
import subprocess
import sys
import textwrap


def test_the_engine_cores_start_before_the_front_end_imports_torch(qwen2_dir):
    code = textwrap.dedent(f"""
        import sys
        from rollout import serve

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


def test_vllm_engines_start_no_cores_of_ours():
    from rollout import serve

    args = serve.build_parser().parse_args(["--engine", "vllm"])
    assert serve.start_cores_early(args, "unused") == []
