"""Requests as the engine sees them: sampling parameters, sequences and their lifecycle."""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass, field

import torch


class RequestError(ValueError):
    """A request the engine refuses (bad prompt, bad sampling parameters, unknown id, ...)."""


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; otherwise softmax(logits / temperature) restricted to the top-p mass."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token: int | None = None

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise RequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise RequestError(f"seed must be an integer or None, got {self.seed!r}")


class Status(enum.Enum):
    WAITING = "waiting"      # queued, or preempted and swapped out
    RUNNING = "running"      # holds pages and a state slot
    FINISHED = "finished"


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    prompt: list[int]
    params: SamplingParams
    image: torch.Tensor | None = None
    id: int = field(default_factory=lambda: next(_ids))
    output: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "length" | "stop" | "cancelled" | "error: ..."
    pages: list[int] = field(default_factory=list)
    shared: int = 0  # leading pages referenced from the prefix cache (not owned by this sequence)
    hit: object = None  # the prefix-cache Hit this sequence's prefill starts from, if any
    slot: int = 0
    swapped: dict | None = None  # host copies of pages and state while preempted
    arrival: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    generator: torch.Generator | None = None
    prompt_embeds: torch.Tensor | None = None  # image embeddings spliced in front of the prompt

    @property
    def num_prompt(self) -> int:
        """Prompt positions, image patches included."""
        extra = 0 if self.prompt_embeds is None else self.prompt_embeds.shape[0]
        return len(self.prompt) + extra

    @property
    def reused(self) -> int:
        """Prompt positions taken from the prefix cache (``hit``), a multiple of the page size."""
        return self.hit.length if self.hit is not None else 0

    @property
    def length(self) -> int:
        """Positions whose keys are in the cache once the last output token has been fed."""
        return self.num_prompt + len(self.output)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass
class RequestOutput:
    id: int
    prompt: list[int]
    tokens: list[int]
    finish_reason: str
    ttft_s: float | None = None
    latency_s: float | None = None
