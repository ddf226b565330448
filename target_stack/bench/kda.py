"""KDA benchmark: decode steps and chunked prefill, beside flash-linear-attention when importable.

For every case: kernel-only time (CUDA-graph replays over enough distinct input sets that L2
cannot serve them), eager call time (host overhead included), effective bandwidth of the
compulsory bytes against a device copy measured in the same run, and fla's numbers side by side.
"""

from __future__ import annotations

import datetime as _dt
import json
import pathlib
import platform
from collections.abc import Callable

import torch

import target_stack.ops  # noqa: F401  (interpreter choice before triton loads)
from target_stack.ops.kda import chunk_kda, fused_recurrent_kda, naive_chunk_kda, naive_recurrent_kda
from target_stack.ops.kda.chunk import CHUNK_SIZE, chunk_kda_fwd, prepare_chunks
from target_stack.ops.kda.testing import make_inputs, rel_err
from target_stack.ops.utils import resolve_dot_precision

DECODE_BATCHES = (1, 16, 64, 256)
BF16_STATE = "target_stack, bf16 state"
FUSED_OUTPUT = "target_stack, fused output"
DECODE_SHAPE = dict(H=32, K=128, V=128)
PREFILL_TOKENS = (4096, 32768)
PREFILL_SHAPE = dict(H=16, K=128, V=128)


def _fla():
    try:
        from fla.ops.kda.chunk import chunk_kda as fla_chunk
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as fla_decode
    except Exception:  # noqa: BLE001 - fla is optional; any import failure means "not available"
        return None
    return fla_chunk, fla_decode


def _decode_sets(batch: int, n_sets: int, H: int, K: int, V: int) -> list[dict]:
    sets = []
    for _ in range(n_sets):
        q, k, v, g, beta = make_inputs(batch, 1, H, K, V, dtype=torch.bfloat16, device="cuda", decay_shift=3.0)
        pool = torch.randn(batch + 1, H, K, V, device="cuda") * 0.1
        slots = torch.arange(1, batch + 1, dtype=torch.int32, device="cuda")
        sets.append(dict(q=q, k=k, v=v, g=g.float(), beta=beta.float(), pool=pool, slots=slots))
    return sets


def _measure(name: str, make_call: Callable[[dict], Callable[[], object]], sets: list[dict], nbytes: int,
             copy_bw: float) -> dict:
    from target_stack.bench.timing import eager_time, graph_time

    print(f"  measuring {name} ({len(sets)} input sets)", flush=True)
    row: dict = {"impl": name}
    try:  # eager first, before this row's graphs and rotations crowd the process
        row["eager_us"] = eager_time(make_call(sets[0])) * 1e6
    except Exception as exc:  # noqa: BLE001
        row["eager_error"] = f"{type(exc).__name__}: {exc}"[:300]
    try:
        row["kernel_us"] = graph_time([make_call(s) for s in sets]) * 1e6
        row["bandwidth_TBps"] = nbytes / (row["kernel_us"] * 1e-6) / 1e12
        row["bandwidth_vs_copy"] = row["bandwidth_TBps"] * 1e12 / copy_bw
    except Exception as exc:  # noqa: BLE001 - report, keep benchmarking the rest
        row["kernel_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return row


def bench_decode(copy_bw: float, fla) -> list[dict]:
    from target_stack.bench.timing import rotations

    H, K, V = DECODE_SHAPE["H"], DECODE_SHAPE["K"], DECODE_SHAPE["V"]
    rows = []
    for batch in DECODE_BATCHES:
        state_bytes = batch * H * K * V * 4
        io_bytes = batch * H * (3 * K * 2 + K * 2 + 2 * V * 2)  # q,k bf16, g fp32, v and o bf16
        nbytes = 2 * state_bytes + io_bytes
        sets = _decode_sets(batch, rotations(state_bytes, cap=128), H, K, V)

        def ours(s):
            return lambda: fused_recurrent_kda(s["q"], s["k"], s["v"], s["g"], s["beta"], initial_state=s["pool"],
                                               ssm_state_indices=s["slots"], use_qk_l2norm_in_kernel=True)

        def ours_bf16(s):  # the reduced-byte state: the same step on a bf16 pool (numerics: never the default)
            if "pool_bf16" not in s:
                s["pool_bf16"] = s["pool"].to(torch.bfloat16)
            return lambda: fused_recurrent_kda(s["q"], s["k"], s["v"], s["g"], s["beta"], initial_state=s["pool_bf16"],
                                               ssm_state_indices=s["slots"], use_qk_l2norm_in_kernel=True)

        impls = [("target_stack", ours), (BF16_STATE, ours_bf16)]
        if fla is not None:
            def theirs(s, fla_decode=fla[1]):
                return lambda: fla_decode(s["q"], s["k"], s["v"], s["g"], s["beta"], initial_state=s["pool"],
                                          inplace_final_state=True, ssm_state_indices=s["slots"],
                                          use_qk_l2norm_in_kernel=True)
            impls.append(("fla", theirs))
        s0 = sets[0]
        qn, kn = (torch.nn.functional.normalize(t.double(), dim=-1) for t in (s0["q"], s0["k"]))
        for name, make in impls:
            # reference from the pool as it is now: timed decode steps update the pools in place
            ro, rs = naive_recurrent_kda(qn, kn, s0["v"].double(), s0["g"].double(), s0["beta"].double(),
                                         initial_state=s0["pool"][1:].double(), output_final_state=True)
            check = {key: val for key, val in s0.items() if key != "pool_bf16"}
            check["pool"] = s0["pool"].clone()
            check["pool"][0] = float("nan")  # the null slot: must stay untouched
            o = make(check)()
            o = o[0] if isinstance(o, tuple) else o
            written = check["pool_bf16"] if name == BF16_STATE else check["pool"]
            row = _measure(name, make, sets, nbytes if name != BF16_STATE else state_bytes + io_bytes, copy_bw)
            row.update(case="decode", batch=batch, rotations=len(sets),
                       rel_err_o=rel_err(o, ro), rel_err_state=rel_err(written[1:], rs))
            rows.append(row)
        for s in sets:
            s.pop("pool_bf16", None)
        _vs_fla(rows[-len(impls):])
    return rows


def _vs_fla(rows: list[dict]) -> None:
    """fla's kernel time over each row's, for one case and size measured in the same run."""
    fla_us = next((r.get("kernel_us") for r in rows if r["impl"] == "fla"), None)
    for r in rows:
        if fla_us and r.get("kernel_us"):
            r["speedup_vs_fla"] = fla_us / r["kernel_us"]


def bench_state_drift(steps: int = 4096, batch: int = 4, checkpoints=(16, 256, 1024, 4096)) -> list[dict]:
    """The reduced-byte state's cost in accuracy: a long decode on fp32 and bf16 pools against float64.

    Every step's inputs are fresh (the decay as a server sees it, ``decay_shift=3``); the errors of the
    step's output and of the state are read at each checkpoint."""
    H, K, V = DECODE_SHAPE["H"], DECODE_SHAPE["K"], DECODE_SHAPE["V"]
    slots = torch.arange(1, batch + 1, dtype=torch.int32, device="cuda")
    h0 = torch.randn(batch, H, K, V, device="cuda") * 0.1
    pools = {dt: torch.cat([torch.zeros_like(h0[:1]), h0]).to(dt) for dt in (torch.float32, torch.bfloat16)}
    exact = h0.double()
    rows = []
    for t in range(1, steps + 1):
        q, k, v, g, beta = make_inputs(batch, 1, H, K, V, dtype=torch.bfloat16, device="cuda", decay_shift=3.0)
        g, beta = g.float(), beta.float()
        qn, kn = (torch.nn.functional.normalize(x.double(), dim=-1) for x in (q, k))
        ro, exact = naive_recurrent_kda(qn, kn, v.double(), g.double(), beta.double(), initial_state=exact,
                                        output_final_state=True)
        outs = {dt: fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, ssm_state_indices=slots,
                                        use_qk_l2norm_in_kernel=True)[0] for dt, pool in pools.items()}
        if t in checkpoints:
            for dt, pool in pools.items():
                rows.append(dict(case="state drift", state=str(dt).replace("torch.", ""), step=t, batch=batch,
                                 rel_err_o=rel_err(outs[dt], ro), rel_err_state=rel_err(pool[1:], exact)))
    return rows


def bench_prefill(copy_bw: float, fla) -> list[dict]:
    from target_stack.bench.timing import eager_time, rotations

    H, K, V = PREFILL_SHAPE["H"], PREFILL_SHAPE["K"], PREFILL_SHAPE["V"]
    rows = []
    precision = resolve_dot_precision(None, torch.device("cuda"))
    for T in PREFILL_TOKENS:
        nbytes = T * H * (2 * K * 2 + K * 4 + 2 * V * 2 + 4)  # q,k bf16, g fp32, v,o bf16, beta fp32
        sets = []
        for _ in range(rotations(nbytes, cap=16)):
            q, k, v, g, beta = make_inputs(1, T, H, K, V, dtype=torch.bfloat16, device="cuda", decay_shift=3.0)
            sets.append(dict(q=q, k=k, v=v, g=g.float(), beta=beta.float()))
        cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
        chunks = prepare_chunks(cu, CHUNK_SIZE)

        def ours_kernel(s, fuse=False):
            return lambda: chunk_kda_fwd(s["q"], s["k"], s["v"], s["g"], s["beta"], K**-0.5, None, True, cu, chunks,
                                         precision, fuse_output=fuse)

        def ours_eager(s):
            return lambda: chunk_kda(s["q"], s["k"], s["v"], s["g"], s["beta"], output_final_state=True)

        s0 = sets[0]
        ro, rs = naive_chunk_kda(*(s0[n].double() for n in ("q", "k", "v", "g", "beta")), output_final_state=True)

        def checked(row, call):
            o, st = call()
            row.update(case="prefill", tokens=T, rotations=len(sets), rel_err_o=rel_err(o, ro),
                       rel_err_state=rel_err(st, rs))
            rows.append(row)

        row = _measure("target_stack", ours_kernel, sets, nbytes, copy_bw)
        row["eager_us"] = eager_time(ours_eager(s0)) * 1e6  # chunk_kda syncs on the host: no graph capture
        checked(row, ours_eager(s0))
        # the output inside the recurrence (chunk.FUSE_OUTPUT, not the default): one launch fewer, no per-chunk
        # states in memory, a longer sequential kernel; timed beside the default form in the same run
        checked(_measure(FUSED_OUTPUT, lambda s: ours_kernel(s, fuse=True), sets, nbytes, copy_bw),
                ours_kernel(s0, fuse=True))
        if fla is not None:
            def theirs(s, fla_chunk=fla[0]):
                return lambda: fla_chunk(s["q"], s["k"], s["v"], s["g"], s["beta"], output_final_state=True)
            checked(_measure("fla", theirs, sets, nbytes, copy_bw), theirs(s0))
        _vs_fla([r for r in rows if r["tokens"] == T])
    return rows


def smoke() -> dict:
    """CPU: a tiny correctness check of every kernel (timings need a GPU)."""
    x = make_inputs(1, 70, 2, 32, 16, decay_shift=3.0)
    ro, rs = naive_recurrent_kda(*(t.double() for t in x), output_final_state=True)
    o1, s1 = chunk_kda(*x, output_final_state=True)
    o2, s2 = fused_recurrent_kda(*x, output_final_state=True)
    cu = torch.tensor([0, 70], dtype=torch.int32)
    o3, s3 = chunk_kda_fwd(*x, 32**-0.5, None, True, cu, prepare_chunks(cu, CHUNK_SIZE),
                           resolve_dot_precision(None, x[0].device), fuse_output=True)
    return {"chunk_kda": max(rel_err(o1, ro), rel_err(s1, rs)),
            "chunk_kda, fused output": max(rel_err(o3, ro), rel_err(s3, rs)),
            "fused_recurrent_kda": max(rel_err(o2, ro), rel_err(s2, rs))}


def environment() -> dict:
    import triton

    env = {"date": _dt.date.today().isoformat(), "python": platform.python_version(),
           "torch": torch.__version__, "triton": triton.__version__}
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name(0)
    fla = _fla()
    if fla is not None:
        import fla as fla_pkg

        env["fla"] = getattr(fla_pkg, "__version__", "?")
    return env


def _fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def run(json_path: pathlib.Path, console, only: str | None = None) -> int:
    from rich.table import Table

    env = environment()
    result: dict = {"benchmark": "kda", "environment": env}
    if not torch.cuda.is_available():
        console.print("[yellow]KDA timings need a GPU[/]: on this machine the kernels run in Triton's interpreter, "
                      "so only a correctness smoke runs.")
        errs = smoke()
        result["smoke_rel_err"] = errs
        table = Table("kernel", "rel. error vs float64")
        for name, e in errs.items():
            table.add_row(name, f"{e:.1e}")
        console.print(table)
        ok = all(e < 1e-5 for e in errs.values())
    else:
        from target_stack.bench.timing import copy_bandwidth

        fla = _fla()
        copy_bw = copy_bandwidth()
        result["copy_bandwidth_TBps"] = copy_bw / 1e12
        result["rows"] = ((bench_decode(copy_bw, fla) if only in (None, "decode") else [])
                          + (bench_prefill(copy_bw, fla) if only in (None, "prefill") else []))
        result["drift"] = bench_state_drift() if only in (None, "decode", "state") else []
        console.print(f"{env.get('device')}  torch {env['torch']}  triton {env['triton']}  fla {env.get('fla', '-')}"
                      f"  device copy {copy_bw / 1e12:.2f} TB/s")
        table = Table("case", "size", "impl", "kernel us", "eager us", "TB/s", "of copy", "fla time / this",
                      "err o", "err state", "rotations")
        for r in result["rows"]:
            size = f"batch {r['batch']}" if r["case"] == "decode" else f"{r['tokens']} tokens"
            table.add_row(r["case"], size, r["impl"], _fmt(r.get("kernel_us")), _fmt(r.get("eager_us")),
                          _fmt(r.get("bandwidth_TBps"), ".2f"), _fmt(r.get("bandwidth_vs_copy"), ".0%"),
                          _fmt(r.get("speedup_vs_fla"), ".2f"), _fmt(r.get("rel_err_o"), ".1e"),
                          _fmt(r.get("rel_err_state"), ".1e"), str(r["rotations"]))
        console.print(table)
        if result["drift"]:
            drift = Table("state", "decode step", "err o vs float64", "err state vs float64",
                          title=f"a long decode, batch {result['drift'][0]['batch']}, fresh inputs every step")
            for r in result["drift"]:
                drift.add_row(r["state"], str(r["step"]), f"{r['rel_err_o']:.1e}", f"{r['rel_err_state']:.1e}")
            console.print(drift)
        for r in result["rows"]:
            for key in ("kernel_error", "eager_error"):
                if key in r:
                    console.print(f"[red]{r['impl']} {r['case']} {key}:[/] {r[key]}")
        ok = True
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=2))
    console.print(f"wrote {json_path}")
    return 0 if ok else 1
