import pytest

from tests.docs.snippets import collect, inventory


@pytest.fixture(scope="session")
def snippet_env(tmp_path_factory):
    """The environment snippets run in, with the tiny model already built into its cache (where
    `--model tiny` and `resolve_model("tiny")` find it)."""
    from engine.models.tiny_model import build_tiny_model
    from tests.docs.runner import environment

    cache = tmp_path_factory.mktemp("rollout_cache")
    build_tiny_model(cache / "qwen2-tiny", "tiny")
    return environment(cache)


def pytest_terminal_summary(terminalreporter):
    """How many of the docs' blocks the tests run and how many are marked, by mark. Printed where
    tests/docs ran in this process (without xdist); `python -m tests.docs.snippets` prints it too."""
    ran_here = any("tests/docs/" in getattr(r, "nodeid", "") for rs in terminalreporter.stats.values() for r in rs)
    if ran_here:
        terminalreporter.write_line(inventory(collect()))
