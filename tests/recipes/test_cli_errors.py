"""A recipe's command line refuses a model that is not there as `rollout.serve` does: one line and
exit 1, before any download is tried or anything starts (never a hub-download traceback)."""

import os
import subprocess
import sys


def test_a_model_that_is_not_there_ends_the_recipe_with_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "recipes.grpo", "--model", "nosuch", "--output-dir",
                          str(tmp_path / "out")], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1, out.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: --model 'nosuch': no such directory; give an HF model "
                                                   "directory or a name: smollm2"), out.stderr
    assert not (tmp_path / "out").exists()  # nothing written before the check
