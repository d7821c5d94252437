"""rollout's layout holds (rollout/__init__.py): the trainer's client (rollout.client) never imports the
sidecar (rollout.sidecar), what both speak (rollout.common) imports neither, the sidecar imports the
client only where it is one (peer_send.py), a sidecar's process loads no module of the client, and the
router (rollout.router) none of the sidecar's."""

import json
import pathlib
import subprocess
import sys

from tests.layout import imported

ROOT = pathlib.Path(__file__).resolve().parents[2] / "rollout"
# each place, the places it must not import (lazy imports and TYPE_CHECKING ones included), and the
# files allowed to all the same
FORBIDDEN = {"common": (("client", "sidecar"), ()), "client": (("sidecar", "router"), ()),
             "sidecar": (("client", "router"), ("peer_send.py",)), "router": (("sidecar",), ())}


def test_the_client_never_imports_the_sidecar_and_the_common_ground_neither():
    wrong = []
    for place, (forbidden, allowed) in FORBIDDEN.items():
        for path in sorted((ROOT / place).rglob("*.py")):
            if path.name in allowed:
                continue
            for line, module in imported(path, "rollout"):
                if module.split(".")[1] in forbidden:
                    wrong.append(f"{path.relative_to(ROOT.parent)}:{line} imports {module}")
    assert not wrong, "\n".join(wrong)


def test_the_top_of_rollout_holds_the_entry_points_only():
    assert sorted(p.name for p in ROOT.glob("*.py")) == ["__init__.py", "launcher.py", "ray_launcher.py", "serve.py"]
    assert sorted(p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith("__")) == [
        "client", "common", "router", "sidecar", "tool_calls"]


def _loaded_by(imports: str, prefixes: tuple[str, ...]) -> list[str]:
    """The modules under `prefixes` a fresh interpreter holds after `import <imports>`."""
    code = (f"import json, sys, {imports}; "
            f"print(json.dumps(sorted(m for m in sys.modules if m == 'torch' or m.startswith({prefixes!r}))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=ROOT.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_a_sidecar_process_loads_no_module_of_the_client():
    imports = "rollout.serve, rollout.sidecar.server, rollout.sidecar.openai_front.app"
    assert [m for m in _loaded_by(imports, ("rollout.client",)) if m != "torch"] == []


def test_a_router_process_loads_no_module_of_the_sidecar_nor_torch():
    """The router (`python -m rollout.router`) is a light process of its own: the client's placement and the
    common protocol, no engine."""
    assert _loaded_by("rollout.router.__main__", ("rollout.sidecar",)) == []


def test_the_public_names_still_import_from_rollout():
    from rollout import AsyncRolloutClient, Rollout, RolloutClient, SidecarError, SidecarGoneError
    from rollout.client import AsyncRolloutClient as again

    assert again is AsyncRolloutClient and issubclass(SidecarGoneError, SidecarError)
    assert RolloutClient.__module__ == "rollout.client.blocking_client" and Rollout.__module__ == "rollout.common.types"
