"""flash-linear-attention's decode as released against the fuse-v-tiles playbook's transform of it, side by side.

    python targets/fla/prepare.py 0.6.0 /tmp/fla060
    python bench/fla_decode_launch.py /tmp/fla060 [--out DIR]      # a GPU; writes fla_decode_launch.json

The playbook's executable transform is run on a copy of the tree (what the offline agent would propose on
evidence that the decode step is issue-bound): fla launches its decode kernel over a flattened grid with a
fixed V tile of 32, the transform chooses the tile per launch (the widest up to 64 that leaves a dozen
programs per SM).  Both modules are loaded side by side and timed on one pooled decode step (H=32, K=V=128,
fp32 state pool, bf16 q/k/v, q/k norms in the kernel) at batch 1, 16, 64 and 256: kernel time from CUDA-graph
replays over input sets larger than L2, three rounds interleaved (median; noise = the rounds' spread), state
bandwidth against a device copy measured in the same run, each version's state against float64 first.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import statistics
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "targets" / "fla"))
H, K, V = 32, 128, 128


def widened_copy(tree: pathlib.Path) -> pathlib.Path:
    from feedback.models import FeedbackReport, Metric, ProbeResult, Status
    from playbooks.model import evaluate, load_library, run_transform

    wide = pathlib.Path(tempfile.mkdtemp(prefix="fla-widened-")) / "fla"
    shutil.copytree(tree, wide)
    issue_bound = FeedbackReport(target=str(wide), candidate="base", results=[ProbeResult(
        probe="fla.kda.decode.b64", status=Status.passed, metrics={"bandwidth_vs_copy": Metric(value=0.55)})])
    pb = load_library()["fuse-v-tiles"]
    app = evaluate(pb, issue_bound, wide, {"fla.kda.decode.b64": ["fla/ops/kda/*.py"]})
    changed = run_transform(pb, wide, app) if app.applies else []
    if "fla/ops/kda/fused_recurrent.py" not in changed:
        raise SystemExit(f"the fuse-v-tiles transform did not change fla's decode kernel ({app.reason})")
    return wide


def load(tree: pathlib.Path):
    """fla's ``fused_recurrent_kda_fwd`` from ``tree``, whatever fla was imported before."""
    from fla_tree import from_tree

    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        del sys.modules[name]
    sys.path.insert(0, str(tree))
    try:
        return from_tree("fla.ops.kda.fused_recurrent", str(tree)).fused_recurrent_kda_fwd
    finally:
        sys.path.remove(str(tree))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("tree", type=pathlib.Path, help="an fla checkout (targets/fla/prepare.py)")
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "out")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("fla_decode_launch times kernels: it needs a GPU")
    from fla_kda_probes import decode_errors

    from target_stack.bench.timing import copy_bandwidth, graph_time, rotations
    from target_stack.ops.kda.testing import make_inputs

    versions = {"as released": load(args.tree.resolve()), "widened": load(widened_copy(args.tree.resolve()))}
    copy = copy_bandwidth()
    print(f"{torch.cuda.get_device_name(0)}: copy {copy / 1e12:.2f} TB/s")
    rows = []
    for B in (1, 16, 64, 256):
        state = B * H * K * V * 4
        slots = torch.arange(1, B + 1, dtype=torch.int32, device="cuda")
        sets = []
        for _ in range(rotations(state)):
            q, k, v, g, beta = make_inputs(B, 1, H, K, V, dtype=torch.bfloat16, device="cuda", decay_shift=3.0)
            sets.append((q, k, v, g.float(), beta.float(), torch.randn(B + 1, H, K, V, device="cuda") * 0.1))

        def step(f, s):
            return f(*s[:5], initial_state=s[5], inplace_final_state=True, ssm_state_indices=slots,
                     use_qk_l2norm_in_kernel=True)

        errs, times = {}, {name: [] for name in versions}
        for name, f in versions.items():
            s = tuple(t.clone() for t in sets[0])
            before = s[5][1:].clone()
            out, _ = step(f, s)
            errs[name] = decode_errors((*s[:5], before), s[5][1:], out)[0]
        for _ in range(3):
            for name, f in versions.items():
                times[name].append(graph_time([lambda f=f, s=s: step(f, s) for s in sets]))
        nbytes = 2 * state + B * H * (3 * K * 2 + 2 * V * 2)
        base = statistics.median(times["as released"])
        for name, ts in times.items():
            t = statistics.median(ts)
            rows.append(dict(batch=B, version=name, us=t * 1e6, bandwidth_vs_copy=nbytes / t / copy,
                             speedup=base / t, noise=(max(ts) - min(ts)) / t, state_rel_err=errs[name]))
            print(f"batch {B:4} {name:12} {t * 1e6:8.1f} us {nbytes / t / copy:5.0%} of copy  x{base / t:.3f}  "
                  f"noise {(max(ts) - min(ts)) / t:.1%}  state err {errs[name]:.1e}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fla_decode_launch.json").write_text(json.dumps(dict(
        device=torch.cuda.get_device_name(0), copy_TBps=copy / 1e12, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
