"""The real sidecar for tests: `rollout.launcher.LocalSidecar` with test defaults."""

import os
from contextlib import contextmanager

from rollout.launcher import LocalSidecar

TOKEN = "test-secret"


def Sidecar(model: str, *extra: str, token: str = TOKEN,  # noqa: N802 - reads like a class
            log_path: str | None = None, env: dict[str, str] | None = None) -> LocalSidecar:
    """`env`: variables the sidecar's environment has on top of this process's."""
    # no warm standby unless a test asks: it is one more interpreter importing torch on 2 cores,
    # started at the first request, while the test measures; a restart without it starts cold
    standby = () if "--warm-standby" in extra else ("--warm-standby", "off")
    with _environment(env or {}):
        return LocalSidecar(model, "--log-level", "WARNING", "--max-model-len", "256", "--stats-interval", "0",
                            *standby, *extra, token=token, log_path=log_path)


@contextmanager
def _environment(values: dict[str, str]):
    """`values` in os.environ while the sidecar starts (its process inherits them), then as before."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def openai_client(side):
    """The official openai client on a sidecar's HTTP front, as an agent framework makes it."""
    import openai

    return openai.OpenAI(base_url=side.http_url + "/v1", api_key=TOKEN, max_retries=0, timeout=120)
