class EngineDeadError(RuntimeError):
    """The engine-core process is gone; no request can complete."""


class EngineGenerateError(RuntimeError):
    """A request failed inside the engine (other requests are unaffected)."""


class RefusedError(ValueError):
    """A call refused before it changed anything (a weight push or load that does not fit the
    engine's weights). A ValueError, as any bad input; `refused` makes it error kind "refused"
    across every process boundary (engine/messages.py, rollout/protocol.py), which tells a
    caller that nothing changed and the weight-sync group is still usable."""

    refused = True


class EngineUnhealthyError(RuntimeError):
    """The engine-core process is alive but cannot serve (`problems` says why)."""

    def __init__(self, problems: list[str]):
        super().__init__("engine unhealthy: " + "; ".join(problems))
        self.problems = list(problems)


class MissingExtraError(ImportError):
    """An optional part (a pip extra, a model package) is not installed. The message is one line
    that ends with the command installing it, so a CLI can exit with it as is."""
