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


def test_an_upside_down_correction_band_is_refused_before_anything_starts(capsys):
    from recipes.flags import build_parser

    parser = build_parser("grpo")
    for argv, said in ((["--is-mode", "token_mask", "--is-cap", "1", "--is-floor", "2"], "lower <= upper"),
                       (["--is-mode", "tis"], "invalid choice")):
        try:
            parser.parse_args(argv)
        except SystemExit as e:
            assert e.code == 2 and said in capsys.readouterr().err
        else:
            raise AssertionError(f"{argv} parsed")
    assert parser.parse_args(["--is-mode", "icepop"]).is_cap is None  # the mode's own band, resolved later
    assert parser.parse_args(["--is-cap", "0", "--is-floor", "5"]).is_cap == 0  # no correction: no band to check
