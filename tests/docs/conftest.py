import pytest

from tests.docs.snippets import collect, inventory


@pytest.fixture(scope="session")
def snippet_env(tmp_path_factory, tiny_dirs):
    """The environment snippets run in, with the tiny models already in its cache (where `--model
    tiny`, `tiny-moe` and `resolve_model("tiny")` find them): copies of the run's builds."""
    import shutil

    from engine.models.tiny_model import default_model_dir
    from tests.docs.runner import environment

    cache = tmp_path_factory.mktemp("rollout_cache")
    for arch, built in tiny_dirs.items():
        shutil.copytree(built, cache / default_model_dir("tiny", arch).name)
    return environment(cache)


def pytest_terminal_summary(terminalreporter):
    """How many of the docs' blocks the tests run and how many are marked, by mark. Printed where
    tests/docs ran in this process (without xdist); `python -m tests.docs.snippets` prints it too."""
    ran_here = any("tests/docs/" in getattr(r, "nodeid", "") for rs in terminalreporter.stats.values() for r in rs)
    if ran_here:
        terminalreporter.write_line(inventory(collect()))
