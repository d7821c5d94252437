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

from rollout.types import Rollout

PROTOCOL_VERSION = 1


class Generate(msgspec.Struct, tag="generate"):
    call_id: int
    prompts: list[Union[str, list[Union[int, dict[str, str]]]]]  # text, token ids or a conversation
    params: Union[dict[str, Any], list[dict[str, Any]]]  # SamplingParams fields, one or per prompt
    token: str = ""


class InitWeightSync(msgspec.Struct, tag="init_weight_sync"):
    call_id: int
    host: str
    port: int
    world_size: int
    rank_offset: int
    group_name: str = ""
    timeout_s: float = 60.0
    secret: str = ""  # the group's: its store keys live under it (weight_sync.group)
    take_over: bool = False  # replace the group of a trainer that still lives (see rollout.weights)
    token: str = ""


class PushWeights(msgspec.Struct, tag="push_weights"):
    call_id: int
    manifest: dict[str, Any]  # weight_sync.Manifest in wire form
    pause_mode: str = ""  # "" = the sidecar's default
    timeout_s: float = 300.0
    group_name: str = ""  # the trainer's group: its workers mark themselves ready there (weight_sync.push)
    shared: dict[str, Any] = {}  # instead of the group: a weight_sync.shared handle (same machine)
    token: str = ""


class LoadWeights(msgspec.Struct, tag="load_weights"):
    """The file fallback: load a safetensors directory written by the trainer."""

    call_id: int
    path: str
    version: int
    pause_mode: str = ""
    token: str = ""


class CloseWeightSync(msgspec.Struct, tag="close_weight_sync"):
    call_id: int
    token: str = ""


class Checksum(msgspec.Struct, tag="checksum"):
    """Every worker's weights checksum (weight_sync.checksum), for checking a push."""

    call_id: int
    token: str = ""


class Sleep(msgspec.Struct, tag="sleep"):
    """Free every engine's KV cache (level 1) and weights too (level 2), e.g. while a colocated
    trainer needs the GPU; rollouts in flight are resubmitted and wait for `wake_up`."""

    call_id: int
    level: int = 1
    token: str = ""


class WakeUp(msgspec.Struct, tag="wake_up"):
    call_id: int
    token: str = ""


class Stats(msgspec.Struct, tag="stats"):
    call_id: int
    token: str = ""


class Health(msgspec.Struct, tag="health"):
    call_id: int
    token: str = ""


class Cancel(msgspec.Struct, tag="cancel"):
    """The client gave up on its generate call `target` (its timeout passed, or its caller was
    cancelled): the sidecar aborts that call's requests, as vLLM aborts a request whose caller
    goes. No reply."""

    call_id: int
    target: int
    token: str = ""


Call = Union[Generate, InitWeightSync, PushWeights, LoadWeights, CloseWeightSync, Checksum, Sleep, WakeUp, Stats,
             Health, Cancel]


class GroupOut(msgspec.Struct, tag="group"):
    call_id: int
    index: int
    rollouts: list[Rollout]


class Progress(msgspec.Struct, tag="progress"):
    """A stage of a long call, e.g. "paused": every engine of a push is paused and its workers
    are about to receive, so the trainer may start broadcasting."""

    call_id: int
    stage: str


# How a call failed, as data: "invalid" (bad input, nothing changed), "refused" (a weight push or
# load refused before any byte moved: nothing changed, the group still usable), "failed".
# "regroup": a push over a weight-sync group the sidecar's engines no longer match (an engine was
# restarted); nothing changed, and the client forms a new group and pushes again by itself.
# "gone": the sidecar cannot serve the call and will not (it is shutting down, or no engine of it
# is left): a client of several sidecars drops it and sends the work to the others.
ERROR_KINDS = ("invalid", "refused", "regroup", "failed", "gone")


def error_kind(e: BaseException) -> str:
    if getattr(e, "gone", False):
        return "gone"
    if getattr(e, "regroup", False):
        return "regroup"
    if getattr(e, "refused", False):
        return "refused"
    return "invalid" if isinstance(e, (ValueError, PermissionError)) else "failed"


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
