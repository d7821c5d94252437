"""What `load` answers (protocol.LoadReply; ZMQ `Load`, HTTP GET /load): how busy this sidecar is, for
the clients and routers that place sessions over several sidecars (rollout/client/placement.py,
rollout/router). Cheap enough to ask every second: the engines' own counters (engine/core.py `stats`),
never a forward; during a push, only what the manager knows (the engines' cores are receiving)."""

from __future__ import annotations

import asyncio

from rollout.common.protocol import LoadReply

ENGINE_STATS_TIMEOUT_S = 2.0  # an engine that takes longer is left out of running/waiting/kv_used


async def load_report(manager) -> LoadReply:
    state = manager.state
    reply = LoadReply(version=manager.version, pushing=state.pushing, engines=len(manager.supervisor.live()),
                      groups=int(state.counter("groups_in_flight")), sequences=sum(manager.load))
    if state.push_lock.locked():
        return reply
    stats = await asyncio.gather(*(asyncio.wait_for(e.get_stats(), ENGINE_STATS_TIMEOUT_S)
                                   for e in manager.serving_engines()), return_exceptions=True)
    stats = [s for s in stats if isinstance(s, dict)]
    ours = [s for s in stats if "num_blocks" in s]  # our engine's; vLLM's says less (engine/vllm_engine.py)
    if stats and len(ours) == len(stats):
        reply.running = sum(s["num_running"] for s in ours)
        reply.waiting = sum(s["num_waiting"] + s.get("num_held", 0) for s in ours)
        blocks = sum(s["num_blocks"] for s in ours)
        reply.kv_used = 1.0 - sum(s["num_free_blocks"] for s in ours) / blocks if blocks else -1.0
    elif stats:
        reply.running = sum(s.get("running_requests", 0) for s in stats)
    reply.prefix_hit_tokens = sum(s.get("prefix_cache_hit_tokens", 0) for s in stats)
    reply.prefix_query_tokens = sum(s.get("prefix_cache_query_tokens", 0) for s in stats)
    reply.forward_s = sum(s.get("forward_seconds", 0.0) for s in stats)
    return reply
