"""End-to-end serving metrics: run a target's serving benchmark and read TTFT, TPOT, throughput.

The benchmark is any command that prints, as its last stdout line, a JSON object with either
per-request records or the aggregate numbers::

    {"requests": [{"arrival": 0.0, "first_token": 0.12, "done": 0.90, "output_tokens": 32}, ...],
     "overheads": {"kv_transfer": 0.004}}
    {"ttft_ms": ..., "tpot_ms": ..., "throughput_tok_s": ..., "overheads": {...}}

From records this module computes TTFT (first token - arrival), TPOT ((done - first token) /
(output tokens - 1)), and throughput (all output tokens / makespan) with medians and p99s.
"""

from __future__ import annotations

import json
import shlex
import statistics
import subprocess
import sys

from pydantic import BaseModel


class ServingMetrics(BaseModel):
    requests: int
    ttft_ms_p50: float
    ttft_ms_p99: float
    tpot_ms_p50: float
    tpot_ms_p99: float
    throughput_tok_s: float
    overheads: dict[str, float] = {}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))] if xs else 0.0


def metrics_from_records(records: list[dict], overheads: dict[str, float] | None = None) -> ServingMetrics:
    if not records:
        raise ValueError("the serving benchmark reported no requests")
    ttft = [(r["first_token"] - r["arrival"]) * 1e3 for r in records]
    tpot = [(r["done"] - r["first_token"]) * 1e3 / (r["output_tokens"] - 1) for r in records if r["output_tokens"] > 1]
    start = min(r["arrival"] for r in records)
    end = max(r["done"] for r in records)
    tokens = sum(r["output_tokens"] for r in records)
    return ServingMetrics(requests=len(records), ttft_ms_p50=statistics.median(ttft), ttft_ms_p99=_pct(ttft, 0.99),
                          tpot_ms_p50=statistics.median(tpot) if tpot else 0.0, tpot_ms_p99=_pct(tpot, 0.99),
                          throughput_tok_s=tokens / (end - start) if end > start else 0.0,
                          overheads=dict(overheads or {}))


def parse_output(stdout: str) -> ServingMetrics:
    lines = [ln for ln in stdout.strip().splitlines() if ln.strip()]
    if not lines:
        raise ValueError("the serving benchmark printed nothing")
    try:
        data = json.loads(lines[-1])
    except json.JSONDecodeError as exc:
        raise ValueError(f"the serving benchmark's last line is not JSON: {lines[-1][:120]!r}") from exc
    if "requests" in data and isinstance(data["requests"], list):
        return metrics_from_records(data["requests"], data.get("overheads"))
    try:
        return ServingMetrics(requests=int(data.get("requests", 0)), ttft_ms_p50=data["ttft_ms"],
                              ttft_ms_p99=data.get("ttft_ms_p99", data["ttft_ms"]), tpot_ms_p50=data["tpot_ms"],
                              tpot_ms_p99=data.get("tpot_ms_p99", data["tpot_ms"]),
                              throughput_tok_s=data["throughput_tok_s"], overheads=data.get("overheads", {}))
    except KeyError as exc:
        raise ValueError(f"the serving benchmark's result lacks {exc}") from exc


def run_benchmark(command: str | list[str], timeout_s: float = 600, cwd: str | None = None) -> ServingMetrics:
    """Run a serving benchmark command and parse its metrics."""
    argv = shlex.split(command) if isinstance(command, str) else command
    if argv and argv[0] == "python":
        argv[0] = sys.executable
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, cwd=cwd)
    if proc.returncode != 0:
        raise RuntimeError(f"serving benchmark exited with {proc.returncode}: {proc.stderr.strip()[-300:]}")
    return parse_output(proc.stdout)
