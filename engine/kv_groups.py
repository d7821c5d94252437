"""Which layers share a KV cache: vLLM's KV cache groups, cut down to the two kinds of layer our
families have, attending to every key or to a sliding window of them.

A model whose layers all attend alike has one group (a window on every layer: Mistral v0.1's, its
blocks behind the window handed back as it decodes, engine/block_manager.py). A model mixing the two
(Gemma 3's five windowed layers of six, Qwen2's upper ones under `use_sliding_window`) gets two: the
full-attention layers' cache, holding each sequence at its full length, and the windowed layers' own,
holding each sequence's last window of keys. Each group has its blocks, its block manager and each
sequence's table in it (engine/grouped_blocks.py); a layer reads its group's. One cache for every layer
would hold every layer's keys at full length: Gemma 3 1B at 4k tokens holds 3.4x the bytes it reads.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_GROUPS = 2  # the full-attention layers, the windowed ones (engine/sequence.py holds a table for each)


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int | None, ...]  # per group: the most keys behind which its layers look (None: every key)
    layer_group: tuple[int, ...]  # per layer: its group

    @property
    def hybrid(self) -> bool:
        return len(self.windows) > 1

    def layers(self, group: int) -> list[int]:
        return [i for i, g in enumerate(self.layer_group) if g == group]


def layer_windows(model) -> list[int | None]:
    """Each layer's sliding window as its attention module holds it (the engine's own layers,
    transformers' Qwen2 and Gemma 3); None where it attends to every key or keeps its window elsewhere
    (transformers' Mistral passes its config's: such a layer is served as a full one, its mask still cut)."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    return [getattr(getattr(layer, "self_attn", None), "sliding_window", None) or None for layer in layers]


def of_windows(windows: list[int | None], hybrid: bool = True) -> KVGroups:
    """The groups of layers with `windows`: one when they all have a window (the largest serves them) or
    none has, or when `hybrid` is off (every layer's keys kept at full length, vLLM's
    disable_hybrid_kv_cache_manager); else the full-attention layers' (group 0) and the windowed ones' (1)."""
    n = len(windows)
    windowed = [w for w in windows if w]
    if windowed and len(windowed) == len(windows):
        return KVGroups((max(windowed),), (0,) * n)
    if not windowed or not hybrid:
        return KVGroups((None,), (0,) * n)
    return KVGroups((None, max(windowed)), tuple(int(bool(w)) for w in windows))
