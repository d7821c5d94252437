"""The weights on 2 MB pages where the kernel allows it (Linux's MADV_COLLAPSE, 6.1+).

A decode step streams every weight once, and the bf16 AMX kernel reads each 16-row tile from 16
rows a weight's row length apart: on 4 KB pages each of those rows is a page of its own, and the
TLB misses showed. On 2 MB pages the same sweep of Llama-3.2-1B's linears at 32 rows took 117 ms
against 142 ms (a 2-core Xeon with AMX; 1.08x at 1 row, 1.13x at 256), and torch's sum over 1 GiB
read 30 GB/s against 22.

MADV_COLLAPSE moves pages already written onto huge pages, for anonymous memory and for /dev/shm
files alike, whatever the system's THP settings say for new faults (shmem's is usually `never`, and
the sidecar's weights live in /dev/shm files so that a host copy can link them). It costs 0.4 s a
GB on a quiet host and up to 7 s a GB in a VM whose host backs each fresh 2 MB then (this one), so
a worker runs it on a thread of its own (`Collapser`), 2 MB a call, while the engine serves: the
weights move onto huge pages under the running engine (the kernel swaps the pages under their
readers), after its start and after each push. It is best effort: a range it cannot collapse
(memory too fragmented, an older kernel) stays on 4 KB pages and works as before.
ROLLOUT_HUGE_PAGES=0 turns it off.

Which pages need it is asked once a range (PAGEMAP_SCAN, Linux 6.7+: in memory? on a huge page
already?): after each push the collapser goes over every weight again, and once they have moved
there is nothing to do; asked page by page (mincore, then an MADV_COLLAPSE each) that pass is
thousands of system calls beside the decode steps right after the switch. Before 6.7: page by page.

A file's pages go onto a huge page only where the address and the file's offset agree modulo 2 MB,
and the kernel aligns a shared mapping of a /dev/shm file only when shmem's THP setting is on
(usually `never`): `map_shared` maps the sidecar's staging files from a 2 MB boundary. (Mapped
where the kernel chose, every collapse of them failed, EINVAL, and the collapser spent a second of
CPU after each 1.7B push on pages that never moved.)

A checkpoint's weights as safetensors loads them are views of the file's private mapping (its
page cache), which does not collapse: `move_parameters` copies them into one anonymous buffer first.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import logging
import mmap
import os
import threading
import time
import weakref

import torch

from engine.kernels.libc import libc_function, mincore

log = logging.getLogger(__name__)

ENV_SWITCH = "ROLLOUT_HUGE_PAGES"
HUGE = 2 << 20
MADV_COLLAPSE = 25


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").lower() not in ("0", "off", "false", "no")


@functools.cache
def madvise():
    """libc's madvise(address, length, advice) -> 0 or -1 (errno kept), or None where there is none."""
    return libc_function("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int))


class _ScanArg(ctypes.Structure):  # struct pm_scan_arg (linux/fs.h)
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "size", "flags", "start", "end", "walk_end", "vec", "vec_len", "max_pages",
        "category_inverted", "category_mask", "category_anyof_mask", "return_mask")]


class _Region(ctypes.Structure):  # struct page_region
    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64), ("categories", ctypes.c_uint64)]


PAGEMAP_SCAN = (3 << 30) | (ctypes.sizeof(_ScanArg) << 16) | (ord("f") << 8) | 16  # _IOWR('f', 16, pm_scan_arg)
PAGE_IS_PRESENT, PAGE_IS_HUGE = 1 << 3, 1 << 6


def pages_to_collapse(start: int, end: int) -> tuple[list[int], int] | None:
    """(the 2 MB pages in [start, end), both 2 MB aligned, whose every 4 KB page is in memory and
    that are not on a huge page yet; the bytes on huge pages already), from the kernel's page
    tables in a few calls (PAGEMAP_SCAN); None where the kernel cannot say (before Linux 6.7)."""
    try:
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)  # per call: a forked child must read its own
    except OSError:
        return None
    vec = (_Region * 512)()
    todo, huge, at = [], 0, start
    try:
        while at < end:
            arg = _ScanArg(size=ctypes.sizeof(_ScanArg), start=at, end=end, vec=ctypes.addressof(vec),
                           vec_len=len(vec), return_mask=PAGE_IS_PRESENT | PAGE_IS_HUGE)
            raw = bytearray(arg)
            try:
                n = fcntl.ioctl(fd, PAGEMAP_SCAN, raw)
            except OSError:
                return None
            for r in vec[:n]:
                if r.categories & PAGE_IS_HUGE:
                    huge += r.end - r.start
                elif r.categories & PAGE_IS_PRESENT:  # regions of equal categories come merged
                    todo.extend(range(-(-r.start // HUGE) * HUGE, r.end // HUGE * HUGE, HUGE))
            walked = _ScanArg.from_buffer_copy(raw).walk_end
            at = end if walked <= at else walked
    finally:
        os.close(fd)
    return todo, huge


def resident(address: int) -> bool:
    """Whether every 4 KB page of the 2 MB page at `address` is in memory (mincore); True where that
    cannot be asked."""
    call = mincore()
    if call is None:
        return True
    vec = (ctypes.c_ubyte * (HUGE // 4096))()
    if call(address, HUGE, vec) != 0:
        return True
    return all(b & 1 for b in vec)


def collapse_range(address: int, nbytes: int, stop=lambda: False, duty: float = 1.0) -> int:
    """Put the whole 2 MB pages inside [address, address + nbytes) (written already) on huge pages,
    one a call (a page that fails leaves the rest to go on; `stop()` ends it early); `duty` < 1
    rests between calls so that collapsing takes at most that share of the time (a reader of a page
    being collapsed waits for it). Returns the bytes that are now (0: none, or not here)."""
    call = madvise()
    start, end = -(-address // HUGE) * HUGE, (address + nbytes) // HUGE * HUGE
    if call is None or end <= start or not enabled():
        return 0
    # a page with holes is left: a collapse fills them with zeros, memory the process never used
    asked = pages_to_collapse(start, end)
    pages, done = asked if asked is not None else ([at for at in range(start, end, HUGE) if resident(at)], 0)
    for at in pages:
        if stop():
            break
        t0 = time.perf_counter()
        done += HUGE if call(at, HUGE, MADV_COLLAPSE) == 0 else 0
        if duty < 1.0:
            time.sleep((time.perf_counter() - t0) * (1 - duty) / duty)
    return done


@functools.cache
def _mmap():
    f = libc_function("mmap", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                               ctypes.c_long))
    if f is not None:
        f.restype = ctypes.c_void_p
    return f


@functools.cache
def _munmap():
    return libc_function("munmap", (ctypes.c_void_p, ctypes.c_size_t))


def map_shared(fd: int, nbytes: int, populate: bool = False) -> torch.Tensor:
    """A uint8 tensor over the first `nbytes` of file `fd`, mapped shared (MAP_POPULATE where
    `populate`) from a 2 MB-aligned address, so that its pages can go onto huge pages; unmapped once
    the last view of it goes. Where libc cannot be reached: Python's mmap, wherever it lands."""
    mmap_, munmap = _mmap(), _munmap()
    if mmap_ is None or munmap is None:
        flags = mmap.MAP_SHARED | (_POPULATE if populate else 0)
        return torch.frombuffer(mmap.mmap(fd, nbytes, flags=flags), dtype=torch.uint8)
    # a reservation 2 MB longer, then the file mapped over it from its first 2 MB boundary
    reserved = mmap_(None, nbytes + HUGE, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)  # PROT_NONE
    if reserved in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), f"reserving {nbytes + HUGE} bytes of address space failed")
    at = -(-reserved // HUGE) * HUGE
    got = mmap_(at, nbytes, mmap.PROT_READ | mmap.PROT_WRITE,
                mmap.MAP_SHARED | _MAP_FIXED | (_POPULATE if populate else 0), fd, 0)
    if got != at:
        err = ctypes.get_errno()
        munmap(reserved, nbytes + HUGE)
        raise OSError(err, f"mapping {nbytes} bytes of a file failed: {os.strerror(err)}")
    # the reservation's ends, outside the file's mapping, go back
    if at > reserved:
        munmap(reserved, at - reserved)
    tail = at + -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    if reserved + nbytes + HUGE > tail:
        munmap(tail, reserved + nbytes + HUGE - tail)
    view = _mapped_bytes(nbytes).from_address(at)
    weakref.finalize(view, munmap, at, nbytes)
    return torch.frombuffer(view, dtype=torch.uint8)


@functools.cache
def _mapped_bytes(nbytes: int) -> type:
    """A ctypes byte array type of `nbytes` that a finalizer can watch (a plain ctypes array takes no
    weak reference)."""
    return type("MappedBytes", (ctypes.c_ubyte * nbytes,), {})


_MAP_FIXED = getattr(mmap, "MAP_FIXED", 0x10)


def move_parameters(model: torch.nn.Module) -> int:
    """Every CPU parameter of `model` moved into one fresh anonymous buffer (a tied one once), from a
    2 MB boundary, where a `Collapser` can put it on huge pages; the same values, dtypes and shapes
    (`param.data` swapped, as a push swaps it). Returns the bytes moved (0 when disabled)."""
    if not enabled() or madvise() is None:
        return 0
    params = [p for p in model.parameters() if p.device.type == "cpu" and p.numel()]
    sizes = [-(-p.numel() * p.element_size() // 64) * 64 for p in params]  # each tensor 64-byte aligned
    if sum(sizes) < HUGE:
        return 0
    buf = mmap.mmap(-1, sum(sizes) + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)
    arena = torch.frombuffer(buf, dtype=torch.uint8)  # keeps `buf` mapped while any weight views it
    offset = -arena.data_ptr() % HUGE  # the weights from a 2 MB boundary: every whole page of them collapses
    with torch.no_grad():
        for p, size in zip(params, sizes):
            view = arena[offset:offset + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
            view.copy_(p.data)
            p.data = view
            offset += size
    return sum(sizes)


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def collapse(tensors, stop=lambda: False, duty: float = 1.0) -> int:
    """`collapse_range` over each CPU storage under `tensors` once (a tensor or an iterable of them);
    returns the bytes on huge pages now, and logs what it took."""
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    t0, done, seen = time.perf_counter(), 0, set()
    for t in tensors:
        if stop():
            break
        if t.device.type != "cpu" or t.layout != torch.strided:  # oneDNN's opaque copies have no storage to reach
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() < HUGE:
            continue
        seen.add(storage.data_ptr())
        done += collapse_range(storage.data_ptr(), storage.nbytes(), stop, duty)
    seconds = time.perf_counter() - t0
    if done:  # said once it moved pages (after a push its buffers are on huge pages already: quick)
        log.log(logging.INFO if seconds > 0.5 else logging.DEBUG, "%.2f GB of weights on 2 MB pages in %.2f s",
                done / 1e9, seconds)
    return done


class Collapser:
    """A thread of its own that puts the storages of what `request` names on huge pages, at a low
    priority, while the engine serves; a new request replaces the one in hand (the weights a push
    swapped in), so it never holds weights a commit let go for longer than a 2 MB step."""

    NICE = 10
    DUTY = 0.5  # collapsing at most half the time: the engine's first steps after a start or a push go on

    def __init__(self):
        self._lock = threading.Lock()
        self._work: list | None = None
        self._generation = 0
        self._wake = threading.Event()
        self._holds = 0  # bodies running under `held()`
        self._released = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self.done_bytes = 0  # on huge pages by the last request it finished
        self.idle = threading.Event()
        self.idle.set()

    def request(self, tensors) -> None:
        if not enabled() or madvise() is None:
            return
        with self._lock:
            self._work, self._generation = list(tensors), self._generation + 1
            self._released.notify_all()  # a thread waiting out a hold takes the new work once it ends
            self.idle.clear()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="huge-pages", daemon=True)
                self._thread.start()
        self._wake.set()

    @contextlib.contextmanager
    def held(self):
        """No page moves while the body runs; the work in hand goes on after it. A push holds it
        while it writes its staging, merges and derives: collapsing beside it (kernel time, page
        locks on the memory being written) made an adapter push 1.7x slower here."""
        with self._lock:
            self._holds += 1
        try:
            yield
        finally:
            with self._lock:
                self._holds -= 1
                self._released.notify_all()

    def _stopped(self, generation: int) -> bool:
        """Whether the work of `generation` is replaced; first waits while a `held()` body runs."""
        with self._lock:
            while self._holds and self._generation == generation:
                self._released.wait()
            return self._generation != generation

    def _run(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.NICE)
        except (AttributeError, OSError):
            pass
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                work, generation, self._work = self._work, self._generation, None
            if work is not None:
                try:
                    done = collapse(work, stop=lambda: self._stopped(generation), duty=self.DUTY)
                except Exception as e:  # noqa: BLE001 - pages stay as they are; the thread goes on for the next request
                    log.warning("putting the weights on 2 MB pages failed (%s: %s)", type(e).__name__, e)
                    done = 0
                del work  # no weights held past their time
                if self._generation == generation:
                    self.done_bytes = done
            with self._lock:
                if self._work is None:
                    self.idle.set()
