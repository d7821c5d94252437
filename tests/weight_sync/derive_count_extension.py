"""Our engine's worker extension with two more RPCs, to watch its derived copies
(engine/kernels/derived_weights.py: the prepacked linears) from a test: how many times a derive function
ran, and which copies the forward reads."""

from engine.kernels import derived_weights
from weight_sync.engine_side.extension import WeightSyncExtension


def served_copies(model) -> int:
    """How many copies an engine of `model` serves: one per linear, but one for each layer's q/k/v
    and one for its gate/up (engine/kernels/fused_linears.py)."""
    import torch

    return sum(isinstance(m, torch.nn.Linear) for m in model.modules()) - 3 * model.config.num_hidden_layers


class DeriveCountExtension(WeightSyncExtension):
    def derive_count(self) -> int:
        """Derivations since the last call (each module's derive function wrapped once with a counter,
        as a new kind of derived copy plugs in: through `module._derive`)."""
        for m in [*derived_weights.derived_modules(self.model), *derived_weights.groups(self.model)]:
            attr = "derive" if isinstance(m, derived_weights.Group) else "_derive"
            if not getattr(getattr(m, attr), "counted", False):
                setattr(m, attr, _counted(getattr(m, attr), self.__dict__.setdefault("_derives", [0])))
        count = self.__dict__.setdefault("_derives", [0])
        out, count[0] = count[0], 0
        return out

    def derived_copy_ids(self) -> list[int]:
        """id() of each served copy (0: none): the modules' own, in module order, then the groups'."""
        own = [id(m._derived) if m._derived is not None else 0 for m in derived_weights.derived_modules(self.model)
               if getattr(m, "_group", None) is None]
        return own + [id(g.copy) if g.copy is not None else 0 for g in derived_weights.groups(self.model)]

    def derived_copy_memory(self) -> list[int]:
        """The address of each served packed copy's memory, as derived_copy_ids orders them (0: none),
        and then the spares the last commit kept."""
        def address(copy):
            return copy.packed.data_ptr() if getattr(copy, "packed", None) is not None else 0

        own = [address(m._derived) for m in derived_weights.derived_modules(self.model)
               if getattr(m, "_group", None) is None]
        served = own + [address(g.copy) for g in derived_weights.groups(self.model)]
        return served + sorted(address(c) for c in derived_weights.spares(self.model).values())


def _counted(derive, count: list):
    def counted(weight, **kwargs):
        count[0] += 1
        return derive(weight, **kwargs)

    counted.counted = True
    counted.takes_parts = derived_weights.takes_parts(derive)
    return counted
