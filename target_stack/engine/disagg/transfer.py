"""The prefill worker's transfer thread: one-sided writes of finished Layer Split stages into the
pages and slot the decode worker reserved, in one of three copy granularities (``COPY_MODES``)."""

from __future__ import annotations

import ctypes
import ctypes.util
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from target_stack.engine.disagg.messages import STOP, Abort, Handoff, Reservation, Reserve
from target_stack.engine.sequence import Sequence
from target_stack.events import emit

COPY_MODES = ("gather", "page", "post")


def _cudart() -> ctypes.CDLL:
    """The CUDA runtime torch has loaded (found in this process's mappings), for per-page posts."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    for path in sorted(paths) or [ctypes.util.find_library("cudart") or "libcudart.so"]:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    raise RuntimeError("transfer copy 'post' on a GPU needs the CUDA runtime library (libcudart), not found")


class PagePoster:
    """One native copy per page, as a transfer engine takes one descriptor per page: a ctypes call
    (which drops the GIL for its duration and takes it back after, like any native post) of
    ``cudaMemcpyAsync`` on the transfer stream on a GPU, ``memmove`` on the CPU."""

    def __init__(self, device: torch.device):
        self.fn = None
        if device.type == "cuda":
            self.fn = _cudart().cudaMemcpyAsync
            self.fn.restype = ctypes.c_int
            self.fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]

    def __call__(self, dst: int, src: int, nbytes: int, stream: int | None) -> None:
        if self.fn is None:
            ctypes.memmove(dst, src, nbytes)
            return
        rc = self.fn(dst, src, nbytes, 3, stream)  # 3: cudaMemcpyDeviceToDevice
        if rc != 0:
            raise RuntimeError(f"cudaMemcpyAsync failed with cudaError {rc}")


def check_copy(copy: str) -> str:
    if copy not in COPY_MODES:
        raise ValueError(f"transfer copy mode must be one of {', '.join(COPY_MODES)}, got {copy!r}")
    return copy


@dataclass
class TransferItem:
    """One unit of the transfer thread's work, run in submission order."""

    kind: str  # reserve | stage | ready | abort
    tid: str  # its id in the events
    seq: Sequence
    layers: list[int] | None = None  # stage: the layers whose KV and states move
    pages: int = 0  # reserve: how many pages
    handoff: Handoff | None = None  # ready: what the decode worker needs to adopt the sequence
    event: Any = None  # stage on a GPU: the compute's point after which the stage is final

    @property
    def rid(self) -> int:
        return self.seq.id


class TransferEngine:
    """The prefill worker's transfer thread, one-sided like RDMA: the decode worker's pools live in
    shared memory, and a transfer writes the sequence's pages and state slots straight into the slots
    the decode worker reserved for it.  Items run in submission order:

    - ``reserve``: ask the decode worker for pages and a slot (a round trip on the control pipe);
    - ``stage``: copy one Layer Split stage (a gather-scatter per cache tensor, a copy per state);
    - ``ready``: tell the decode worker the sequence is complete (first token, sampling parameters);
    - ``abort``: tell it to free the reservation of a prefill that failed.
    """

    def __init__(self, runner, remote: dict[str, torch.Tensor], ctl_send, ctl_recv, on_complete,
                 copy: str = "gather"):
        self.runner, self.remote, self.ctl_send, self.ctl_recv = runner, remote, ctl_send, ctl_recv
        self.on_complete, self.copy = on_complete, check_copy(copy)
        # on a GPU the copies run on their own stream, after the compute that produced them
        self.stream = torch.cuda.Stream(runner.device) if runner.device.type == "cuda" else None
        self.post = PagePoster(runner.device) if copy == "post" else None
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="kv-transfer", daemon=True)
        self.thread.start()

    def submit(self, item: TransferItem) -> None:
        emit("kv_transfer.submit", id=item.tid, rid=item.rid)
        if self.stream is not None and item.kind == "stage":
            item.event = torch.cuda.Event()
            item.event.record()  # the stage's KV and state are final at this point of the stream
        self.queue.put(item)

    def close(self) -> None:
        self.queue.put(STOP)
        self.thread.join()

    def _copy_stage(self, seq: Sequence, layers: list[int], dst_pages: list[int], dst_slot: int) -> int:
        """One gather-scatter per cache tensor of each layer (the scatter list of a one-sided write),
        not one copy per page: the thread's host work per stage stays a handful of calls.  ``copy="page"``
        writes page by page instead (one call per page and tensor, as a transfer thread that posts a
        descriptor per page does): the GIL-heavy form, kept for the GIL scenario's measurements.
        ``copy="post"`` also goes page by page, each page one native copy at its byte address (a
        descriptor posted to a native engine): a third of the Python calls of ``page``, and as many
        GIL round trips."""
        moved = 0
        n = min(len(seq.pages), len(dst_pages))
        index = None  # (source, destination) page ids on the device, made once a KV layer needs them
        for layer in layers:
            if layer in self.runner.kv:
                for name, t in self.runner.kv[layer].tensors().items():
                    remote = self.remote[f"kv.{layer}.{name}"]
                    if self.copy == "gather":
                        if index is None:
                            index = [torch.tensor(ids[:n], dtype=torch.long, device=self.runner.device)
                                     for ids in (seq.pages, dst_pages)]
                        remote.index_copy_(0, index[1], t.index_select(0, index[0]))
                    elif self.copy == "post":
                        if not (t.is_contiguous() and remote.is_contiguous()):
                            raise RuntimeError(f"kv.{layer}.{name}: page posts need contiguous pools")
                        nb = t[0].numel() * t.element_size()
                        s0, d0 = t.data_ptr(), remote.data_ptr()
                        stream = self.stream.cuda_stream if self.stream is not None else None
                        for src, dst in zip(seq.pages[:n], dst_pages[:n], strict=True):
                            self.post(d0 + dst * nb, s0 + src * nb, nb, stream)
                    else:  # "page": one write per page, the host (and the GIL) in every one of them
                        for src, dst in zip(seq.pages[:n], dst_pages[:n], strict=True):
                            remote[dst].copy_(t[src])
                    moved += n * t[0].numel() * t.element_size()
            else:
                pool = self.runner.states[layer]
                for name in ("kda", "conv"):
                    src = getattr(pool, name)[seq.slot]
                    self.remote[f"state.{layer}.{name}"][dst_slot].copy_(src)
                    moved += src.numel() * src.element_size()
        return moved

    def _run(self) -> None:
        reservations: dict[int, Reservation] = {}
        while (item := self.queue.get()) is not STOP:
            rid, kind = item.rid, item.kind
            emit("kv_transfer.start", id=item.tid, rid=rid)
            error, moved = None, 0
            try:
                if kind == "reserve":
                    self.ctl_send.send(Reserve(rid, item.pages))
                    reply: Reservation = self.ctl_recv.recv()
                    error = reply.error
                    if not error:
                        reservations[rid] = reply
                elif rid not in reservations:
                    pass  # the reservation failed and was reported; nothing to move or announce
                elif kind == "stage":
                    r = reservations[rid]
                    if self.stream is None:
                        moved = self._copy_stage(item.seq, item.layers, r.pages, r.slot)
                    else:
                        self.stream.wait_event(item.event)
                        with torch.cuda.stream(self.stream):
                            moved = self._copy_stage(item.seq, item.layers, r.pages, r.slot)
                        self.stream.synchronize()
                elif kind == "ready":
                    item.handoff.timing.transfer_done = time.monotonic()
                    self.ctl_send.send(item.handoff)
                    reservations.pop(rid)
                elif kind == "abort":
                    self.ctl_send.send(Abort(rid))
                    reservations.pop(rid)
            except (EOFError, OSError) as e:
                error = f"decode worker unreachable: {type(e).__name__}: {e}"
                reservations.pop(rid, None)
            emit("kv_transfer.done", id=item.tid, rid=rid, bytes=moved)
            self.on_complete(item, error)
