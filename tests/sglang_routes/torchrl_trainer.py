"""TorchRL's SGLang weight sync, the trainer's side: `SGLangWeightSyncScheme` -> `SGLangWeightSender`
-> `SGLangCollectiveTransport` (HTTP to /server_info, /init_weights_update_group, /pause_generation,
/get_load, /update_weights_from_distributed, /continue_generation; the group through
`_init_custom_process_group`; one broadcast per tensor). tests/sglang_routes/torchrl_driver.py runs it
as TorchRL's GRPO does, in a process of its own.

Copied from pytorch/rl@ae9719f17b1517af5c2523a36c4616f003ee55cf (torchrl is not installed: it pulls
another torch), as close to the original as the CPU allows:
- torchrl/weight_update/llm/sglang_nccl.py: everything from `_SGLANG_PAUSE_GENERATION_MODE` to
  `SGLangWeightSender`, verbatim but for the lines marked `PATCH`;
- torchrl/modules/llm/backends/sglang/sglang_utils.py: `get_open_port`, `get_local_ip_address`,
  `get_server_info`, `dtype_to_str`;
- torchrl/weight_update/weight_sync_schemes.py: `_merged_lora_state_dict`, and `WeightStrategy`'s
  "state_dict" branch (the strategy sota-implementations/grpo uses).
Docstrings are shortened, and what the trainer does not call is left out (the sender's `flush_cache`,
the scheme's `create_receiver`, which returns None for SGLang).

TorchRL internals replaced with minimal equivalents: `torchrl._utils.implement_for` (a torch version
test), `torchrl_logger` (a logging.Logger), the `WeightSyncScheme` base class (nothing of it is used),
`WeightStrategy` (its state_dict branch only: no tensordict). PATCH, the backend only: TorchRL hard-codes
NCCL and CUDA (`backend="nccl"`, `torch.cuda.set_device`, `.to("cuda:i")`, `torch.cuda.synchronize`);
with `BACKEND = "gloo"` (the default here) the group is gloo and tensors stay on the CPU. TorchRL's HTTP
payloads are unchanged: its init names no backend (SGLang's default is "nccl"; a CPU sidecar takes gloo).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import requests
import torch
from torch.distributed.distributed_c10d import (
    Backend,
    PrefixStore,
    _new_process_group_helper,
    _world,
    default_pg_timeout,
    rendezvous,
)

torchrl_logger = logging.getLogger("torchrl")
BACKEND = "gloo"  # PATCH: TorchRL's collective is "nccl" (CUDA); the driver's --backend sets it


def _on_device(tensor: torch.Tensor, device: int) -> torch.Tensor:  # PATCH: the tensor's device per backend
    return tensor.to(f"cuda:{device}") if BACKEND == "nccl" else tensor.to("cpu")


# -- torchrl/modules/llm/backends/sglang/sglang_utils.py ---------------------------------------------
_MIN_USER_PORT = 1024
_MAX_SGLANG_HTTP_PORT = 55535


def get_open_port() -> int:
    for _ in range(128):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        if port <= _MAX_SGLANG_HTTP_PORT:
            return port
    for port in range(_MIN_USER_PORT, _MAX_SGLANG_HTTP_PORT + 1):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError("Could not find an available SGLang port")


def get_local_ip_address() -> str:
    hostname = socket.gethostname()
    try:
        return socket.gethostbyname(hostname)
    except socket.gaierror:
        return "127.0.0.1"


def get_server_info(server_url: str, timeout: float = 10.0) -> dict[str, Any]:
    server_url = server_url.rstrip("/")
    response = requests.get(f"{server_url}/server_info", timeout=timeout)
    response.raise_for_status()
    return response.json()


def dtype_to_str(dtype) -> str:
    dtype_map = {
        torch.float16: "float16",
        torch.float32: "float32",
        torch.bfloat16: "bfloat16",
        torch.int8: "int8",
        torch.int16: "int16",
        torch.int32: "int32",
        torch.int64: "int64",
    }
    return dtype_map.get(dtype, str(dtype).split(".")[-1])


# -- torchrl/weight_update/weight_sync_schemes.py -----------------------------------------------------
def _merged_lora_state_dict(source: torch.nn.Module) -> dict[str, torch.Tensor]:
    import copy

    source_copy = copy.deepcopy(source)
    try:
        return source_copy.merge_and_unload().state_dict()
    finally:
        del source_copy


class WeightStrategy:
    """TorchRL's WeightStrategy, its extraction as "state_dict" only."""

    def __init__(self, extract_as: Literal["tensordict", "state_dict"] = "tensordict"):
        if extract_as == "state_dict":
            warnings.warn(
                "state_dict strategy is experimental. Use tensordict strategy for safer weight updates.",
                UserWarning,
            )
        if extract_as != "state_dict":
            raise NotImplementedError("this copy extracts as state_dict only (no tensordict here)")
        self.extract_as = extract_as

    def extract_weights(self, source: Any) -> dict | None:
        if isinstance(source, torch.nn.Module):
            if hasattr(source, "merge_and_unload"):
                return _merged_lora_state_dict(source)
            return source.state_dict()
        elif isinstance(source, dict):
            return source
        torchrl_logger.warning(f"Unsupported source type for TensorDict extraction: {type(source)}")
        return {}


# -- torchrl/weight_update/llm/sglang_nccl.py ---------------------------------------------------------
_SGLANG_PAUSE_GENERATION_MODE = "retract"
_SGLANG_PAUSE_GENERATION_MODE_ENV = "TORCHRL_SGLANG_PAUSE_GENERATION_MODE"
_SGLANG_PAUSE_POLL_INTERVAL = 0.05
_SGLANG_FLUSH_CACHE_ENV = "TORCHRL_SGLANG_WEIGHT_SYNC_FLUSH_CACHE"


def _truthy_env(name: str, *, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.lower() in {"1", "true", "yes", "on"}


def _pause_generation_mode() -> Literal["abort", "retract", "in_place"]:
    mode = os.environ.get(_SGLANG_PAUSE_GENERATION_MODE_ENV, _SGLANG_PAUSE_GENERATION_MODE)
    if mode not in {"abort", "retract", "in_place"}:
        raise ValueError(
            f"{_SGLANG_PAUSE_GENERATION_MODE_ENV} must be one of "
            f"'abort', 'retract' or 'in_place', got {mode!r}."
        )
    return mode


def _process_group_options_kwargs() -> dict[str, None]:
    # implement_for("torch", None, "2.6") -> pg_options; ("torch", "2.6") -> backend_options
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return {"backend_options": None} if (major, minor) >= (2, 6) else {"pg_options": None}


def _init_custom_process_group(
    backend: str = "nccl",
    init_method: str | None = None,
    world_size: int = -1,
    rank: int = -1,
    group_name: str = "default",
    timeout: float | None = None,
) -> torch.distributed.ProcessGroup:
    """Create a torch.distributed process group without requiring a default group (SGLang's
    ``init_custom_process_group``)."""
    if init_method is None:
        init_method = "env://"

    backend = Backend(backend)

    if timeout is None:
        timeout = default_pg_timeout

    rendezvous_iterator = rendezvous(init_method, rank, world_size, timeout=timeout)
    store, rank, world_size = next(rendezvous_iterator)
    store.set_timeout(timeout)

    store = PrefixStore(group_name, store)

    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        backend,
        store,
        group_name=group_name,
        **_process_group_options_kwargs(),
        timeout=timeout,
    )

    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}

    return pg


def get_model_metadata(model: Any) -> dict[str, tuple[torch.dtype, torch.Size]]:
    if hasattr(model, "merge_and_unload"):
        sd = _merged_lora_state_dict(model)
    else:
        sd = model.state_dict()

    return {k: (v.dtype, v.shape) for k, v in sd.items()}


class SGLangCollectiveTransport:
    """TorchRL's transport for SGLang: HTTP coordination, a collective for the bytes."""

    def __init__(
        self,
        server_url: str,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        device: torch.device | str | int | None = None,
        timeout: float = 300.0,
        flush_cache_on_update: bool | None = None,
        pause_mode: Literal["abort", "retract", "in_place"] | None = None,
    ):
        self.server_url = server_url.rstrip("/")
        self.master_address = master_address
        self.master_port = master_port
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.flush_cache_on_update = flush_cache_on_update
        self.pause_mode = pause_mode
        if flush_cache_on_update and self._effective_pause_mode() != "abort":
            raise ValueError(
                "flush_cache_on_update=True requires pause_mode='abort': SGLang "
                "only flushes its radix cache when the scheduler is idle, and "
                "the 'retract'/'in_place' pause modes leave requests queued, so "
                "the requested flush would fail server-side after the weights "
                "have already been swapped."
            )
        self._comm_group = None
        self._group_name = None
        self._model_metadata = None
        self._http_executor = ThreadPoolExecutor(max_workers=1)
        self._flush_downgrade_warned = False

        # Handle device specification
        if device is None:
            self.device = 0
        elif isinstance(device, str):
            self.device = int(device.split(":")[-1]) if ":" in device else 0
        elif isinstance(device, torch.device):
            self.device = device.index if device.index is not None else 0
        else:
            self.device = device

    def _build_update_payload(self, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> dict:
        mode = self._effective_pause_mode()
        default = self.flush_cache_on_update if self.flush_cache_on_update is not None else mode == "abort"
        requested = _truthy_env(_SGLANG_FLUSH_CACHE_ENV, default=default)
        flush_cache = requested and mode == "abort"
        if requested and not flush_cache and not self._flush_downgrade_warned:
            torchrl_logger.warning(
                "Skipping the SGLang radix-cache flush during weight sync: the "
                f"pause mode is '{mode}', which leaves requests queued, and "
                "SGLang only flushes when idle. Stale prefix-cache entries "
                "persist across this update. Set "
                f"{_SGLANG_PAUSE_GENERATION_MODE_ENV}=abort (or "
                "pause_mode='abort') to flush on every sync, or disable the "
                "radix cache."
            )
            self._flush_downgrade_warned = True
        return {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": self._group_name,
            "flush_cache": flush_cache,
            # Keep SGLang's endpoint-level abort disabled: the explicit
            # pause_generation call provides the scheduling barrier.
            "abort_all_requests": False,
        }

    def _effective_pause_mode(self) -> Literal["abort", "retract", "in_place"]:
        if self.pause_mode is not None:
            return self.pause_mode
        return _pause_generation_mode()

    def _pause_generation_for_update(self, model_id: str) -> None:
        mode = self._effective_pause_mode()
        try:
            response = requests.post(f"{self.server_url}/pause_generation", json={"mode": mode}, timeout=self.timeout)
        except requests.exceptions.RequestException as err:
            raise RuntimeError(
                f"Failed to pause SGLang generation before updating model '{model_id}': {err}"
            ) from err

        if response.status_code >= 400:
            raise RuntimeError(
                f"SGLang generation pause before updating model '{model_id}' failed: {response.text.strip()}"
            )

        self._wait_for_generation_pause(model_id)

    def _running_generation_requests(self, model_id: str) -> int:
        try:
            response = requests.get(f"{self.server_url}/get_load", timeout=min(self.timeout, 10.0))
        except requests.exceptions.RequestException as err:
            raise RuntimeError(
                f"Failed to query SGLang load while pausing generation before updating model '{model_id}': {err}"
            ) from err

        if response.status_code >= 400:
            raise RuntimeError(
                f"SGLang load query while pausing generation before updating "
                f"model '{model_id}' failed: {response.text.strip()}"
            )

        running = 0
        for load in response.json():
            if "num_running_reqs" in load:
                running += int(load["num_running_reqs"])
            else:
                running += max(0, int(load.get("num_reqs", 0)) - int(load.get("num_waiting_reqs", 0)))
        return running

    def _wait_for_generation_pause(self, model_id: str) -> None:
        deadline = time.monotonic() + self.timeout
        while True:
            running = self._running_generation_requests(model_id)
            if running == 0:
                return
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"Timed out waiting for SGLang generation to pause before "
                    f"updating model '{model_id}' ({running} requests still running)"
                )
            time.sleep(_SGLANG_PAUSE_POLL_INTERVAL)

    def _continue_generation_after_update(self, model_id: str) -> None:
        try:
            response = requests.post(
                f"{self.server_url}/continue_generation", json={"torch_empty_cache": True}, timeout=self.timeout
            )
        except requests.exceptions.RequestException as err:
            raise RuntimeError(f"Failed to resume SGLang generation after updating model '{model_id}': {err}") from err

        if response.status_code >= 400:
            raise RuntimeError(
                f"SGLang generation resume after updating model '{model_id}' failed: {response.text.strip()}"
            )

    def init_all_workers_group(self, model_metadata: dict[str, tuple[torch.dtype, torch.Size]]) -> None:
        self._model_metadata = model_metadata

        if self.rank != 0:
            raise RuntimeError("Only rank 0 (trainer) should call init_all_workers_group")

        os.environ["NCCL_P2P_DISABLE"] = "1"
        os.environ["NCCL_SHM_DISABLE"] = "1"

        if BACKEND == "nccl":  # PATCH: a CUDA device only with NCCL
            torch.cuda.set_device(self.device)

        # Use a unique group name per attempt to avoid "group already exists"
        # errors on SGLang server retries
        group_name = f"weight_update_group_{uuid.uuid4().hex[:8]}"

        torchrl_logger.info(
            f"Creating torch.distributed process group via TCP rendezvous on "
            f"{self.master_address}:{self.master_port} (group={group_name})"
        )

        pg_error = [None]
        pg_result = [None]

        def _trainer_pg_init():
            try:
                pg = _init_custom_process_group(
                    backend=BACKEND,  # PATCH: was "nccl"
                    init_method=f"tcp://{self.master_address}:{self.master_port}",
                    world_size=self.world_size,
                    rank=0,
                    group_name=group_name,
                )
                torchrl_logger.info("Trainer-side torch.distributed process group created successfully")
                pg_result[0] = pg
            except Exception as e:
                pg_error[0] = e

        pg_thread = threading.Thread(target=_trainer_pg_init, daemon=True)
        pg_thread.start()

        # Give the TCP store server a moment to start listening
        time.sleep(0.3)

        torchrl_logger.info(
            f"Requesting SGLang server to join NCCL group: address={self.master_address}, port={self.master_port}"
        )

        init_data = {
            "master_address": self.master_address,
            "master_port": self.master_port,
            "rank_offset": 1,  # Server workers start from rank 1
            "world_size": self.world_size,
            "group_name": group_name,
        }

        init_future = self._http_executor.submit(
            requests.post,
            f"{self.server_url}/init_weights_update_group",
            json=init_data,
            timeout=self.timeout,
        )

        # Wait for both sides to complete
        torchrl_logger.info("Waiting for NCCL group initialization...")
        pg_thread.join(timeout=self.timeout)

        if pg_error[0] is not None:
            raise RuntimeError(f"Trainer process group init failed: {pg_error[0]}") from pg_error[0]

        if pg_result[0] is None:
            raise RuntimeError("Trainer process group init timed out")

        self._comm_group = pg_result[0]
        self._group_name = group_name

        response = init_future.result(timeout=self.timeout + 5.0)
        response.raise_for_status()
        result = response.json()

        if not result.get("success", False):
            raise RuntimeError(
                f"SGLang server failed to initialize weight update group: {result.get('message', 'Unknown error')}"
            )

        torchrl_logger.info("NCCL group initialized successfully")

    def send_weights(self, model_id: str, weights: dict[str, torch.Tensor]) -> None:
        if self.rank != 0:
            raise RuntimeError("send_weights should only be called from rank 0")

        if self._comm_group is None:
            raise RuntimeError("Communication group not initialized. Call init_all_workers_group first.")

        if self._model_metadata is None:
            raise RuntimeError("Model metadata not set")

        if BACKEND == "nccl":  # PATCH: a CUDA device only with NCCL
            torch.cuda.set_device(self.device)

        names = []
        dtypes = []
        shapes = []
        for name, (dtype, shape) in self._model_metadata.items():
            if name not in weights:
                raise ValueError(
                    f"Weight '{name}' not found in weights. Available keys: {list(weights.keys())[:10]}..."
                )
            weight = weights[name]
            if weight.dtype != dtype or weight.shape != shape:
                raise ValueError(
                    f"Weight '{name}' metadata changed before SGLang sync: "
                    f"expected dtype={dtype}, shape={tuple(shape)}, got "
                    f"dtype={weight.dtype}, shape={tuple(weight.shape)}."
                )
            names.append(name)
            dtypes.append(dtype_to_str(dtype))
            shapes.append(list(shape))

        torchrl_logger.info(f"Broadcasting {len(names)} weights for model '{model_id}'")

        paused = False
        update_error = None
        try:
            self._pause_generation_for_update(model_id)
            paused = True

            update_data = self._build_update_payload(names, dtypes, shapes)
            update_future = self._http_executor.submit(
                requests.post,
                f"{self.server_url}/update_weights_from_distributed",
                json=update_data,
                timeout=self.timeout,
            )

            for name in names:
                tensor = _on_device(weights[name], self.device)  # PATCH: was .to(f"cuda:{self.device}")
                torch.distributed.broadcast(tensor, src=0, group=self._comm_group)
                del tensor

            if BACKEND == "nccl":  # PATCH: CUDA only
                torch.cuda.synchronize()

            response = update_future.result(timeout=self.timeout + 5.0)
            response.raise_for_status()
            result = response.json()
            if not result.get("success", False):
                raise RuntimeError(f"SGLang weight update failed: {result.get('message', 'Unknown error')}")
        except BaseException as err:
            update_error = err
            raise
        finally:
            if paused:
                try:
                    self._continue_generation_after_update(model_id)
                except Exception as err:
                    if update_error is None:
                        raise
                    torchrl_logger.warning(
                        f"Failed to resume SGLang generation after a failed weight update for model '{model_id}': {err}"
                    )

        torchrl_logger.info(f"Broadcast complete for model '{model_id}'")

    def check_connection(self) -> bool:
        return self._comm_group is not None

    def shutdown(self) -> None:
        if self._comm_group is not None:
            torch.distributed.destroy_process_group(self._comm_group)
            self._comm_group = None
        self._http_executor.shutdown(wait=False, cancel_futures=True)


class SGLangWeightSyncScheme:  # TorchRL: (WeightSyncScheme), whose machinery this scheme does not use
    def __init__(
        self,
        server_url: str,
        master_address: str | None = None,
        master_port: int | None = None,
        num_gpus: int = 1,
        strategy: Literal["tensordict", "state_dict"] = "tensordict",
        device: torch.device | str | int = 0,
        flush_cache_on_update: bool | None = None,
        pause_mode: Literal["abort", "retract", "in_place"] | None = None,
    ):
        self.server_url = server_url.rstrip("/")
        self.master_address = master_address or get_local_ip_address()
        self.master_port = master_port or get_open_port()
        self.num_gpus = num_gpus
        self.strategy_name = strategy
        self.device = device
        self.flush_cache_on_update = flush_cache_on_update
        self.pause_mode = pause_mode
        if flush_cache_on_update and pause_mode is not None and pause_mode != "abort":
            raise ValueError(
                "flush_cache_on_update=True requires pause_mode='abort': SGLang "
                "only flushes its radix cache when the scheduler is idle, and "
                f"the '{pause_mode}' pause mode leaves requests queued."
            )

    @property
    def world_size(self) -> int:
        return 1 + self.num_gpus

    def create_transport(self, **kwargs) -> SGLangCollectiveTransport:
        return SGLangCollectiveTransport(
            server_url=self.server_url,
            master_address=self.master_address,
            master_port=self.master_port,
            rank=0,
            world_size=self.world_size,
            device=self.device,
            flush_cache_on_update=self.flush_cache_on_update,
            pause_mode=self.pause_mode,
        )

    def create_sender(self) -> SGLangWeightSender:
        return SGLangWeightSender(self)


class SGLangWeightSender:
    def __init__(self, scheme: SGLangWeightSyncScheme):
        self._scheme = scheme
        self._model_ref = None
        self._model_metadata = None
        self._transport = None
        self._strategy = WeightStrategy(extract_as=scheme.strategy_name)
        self._collectors: list = []
        self._post_hooks: list = []

    def register_collector(self, collector) -> None:
        self._collectors.append(collector)
        if len(self._post_hooks) == 0:
            self._post_hooks.append(self._increment_all_collector_versions)

    def _increment_all_collector_versions(self):
        for collector in self._collectors:
            try:
                collector.increment_version()
            except Exception as e:
                torchrl_logger.warning(f"Failed to increment version for collector: {e}")

    def register_model(self, model: Any) -> None:
        self._model_ref = weakref.ref(model)

    def init_all_workers_group(self, model_metadata: dict[str, tuple[torch.dtype, torch.Size]]) -> None:
        self._model_metadata = model_metadata
        self._transport = self._scheme.create_transport()
        self._transport.init_all_workers_group(model_metadata)

    def update_weights(self, weights: dict[str, torch.Tensor] | None = None) -> None:
        if self._transport is None:
            raise RuntimeError("Transport not initialized. Call init_all_workers_group first.")

        if weights is None:
            if self._model_ref is None:
                raise RuntimeError(
                    "No model registered and no weights provided. "
                    "Call register_model() first or provide weights explicitly."
                )
            model = self._model_ref()
            if model is None:
                raise RuntimeError("Model reference is no longer valid")
            weights = self._strategy.extract_weights(model)

        if hasattr(weights, "to_dict"):
            weights = weights.to_dict()

        self._transport.send_weights("sglang_model", weights)

        for hook in self._post_hooks:
            hook()

    def shutdown(self) -> None:
        if self._transport is not None:
            shutdown = getattr(self._transport, "shutdown", None)
            if shutdown is not None:
                shutdown()
            self._transport = None
        self._collectors.clear()
        self._post_hooks.clear()
