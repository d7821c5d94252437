"""Every bash block of README.md and docs/ runs as written (a `serves` block: each sidecar it
starts must print READY), unless it is marked, visibly, as needing a GPU, a cluster, SmolLM2,
vLLM or minutes; and every block's language and marks are ones the tests know."""

import pytest

from tests.docs import runner
from tests.docs.snippets import collect, inventory, problems

pytestmark = pytest.mark.timeout(300)
SNIPPETS = [s for s in collect() if s.lang == "bash"]


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.id for s in SNIPPETS])
def test_shell_snippet_runs(snippet, snippet_env, tmp_path):
    if snippet.skip_reason:
        pytest.skip(snippet.skip_reason)
    if "serves" in snippet.marks:
        for cmd in runner.serve_commands(snippet.code):
            runner.serve_until_ready(cmd, snippet_env)
        return
    done = runner.run(snippet, snippet_env, tmp_path)
    assert done.returncode == 0, f"{snippet.id} failed ({done.returncode}):\n{done.stdout[-6000:]}"


def test_every_block_is_run_or_marked_visibly():
    found = collect()
    assert not problems(found), "\n".join(problems(found))
    print(inventory(found))
    code = [s for s in found if s.lang in ("python", "bash")]
    # most of the docs' code runs: a page whose blocks all get marked away is a page nothing checks
    assert sum(s.skip_reason is None for s in code) >= len(code) // 2, inventory(found)
