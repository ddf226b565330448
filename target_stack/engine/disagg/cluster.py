"""The disaggregated cluster's client: starts the three workers, runs requests through them, joins them."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from dataclasses import dataclass

from target_stack.engine.disagg.messages import STOP, Done, Failed, Prefilled, Ready, Request, Stats, Timing
from target_stack.engine.disagg.transfer import check_copy
from target_stack.engine.disagg.workers import decode_worker, encode_worker, prefill_worker
from target_stack.engine.sequence import RequestError, RequestOutput, SamplingParams


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
        check_copy(copy)  # here, so a bad mode fails in the caller rather than in a worker
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
                msg = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [n for n, p in self.procs.items() if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.close(timeout_s=1)
                    why = ", ".join(dead) or "timeout"
                    raise RuntimeError(f"disaggregated workers failed to start: {why}") from None
                continue
            if isinstance(msg, Ready):
                waiting.discard(msg.worker)

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
            req = Request(rid, list(prompt), params, timings[rid], transfer, image=image)
            (self.encode_inbox if image is not None else self.prefill_inbox).put(req)
        while len(outputs) < len(requests):
            try:
                msg = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [n for n, p in self.procs.items() if not p.is_alive()]
                if dead or time.monotonic() - t0 > timeout_s:
                    why = f"worker died: {', '.join(dead)}" if dead else f"timed out after {timeout_s:.0f} s"
                    for rid in range(base, base + len(requests)):
                        outputs.setdefault(rid, RequestError(why))
                continue
            if isinstance(msg, Done):
                outputs[msg.output.id], timings[msg.output.id] = msg.output, msg.timing
            elif isinstance(msg, Prefilled):
                outputs[msg.rid] = RequestOutput(id=msg.rid, prompt=requests[msg.rid - base][0], tokens=[msg.first],
                                                 finish_reason="prefill")
                timings[msg.rid] = msg.timing
            elif isinstance(msg, Failed):
                outputs[msg.rid] = RequestError(msg.error)
        ids = range(base, base + len(requests))
        return DisaggResult([outputs[r] for r in ids], [timings.get(r) for r in ids], {})

    def close(self, timeout_s: float = 30.0) -> dict[str, dict]:
        """Stop the workers; returns their pool accounting (leaked pages and slots).  Idempotent."""
        if self._closed is not None:
            return self._closed
        stats: dict[str, dict] = {}
        self.encode_inbox.put(STOP)
        self.prefill_inbox.put(STOP)
        want = {"prefill"} | ({"decode"} if self.transfer else set())
        deadline = time.monotonic() + timeout_s
        while want and time.monotonic() < deadline:
            try:
                msg = self.results.get(timeout=0.5)
            except queue.Empty:
                if all(not p.is_alive() for p in self.procs.values()):
                    break
                continue
            if isinstance(msg, Stats) and msg.worker in want:
                stats[msg.worker] = {"leaked_pages": msg.leaked_pages, "leaked_slots": msg.leaked_slots}
                want.discard(msg.worker)
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
