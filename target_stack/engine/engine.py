"""The engine: requests in, tokens out.  ``LLMEngine.step`` is one scheduler decision (a prefill of
admitted prompts, or one decode token for every running sequence); ``generate`` loops it.

    engine = LLMEngine("tiny")
    outs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=8))

Bad requests raise :class:`RequestError` at ``add_request`` and never enter the batch; a failure
while running one sequence finishes that sequence with ``finish_reason='error: ...'`` and frees its
memory, leaving the rest of the batch running.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from target_stack.engine.cache import FreeList
from target_stack.engine.prefix import OWNER, PrefixCache
from target_stack.engine.runner import ModelRunner
from target_stack.engine.sampler import sample
from target_stack.engine.scheduler import Scheduler
from target_stack.engine.sequence import RequestError, RequestOutput, SamplingParams, Sequence, Status
from target_stack.events import emit
from target_stack.model.image import ImageError, load_image
from target_stack.model.model import HybridModel


class LLMEngine:
    def __init__(self, model: HybridModel | str = "tiny", *, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None, num_pages: int = 256, page_size: int = 16, num_slots: int = 33,
                 max_batch: int = 32, max_model_len: int = 1024, max_prefill_tokens: int = 4096,
                 cuda_graphs: bool | None = None, prefix_cache: bool = False, prefix_ring: int = 64,
                 prefix_entries: int = 64):
        if isinstance(model, str):
            model = HybridModel(model)
        device = torch.device(device) if device is not None else model.embed.device
        self.model = model.to(device=device, dtype=dtype or model.embed.dtype).eval()
        self.cfg = model.cfg
        self.page_size, self.max_model_len = page_size, max_model_len
        self.pages = FreeList(num_pages, "KV pages")
        self.slots = FreeList(num_slots, "state slots")
        if -(-max_model_len // page_size) > num_pages - 1:
            raise ValueError(f"max_model_len={max_model_len} needs more than the {num_pages - 1} usable pages")
        self.runner = ModelRunner(self.model, num_pages, page_size, num_slots)
        if cuda_graphs is None:
            cuda_graphs = device.type == "cuda"
        if cuda_graphs:
            if device.type != "cuda":
                raise ValueError("cuda_graphs=True needs a CUDA device; the CPU path stays eager")
            self.runner.enable_cuda_graphs(max_batch, max_model_len)
        self.prefix = PrefixCache(self.pages, page_size, prefix_ring, prefix_entries) if prefix_cache else None
        self.scheduler = Scheduler(self.pages, self.slots, page_size, max_batch, max_prefill_tokens,
                                   swap_out=self.runner.swap_out, prefix=self.prefix)
        self.seqs: dict[int, Sequence] = {}
        self.preemptions = 0

    # -- requests -----------------------------------------------------------------------------------
    def add_request(self, prompt: Iterable[int], params: SamplingParams | None = None, image: object = None) -> int:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be SamplingParams, got {type(params).__name__}")
        try:
            tokens = [int(t) for t in prompt]
        except (TypeError, ValueError) as e:
            raise RequestError(f"prompt must be a sequence of token ids: {e}") from None
        if not tokens:
            raise RequestError("empty prompt: at least one token is needed")
        bad = [t for t in tokens if not 0 <= t < self.cfg.vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} outside the vocabulary [0, {self.cfg.vocab})")
        seq = Sequence(prompt=tokens, params=params, arrival=time.monotonic())
        if image is not None:
            try:
                img = load_image(image, self.cfg.patch, self.cfg.max_image_side)
            except ImageError as e:
                raise RequestError(str(e)) from None
            seq.image = img
            with torch.no_grad():
                seq.prompt_embeds = self.model.image_encoder(img.to(self.runner.device, self.runner.dtype))
        total = seq.num_prompt + params.max_tokens
        if total > self.max_model_len:
            raise RequestError(f"prompt ({seq.num_prompt} positions) + max_tokens ({params.max_tokens}) = {total} "
                               f"exceeds max_model_len={self.max_model_len}")
        self.seqs[seq.id] = seq
        self.scheduler.add(seq)
        emit("request.add", id=seq.id, prompt=seq.num_prompt)
        return seq.id

    def cancel(self, request_id: int) -> None:
        seq = self.seqs.get(request_id)
        if seq is None:
            raise RequestError(f"unknown request id {request_id}")
        if not seq.finished:
            self._finish(seq, "cancelled")

    def adopt(self, seq: Sequence, first_token: int) -> None:
        """Take in a sequence prefilled elsewhere (a disaggregated prefill worker): its pages and
        slot are already held and written; it joins the running batch with its first token."""
        seq.status = Status.RUNNING
        self.seqs[seq.id] = seq
        self.scheduler.running.append(seq)
        self._append(seq, first_token)

    def has_unfinished(self) -> bool:
        """Requests not yet returned by ``step`` (finished ones, cancelled ones included, are removed there)."""
        return bool(self.seqs)

    # -- the loop -------------------------------------------------------------------------------------
    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.release(seq)
        self.scheduler.remove_waiting(seq)
        seq.swapped = None
        seq.status, seq.finish_reason, seq.finish_time = Status.FINISHED, reason, time.monotonic()
        emit("request.finish", id=seq.id, reason=reason, tokens=len(seq.output))

    def _append(self, seq: Sequence, token: int) -> None:
        seq.output.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        if seq.params.stop_token is not None and token == seq.params.stop_token:
            self._finish(seq, "stop")
        elif len(seq.output) >= seq.params.max_tokens:
            self._finish(seq, "length")

    def step(self) -> list[RequestOutput]:
        """One scheduler decision; returns the requests that finished in it."""
        plan = self.scheduler.schedule()
        self.preemptions += len(plan.preempted)
        for seq in plan.preempted:
            emit("request.preempt", id=seq.id)
        for seq in plan.resumed:
            self.runner.swap_in(seq, seq.swapped)
            seq.swapped = None
        for seq in plan.prefill:
            record = self.prefix is not None and seq.prompt_embeds is None
            emit("prefill.start", id=seq.id, tokens=seq.num_prompt, reused=seq.reused)
            try:
                logits, tails = self.runner.prefill_from(seq, self.prefix.ring if record else 0)
                token = sample(logits[None], [seq])[0]
                if record:
                    seq.shared = self.prefix.insert(seq.prompt, seq.id, seq.pages, seq.shared, seq.reused, tails)
            except Exception as e:  # noqa: BLE001 - one bad sequence must not take the batch down
                self._finish(seq, f"error: {type(e).__name__}: {e}")
                continue
            finally:
                emit("prefill.done", id=seq.id)
            self._append(seq, token)
        if plan.decode:
            logits = self.runner.decode(plan.decode)
            for seq, token in zip(plan.decode, sample(logits, plan.decode), strict=True):
                self._append(seq, token)
        finished = [s for s in self.seqs.values() if s.finished]  # this step's, and any cancelled since
        for seq in finished:
            del self.seqs[seq.id]
        return [self._output(s) for s in finished]

    def _output(self, seq: Sequence) -> RequestOutput:
        ttft = None if seq.first_token_time is None else seq.first_token_time - seq.arrival
        return RequestOutput(id=seq.id, prompt=seq.prompt, tokens=list(seq.output), finish_reason=seq.finish_reason,
                             ttft_s=ttft, latency_s=seq.finish_time - seq.arrival)

    def generate(self, prompts: list[Iterable[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 images: list[object] | None = None) -> list[RequestOutput]:
        """Run prompts to completion; outputs in the order of ``prompts``.  All or nothing: when one
        prompt is refused, those of the call already queued are cancelled and dropped before the error
        is raised (a later call must not run them, nobody collects them)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ilist = images or [None] * len(prompts)
        ids: list[int] = []
        try:
            for p, sp, img in zip(prompts, plist, ilist, strict=True):
                ids.append(self.add_request(p, sp, img))
        except BaseException:
            for i in ids:
                self.cancel(i)
                del self.seqs[i]
            raise
        results: dict[int, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                results[out.id] = out
        return [results[i] for i in ids]

    # -- accounting -----------------------------------------------------------------------------------
    def usage(self) -> dict[str, int]:
        """Pages in use include the prefix cache's (``pages_cached``; ``clear_prefix_cache`` frees them)."""
        return {"pages_used": self.pages.used, "pages_free": self.pages.free,
                "pages_cached": self.prefix.cached_pages if self.prefix else 0,
                "slots_used": self.slots.used, "slots_free": self.slots.free}

    def leaks(self) -> dict[str, dict]:
        """Pages and slots still held by sequences that are not live, and any disagreement in the
        prefix cache's page references: all empty after a clean run."""
        live = {s.id for s in self.scheduler.running}
        out = {"pages": {p: o for p, o in self.pages.holders().items() if o not in live and o != OWNER},
               "slots": {s: o for s, o in self.slots.holders().items() if o not in live}}
        if self.prefix is not None:
            shared = {s.id: s.pages[:s.shared] for s in self.scheduler.running}
            out["prefix"] = dict(enumerate(self.prefix.problems(shared)))
        return out

    def clear_prefix_cache(self) -> None:
        """Drop every cached prefix (pages still read by live sequences stay until they finish)."""
        if self.prefix is not None:
            self.prefix.clear()
