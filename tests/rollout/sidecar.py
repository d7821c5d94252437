"""The real sidecar for tests: `rollout.launcher.LocalSidecar` with test defaults."""

from rollout.launcher import LocalSidecar

TOKEN = "test-secret"


def Sidecar(model: str, *extra: str, token: str = TOKEN,  # noqa: N802 - reads like a class
            log_path: str | None = None) -> LocalSidecar:
    # no warm standby unless a test asks: it is one more interpreter importing torch on 2 cores,
    # started at the first request, while the test measures; a restart without it starts cold
    standby = () if "--warm-standby" in extra else ("--warm-standby", "off")
    return LocalSidecar(model, "--log-level", "WARNING", "--max-model-len", "256", "--stats-interval", "0",
                        *standby, *extra, token=token, log_path=log_path)
