"""Sidecars on a Ray cluster: placed, found and healed by Ray (the `[ray]` extra).

`RaySidecars(model, num_sidecars)` starts each sidecar as a Ray actor in a placement group (one
bundle per sidecar: its engines' GPUs, or CPUs), and `.client()` hands the trainer a connected
`RolloutClient` with every address; nothing is typed by hand.

    actor (a Ray worker process, on the node its bundle landed on)
      └─ python -m rollout.serve --host <node IP> --port 0 --token T --parent-pid <actor>
           └─ engine cores (as on one machine)

Each actor runs the very sidecar `python -m rollout.serve` runs (rollout.launcher.LocalSidecar):
same processes, same ZMQ protocol, a token because it binds off loopback. Its peers:
- the actor's process dies (SIGKILL, OOM): the sidecar sees its parent gone within 0.5 s and
  shuts down; the client drops it and sends its unfinished prompts to the others (the client's
  rule). Ray restarts the actor (`max_restarts`), which starts a fresh sidecar; the client
  (`RayRolloutClient`) notices the new incarnation at its next call and adds it back: a live
  sidecar sends it the newest weights, and it gets no prompt until it holds them (`add_sidecar`).
- a node is lost: its sidecars go as above; Ray restarts them where the placement group can.
- an actor that hangs: its sidecar still answers or not on its own socket (the client's
  heartbeats judge that); the launcher only asks the actor where its sidecar is, without blocking.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
import uuid
from dataclasses import dataclass

try:
    import ray
except ImportError as e:  # the extra is optional: say how to get it
    raise ImportError("sidecars on Ray need the 'ray' extra: pip install -e '.[ray]'") from e
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rollout.client.blocking_client import RolloutClient
from rollout.launcher import LocalSidecar

log = logging.getLogger("rollout.ray")

PLACEMENTS = {"pack": "PACK", "spread": "SPREAD", "strict_pack": "STRICT_PACK", "strict_spread": "STRICT_SPREAD"}


class SidecarActor:
    """One sidecar, owned by a Ray actor (its process is the sidecar's parent)."""

    def __init__(self, model: str, serve_args: list[str], token: str):
        self.node_ip = ray.util.get_node_ip_address()
        self.sidecar = LocalSidecar(model, "--host", self.node_ip, *serve_args, token=token)
        self.boot = uuid.uuid4().hex  # this incarnation: a restarted actor has a new one

    def info(self) -> dict:
        return {"url": self.sidecar.url, "http_url": self.sidecar.http_url, "boot": self.boot, "pid": os.getpid(),
                "sidecar_pid": self.sidecar.proc.pid,
                "node_id": ray.get_runtime_context().get_node_id(), "node_ip": self.node_ip}

    def stop(self) -> int:
        return self.sidecar.stop()


@dataclass
class _Slot:
    actor: object
    url: str
    boot: str
    pending: object | None = None  # an info() call not answered yet (the actor may be restarting)
    next_poll: float = 0.0
    failures: int = 0


class RaySidecars:
    """`num_sidecars` sidecars as Ray actors in one placement group.

    `placement`: pack (as few nodes as fit) or spread (one per node where possible), or their
    strict forms. Each sidecar's bundle: `gpus_per_sidecar` GPUs (engines x tensor-parallel size;
    pass `--device cuda` in `serve_args`) or `cpus_per_sidecar` CPUs, plus `resources_per_sidecar`
    (custom resources, e.g. to pin sidecars to labelled nodes). Ray must be initialized, or is
    (`ray.init(address=ray_address)`). A dead actor is restarted up to `max_restarts` times
    (-1: always)."""

    def __init__(self, model: str, num_sidecars: int = 1, serve_args: list[str] | tuple = (), *,
                 placement: str = "pack", cpus_per_sidecar: float = 1, gpus_per_sidecar: float = 0,
                 resources_per_sidecar: dict | None = None, max_restarts: int = -1, token: str | None = None,
                 ray_address: str | None = None, ready_timeout_s: float = 300.0, poll_s: float = 0.5):
        if num_sidecars < 1:
            raise ValueError(f"num_sidecars must be at least 1, got {num_sidecars}")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {sorted(PLACEMENTS)}, got {placement!r}")
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            start_local = ray_address is None and not os.environ.get("RAY_ADDRESS")
            # a cluster of our own for this run: no dashboard (its start is seconds on small machines)
            ray.init(address=ray_address, **({"include_dashboard": False} if start_local else {}))
        self.token = token or secrets.token_hex(16)  # sidecars bind off loopback: a token is required
        self.poll_s = poll_s
        bundle = {"CPU": cpus_per_sidecar, **({"GPU": gpus_per_sidecar} if gpus_per_sidecar else {}),
                  **(resources_per_sidecar or {})}
        self.placement_group = placement_group([dict(bundle) for _ in range(num_sidecars)],
                                               strategy=PLACEMENTS[placement])
        try:
            ray.get(self.placement_group.ready(), timeout=ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.placement_group)
            raise TimeoutError(f"Ray could not place {num_sidecars} sidecars of {bundle} ({placement}) in "
                               f"{ready_timeout_s:.0f} s: the cluster has {ray.available_resources()} free") from None
        actor_cls = ray.remote(SidecarActor)
        self.actors = [
            actor_cls.options(
                num_cpus=cpus_per_sidecar, num_gpus=gpus_per_sidecar, resources=resources_per_sidecar or None,
                max_restarts=max_restarts, max_task_retries=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=i),
            ).remote(model, list(serve_args), self.token)
            for i in range(num_sidecars)]
        try:
            infos = ray.get([a.info.remote() for a in self.actors], timeout=ready_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self._slots = [_Slot(a, i["url"], i["boot"]) for a, i in zip(self.actors, infos)]
        self.infos = infos  # as the sidecars started (node, pids); info(i) asks again
        log.info("%d sidecars on Ray: %s", num_sidecars, ", ".join(f"{i['url']} (node {i['node_id'][:8]})" for i in infos))

    @property
    def urls(self) -> list[str]:
        """Each sidecar's address, as last seen."""
        return [s.url for s in self._slots]

    def http_urls(self, timeout_s: float = 60.0) -> list[str]:
        """Each sidecar's HTTP front now (started with `--http-port`), for `python -m rollout.router --sidecars`;
        a sidecar Ray restarts comes back on a new port: hand it to the router (`POST /add_worker?url=`)."""
        return [u for u in (self.info(i, timeout_s)["http_url"] for i in range(len(self.actors))) if u]

    def info(self, i: int, timeout_s: float = 60.0) -> dict:
        """Sidecar i's address, node and processes now (waits for a restarting actor)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return ray.get(self.actors[i].info.remote(), timeout=max(deadline - time.monotonic(), 0.1))
            except ray.exceptions.ActorUnavailableError:  # dying or restarting: ask the next incarnation
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def client(self, timeout_s: float = 600.0) -> "RayRolloutClient":
        """A RolloutClient of every sidecar that takes restarted ones back by itself."""
        return RayRolloutClient(self, timeout_s)

    def refresh(self) -> None:
        """Asks each actor which sidecar it runs now, without blocking: an actor restarting
        answers once its new sidecar is ready (then `urls` has the new address)."""
        now = time.monotonic()
        for i, s in enumerate(self._slots):
            if s.pending is None:
                if now < s.next_poll:
                    continue
                s.pending = s.actor.info.remote()
            if not ray.wait([s.pending], timeout=0)[0]:
                continue  # restarting: Ray answers once the new sidecar is ready
            ref, s.pending = s.pending, None
            try:
                info = ray.get(ref)
            except ray.exceptions.RayActorError as e:  # died during the call; restarting or gone for good
                s.failures += 1
                s.next_poll = now + min(self.poll_s * 2 ** s.failures, 10.0)
                if s.failures == 1:
                    log.warning("sidecar actor %d is down: %s", i, type(e).__name__)
                continue
            s.failures, s.next_poll = 0, now + self.poll_s
            if info["boot"] != s.boot:
                log.warning("sidecar actor %d was restarted by Ray: %s -> %s", i, s.url, info["url"])
                s.url, s.boot = info["url"], info["boot"]

    def shutdown(self) -> None:
        """Stop every sidecar (SIGTERM: in-flight work aborted), then the actors and their group."""
        stops = [a.stop.remote() for a in self.actors]
        ray.wait(stops, num_returns=len(stops), timeout=30)
        for a in self.actors:
            ray.kill(a, no_restart=True)
        remove_placement_group(self.placement_group)
        if self._owns_ray:
            ray.shutdown()

    stop = shutdown  # what recipes call on the sidecar they started


class RayRolloutClient(RolloutClient):
    """A RolloutClient of Ray-launched sidecars: before each call it takes back the sidecars Ray
    restarted (the old address out, the new one in, caught up from a peer), and its weight-sync group
    listens on this node's IP, so sidecars on other nodes reach it."""

    def __init__(self, sidecars: RaySidecars, timeout_s: float = 600.0):
        self.sidecars = sidecars
        self._healing = False  # not while the base class connects
        super().__init__(sidecars.urls, token=sidecars.token, timeout_s=timeout_s)
        self._known = list(sidecars.urls)  # each client its own view: several may share the sidecars
        self._healing = True

    def _run(self, coro):
        if self._healing:
            self._take_back()
        return super()._run(coro)

    def _take_back(self) -> None:
        self.sidecars.refresh()
        for i, (old, new) in enumerate(zip(self._known, self.sidecars.urls)):
            if old == new:
                continue
            if old in self._client.urls:  # its death not noticed yet (no call since): out first
                super()._run(self._client.remove_sidecar(old))
            super()._run(self._client.add_sidecar(new))
            self._known[i] = new

    def init_weight_sync(self, host: str | None = None, port: int = 0, timeout_s: float = 120.0, **kw):
        """As RolloutClient's, on this node's IP and a free port of it by default."""
        return super().init_weight_sync(host or ray.util.get_node_ip_address(), port, timeout_s, **kw)
