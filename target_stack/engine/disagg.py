"""Encode / prefill / decode disaggregation with a KV-transfer thread and Layer Split.

Three worker processes and a client::

    client --(image requests)--> encode --(embeddings)--+
    client --(text requests)------------------------------> prefill --(KV pages, state slots)--> decode --> client
                                                             main thread: prefill, layer by layer
                                                             transfer thread: ships finished stages

The prefill worker's layers are cut into ``stages`` (Layer Split).  When the mixer of a stage's
last layer is done for a sequence, the main thread submits a transfer of that stage's KV pages and
KDA state slots and goes on with the layer's MoE; the transfer thread writes them straight into the
pages and slot the decode worker reserved for the sequence (its pools are shared memory, or CUDA
IPC on a GPU).  The prefill's MoE runs through the native extension (the whole dispatch on the CPU,
the wait for the routing on a GPU); loaded so that it releases the GIL, the transfer thread runs
beside it, otherwise it waits for every call to end.  Events: ``prefill.start/done``,
``kv_transfer.submit/start/done``, ``dispatch.enter/exit`` (see ``feedback.events``).

The decode worker adopts each transferred sequence into its own :class:`LLMEngine` and decodes it
with the others.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import multiprocessing as mp
import queue
import threading
import time
from dataclasses import dataclass

import torch

from target_stack.engine.sequence import RequestError, RequestOutput, SamplingParams, Sequence
from target_stack.events import emit

_STOP = None
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


def _check_copy(copy: str) -> str:
    if copy not in COPY_MODES:
        raise ValueError(f"transfer copy mode must be one of {', '.join(COPY_MODES)}, got {copy!r}")
    return copy


@dataclass
class Timing:
    """Per-request timestamps (time.monotonic, one clock for every process on the machine)."""

    arrival: float = 0.0
    prefill_start: float = 0.0
    prefill_done: float = 0.0
    transfer_done: float = 0.0
    first_token: float = 0.0
    done: float = 0.0


def _model(cfg_dict: dict, moe_backend: str | None = None, on_device: bool = True):
    """The worker's model from the cluster's config: {"preset", "device", field overrides...};
    on a GPU in bf16."""
    from target_stack.model.model import PRESETS, HybridModel

    cfg_dict = dict(cfg_dict)
    device = cfg_dict.pop("device", "cpu")
    base = PRESETS[cfg_dict.pop("preset", "tiny")]
    cfg = dataclasses.replace(base, **cfg_dict)
    if moe_backend:
        cfg = dataclasses.replace(cfg, moe_backend=moe_backend)
    model = HybridModel(cfg)
    if on_device and device != "cpu":
        model = model.to(device=device, dtype=torch.bfloat16)
    return model


# -- encode ----------------------------------------------------------------------------------------
def encode_worker(cfg: dict, inbox: mp.Queue, prefill_inbox: mp.Queue, results: mp.Queue) -> None:
    from target_stack.model.image import ImageError, load_image

    torch.set_num_threads(1)
    model = _model(cfg, on_device=False)  # images are small: the encoder stays on the CPU
    results.put(("ready", "encode"))
    while (msg := inbox.get()) is not _STOP:
        rid, prompt, params, image, timing, move = msg
        try:
            img = load_image(image, model.cfg.patch, model.cfg.max_image_side)
            with torch.no_grad():
                embeds = model.image_encoder(img)
        except ImageError as e:
            results.put(("error", rid, f"image: {e}"))
            continue
        prefill_inbox.put((rid, prompt, params, embeds.numpy(), timing, move))


# -- prefill ---------------------------------------------------------------------------------------
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
        self.on_complete, self.copy = on_complete, _check_copy(copy)
        # on a GPU the copies run on their own stream, after the compute that produced them
        self.stream = torch.cuda.Stream(runner.device) if runner.device.type == "cuda" else None
        self.post = PagePoster(runner.device) if copy == "post" else None
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="kv-transfer", daemon=True)
        self.thread.start()

    def submit(self, item: dict) -> None:
        emit("kv_transfer.submit", id=item["tid"], rid=item["rid"])
        if self.stream is not None and item["kind"] == "stage":
            item["event"] = torch.cuda.Event()
            item["event"].record()  # the stage's KV and state are final at this point of the stream
        self.queue.put(item)

    def close(self) -> None:
        self.queue.put(_STOP)
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
        reservations: dict[int, dict] = {}
        while (item := self.queue.get()) is not _STOP:
            rid, kind = item["rid"], item["kind"]
            emit("kv_transfer.start", id=item["tid"], rid=rid)
            error, moved = None, 0
            try:
                if kind == "reserve":
                    self.ctl_send.send(("reserve", rid, item["pages"]))
                    reply = self.ctl_recv.recv()
                    error = reply.get("error")
                    if not error:
                        reservations[rid] = reply
                elif rid not in reservations:
                    pass  # the reservation failed and was reported; nothing to move or announce
                elif kind == "stage":
                    r = reservations[rid]
                    if self.stream is None:
                        moved = self._copy_stage(item["seq"], item["layers"], r["pages"], r["slot"])
                    else:
                        self.stream.wait_event(item["event"])
                        with torch.cuda.stream(self.stream):
                            moved = self._copy_stage(item["seq"], item["layers"], r["pages"], r["slot"])
                        self.stream.synchronize()
                elif kind == "ready":
                    item["timing"].transfer_done = time.monotonic()
                    self.ctl_send.send(("ready", {k: v for k, v in item.items() if k != "seq"}))
                    reservations.pop(rid)
                elif kind == "abort":
                    self.ctl_send.send(("abort", rid))
                    reservations.pop(rid)
            except (EOFError, OSError) as e:
                error = f"decode worker unreachable: {type(e).__name__}: {e}"
                reservations.pop(rid, None)
            emit("kv_transfer.done", id=item["tid"], rid=rid, bytes=moved)
            self.on_complete(item, error)


def prefill_worker(cfg: dict, stages: int, transfer: bool, inbox: mp.Queue, ctl_send, ctl_recv, pools: mp.Queue,
                   results: mp.Queue, num_pages: int, page_size: int, num_slots: int,
                   max_model_len: int = 2048, copy: str = "gather") -> None:
    from target_stack.engine.cache import FreeList
    from target_stack.engine.runner import ModelRunner
    from target_stack.engine.sampler import sample

    torch.set_num_threads(1)
    model = _model(cfg, moe_backend="native")
    runner = ModelRunner(model, num_pages, page_size, num_slots)
    pages, slots = FreeList(num_pages, "prefill KV pages"), FreeList(num_slots, "prefill state slots")
    n_layers = len(model.blocks)
    bounds = [round(n_layers * (s + 1) / stages) - 1 for s in range(stages)]  # last layer of each stage
    stage_layers = {b: list(range(a + 1, b + 1)) for a, b in zip([-1, *bounds], bounds, strict=False)}
    failed: set[int] = set()

    def release(seq: Sequence) -> None:
        if seq.pages:
            pages.give(seq.pages, seq.id)
            seq.pages = []
        if seq.slot:
            slots.give([seq.slot], seq.id)
            seq.slot = 0

    def on_complete(item: dict, error: str | None) -> None:
        seq = item["seq"]
        if error and seq.id not in failed:
            failed.add(seq.id)
            results.put(("error", seq.id, error))
        if item["kind"] in ("ready", "abort"):
            release(seq)  # every earlier item of this sequence has run: its pages are no longer read

    engine = None
    if transfer:
        engine = TransferEngine(runner, pools.get(), ctl_send, ctl_recv, on_complete, copy)

    moving = False  # whether the sequence in prefill goes to the decode worker (one at a time)

    def layer_done(seq: Sequence, layer: int) -> None:
        # A layer's KV and state are final once its mixer has run (the FFN does not touch them), so the
        # runner calls this before the layer's FFN: the stage moves while the MoE computes.
        if moving and layer in stage_layers:
            engine.submit({"kind": "stage", "tid": f"{seq.id}:{layer}", "rid": seq.id, "seq": seq,
                           "layers": stage_layers[layer]})

    runner.mixer_done = layer_done
    results.put(("ready", "prefill"))
    while (msg := inbox.get()) is not _STOP:
        rid, prompt, params, embeds, timing, move = msg
        moving = engine is not None and move
        seq = Sequence(prompt=prompt, params=params, id=rid)
        if embeds is not None:
            seq.prompt_embeds = torch.from_numpy(embeds)
        if seq.num_prompt + params.max_tokens > max_model_len:  # image patches count: checked after encoding
            results.put(("error", rid, f"prompt ({seq.num_prompt} positions) + max_tokens ({params.max_tokens}) "
                                       f"exceeds max_model_len={max_model_len}"))
            continue
        need = -(-(seq.num_prompt + 1) // page_size)
        try:
            seq.pages = pages.take(need, rid)
            seq.slot = slots.take(1, rid)[0]
        except Exception as e:  # noqa: BLE001 - refuse this request, keep serving
            release(seq)
            results.put(("error", rid, f"prefill worker: {e}"))
            continue
        if moving:  # the round trip runs while the first layers compute
            engine.submit({"kind": "reserve", "tid": f"{rid}:reserve", "rid": rid, "seq": seq, "pages": need})
        timing.prefill_start = time.monotonic()
        emit("prefill.start", id=rid, tokens=seq.num_prompt)
        try:
            first = sample(runner.prefill(seq)[None], [seq])[0]
        except Exception as e:  # noqa: BLE001 - this request fails, the worker keeps serving
            emit("prefill.done", id=rid)
            failed.add(rid)
            results.put(("error", rid, f"prefill failed: {type(e).__name__}: {e}"))
            if not moving:
                release(seq)
            else:
                engine.submit({"kind": "abort", "tid": f"{rid}:abort", "rid": rid, "seq": seq})
            continue
        timing.prefill_done = time.monotonic()
        emit("prefill.done", id=rid)
        if not moving:  # prefill-only measurement: nothing leaves this process
            release(seq)
            results.put(("prefilled", rid, first, timing))
            continue
        engine.submit({"kind": "ready", "tid": f"{rid}:ready", "rid": rid, "seq": seq, "first": first,
                       "params": params, "prompt": prompt, "num_prompt": seq.num_prompt, "timing": timing})
    if engine is not None:
        engine.close()
        engine.remote.clear()  # drop the decode worker's (shared) pools before it may exit
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        try:
            ctl_send.send(_STOP)
        except OSError:
            pass
    results.put(("prefill_stats", {"leaked_pages": pages.used, "leaked_slots": slots.used}))


# -- decode ----------------------------------------------------------------------------------------
def decode_worker(cfg: dict, ctl_recv, ctl_send, pools: mp.Queue, results: mp.Queue, num_pages: int,
                  page_size: int, num_slots: int, max_batch: int, max_model_len: int, sink: bool = False) -> None:
    """Owns the decode engine; its pools are in shared memory for the prefill worker to write.  A
    receiver thread answers reservations and queues finished sequences; the main thread adopts them
    between decode steps.  ``sink``: receive the sequences and free them at once, decoding nothing
    (the KV-transfer measurement without decode steps sharing the machine)."""
    from target_stack.engine.engine import LLMEngine

    torch.set_num_threads(1)
    engine = LLMEngine(_model(cfg), num_pages=num_pages, page_size=page_size, num_slots=num_slots,
                       max_batch=max_batch, max_model_len=max_model_len)
    shared: dict[str, torch.Tensor] = {}
    for layer, cache in engine.runner.kv.items():
        for name, t in cache.tensors().items():
            shared[f"kv.{layer}.{name}"] = t.share_memory_()
    for layer, pool in engine.runner.states.items():
        shared[f"state.{layer}.kda"] = pool.kda.share_memory_()
        shared[f"state.{layer}.conv"] = pool.conv.share_memory_()
    pools.put(shared)
    incoming: dict[int, Sequence] = {}
    ready: queue.SimpleQueue = queue.SimpleQueue()
    timings: dict[int, Timing] = {}

    def receive() -> None:
        while True:
            try:
                msg = ctl_recv.recv()
            except (EOFError, OSError):
                break
            if msg is _STOP:
                break
            kind, *rest = msg
            if kind == "reserve":
                rid, n = rest
                seq = Sequence(prompt=[], params=SamplingParams(), id=rid)
                try:
                    seq.pages = engine.pages.take(n, rid)
                    seq.slot = engine.slots.take(1, rid)[0]
                except Exception as e:  # noqa: BLE001 - refuse this one, keep the others
                    engine.scheduler.release(seq)
                    ctl_send.send({"error": f"decode worker: {e}"})
                    continue
                incoming[rid] = seq
                ctl_send.send({"pages": seq.pages, "slot": seq.slot})
            elif kind == "ready":
                h = rest[0]
                h["seq"] = incoming.pop(h["rid"])
                if sink:
                    engine.scheduler.release(h["seq"])
                    results.put(("prefilled", h["rid"], h["first"], h["timing"]))
                else:
                    ready.put(h)
            elif kind == "abort":
                seq = incoming.pop(rest[0], None)
                if seq is not None:
                    engine.scheduler.release(seq)
        ready.put(_STOP)

    def adopt(h: dict) -> None:
        seq: Sequence = h["seq"]
        seq.prompt, seq.params = h["prompt"], h["params"]
        extra = h["num_prompt"] - len(h["prompt"])
        seq.prompt_embeds = torch.empty(extra, 0) if extra else None  # image positions: only their count matters now
        t = timings[seq.id] = h["timing"]
        t.first_token = time.monotonic()
        seq.arrival = t.arrival
        engine.adopt(seq, h["first"])

    receiver = threading.Thread(target=receive, name="kv-receive", daemon=True)
    receiver.start()
    results.put(("ready", "decode"))
    open_ = True
    while open_ or engine.has_unfinished():
        try:
            while True:
                h = ready.get(block=open_ and not engine.has_unfinished())
                if h is _STOP:
                    open_ = False
                    break
                adopt(h)
        except queue.Empty:
            pass
        if engine.has_unfinished():
            for out in engine.step():
                t = timings.pop(out.id)
                t.done = time.monotonic()
                results.put(("done", out, t))
    receiver.join(timeout=5)
    for seq in list(incoming.values()):
        engine.scheduler.release(seq)
    results.put(("decode_stats", {"leaked_pages": engine.pages.used, "leaked_slots": engine.slots.used}))


# -- client ----------------------------------------------------------------------------------------
@dataclass
class DisaggResult:
    outputs: list[RequestOutput | RequestError]
    timings: list[Timing | None]
    stats: dict[str, dict]


class DisaggCluster:
    """Start the three workers; ``run`` a list of requests through them; ``close`` joins them.

    ``transfer=False`` stops at the prefill (no transfer thread, no decode worker; ``run(...,
    transfer=False)`` does the same for one run of a transferring cluster).  ``decode=False``
    transfers every sequence into the decode worker's pools, which frees it on arrival: prefill +
    transfer with no decode steps competing for the machine (on one GPU or a few cores they would,
    which disaggregation proper avoids).
    ``copy``: the transfer thread's copy granularity, "gather" (a gather-scatter per cache tensor),
    "page" (one torch copy per page) or "post" (one native copy per page).
    """

    def __init__(self, cfg: dict | None = None, *, stages: int = 2, transfer: bool = True, decode: bool = True,
                 copy: str = "gather", num_pages: int = 512, page_size: int = 16, num_slots: int = 65,
                 max_batch: int = 32, max_model_len: int = 2048):
        _check_copy(copy)  # here, so a bad mode fails in the caller rather than in a worker
        self.cfg = dict(cfg or {"preset": "tiny"})
        self.transfer = transfer
        self.max_model_len = max_model_len
        self._next_rid = 0
        self._closed: dict[str, dict] | None = None
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.encode_inbox, self.prefill_inbox = ctx.Queue(), ctx.Queue()
        ctl_recv_d, ctl_send_p = ctx.Pipe(duplex=False)  # prefill -> decode: reserve, ready, abort
        ctl_recv_p, ctl_send_d = ctx.Pipe(duplex=False)  # decode -> prefill: reservations
        pools = ctx.Queue()  # the decode worker's shared-memory pools, handed to the prefill worker
        self.procs = {
            "encode": ctx.Process(target=encode_worker, name="encode", daemon=True,
                                  args=(dict(self.cfg), self.encode_inbox, self.prefill_inbox, self.results)),
            "prefill": ctx.Process(target=prefill_worker, name="prefill", daemon=True,
                                   args=(dict(self.cfg), stages, transfer, self.prefill_inbox, ctl_send_p, ctl_recv_p,
                                         pools, self.results, num_pages, page_size, num_slots, max_model_len,
                                         copy)),
        }
        if transfer:
            self.procs["decode"] = ctx.Process(target=decode_worker, name="decode", daemon=True,
                                               args=(dict(self.cfg), ctl_recv_d, ctl_send_d, pools, self.results,
                                                     num_pages, page_size, num_slots, max_batch, max_model_len,
                                                     not decode))
        for p in self.procs.values():
            p.start()
        waiting, deadline = set(self.procs), time.monotonic() + 300
        while waiting:  # every worker has built its model and is listening
            try:
                kind, *rest = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [n for n, p in self.procs.items() if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.close(timeout_s=1)
                    why = ", ".join(dead) or "timeout"
                    raise RuntimeError(f"disaggregated workers failed to start: {why}") from None
                continue
            if kind == "ready":
                waiting.discard(rest[0])

    def run(self, requests: list[tuple[list[int], SamplingParams, object]], arrivals: list[float] | None = None,
            timeout_s: float = 600.0, transfer: bool = True) -> DisaggResult:
        """Submit (prompt, params, image) requests at ``arrivals`` (seconds from now); wait for all.

        ``transfer=False`` stops this run's requests at the prefill, in the same worker processes:
        the prefill-only baseline of the KV-transfer overhead with nothing else changed.

        Outputs and timings come back in the order of ``requests``; a refused or failed request is a
        :class:`RequestError` in its place.
        """
        t0 = time.monotonic()
        arrivals = arrivals or [0.0] * len(requests)
        base = self._next_rid
        self._next_rid += len(requests)
        timings: dict[int, Timing] = {}
        outputs: dict[int, RequestOutput | RequestError] = {}
        for i, ((prompt, params, image), at) in enumerate(zip(requests, arrivals, strict=True)):
            rid = base + i
            if not prompt:
                outputs[rid] = RequestError("empty prompt: at least one token is needed")
                continue
            delay = t0 + at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            timings[rid] = Timing(arrival=time.monotonic())
            msg = (rid, list(prompt), params, image, timings[rid], transfer)
            (self.encode_inbox if image is not None else self.prefill_inbox).put(msg)
        while len(outputs) < len(requests):
            try:
                kind, *rest = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [n for n, p in self.procs.items() if not p.is_alive()]
                if dead or time.monotonic() - t0 > timeout_s:
                    why = f"worker died: {', '.join(dead)}" if dead else f"timed out after {timeout_s:.0f} s"
                    for rid in range(base, base + len(requests)):
                        outputs.setdefault(rid, RequestError(why))
                continue
            if kind == "done":
                out, t = rest
                outputs[out.id], timings[out.id] = out, t
            elif kind == "prefilled":
                rid, first, t = rest
                outputs[rid] = RequestOutput(id=rid, prompt=requests[rid - base][0], tokens=[first],
                                             finish_reason="prefill")
                timings[rid] = t
            elif kind == "error":
                rid, msg = rest
                outputs[rid] = RequestError(msg)
        ids = range(base, base + len(requests))
        return DisaggResult([outputs[r] for r in ids], [timings.get(r) for r in ids], {})

    def close(self, timeout_s: float = 30.0) -> dict[str, dict]:
        """Stop the workers; returns their pool accounting (leaked pages and slots).  Idempotent."""
        if self._closed is not None:
            return self._closed
        stats: dict[str, dict] = {}
        self.encode_inbox.put(_STOP)
        self.prefill_inbox.put(_STOP)
        want = {"prefill_stats"} | ({"decode_stats"} if self.transfer else set())
        deadline = time.monotonic() + timeout_s
        while want and time.monotonic() < deadline:
            try:
                kind, *rest = self.results.get(timeout=0.5)
            except queue.Empty:
                if all(not p.is_alive() for p in self.procs.values()):
                    break
                continue
            if kind in want:
                stats[kind.removesuffix("_stats")] = rest[0]
                want.discard(kind)
        for p in self.procs.values():
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        self._closed = stats
        return stats

    def __enter__(self) -> DisaggCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

