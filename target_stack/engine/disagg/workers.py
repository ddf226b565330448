"""The three worker processes of the disaggregated cluster: encode (images to patch embeddings),
prefill (the prompt, layer by layer, with the transfer thread shipping finished stages), decode (its
own engine; adopts each transferred sequence and decodes it with the others).  Each talks to the
others only through the records of :mod:`.messages`."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import queue
import threading
import time

import torch

from target_stack.engine.cache import FreeList
from target_stack.engine.disagg.messages import (
    STOP,
    Abort,
    Done,
    Failed,
    Handoff,
    Prefilled,
    Ready,
    Reservation,
    Reserve,
    Stats,
    Timing,
)
from target_stack.engine.disagg.transfer import TransferEngine, TransferItem
from target_stack.engine.engine import LLMEngine
from target_stack.engine.runner import ModelRunner
from target_stack.engine.sampler import sample
from target_stack.engine.sequence import SamplingParams, Sequence
from target_stack.events import emit
from target_stack.model.image import ImageError, load_image
from target_stack.model.model import PRESETS, HybridModel


def _model(cfg_dict: dict, moe_backend: str | None = None, on_device: bool = True):
    """The worker's model from the cluster's config: {"preset", "device", field overrides...};
    on a GPU in bf16."""
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



def encode_worker(cfg: dict, inbox: mp.Queue, prefill_inbox: mp.Queue, results: mp.Queue) -> None:
    torch.set_num_threads(1)
    model = _model(cfg, on_device=False)  # images are small: the encoder stays on the CPU
    results.put(Ready("encode"))
    while (req := inbox.get()) is not STOP:
        try:
            img = load_image(req.image, model.cfg.patch, model.cfg.max_image_side)
            with torch.no_grad():
                embeds = model.image_encoder(img)
        except ImageError as e:
            results.put(Failed(req.rid, f"image: {e}"))
            continue
        prefill_inbox.put(dataclasses.replace(req, image=None, embeds=embeds.numpy()))



def prefill_worker(cfg: dict, stages: int, transfer: bool, inbox: mp.Queue, ctl_send, ctl_recv, pools: mp.Queue,
                   results: mp.Queue, num_pages: int, page_size: int, num_slots: int,
                   max_model_len: int = 2048, copy: str = "gather") -> None:
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

    def on_complete(item: TransferItem, error: str | None) -> None:
        seq = item.seq
        if error and seq.id not in failed:
            failed.add(seq.id)
            results.put(Failed(seq.id, error))
        if item.kind in ("ready", "abort"):
            release(seq)  # every earlier item of this sequence has run: its pages are no longer read

    engine = None
    if transfer:
        engine = TransferEngine(runner, pools.get(), ctl_send, ctl_recv, on_complete, copy)

    moving = False  # whether the sequence in prefill goes to the decode worker (one at a time)

    def layer_done(seq: Sequence, layer: int) -> None:
        # A layer's KV and state are final once its mixer has run (the FFN does not touch them), so the
        # runner calls this before the layer's FFN: the stage moves while the MoE computes.
        if moving and layer in stage_layers:
            engine.submit(TransferItem("stage", f"{seq.id}:{layer}", seq, layers=stage_layers[layer]))

    runner.mixer_done = layer_done
    results.put(Ready("prefill"))
    while (req := inbox.get()) is not STOP:
        rid, prompt, params, timing = req.rid, req.prompt, req.params, req.timing
        moving = engine is not None and req.move
        seq = Sequence(prompt=prompt, params=params, id=rid)
        if req.embeds is not None:
            seq.prompt_embeds = torch.from_numpy(req.embeds)
        if seq.num_prompt + params.max_tokens > max_model_len:  # image patches count: checked after encoding
            results.put(Failed(rid, f"prompt ({seq.num_prompt} positions) + max_tokens ({params.max_tokens}) "
                                    f"exceeds max_model_len={max_model_len}"))
            continue
        need = -(-(seq.num_prompt + 1) // page_size)
        try:
            seq.pages = pages.take(need, rid)
            seq.slot = slots.take(1, rid)[0]
        except Exception as e:  # noqa: BLE001 - refuse this request, keep serving
            release(seq)
            results.put(Failed(rid, f"prefill worker: {e}"))
            continue
        if moving:  # the round trip runs while the first layers compute
            engine.submit(TransferItem("reserve", f"{rid}:reserve", seq, pages=need))
        timing.prefill_start = time.monotonic()
        emit("prefill.start", id=rid, tokens=seq.num_prompt)
        try:
            first = sample(runner.prefill(seq)[None], [seq])[0]
        except Exception as e:  # noqa: BLE001 - this request fails, the worker keeps serving
            emit("prefill.done", id=rid)
            failed.add(rid)
            results.put(Failed(rid, f"prefill failed: {type(e).__name__}: {e}"))
            if not moving:
                release(seq)
            else:
                engine.submit(TransferItem("abort", f"{rid}:abort", seq))
            continue
        timing.prefill_done = time.monotonic()
        emit("prefill.done", id=rid)
        if not moving:  # prefill-only measurement: nothing leaves this process
            release(seq)
            results.put(Prefilled(rid, first, timing))
            continue
        engine.submit(TransferItem("ready", f"{rid}:ready", seq,
                                   handoff=Handoff(rid, first, params, prompt, seq.num_prompt, timing)))
    if engine is not None:
        engine.close()
        engine.remote.clear()  # drop the decode worker's (shared) pools before it may exit
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        try:
            ctl_send.send(STOP)
        except OSError:
            pass
    results.put(Stats("prefill", pages.used, slots.used))



def decode_worker(cfg: dict, ctl_recv, ctl_send, pools: mp.Queue, results: mp.Queue, num_pages: int,
                  page_size: int, num_slots: int, max_batch: int, max_model_len: int, sink: bool = False) -> None:
    """Owns the decode engine; its pools are in shared memory for the prefill worker to write.  A
    receiver thread answers reservations and queues finished sequences; the main thread adopts them
    between decode steps.  ``sink``: receive the sequences and free them at once, decoding nothing
    (the KV-transfer measurement without decode steps sharing the machine)."""
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
            if msg is STOP:
                break
            if isinstance(msg, Reserve):
                seq = Sequence(prompt=[], params=SamplingParams(), id=msg.rid)
                try:
                    seq.pages = engine.pages.take(msg.pages, msg.rid)
                    seq.slot = engine.slots.take(1, msg.rid)[0]
                except Exception as e:  # noqa: BLE001 - refuse this one, keep the others
                    engine.scheduler.release(seq)
                    ctl_send.send(Reservation(error=f"decode worker: {e}"))
                    continue
                incoming[msg.rid] = seq
                ctl_send.send(Reservation(pages=seq.pages, slot=seq.slot))
            elif isinstance(msg, Handoff):
                seq = incoming.pop(msg.rid)
                if sink:
                    engine.scheduler.release(seq)
                    results.put(Prefilled(msg.rid, msg.first, msg.timing))
                else:
                    ready.put((seq, msg))
            elif isinstance(msg, Abort):
                seq = incoming.pop(msg.rid, None)
                if seq is not None:
                    engine.scheduler.release(seq)
        ready.put(STOP)

    def adopt(seq: Sequence, h: Handoff) -> None:
        seq.prompt, seq.params = h.prompt, h.params
        extra = h.num_prompt - len(h.prompt)
        seq.prompt_embeds = torch.empty(extra, 0) if extra else None  # image positions: only their count matters now
        t = timings[seq.id] = h.timing
        t.first_token = time.monotonic()
        seq.arrival = t.arrival
        engine.adopt(seq, h.first)

    receiver = threading.Thread(target=receive, name="kv-receive", daemon=True)
    receiver.start()
    results.put(Ready("decode"))
    open_ = True
    while open_ or engine.has_unfinished():
        try:
            while True:
                got = ready.get(block=open_ and not engine.has_unfinished())
                if got is STOP:
                    open_ = False
                    break
                adopt(*got)
        except queue.Empty:
            pass
        if engine.has_unfinished():
            for out in engine.step():
                t = timings.pop(out.id)
                t.done = time.monotonic()
                results.put(Done(out, t))
    receiver.join(timeout=5)
    for seq in list(incoming.values()):
        engine.scheduler.release(seq)
    results.put(Stats("decode", engine.pages.used, engine.slots.used))
