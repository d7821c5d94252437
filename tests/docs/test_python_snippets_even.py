"""Every python block of README.md and docs/ runs as written (against a fresh sidecar of the tiny
model where it says `sidecar` / `http`), unless it is marked, visibly, as needing a GPU, a cluster,
SmolLM2, vLLM or minutes (tests/docs/snippets.py). The blocks are dealt over two files, this one the even-numbered, so
that xdist's --dist loadfile runs them on both workers."""

import pytest

from tests.docs import runner
from tests.docs.snippets import collect

pytestmark = pytest.mark.timeout(300)
SNIPPETS = [s for s in collect() if s.lang == "python"][0::2]


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.id for s in SNIPPETS])
def test_python_snippet_runs(snippet, snippet_env, tmp_path):
    runner.check_python_snippet(snippet, snippet_env, tmp_path)
