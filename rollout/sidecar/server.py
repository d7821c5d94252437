"""The sidecar's ZMQ server: a ROUTER socket, one asyncio task per call, replies by call id.

A malformed message, an unknown call, a wrong token or bad parameters get an error reply (or,
when not even a call id can be read, a reply with call id -1) and nothing else changes.

A client that vanishes mid-generate (its connection closed: the process died) has its generate
calls cancelled, which aborts their engine requests: nothing is generated, or kept in memory,
for nobody. The ROUTER says which clients are gone (ROUTER_MANDATORY: a send to one fails with
EHOSTUNREACH), so every PROBE_S each client with a generate in flight is sent a message that no
client reads (call id PROBE_CALL_ID, which no client uses: clients drop it). A client that is
only stopped (a debugger) keeps its connection and its calls.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time

import msgspec
import zmq
import zmq.asyncio

from engine import SamplingParams
from engine.errors import error_kind
from rollout.common import protocol as P
from rollout.sidecar.load_report import load_report
from rollout.sidecar.manager import RolloutManager
from rollout.sidecar.peer_send import send_weights
from rollout.sidecar.push_coordinator import PushCoordinator
from rollout.sidecar.weights import SidecarWeights
from weight_sync.engine_side.engines import engines_checksums

log = logging.getLogger(__name__)

PROBE_S = 1.0  # how often the clients of generate calls in flight are checked for
PROBE_CALL_ID = -2  # client call ids count from 0, and -1 is the server's "unreadable message"


class RolloutServer:
    def __init__(self, manager: RolloutManager, address: str, token: str = "", push_stall_s: float = 10.0,
                 overlap_receive: bool = True, staging_limit_bytes: int | None = None):
        self.manager = manager
        # the sidecar's one staged push, under every front end: the ZMQ calls here, the HTTP routes
        self.pushes = PushCoordinator(manager, manager.state, push_stall_s)
        self.weights = SidecarWeights(self.pushes, overlap_receive, staging_limit_bytes)
        self.token = token
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a client that is gone fails: we learn it is
        self.sock.bind(address)
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.tasks: set[asyncio.Task] = set()
        self.generating: dict[bytes, set[asyncio.Task]] = {}  # a client's generate calls in flight
        self.generate_calls: dict[tuple[bytes, int], asyncio.Task] = {}  # the same, by (client, call id)
        self.accepting = True
        # one handler per call type of rollout.common.protocol.Call
        self.handlers = {
            P.Generate: self._on_generate,
            P.InitWeightSync: self._on_init_weight_sync,
            P.PushWeights: self._on_push_weights,
            P.LoadWeights: self._on_load_weights,
            P.SendWeights: self._on_send_weights,
            P.CloseWeightSync: self._on_close_weight_sync,
            P.Checksum: self._on_checksum,
            P.Sleep: self._on_sleep,
            P.WakeUp: self._on_wake_up,
            P.Stats: self._on_stats,
            P.Health: self._on_health,
            P.Load: self._on_load,
        }

    async def serve(self, stop: asyncio.Event) -> None:
        log.info("sidecar listening on %s", self.address)
        loops = [asyncio.ensure_future(self._receive()), asyncio.ensure_future(self._watch_clients())]
        await stop.wait()
        self.accepting = False
        for t in loops:
            t.cancel()
        await asyncio.gather(*loops, return_exceptions=True)

    async def drain(self) -> None:
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()

    async def _receive(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            identity, body = frames[0], frames[-1]
            try:
                call = P.call_decoder.decode(body)
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
                await self._reply(identity, P.Reply(_call_id_of(body), False, error=f"malformed message: {e}",
                                                    error_kind="invalid"))
                continue
            if isinstance(call, P.Cancel):
                self._cancel(identity, call)
                continue
            if not self.accepting:
                await self._reply(identity, P.Reply(call.call_id, False, error="sidecar is shutting down",
                                                    error_kind="gone"))  # a client of several sends it elsewhere
                continue
            task = asyncio.ensure_future(self._handle(identity, call))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
            if isinstance(call, P.Generate):
                self._track(identity, call.call_id, task)

    async def _send(self, identity: bytes, msg) -> None:
        try:
            await self.sock.send_multipart([identity, P.encoder.encode(msg)])
        except zmq.ZMQError as e:  # the client is gone: nothing to tell it
            log.debug("cannot reply to a client: %s", e)
            if e.errno == zmq.EHOSTUNREACH:
                self._client_gone(identity)

    _reply = _send

    # -- clients that vanish ------------------------------------------------------------------
    def _track(self, identity: bytes, call_id: int, task: asyncio.Task) -> None:
        calls = self.generating.setdefault(identity, set())
        calls.add(task)
        self.generate_calls[(identity, call_id)] = task

        def done(t: asyncio.Task) -> None:
            calls.discard(t)
            self.generate_calls.pop((identity, call_id), None)
            if not calls and self.generating.get(identity) is calls:
                del self.generating[identity]

        task.add_done_callback(done)

    def _cancel(self, identity: bytes, call: P.Cancel) -> None:
        """A client gave up on one of its own generate calls (a call of another client is not
        found under this one's identity)."""
        if self.token and not hmac.compare_digest(call.token.encode(), self.token.encode()):
            return
        task = self.generate_calls.get((identity, call.target))
        if task is not None:
            task.cancel()
            log.info("a client gave up on its generate call %d: its requests are aborted", call.target)

    def _client_gone(self, identity: bytes) -> None:
        """Cancels the generate calls of a client whose connection is gone (their engine requests
        are aborted as they unwind)."""
        calls = self.generating.pop(identity, set())
        for t in calls:
            t.cancel()
        if calls:
            log.info("a client vanished with %d generate call(s) in flight: cancelled", len(calls))

    async def _watch_clients(self) -> None:
        probe = P.encoder.encode(P.Progress(PROBE_CALL_ID, "probe"))
        while True:
            await asyncio.sleep(PROBE_S)
            for identity in list(self.generating):
                try:
                    await self.sock.send_multipart([identity, probe], flags=zmq.NOBLOCK)
                except zmq.ZMQError as e:
                    if e.errno == zmq.EHOSTUNREACH:
                        self._client_gone(identity)

    async def _handle(self, identity: bytes, call) -> None:
        try:
            if self.token and not hmac.compare_digest(call.token.encode(), self.token.encode()):
                raise PermissionError("wrong or missing token")
            value = await self.handlers[type(call)](identity, call)
            await self._reply(identity, P.Reply(call.call_id, True, value))
        except asyncio.CancelledError:
            await self._reply(identity, P.Reply(call.call_id, False, error="sidecar is shutting down",
                                                error_kind="gone"))
            raise
        except Exception as e:
            outcome = "withdrawn" if getattr(e, "withdrawn", False) else "failed"  # withdrawn: redone at once
            log.info("call %s %s: %s", type(call).__name__, outcome, e)
            await self._reply(identity, P.Reply(call.call_id, False, error=f"{type(e).__name__}: {e}",
                                                error_kind=error_kind(e)))

    async def _on_generate(self, identity: bytes, call: P.Generate) -> dict:
        n = len(call.prompts)
        raw = call.params if isinstance(call.params, list) else [call.params] * n
        if len(raw) != n:
            raise ValueError(f"{len(raw)} sampling params for {n} prompts")
        params = [SamplingParams.from_dict(p) for p in raw]
        prompt_ids = [self.manager.prepare_prompt(p) for p in call.prompts]  # all valid, or none runs
        t0 = time.monotonic()

        async def one(i: int):
            rollouts = await self.manager.generate_group(prompt_ids[i], params[i])
            await self._send(identity, P.GroupOut(call.call_id, i, rollouts))

        await asyncio.gather(*(one(i) for i in range(n)))
        return {"groups": n, "seconds": time.monotonic() - t0}

    async def _on_init_weight_sync(self, identity: bytes, call: P.InitWeightSync) -> dict:
        return await self.weights.init(call.host, call.port, call.world_size, call.rank_offset, call.group_name,
                                       call.timeout_s, call.secret, call.take_over)

    async def _on_push_weights(self, identity: bytes, call: P.PushWeights) -> dict:
        async def paused():
            await self._send(identity, P.Progress(call.call_id, "paused"))

        return await self.weights.push(call.manifest, call.pause_mode or None, call.timeout_s, paused,
                                       call.group_name or None, call.shared or None)

    async def _on_load_weights(self, identity: bytes, call: P.LoadWeights) -> dict:
        return await self.weights.load(call.path, call.version, call.pause_mode or None)

    async def _on_send_weights(self, identity: bytes, call: P.SendWeights) -> dict:
        return await send_weights(self.manager, call.to, self.token, call.timeout_s)

    async def _on_close_weight_sync(self, identity: bytes, call: P.CloseWeightSync) -> bool:
        return await self.weights.close(call.group_name or None)

    async def _on_checksum(self, identity: bytes, call: P.Checksum) -> list[str]:
        return await engines_checksums(self.manager.serving_engines(), timeout=120)

    async def _on_sleep(self, identity: bytes, call: P.Sleep) -> bool:
        await asyncio.gather(*(e.sleep(call.level) for e in self.manager.up_engines()))
        return True

    async def _on_wake_up(self, identity: bytes, call: P.WakeUp) -> bool:
        await asyncio.gather(*(e.wake_up() for e in self.manager.up_engines()))
        return True

    async def _on_stats(self, identity: bytes, call: P.Stats) -> dict:
        return self.manager.stats()

    async def _on_health(self, identity: bytes, call: P.Health) -> P.HealthReply:
        return await self.manager.health(owner=await self.pushes.owner_status())

    async def _on_load(self, identity: bytes, call: P.Load) -> P.LoadReply:
        return await load_report(self.manager)


def _call_id_of(body: bytes) -> int:
    """Best effort: the call id of a message that failed validation, so its sender hears why."""
    try:
        obj = msgspec.msgpack.decode(body)
        cid = obj.get("call_id") if isinstance(obj, dict) else None
        return cid if isinstance(cid, int) else -1
    except Exception:
        return -1
