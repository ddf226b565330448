"""``python -m target_stack.bench serve``: a synthetic serving workload through the engine and the
disaggregated workers.

Workload: Poisson arrivals at ``rate`` requests/s (0: all at once), prompt and output lengths drawn
uniformly from ranges, a share of multimodal requests (a random image in front of the prompt).

Reported, on the same workload:
- colocated engine (on the GPU when there is one): TTFT, TPOT (p50/p99) and output throughput;
- disaggregated (encode / prefill / decode processes, KV moved by the prefill's transfer thread):
  TTFT, TPOT, and the KV-transfer overhead = sum over requests of (prefill start -> transfer done)
  / sum of (prefill start -> prefill done) in a prefill-only run, minus 1, where the decode worker
  receives every sequence and frees it (so decode steps sharing the machine do not count as
  transfer cost; that number, with decode running, is reported beside it); with the exposed
  transfer (prefill done -> transfer done) and the pool accounting of every worker;
- ``--compare-gil``: the disaggregated part again in a scratch copy of target_stack with
  ``scenarios/gil-kv-transfer.patch`` applied (the native MoE dispatch loaded so that it holds the GIL).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from target_stack.engine import LLMEngine, SamplingParams

DEFAULT_WORKLOAD = "requests=16,rate=0,prompt=128-256,output=4-12,mm=0.25,seed=0"


def fill_from_spec(obj, spec: str, what: str):
    """Set a dataclass's fields from ``key=value,...``; a tuple field takes a range ``LO-HI`` (or one
    number), the others their default's type.  Unknown keys and unparsable values are errors."""
    kinds = {f.name: type(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, _, value = part.partition("=")
        kind = kinds.get(key)
        if kind is None:
            raise ValueError(f"unknown {what} key {key!r}; known: {', '.join(kinds)}")
        try:
            if kind is tuple:
                lo, _, hi = value.partition("-")
                setattr(obj, key, (int(lo), int(hi or lo)))
            else:
                setattr(obj, key, kind(value))
        except ValueError:
            expected = {tuple: "a range LO-HI", int: "an integer", float: "a number"}.get(kind, kind.__name__)
            raise ValueError(f"invalid {what}: {part!r}, the value must be {expected}") from None
    return obj


@dataclasses.dataclass
class Workload:
    requests: int = 16
    rate: float = 0.0
    prompt: tuple[int, int] = (128, 256)
    output: tuple[int, int] = (4, 12)
    mm: float = 0.25
    seed: int = 0

    @classmethod
    def parse(cls, spec: str) -> Workload:
        w = fill_from_spec(cls(), spec, "workload")
        if w.requests < 1 or w.prompt[0] < 1 or w.output[0] < 1 or not 0 <= w.mm <= 1 or w.rate < 0:
            raise ValueError(f"invalid workload: {spec!r}")
        return w

    def build(self, vocab: int, patch: int) -> tuple[list[tuple[list[int], SamplingParams, object]], list[float]]:
        rng = random.Random(self.seed)
        gen = torch.Generator().manual_seed(self.seed)
        requests, arrivals, t = [], [], 0.0
        for _ in range(self.requests):
            prompt = torch.randint(0, vocab, (rng.randint(*self.prompt),), generator=gen).tolist()
            image = None
            if rng.random() < self.mm:
                image = torch.rand(3, 2 * patch, 2 * patch, generator=gen)
            requests.append((prompt, SamplingParams(max_tokens=rng.randint(*self.output)), image))
            arrivals.append(t)
            if self.rate > 0:
                t += rng.expovariate(self.rate)
        return requests, arrivals


def _pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile the benchmark reports: the sorted sample at the position q * (n - 1) rounded to the
    nearest index, a half up (no interpolation: always a measured value); NaN for no sample."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))] if xs else float("nan")


def _latency_stats(ttft: list[float], tpot: list[float], tokens: int, makespan: float) -> dict:
    """TTFT and TPOT p50/p99 in ms (``_pct``), output throughput (tokens / makespan) and the request count."""
    return {"ttft_ms_p50": 1e3 * _pct(ttft, 0.5), "ttft_ms_p99": 1e3 * _pct(ttft, 0.99),
            "tpot_ms_p50": 1e3 * _pct(tpot, 0.5), "tpot_ms_p99": 1e3 * _pct(tpot, 0.99),
            "throughput_tok_s": tokens / makespan if makespan > 0 else 0.0, "requests": len(ttft)}


def run_colocated(preset: str, workload: Workload, device: str | None = None) -> dict:
    """The workload through one in-process engine (on the GPU when there is one: bf16, CUDA graphs)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device == "cuda" else None
    engine = LLMEngine(preset, device=device, dtype=dtype, max_model_len=2048, num_pages=1024)
    requests, arrivals = workload.build(engine.cfg.vocab, engine.cfg.patch)
    engine.generate([requests[0][0][:8]], SamplingParams(max_tokens=2))  # warm-up
    t0 = time.monotonic()
    pending = list(zip(arrivals, requests, strict=True))
    outs = []
    while pending or engine.has_unfinished():
        now = time.monotonic() - t0
        while pending and pending[0][0] <= now:
            _, (prompt, params, image) = pending.pop(0)
            engine.add_request(prompt, params, image)
        if engine.has_unfinished():
            outs.extend(engine.step())
        elif pending:
            time.sleep(max(0.0, pending[0][0] - (time.monotonic() - t0)))
    makespan = time.monotonic() - t0
    ttft = [o.ttft_s for o in outs]
    tpot = [(o.latency_s - o.ttft_s) / (len(o.tokens) - 1) for o in outs if len(o.tokens) > 1]
    stats = _latency_stats(ttft, tpot, sum(len(o.tokens) for o in outs), makespan)
    stats["leaks"] = {k: len(v) for k, v in engine.leaks().items()}
    stats["preemptions"] = engine.preemptions
    stats["device"] = device
    return stats


def run_disagg(preset: str, workload: Workload, stages: int, repeats: int = 1, device: str = "cpu",
               copy: str = "gather") -> dict:
    """The workload through two clusters alive side by side (idle workers cost nothing), run in
    turn ``repeats`` times; sums and latencies are medians over the repeats:

    - one whose decode worker frees each sequence on arrival, run without and then with the
      transfer: the prefill-only baseline and the KV-transfer overhead, in the same processes;
    - the full cluster (transfer, then decode): TTFT, TPOT, throughput, and the overhead again with
      decode steps sharing the machine (one GPU, or this machine's cores), reported beside it.
    """
    from target_stack.engine.disagg import DisaggCluster
    from target_stack.model.model import PRESETS

    cfg = PRESETS[preset]
    requests, arrivals = workload.build(cfg.vocab, cfg.patch)
    warm = [(requests[0][0][:8], SamplingParams(max_tokens=2), None)]
    kinds = {"transfer": dict(decode=False), "full": dict()}
    runs: dict[str, list] = {"prefill": [], "transfer": [], "full": []}
    max_len = workload.prompt[1] + workload.output[1] + 64  # image patches included
    pages = max(2048, 2 * workload.requests * -(-max_len // 16))
    clusters = {k: DisaggCluster({"preset": preset, "device": device}, stages=stages, copy=copy, num_pages=pages,
                                 max_model_len=max_len, **kw) for k, kw in kinds.items()}
    try:
        for c in clusters.values():
            c.run(warm)
        for _ in range(repeats):
            for kind, cluster, move in (("prefill", clusters["transfer"], False),
                                        ("transfer", clusters["transfer"], True), ("full", clusters["full"], True)):
                t0 = time.monotonic()  # A B C A B C: drift hits all alike
                result = cluster.run(requests, arrivals, transfer=move)
                makespan = time.monotonic() - t0
                errors = [str(o) for o in result.outputs if isinstance(o, Exception)]
                if errors:
                    raise RuntimeError(f"disaggregated run failed: {errors[0]}")
                runs[kind].append((result, makespan))
    finally:
        pools = {k: c.close() for k, c in clusters.items()}

    def total(kind: str, end: str) -> float:
        return statistics.median(sum(getattr(t, end) - t.prefill_start for t in r.timings) for r, _ in runs[kind])

    prefill_only, with_transfer = total("prefill", "prefill_done"), total("transfer", "transfer_done")
    with_decode = total("full", "transfer_done")
    out: dict = {"stages": stages, "repeats": repeats, "device": device, "copy": copy,
                 "prefill_only_s": prefill_only, "prefill_plus_transfer_s": with_transfer,
                 "kv_transfer_overhead": with_transfer / prefill_only - 1,
                 "prefill_plus_transfer_with_decode_s": with_decode,
                 "overhead_with_decode": with_decode / prefill_only - 1}
    exposed = [t.transfer_done - t.prefill_done for r, _ in runs["transfer"] for t in r.timings]
    out["exposed_transfer_ms_p50"] = 1e3 * _pct(exposed, 0.5)
    out["exposed_transfer_ms_p99"] = 1e3 * _pct(exposed, 0.99)
    out["exposed_transfer_samples"] = len(exposed)
    timings = [t for r, _ in runs["full"] for t in r.timings]
    outs = [o for r, _ in runs["full"] for o in r.outputs]
    ttft = [t.first_token - t.arrival for t in timings]
    tpot = [(t.done - t.first_token) / (len(o.tokens) - 1) for t, o in zip(timings, outs, strict=True)
            if len(o.tokens) > 1]
    makespan = statistics.median(m for _, m in runs["full"])
    out.update(_latency_stats(ttft, tpot, sum(len(o.tokens) for o in runs["full"][0][0].outputs), makespan))
    out["ttft_samples"] = len(ttft)
    out["requests"] = len(requests)
    unreported = {"unreported": 1}  # a worker that died before its accounting counts as a leak
    out["pools"] = {**pools["full"], "transfer_prefill": pools["transfer"].get("prefill", unreported),
                    "transfer_sink": pools["transfer"].get("decode", unreported)}
    return out


def _scenario_copy(name: str) -> pathlib.Path:
    """A scratch copy of this target_stack with ``scenarios/NAME.patch`` applied."""
    pkg = pathlib.Path(__file__).resolve().parents[1]
    patch = pkg / "scenarios" / f"{name}.patch"
    root = pathlib.Path(tempfile.mkdtemp(prefix=f"ts-{name}-"))
    shutil.copytree(pkg, root / "target_stack", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    proc = subprocess.run(["git", "apply", "--unsafe-paths", str(patch)], cwd=root, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{patch.name} does not apply: {proc.stderr.strip()}")
    return root


def run_disagg_in_scenario(name: str, preset: str, workload_spec: str, stages: int, repeats: int,
                           device: str = "cpu", copy: str = "gather") -> dict:
    root = _scenario_copy(name)
    try:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run([sys.executable, "-m", "target_stack.bench", "serve", "--preset", preset,
                               "--workload", workload_spec, "--stages", str(stages), "--only", "disagg",
                               "--repeats", str(repeats), "--disagg-device", device, "--transfer-copy", copy,
                               "--print-json"], cwd=root, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"scenario {name} run failed:\n{proc.stderr[-2000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])["disagg"]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(preset: str, workload_spec: str, stages: int, only: str | None, compare_gil: bool,
        json_path: pathlib.Path | None, print_json: bool, console, repeats: int = 3, disagg_device: str = "cpu",
        copy: str = "gather") -> int:
    from rich.table import Table

    workload = Workload.parse(workload_spec)
    torch.set_num_threads(1)
    result: dict = {"preset": preset, "workload": dataclasses.asdict(workload), "date": time.strftime("%Y-%m-%d"),
                    "torch": torch.__version__, "disaggregated_workers": disagg_device}
    if only in (None, "engine"):
        result["engine"] = run_colocated(preset, workload)
    if only in (None, "disagg"):
        result["disagg"] = run_disagg(preset, workload, stages, repeats, disagg_device, copy)
    if compare_gil:
        result["disagg_gil_held"] = run_disagg_in_scenario("gil-kv-transfer", preset, workload_spec, stages, repeats,
                                                           disagg_device, copy)
    if not print_json:
        table = Table(title=f"serve: preset={preset}, {workload_spec}")
        table.add_column("run")
        for col in ("TTFT p50/p99 ms", "TPOT p50/p99 ms", "tok/s", "KV-transfer overhead",
                    "exposed transfer p50/p99 ms", "overhead with decode"):
            table.add_column(col, justify="right")
        for key in ("engine", "disagg", "disagg_gil_held"):
            r = result.get(key)
            if not r:
                continue
            ovh = f"{100 * r['kv_transfer_overhead']:.1f}%" if "kv_transfer_overhead" in r else "-"
            exp = (f"{r['exposed_transfer_ms_p50']:.1f} / {r['exposed_transfer_ms_p99']:.1f}"
                   if "exposed_transfer_ms_p50" in r else "-")
            wd = f"{100 * r['overhead_with_decode']:.1f}%" if "overhead_with_decode" in r else "-"
            table.add_row(key, f"{r['ttft_ms_p50']:.0f} / {r['ttft_ms_p99']:.0f}",
                          f"{r['tpot_ms_p50']:.1f} / {r['tpot_ms_p99']:.1f}", f"{r['throughput_tok_s']:.0f}",
                          ovh, exp, wd)
        console.print(table)
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2))
        if not print_json:
            console.print(f"wrote {json_path}")
    if print_json:
        print(json.dumps(result))
    leaked = (any(result.get("engine", {}).get("leaks", {}).values())
              or any(any(worker.values()) for worker in result.get("disagg", {}).get("pools", {}).values()))
    return 1 if leaked or math.isnan(result.get("disagg", {}).get("kv_transfer_overhead", 0.0)) else 0
