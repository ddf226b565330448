"""``python -m target_stack.bench prefix``: multi-turn conversations with and without prefix reuse.

Each conversation resends its history every turn: turn 1 is a fresh prompt, turn n the prompt of
turn n - 1, its answer and a new user message.  Two engines, one with the prefix cache, take the
same turns side by side (the one going first alternates from turn to turn); the next turn's
history comes from the engine without the cache, so both always see the same prompts.  Reported
per turn: prompt length, positions reused, TTFT p50 of both and their ratio, and whether the
greedy answers agree.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import random
import statistics
import time

import torch

from target_stack.bench.serve import fill_from_spec
from target_stack.engine import LLMEngine, SamplingParams

DEFAULT = "conversations=4,turns=4,first=96-160,user=16-48,output=8"


@dataclasses.dataclass
class Conversations:
    conversations: int = 4
    turns: int = 4
    first: tuple[int, int] = (96, 160)
    user: tuple[int, int] = (16, 48)
    output: int = 8
    seed: int = 0

    @classmethod
    def parse(cls, spec: str) -> Conversations:
        c = fill_from_spec(cls(), spec, "conversations")
        if min(c.conversations, c.turns, c.output, c.first[0], c.user[0]) < 1:
            raise ValueError(f"invalid conversations: {spec!r}")
        return c


def run(preset: str, spec: str, out: pathlib.Path, console, device: str | None = None,
        print_json: bool = False) -> int:
    from rich.table import Table

    conv = Conversations.parse(spec)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device == "cuda" else None
    longest = conv.first[1] + (conv.turns - 1) * (conv.output + conv.user[1]) + conv.output
    max_len = 16 * (longest // 16 + 2)
    kw = dict(device=device, dtype=dtype, max_model_len=max_len, num_pages=conv.conversations * (max_len // 16) * 3 + 8)
    engines = {"plain": LLMEngine(preset, **kw), "cached": LLMEngine(preset, prefix_cache=True, **kw)}
    vocab = engines["plain"].cfg.vocab
    rng, gen = random.Random(conv.seed), torch.Generator().manual_seed(conv.seed)

    def tokens(lo_hi: tuple[int, int]) -> list[int]:
        return torch.randint(0, vocab, (rng.randint(*lo_hi),), generator=gen).tolist()

    for engine in engines.values():  # warm-up (kernels, graphs), then an empty cache
        engine.generate([tokens((32, 32))], SamplingParams(max_tokens=2))
        engine.clear_prefix_cache()
    params = SamplingParams(max_tokens=conv.output)
    prompts = [tokens(conv.first) for _ in range(conv.conversations)]
    rows = []
    for turn in range(conv.turns):
        order = ["plain", "cached"] if turn % 2 == 0 else ["cached", "plain"]
        results, reused = {}, 0
        for name in order:
            engine = engines[name]
            before = engine.prefix.stats["reused_tokens"] if engine.prefix else 0
            t0 = time.monotonic()
            outs = [engine.generate([p], params)[0] for p in prompts]  # one request at a time: TTFT = prefill
            failed = [o for o in outs if o.ttft_s is None]
            if failed:  # no first token: nothing to time, and the turns after it would build on nothing
                raise RuntimeError(f"turn {turn + 1}: the {name} engine's request of {len(failed[0].prompt)} tokens "
                                   f"ended {failed[0].finish_reason!r} before its first token")
            if device == "cuda":
                torch.cuda.synchronize()
            results[name] = (outs, time.monotonic() - t0)
            if engine.prefix:
                reused = engine.prefix.stats["reused_tokens"] - before
        plain, cached = results["plain"][0], results["cached"][0]
        ttft = {n: statistics.median(o.ttft_s for o in results[n][0]) for n in results}
        rows.append({"turn": turn + 1, "prompt_p50": statistics.median(len(p) for p in prompts),
                     "reused_share": reused / sum(len(p) for p in prompts),
                     "ttft_ms_p50_plain": 1e3 * ttft["plain"], "ttft_ms_p50_cached": 1e3 * ttft["cached"],
                     "speedup": ttft["plain"] / ttft["cached"],
                     "answers_agree": sum(a.tokens == b.tokens for a, b in zip(plain, cached, strict=True))})
        prompts = [p + o.tokens + tokens(conv.user) for p, o in zip(prompts, plain, strict=True)]
    cached_engine = engines["cached"]
    leaks = cached_engine.leaks()
    cached_engine.clear_prefix_cache()
    result = {"preset": preset, "device": device, "conversations": dataclasses.asdict(conv), "turns": rows,
              "prefix_stats": cached_engine.prefix.stats, "leaks": {k: len(v) for k, v in leaks.items()},
              "pages_used_after_clear": cached_engine.usage()["pages_used"]}
    table = Table(title=f"prefix reuse, {preset} on {device}: TTFT p50 per turn ({conv.conversations} conversations)")
    for col in ("turn", "prompt p50", "reused", "TTFT plain ms", "TTFT cached ms", "speedup", "answers agree"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["turn"]), f"{r['prompt_p50']:.0f}", f"{100 * r['reused_share']:.0f}%",
                      f"{r['ttft_ms_p50_plain']:.2f}", f"{r['ttft_ms_p50_cached']:.2f}", f"{r['speedup']:.2f}x",
                      f"{r['answers_agree']}/{conv.conversations}")
    console.print(table)
    console.print(f"leaks: {result['leaks']}, pages in use after clearing the cache: "
                  f"{result['pages_used_after_clear']}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    if print_json:
        print(json.dumps(result))
    bad = any(result["leaks"].values()) or result["pages_used_after_clear"]
    return 1 if bad else 0
