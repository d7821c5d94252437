class EngineDeadError(RuntimeError):
    """The engine-core process is gone; no request can complete."""


class EngineGenerateError(RuntimeError):
    """A request failed inside the engine (other requests are unaffected)."""


class RefusedError(ValueError):
    """A call refused before it changed anything (a weight push or load that does not fit the
    engine's weights, a push the sidecar's state refuses). The one root of every refusal: the
    engine's, weight_sync's (`WeightSyncRefusedError`, `PushRefused`) and the sidecar's
    (`WeightSyncRefused`). A ValueError, as any bad input; error kind "refused" across every process
    boundary (`error_kind`), which tells a caller that nothing changed and the weight-sync group is
    still usable."""

    refused = True
    error_kind = "refused"


class EngineUnhealthyError(RuntimeError):
    """The engine-core process is alive but cannot serve (`problems` says why)."""

    error_kind = "unhealthy"

    def __init__(self, problems: list[str]):
        super().__init__("engine unhealthy: " + "; ".join(problems))
        self.problems = list(problems)


class MissingExtraError(ImportError):
    """An optional part (a pip extra, a model package) is not installed. The message is one line
    that ends with the command installing it, so a CLI can exit with it as is."""


# What kind of failure an error is, carried as data across every boundary (never read out of its text):
# "refused": a weight push or load refused before it changed anything (RefusedError and its children);
# "invalid": the caller's input was refused and nothing changed (a ValueError or PermissionError);
# "unhealthy": the call failed half way and left the worker unable to serve until it is restarted;
# "regroup" and "gone": the sidecar's (rollout/common/protocol.py says what they ask of a client);
# "failed": anything else.
REFUSED, INVALID, UNHEALTHY, FAILED = "refused", "invalid", "unhealthy", "failed"


def error_kind(e: BaseException) -> str:
    """The one reader of an error's kind, in the engine's core, its workers and the sidecar: the kind
    its class declares (`error_kind`), else "invalid" for bad input, else "failed"."""
    kind = getattr(e, "error_kind", None)
    if isinstance(kind, str) and kind:
        return kind
    return INVALID if isinstance(e, (ValueError, PermissionError)) else FAILED
