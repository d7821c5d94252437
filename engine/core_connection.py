"""The frontend's connection to its engine-core process (the multiprocess half of vLLM v1's
`core_client.py`): the process (started cold, or a warm standby handed its arguments), its ZMQ
sockets (requests ROUTER -> DEALER, outputs PUSH -> PULL, msgpack), the start-up handshake, the
threads that read outputs and watch the process, and their release.

It never holds the frontend: the threads reach it through weak methods, so that an engine nobody
holds is collected and its finalizer (`CoreConnection.close`) stops the core."""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
import weakref
from dataclasses import asdict

import zmq

from engine.config import EngineConfig
from engine.messages import EngineOutput, Fatal, Ready, Shutdown
from engine.serial import Decoder, Encoder
from engine.standby import hand_over, start_core

log = logging.getLogger(__name__)


class CoreConnection:
    def __init__(self, cfg: EngineConfig, log_level: str, standby: subprocess.Popen | None = None):
        """Binds the sockets and starts the core process, or hands `standby` (from
        `engine.standby.spawn_standby`, still alive) its arguments instead."""
        self._dir = tempfile.mkdtemp(prefix="engine-")
        in_addr, out_addr = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._zctx = zmq.Context()
        self.input = self._zctx.socket(zmq.ROUTER)
        self.input.setsockopt(zmq.SNDHWM, 0)  # a ROUTER drops at its high-water mark: never drop
        self.input.setsockopt(zmq.LINGER, 0)
        self.input.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.input.bind(in_addr)
        self._output = self._zctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(out_addr)
        self.identity = uuid.uuid4().hex.encode()
        self._encoder, self._decoder = Encoder(), Decoder(EngineOutput)
        self.fatal = ""  # what the core said before it exited during start-up (a Fatal), if anything
        self._threads: list[threading.Thread] = []
        self._stop_reading = threading.Event()
        core_args = ["--config-json", json.dumps(asdict(cfg)), "--input-addr", in_addr, "--output-addr", out_addr,
                     "--identity", self.identity.decode(), "--parent-pid", str(os.getpid()), "--log-level", log_level]
        self.proc = standby if standby is not None and hand_over(standby, core_args) else start_core(core_args)
        # killed at exit if it still runs then (held weakly: once collected, its engine's finalizer stopped it)
        atexit.register(_kill_quietly, weakref.ref(self.proc))

    def handshake(self, timeout: float) -> Ready:
        """Wait for the core to connect and say Ready; raises if it exits or is not ready in time."""
        deadline = time.monotonic() + timeout
        poller = zmq.Poller()
        poller.register(self.input, zmq.POLLIN)
        poller.register(self._output, zmq.POLLIN)
        got_identity, ready = False, None
        while not (got_identity and ready):
            if self.proc.poll() is not None:
                why = self._last_word()
                raise RuntimeError(f"engine core process exited with code {self.proc.returncode} during startup"
                                   + (f": {why}" if why else ""))
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine core not ready after {timeout:.0f}s")
            for sock, _ in poller.poll(200):
                if sock is self.input:
                    identity, *_ = self.input.recv_multipart()
                    got_identity = identity == self.identity
                else:
                    msg = self._decoder.decode(self._output.recv_multipart())
                    if isinstance(msg, Ready):
                        ready = msg
                    elif isinstance(msg, Fatal):
                        self.fatal = msg.error
        return ready

    def _last_word(self, wait_s: float = 1.0) -> str:
        """What a core that exited during start-up said why (core_proc's Fatal), if it did."""
        deadline = time.monotonic() + wait_s
        while not self.fatal and self._output.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            msg = self._decoder.decode(self._output.recv_multipart())
            if isinstance(msg, Fatal):
                self.fatal = msg.error
        return self.fatal

    def send(self, msg) -> None:
        """One message to the core; raises zmq.ZMQError when it cannot be reached."""
        self.input.send_multipart([self.identity, *self._encoder.encode(msg)], copy=False)

    def start_reader(self, dispatch: weakref.WeakMethod, loop: asyncio.AbstractEventLoop) -> None:
        """Hand every message from the core to `dispatch` on `loop`, from a thread."""
        reader = threading.Thread(target=_read_outputs, daemon=True, name="engine-outputs",
                                  args=(dispatch, self._output, self._decoder, loop, self._stop_reading))
        self._threads.append(reader)
        reader.start()

    def watch(self, on_exit: weakref.WeakMethod) -> None:
        """Call `on_exit` (from a thread) when the core process exits."""
        threading.Thread(target=_watch_process, args=(self.proc, on_exit), daemon=True, name="engine-watch").start()

    def close(self, timeout: float = 2.0) -> None:
        """Stop the core (Shutdown, then SIGKILL after `timeout`) and free the sockets. Called by the
        engine's shutdown(), or by the finalizer of an engine nobody holds any more."""
        if self.proc.poll() is None:
            try:
                self.input.send_multipart([self.identity, *Encoder().encode(Shutdown())], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._stop_reading.set()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=2.0)
        self.input.close(0)
        self._output.close(0)
        self._zctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)


def _watch_process(proc: subprocess.Popen, on_exit: weakref.WeakMethod) -> None:
    """Thread: waits for the core to exit and tells the engine, if anyone still holds it."""
    proc.wait()
    callback = on_exit()
    if callback is not None:
        callback()


def _read_outputs(dispatch: weakref.WeakMethod, sock, decoder: Decoder, loop: asyncio.AbstractEventLoop,
                  stop: threading.Event) -> None:
    """Output thread: receives and decodes the core's messages and hands them to the event loop.
    A thread rather than a zmq.asyncio socket so that nothing of ours stays registered with the
    loop after shutdown (a later engine's socket may reuse the file descriptor). It holds the
    engine only by a weak method, so that a dropped engine is collected."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while not stop.is_set():
        try:
            if not poller.poll(100):
                continue
            frames = sock.recv_multipart(copy=False)
        except zmq.ZMQError:  # closed under us by the finalizer
            return
        try:
            msg = decoder.decode([f.buffer for f in frames])
        except Exception as e:
            log.error("undecodable output from the engine core: %s", e)
            continue
        handler = dispatch()
        if handler is None:
            return
        try:
            loop.call_soon_threadsafe(handler, msg)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            return
        finally:
            del handler


def _kill_quietly(ref) -> None:
    proc = ref()
    if proc is not None and proc.poll() is None:
        proc.kill()
