class EngineDeadError(RuntimeError):
    """The engine-core process is gone; no request can complete."""


class EngineGenerateError(RuntimeError):
    """A request failed inside the engine (other requests are unaffected)."""
