"""The disaggregated cluster's wire protocol: every message between the client and the workers, and
between the prefill and decode workers, as a typed record (pickled through multiprocessing queues and
pipes).  ``STOP`` (None) ends a queue or pipe.

    client  -> encode, prefill   Request
    workers -> client            Ready, Failed, Prefilled, Done, Stats
    prefill -> decode (control)  Reserve, Handoff, Abort
    decode  -> prefill (control) Reservation
    decode  -> prefill (once)    the decode pools: {"kv.<layer>.<name>" | "state.<layer>.<kda|conv>": tensor}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

STOP = None


@dataclass
class Timing:
    """Per-request timestamps (time.monotonic, one clock for every process on the machine)."""

    arrival: float = 0.0
    prefill_start: float = 0.0
    prefill_done: float = 0.0
    transfer_done: float = 0.0
    first_token: float = 0.0
    done: float = 0.0


@dataclass
class Request:
    """A request on its way to the prefill worker (through the encode worker when it has an image)."""

    rid: int
    prompt: list[int]
    params: Any  # SamplingParams
    timing: Timing
    move: bool  # to the decode worker (False: stop after the prefill)
    image: Any = None  # for the encode worker: what load_image accepts
    embeds: Any = None  # from the encode worker: the image's patch embeddings (a numpy array)


# -- workers -> client -----------------------------------------------------------------------------
@dataclass
class Ready:
    worker: str  # has built its model and listens


@dataclass
class Failed:
    rid: int
    error: str


@dataclass
class Prefilled:
    """A request that stopped after its prefill (no transfer, or a decode worker that only receives)."""

    rid: int
    first: int
    timing: Timing


@dataclass
class Done:
    output: Any  # RequestOutput
    timing: Timing


@dataclass
class Stats:
    """A worker's pool accounting when it stops: what it still holds is leaked."""

    worker: str
    leaked_pages: int
    leaked_slots: int


# -- prefill <-> decode -----------------------------------------------------------------------------
@dataclass
class Reserve:
    rid: int
    pages: int


@dataclass
class Reservation:
    pages: list[int] = field(default_factory=list)
    slot: int = 0
    error: str | None = None


@dataclass
class Handoff:
    """A sequence whose KV pages and state slots are all in the decode worker's reservation."""

    rid: int
    first: int
    params: Any  # SamplingParams
    prompt: list[int]
    num_prompt: int  # positions, image patches included
    timing: Timing


@dataclass
class Abort:
    rid: int  # the prefill failed: free the reservation
