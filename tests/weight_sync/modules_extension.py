"""Our engine's worker extension with one more RPC: which weight_sync modules its core process
has loaded (tests/weight_sync/test_layout.py)."""

import sys

from weight_sync.engine_side.extension import WeightSyncExtension


class ModulesExtension(WeightSyncExtension):
    def weight_sync_modules(self) -> list[str]:
        return sorted(m for m in sys.modules if m == "weight_sync" or m.startswith("weight_sync."))
