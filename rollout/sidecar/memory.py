"""What the sidecar's memory holds, by part, as its engines report it (engine/memory_report.py and
weight sync's part): said once at start in the log, in every health reply (each engine's
`memory`) and in /metrics (`rollout_memory_bytes{part, engine}`).

The parts of a weight copy: `weights` (the served weights), `derived_copies` (a prepacked or 8-bit
copy the forward reads instead: none for bf16 on AMX, which reads the weights in place; with the
staging kept, also the fp32 panels the last commit retired, the next push's memory),
`staging_kept` (the buffer the next push stages into: --overlap-receive on keeps it ready), the
host copy (a link to the served weights on the CPU: no bytes of its own; --host-copy off drops
it), and the KV cache (`kv_cache`: its budget; `kv_cache_resident`: what sequences have written)."""

from __future__ import annotations

PARTS = ("weights", "derived_copies", "staging_kept", "kv_cache", "kv_cache_resident")


def summary(engine_states: list, host_copy: bool, standby: bool) -> str:
    """One line per the first engine's report (every engine holds the same)."""
    mem = next((s.memory for s in engine_states if getattr(s, "memory", None)), None)
    if not mem:
        return "memory: not reported by the engines"
    gb = {k: mem.get(k, 0) / 1e9 for k in PARTS}
    copies = mem.get("weights", 0) + mem.get("derived_copies", 0) + mem.get("staging_kept", 0)
    links = mem.get("host_copy_links_weights", False)
    host = ("off" if not host_copy else "a link to the served weights, 0 GB" if links else
            f"written after each push, {gb['weights']:.2f} GB in /dev/shm")
    ratio = copies / mem["weights"] if mem.get("weights") else 0.0
    return (f"memory per engine: weights {gb['weights']:.2f} GB, derived copies {gb['derived_copies']:.2f} GB, "
            f"staging kept for the next push {gb['staging_kept']:.2f} GB ({ratio:.2f}x the weights in all); host "
            f"copy: {host}; KV cache {gb['kv_cache']:.2f} GB budget, {gb['kv_cache_resident']:.2f} GB written; "
            f"warm standby {'on (an idle interpreter, ~0.4 GB)' if standby else 'off'}")
