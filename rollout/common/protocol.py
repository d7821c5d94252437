"""The sidecar's wire protocol: client DEALER <-> server ROUTER, msgpack (msgspec), no pickle.

Every call is one message type carrying a call id and the shared token (empty on loopback).
The server answers each call with exactly one `Reply` (ok + value, or the error text); a
`generate` call first streams one `GroupOut` per prompt as each group finishes (any order,
`index` says which prompt), then its `Reply`; a `push_weights` call sends `Progress("paused")`
once its engines are paused (informational: the trainer starts broadcasting once every worker
marked itself ready in the group's store), then its `Reply`.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from rollout.common.types import Rollout
from weight_sync.common.manifest import Manifest

PROTOCOL_VERSION = 1


class _Call(msgspec.Struct, kw_only=True):
    """What every call carries: its id, which its replies carry back, and the shared token."""

    call_id: int
    token: str = ""


class Generate(_Call, tag="generate"):
    prompts: list[Union[str, list[Union[int, dict[str, str]]]]]  # text, token ids or a conversation
    params: Union[dict[str, Any], list[dict[str, Any]]]  # SamplingParams fields, one or per prompt


class InitWeightSync(_Call, tag="init_weight_sync"):
    host: str
    port: int
    world_size: int
    rank_offset: int
    group_name: str = ""
    timeout_s: float = 60.0
    secret: str = ""  # the group's: its store keys live under it (weight_sync.common.group)
    take_over: bool = False  # replace the group of a trainer that still lives (see rollout.sidecar.weights)


class PushWeights(_Call, tag="push_weights"):
    manifest: Manifest
    pause_mode: str = ""  # "" = the sidecar's default
    timeout_s: float = 300.0
    group_name: str = ""  # the trainer's group: its workers mark themselves ready there (weight_sync.trainer.push)
    shared: dict[str, Any] = {}  # instead of the group: a weight_sync.trainer.shared_memory handle (same machine)


class LoadWeights(_Call, tag="load_weights"):
    """The file fallback: load a safetensors directory written by the trainer."""

    path: str
    version: int
    pause_mode: str = ""


class SendWeights(_Call, tag="send_weights"):
    """This sidecar pushes its newest committed weights to the sidecar at `to` (its tcp://
    address; the same token), as a trainer would: how a client catches a sidecar that joins up
    from a peer (rollout.sidecar.peer_send)."""

    to: str
    timeout_s: float = 300.0


class CloseWeightSync(_Call, tag="close_weight_sync"):
    """The caller's group (`group_name`; "" for whichever) is left. Another trainer's group is
    not: a client whose own group never formed (refused: another owns the sidecar) closes nothing."""

    group_name: str = ""


class Checksum(_Call, tag="checksum"):
    """Every worker's weights checksum (weight_sync.common.checksum), for checking a push."""


class Sleep(_Call, tag="sleep"):
    """Free every engine's KV cache (level 1) and weights too (level 2), e.g. while a colocated
    trainer needs the GPU; rollouts in flight are resubmitted and wait for `wake_up`."""

    level: int = 1


class WakeUp(_Call, tag="wake_up"):
    pass


class Stats(_Call, tag="stats"):
    pass


class Health(_Call, tag="health"):
    pass


class Load(_Call, tag="load"):
    """How busy the sidecar is now (a LoadReply): cheap, asked every second by the clients and
    routers that place sessions over several sidecars (rollout/client/placement.py)."""


class Cancel(_Call, tag="cancel"):
    """The client gave up on its generate call `target` (its timeout passed, or its caller was
    cancelled): the sidecar aborts that call's requests, as vLLM aborts a request whose caller
    goes. No reply."""

    target: int


Call = Union[Generate, InitWeightSync, PushWeights, LoadWeights, SendWeights, CloseWeightSync, Checksum, Sleep,
             WakeUp, Stats, Health, Load, Cancel]


class GroupOut(msgspec.Struct, tag="group"):
    call_id: int
    index: int
    rollouts: list[Rollout]


class Progress(msgspec.Struct, tag="progress"):
    """A stage of a long call, e.g. "paused": every engine of a push is paused and its workers
    are about to receive, so the trainer may start broadcasting."""

    call_id: int
    stage: str


class EngineState(msgspec.Struct, omit_defaults=True):
    """One engine as `health` reports it: its state (rollout.sidecar.supervision: "live", "restarting",
    "dead"), the weight version it holds (None when not asked: not live), and why when not live."""

    state: str
    version: int | None
    restarts: int
    pid: int
    reason: str = ""
    # bytes by part, as its worker reports them when asked (engine/memory_report.py): weights,
    # derived_copies, kv_cache (budget), kv_cache_resident, staging_kept; host_copy_links_weights;
    # huge_pages_moving (1 while its weights are still being moved onto 2 MB pages)
    memory: dict[str, int] | None = None
    # its prefix cache's counters (engine/core.py prefix_cache_stats: hit_tokens, query_tokens,
    # hit_tokens_other_version, blocks_dropped); None for an engine that does not report them (vLLM)
    prefix_cache: dict[str, int] | None = None


class HealthReply(msgspec.Struct, omit_defaults=True):
    """The value of a `health` call (and of the HTTP front's /health). `engines`: how many serve;
    `workers`: the ranks a weight-sync group would hold now; `pushing`: a push is under way (the
    engines were not asked); `dtype`: the weights' (pushes travel in it); `weight_sync_owner`:
    the group that owns weight sync and whether its trainer still listens (None: no owner);
    `quantization`, `quantized_bytes`: the precision the engines serve in, and its copy's memory."""

    ok: bool
    version: int
    engines: int
    workers: int
    engine_states: list[EngineState]
    protocol: int
    pushing: bool
    dtype: str
    weight_sync_owner: dict[str, Any] | None
    reason: str = ""  # when not ok: which engines do not serve, and why
    quantization: str = "none"  # what the engines serve from: "none" (the weights), "int8", "fp8"
    quantized_bytes: int = 0  # the 8-bit copy's memory per engine, beside the weights (the truth)


class LoadReply(msgspec.Struct):
    """The value of a `load` call (and of the HTTP front's GET /load), read without running a forward:
    `groups`: prompts in flight (every client's, ZMQ and HTTP); `sequences`: their samples;
    `running` / `waiting`: the engines' scheduled and queued sequences (-1: an engine that does not say);
    `kv_used`: the fraction of KV cache blocks in use (-1: unknown); `prefix_hit_tokens` /
    `prefix_query_tokens`: the prefix cache's counters since start (rollout_prefix_cache in /metrics);
    `forward_s`: the seconds the engines spent in forwards since start (their busy time; 0: not said);
    `engines`: how many serve; `version`, `pushing` as in health."""

    version: int
    pushing: bool
    engines: int
    groups: int
    sequences: int
    running: int = -1
    waiting: int = -1
    kv_used: float = -1.0
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    forward_s: float = 0.0


# How a call failed, as data: "invalid" (bad input, nothing changed), "refused" (a weight push or
# load refused before any byte moved: nothing changed, the group still usable), "failed".
# "regroup": a push over a weight-sync group the sidecar's engines no longer match (an engine was
# restarted); nothing changed, and the client forms a new group and pushes again by itself.
# "gone": the sidecar cannot serve the call and will not (it is shutting down, or no engine of it
# is left): a client of several sidecars drops it and sends the work to the others.
ERROR_KINDS = ("invalid", "refused", "regroup", "failed", "gone")


def owned_message(group_name: str) -> str:
    """Why a sidecar refuses a trainer: another one owns its weight sync (the sidecar says it; a client
    that sees the owner in health says it before asking)."""
    return (f"another trainer owns this sidecar's weight sync (group {group_name}); it must close_weight_sync() "
            "first, or call init_weight_sync(take_over=True)")


class Reply(msgspec.Struct, tag="reply"):
    call_id: int
    ok: bool
    value: Any = None
    error: str = ""
    error_kind: str = ""  # one of ERROR_KINDS when ok is false


ServerMessage = Union[GroupOut, Progress, Reply]

call_decoder = msgspec.msgpack.Decoder(Call)
server_decoder = msgspec.msgpack.Decoder(ServerMessage)
encoder = msgspec.msgpack.Encoder()
