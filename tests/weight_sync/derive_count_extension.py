"""Our engine's worker extension with two more RPCs, to watch its derived copies
(engine/derived_weights.py: the prepacked linears) from a test: how many times a derive function
ran, and which copies the forward reads."""

from engine import derived_weights
from weight_sync.engine_side.extension import WeightSyncExtension


class DeriveCountExtension(WeightSyncExtension):
    def derive_count(self) -> int:
        """Derivations since the last call (each module's derive function wrapped once with a counter,
        as a new kind of derived copy plugs in: through `module._derive`)."""
        for m in derived_weights.derived_modules(self.model):
            if not getattr(m._derive, "counted", False):
                m._derive = _counted(m._derive, self.__dict__.setdefault("_derives", [0]))
        count = self.__dict__.setdefault("_derives", [0])
        out, count[0] = count[0], 0
        return out

    def derived_copy_ids(self) -> list[int]:
        """id() of each module's served copy (0: none), in module order."""
        return [id(m._derived) if m._derived is not None else 0 for m in derived_weights.derived_modules(self.model)]


def _counted(derive, count: list):
    def counted(weight):
        count[0] += 1
        return derive(weight)

    counted.counted = True
    return counted
