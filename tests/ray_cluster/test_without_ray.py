"""Ray is an optional extra: with it absent, everything else imports and the recipes' parser
works; asking for --ray says which extra to install. Runs whether Ray is installed or not."""

import subprocess
import sys

SCRIPT = """
import sys
sys.modules["ray"] = None  # as if not installed: `import ray` raises ImportError
import rollout, rollout.serve, recipes.grpo, recipes.ppo, weight_sync, engine
from recipes.rl_train import build_parser
args = build_parser("grpo").parse_args(["--ray", "--num-sidecars", "2", "--placement", "spread"])
assert args.ray and args.num_sidecars == 2
assert "ray" not in [m for m in sys.modules if sys.modules[m] is not None]
try:
    import rollout.ray_launcher
except ImportError as e:
    print("REFUSED", e)
"""


def test_everything_but_the_ray_launcher_works_without_ray():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "REFUSED sidecars on Ray need the 'ray' extra" in out.stdout
