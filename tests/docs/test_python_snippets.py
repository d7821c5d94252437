"""Every python block of README.md and docs/ runs as written (against a fresh sidecar of the tiny
model where it says `sidecar` / `http`), unless it is marked, visibly, as needing a GPU, a cluster,
SmolLM2, vLLM or minutes (tests/docs/snippets.py)."""

import pytest

from tests.docs import runner
from tests.docs.snippets import collect

pytestmark = pytest.mark.timeout(300)
SNIPPETS = [s for s in collect() if s.lang == "python"]


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.id for s in SNIPPETS])
def test_python_snippet_runs(snippet, snippet_env, tmp_path):
    if snippet.skip_reason:
        pytest.skip(snippet.skip_reason)
    first = snippet
    while "continues" in first.marks and first.previous is not None:  # the sidecar is the first block's
        first = first.previous
    if first.marks & {"sidecar", "http"}:
        with runner.sidecar(snippet_env, "http" in first.marks, first.sidecar_args) as side:
            done = runner.run(snippet, snippet_env, tmp_path, side.url, side.http_url)
    else:
        done = runner.run(snippet, snippet_env, tmp_path)
    assert done.returncode == 0, f"{snippet.id} failed ({done.returncode}):\n{done.stdout[-6000:]}"
