"""The real sidecar for tests: `rollout.launcher.LocalSidecar` with test defaults."""

from rollout.launcher import LocalSidecar

TOKEN = "test-secret"


def Sidecar(model: str, *extra: str, token: str = TOKEN) -> LocalSidecar:  # noqa: N802 - reads like a class
    return LocalSidecar(model, "--log-level", "WARNING", "--max-model-len", "256", "--stats-interval", "0", *extra,
                        token=token)
