"""The engine core in its own process: an input thread (DEALER), an output thread (PUSH) and the
main thread that steps the core. Started by AsyncEngine as `python -m engine.core_proc`, so no
pickled object ever reaches it: the config comes as JSON, everything else as msgpack frames."""

from __future__ import annotations

import time

_STARTED = time.perf_counter()  # before the imports below: a start's largest part is importing torch

import argparse
import ctypes
import gc
import json
import logging
import os
import queue
import signal
import sys
import threading
import traceback
from concurrent.futures import Future

import msgspec
import zmq

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.models.model_loader import quantized_bytes
from engine.messages import (
    FAILED, AbortRequests, AddRequest, AddRequestId, CallResult, EngineInput, Fatal, Ready, RequestError, Shutdown,
    PauseMode, StepOutputs, UtilityCall,
)
from engine.errors import error_kind
from engine.serial import Decoder, Encoder

log = logging.getLogger("engine.core_proc")


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL ourselves when the parent dies, even by SIGKILL (Linux prctl), plus a watchdog."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass

    def watch():
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def _last_word(output_addr: str, reason: str) -> None:
    """A core that cannot start tells its frontend why (a Fatal) before it exits, so the error
    its caller sees names the cause, not only an exit code."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)  # close() waits this long for the message to leave
    try:
        sock.connect(output_addr)
        sock.send_multipart(Encoder().encode(Fatal(reason)))
    finally:
        sock.close()
        ctx.term()


class EngineCoreProc:
    def __init__(self, cfg: EngineConfig, input_addr: str, output_addr: str, identity: bytes):
        self.core = EngineCore(cfg)
        self.inputs: queue.Queue = queue.Queue()
        self.outputs: queue.Queue = queue.Queue()
        self.drains: list[Future] = []  # pause(mode="wait") calls' answers, completed once drained
        self.running = True
        self.exit_code = 0
        self.flushed = threading.Event()  # set by the output thread once everything queued is sent
        # the utility calls AsyncEngine may make (UtilityCall.method -> handler)
        self.utilities = {
            "pause": self._pause, "resume": self._resume, "is_paused": self._is_paused,
            "collective_rpc": self._collective_rpc, "set_weight_version": self._set_weight_version,
            "reset_prefix_cache": self._reset_prefix_cache, "sleep": self._sleep, "wake_up": self._wake_up,
            "check_health": self._check_health, "stats": self._stats,
        }
        ctx = zmq.Context()
        self.in_sock = ctx.socket(zmq.DEALER)
        self.in_sock.setsockopt(zmq.IDENTITY, identity)
        self.in_sock.setsockopt(zmq.LINGER, 0)
        self.in_sock.connect(input_addr)
        self.out_sock = ctx.socket(zmq.PUSH)
        self.out_sock.setsockopt(zmq.LINGER, 1000)
        self.out_sock.connect(output_addr)
        threading.Thread(target=self._input_loop, daemon=True, name="core-input").start()
        threading.Thread(target=self._output_loop, daemon=True, name="core-output").start()
        runner = self.core.runner
        self.outputs.put(Ready(os.getpid(), runner.vocab_size, runner.num_blocks, quantized_bytes(runner.model)))
        self.in_sock.send(b"READY")  # lets the frontend's ROUTER learn our identity

    # -- IO threads ---------------------------------------------------------------------------
    def _input_loop(self) -> None:
        decoder = Decoder(EngineInput)
        while True:
            frames = [f.buffer for f in self.in_sock.recv_multipart(copy=False)]
            try:
                msg = decoder.decode(frames)
            except Exception as e:  # a malformed message is refused; the core never dies of one
                self._refuse(frames, e)
                continue
            self.inputs.put(msg)

    def _refuse(self, frames: list, e: Exception) -> None:
        """A request whose parameters do not decode (msgspec runs SamplingParams' checks) fails
        alone, as a bad request; any other malformed message is dropped."""
        request_id = _request_id_of(frames)
        if request_id is None:
            log.warning("dropped a malformed input message: %s", str(e)[:200])
        else:
            self.outputs.put(RequestError(request_id, f"{type(e).__name__}: {e}", error_kind(e)))

    def _output_loop(self) -> None:
        encoder = Encoder()
        while True:
            msg = self.outputs.get()
            if msg is None:  # run() is over: everything before this is sent
                self.flushed.set()
                return
            try:
                self.out_sock.send_multipart(encoder.encode(msg), copy=False)
            except TypeError as e:  # a result we cannot serialise becomes an error for its caller
                if isinstance(msg, CallResult):
                    self.out_sock.send_multipart(encoder.encode(
                        CallResult(msg.call_id, False, None, f"result cannot be sent: {e}", FAILED)))
                else:
                    log.error("cannot send output: %s", e)

    # -- main loop ----------------------------------------------------------------------------
    def run(self) -> None:
        while self.running:
            self._handle_inputs(block=not self.core.can_step())
            if self.running and self.core.can_step():
                self._step()
            if self.drains and self.core.drained():
                self._complete_drains()

    def _handle_inputs(self, block: bool) -> None:
        try:
            msg = self.inputs.get(timeout=0.2) if block else self.inputs.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(msg)
            try:
                msg = self.inputs.get_nowait()
            except queue.Empty:
                return

    def _step(self) -> None:
        try:
            deltas = self.core.step()
        except Exception as e:
            # As in vLLM: after a failed forward (on a GPU, an illegal access or an OOM) the device
            # state cannot be trusted, so the core does not step on. It says why and exits; the
            # frontend fails every request with EngineDeadError and the rollout manager restarts it.
            log.error("engine step failed; the engine core exits:\n%s", traceback.format_exc())
            self.outputs.put(Fatal(f"engine step failed: {type(e).__name__}: {e}"))
            self.running, self.exit_code = False, 1
            return
        if deltas:
            self.outputs.put(StepOutputs(deltas))

    def _handle(self, msg) -> None:
        if isinstance(msg, AddRequest):
            self._add(msg)
        elif isinstance(msg, AbortRequests):
            self._abort(msg.request_ids)
        elif isinstance(msg, UtilityCall):
            self._call(msg)
        elif isinstance(msg, Shutdown):
            self.running = False

    def _add(self, msg: AddRequest) -> None:
        try:
            self.core.add_request(msg.request_id, msg.prompt_token_ids, msg.params)
        except Exception as e:
            self.outputs.put(RequestError(msg.request_id, f"{type(e).__name__}: {e}", error_kind(e)))

    def _abort(self, request_ids: list[str]) -> None:
        deltas = self.core.abort_requests(request_ids)
        if deltas:
            self.outputs.put(StepOutputs(deltas))

    # -- utility calls ------------------------------------------------------------------------
    def _call(self, msg: UtilityCall) -> None:
        """Run a utility call and answer it; a handler that returns a Future is answered from its
        done-callback, by whichever thread completes it (vLLM's `_invoke_utility_method`)."""
        try:
            handler = self.utilities.get(msg.method)
            if handler is None:
                raise ValueError(f"unknown engine call {msg.method!r}")
            value = handler(*msg.args, **msg.kwargs)
        except Exception as e:
            log.debug("call %s failed", msg.method, exc_info=True)
            self.outputs.put(_failure(msg.call_id, e))
            return
        if isinstance(value, Future):
            value.add_done_callback(lambda done: self.outputs.put(_answer(msg.call_id, done)))
        else:
            self.outputs.put(CallResult(msg.call_id, True, value))

    def _pause(self, mode: PauseMode = "abort", clear_cache: bool = True) -> bool | Future:
        deltas = self.core.pause(mode, clear_cache)
        if deltas:
            self.outputs.put(StepOutputs(deltas))
        if self.core.drained():
            return True
        drained: Future = Future()  # "wait": completed by run() once every earlier request finished
        self.drains.append(drained)
        return drained

    def _complete_drains(self) -> None:
        drains, self.drains = self.drains, []
        for drained in drains:
            drained.set_result(True)

    def _resume(self):
        self.core.resume()
        self._complete_drains()  # resumed before a drain completed: that pause is over
        return True

    def _is_paused(self):
        return self.core.is_paused

    def _collective_rpc(self, method: str, args: list | None = None, kwargs: dict | None = None):
        worker = self.core.worker
        if not isinstance(method, str) or method.startswith("_") or not worker.rpc_allowed(method):
            raise ValueError(f"method {method!r} is not callable over collective_rpc")
        result = getattr(worker, method)(*(args or []), **(kwargs or {}))
        return _one_per_worker(result) if isinstance(result, Future) else [result]

    def _set_weight_version(self, version: int):
        self.core.weight_version = int(version)
        return self.core.weight_version

    def _reset_prefix_cache(self):
        self.core.reset_prefix_cache()
        return True

    def _sleep(self, level: int = 1):
        deltas = self.core.sleep(level)
        if deltas:
            self.outputs.put(StepOutputs(deltas))
        return True

    def _wake_up(self):
        self.core.wake_up()
        return True

    def _check_health(self):
        return {**self.core.worker.check_health(), "prefix_cache": self.core.prefix_cache_stats()}

    def _stats(self):
        return self.core.stats()


def _request_id_of(frames: list) -> str | None:
    """The id of the AddRequest in `frames`, or None when they are not one."""
    try:
        return msgspec.msgpack.decode(frames[0], type=AddRequestId).request_id
    except Exception:  # noqa: BLE001 - random bytes raise more than DecodeError (a UnicodeDecodeError)
        return None


def _failure(call_id: int, e: BaseException) -> CallResult:
    return CallResult(call_id, False, None, f"{type(e).__name__}: {e}", error_kind(e))


def _answer(call_id: int, done: Future) -> CallResult:
    """The answer to a deferred call, from its completed future."""
    try:
        return CallResult(call_id, True, done.result())
    except Exception as e:  # noqa: BLE001 - the handler's failure (or a cancellation), for its caller
        return _failure(call_id, e)


def _one_per_worker(result: Future) -> Future:
    """A worker's deferred RPC result as collective_rpc answers: one per worker, a list of one."""
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            out.set_result([f.result()])
        except Exception as e:  # noqa: BLE001 - its error, kind kept, for the caller
            out.set_exception(e)

    result.add_done_callback(done)
    return out


def _warm_up(model_dir: str) -> None:
    """What a standby core does before it is needed: import the model's modelling code (most of
    an engine's start on CPU is importing torch and transformers, not loading the weights)."""
    from engine import model_runner  # noqa: F401 - torch, and the engine's own modules
    from engine.models import model_loader
    from engine.tokenizer import load_tokenizer

    load_tokenizer(model_dir)  # imports what this model's tokenizer needs (transformers', or tokenizers alone)
    if model_loader.own_module(model_dir).unsupported(model_dir) is not None:  # transformers' code will load it
        from transformers import AutoConfig, AutoModelForCausalLM

        from engine.models import attention

        attention.register()
        AutoModelForCausalLM._model_mapping[type(AutoConfig.from_pretrained(model_dir))]  # imports the model class


def _read_standby_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """A standby waits, warmed up, for one line on stdin: the arguments of the engine it becomes
    (as JSON). EOF (its AsyncEngine side went away) ends it."""
    try:
        _warm_up(args.standby)
    except Exception as e:  # noqa: BLE001 - a standby that cannot warm up still serves, just slower
        log.warning("standby core could not warm up: %s", e)
    line = sys.stdin.readline()
    if not line:
        os._exit(0)
    return p.parse_args(json.loads(line))


def _freeze_startup_heap() -> None:
    """As vLLM's engine core does: what start-up made (torch, transformers, the model's modules)
    goes out of the collector's sight, so a full collection scans only what serving made since.
    One over the whole heap took 130-820 ms on 2 busy cores; one that fell right after a push (its
    views and copies tip the count) held the first step after the switch (bench.push_stall)."""
    gc.collect()
    gc.freeze()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Engine-core process (started by AsyncEngine; not for direct use).")
    p.add_argument("--config-json", help="EngineConfig as JSON")
    p.add_argument("--input-addr")
    p.add_argument("--output-addr")
    p.add_argument("--identity")
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--standby", metavar="MODEL_DIR", default=None,
                   help="start warm (imports done for this model) and wait for the other arguments on stdin")
    args = p.parse_args(argv)
    started, how = _STARTED, "cold"
    if args.standby:
        _die_with_parent(args.parent_pid)
        args = _read_standby_args(p, args)
        started, how = time.perf_counter(), "from a warm standby, counted from its arguments"
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _die_with_parent(args.parent_pid)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    cfg = EngineConfig(**json.loads(args.config_json))
    try:
        proc = EngineCoreProc(cfg, args.input_addr, args.output_addr, args.identity.encode())
    except Exception as e:
        log.error("engine core failed to start:\n%s", traceback.format_exc())
        _last_word(args.output_addr, f"{type(e).__name__}: {e}")
        sys.exit(1)
    log.info("engine core up in %.2f s (%s)", time.perf_counter() - started, how)
    _freeze_startup_heap()
    proc.run()
    proc.outputs.put(None)
    proc.flushed.wait(5.0)  # the last outputs (a Fatal above all) reach the frontend
    time.sleep(0.05)  # the PUSH socket hands them to the kernel
    os._exit(proc.exit_code)


if __name__ == "__main__":
    main()
