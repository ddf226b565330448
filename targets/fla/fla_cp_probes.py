"""Probes of flash-linear-attention's context-parallel kernels, kept outside the fla tree they judge.

The manifest beside this file names them (``probe_path: [.]``); the runner puts this folder first on
the import path and imports ``fla`` from the tree under test.  Nothing of fla is copied here: the
probes call fla's own kernels, found by what they are, not by one release's file layout.

* ``merge_growth``: fla's cross-rank merge kernel (``h <- M_r h + he_r`` over the ranks before this
  one, fp32 ``tl.dot`` in a chain) on chains of increasing length P, each against a float64 chain
  on the same inputs.  At the default (tf32) precision the relative error is ~1e-3 and grows with P;
  at tf32x3 or ieee it stays near fp32's 1e-7.  On a CPU the kernel runs in Triton's interpreter
  under the harness's tf32 emulation; on a GPU natively.  The transitions are random contractions
  (orthogonal times 0.99), the kind of matrix a gated delta rule's chunk products are.
* ``merge_time`` (GPU only): the same kernel timed by the harness at a server's shapes (HV heads,
  K=V=128, a chain of ``ranks``), its output re-checked against float64 after timing: what a change
  of the dots' precision costs (tf32x3 is three MMAs per product).
"""

from __future__ import annotations

import os
import pkgutil

import torch
from fla_tree import from_tree

from feedback.correctness import rel_err
from feedback.probe import ProbeContext, probe


def merge_kernel(tree: str):
    """(module file, name, kernel) of fla's CP merge: a Triton kernel under ``fla.ops.cp`` taking ``h`` and
    ``ag_hm``, imported from the tree under test (never from an installed fla)."""
    cp = from_tree("fla.ops.cp", tree)
    for info in pkgutil.iter_modules(cp.__path__):
        mod = from_tree(f"fla.ops.cp.{info.name}", tree)
        for name, obj in vars(mod).items():
            args = getattr(obj, "arg_names", None)
            if "merge" in name and args and {"h", "ag_hm"} <= set(args):
                return mod.__file__, name, obj
    raise LookupError("no CP merge kernel (taking h and ag_hm) under fla.ops.cp")


def run_merge(kernel, h: torch.Tensor, ag: torch.Tensor, ranks: int) -> None:
    """The forward merge of ``ranks`` earlier ranks into ``h`` (h0 = 0), by argument name, across releases."""
    import triton

    _, HV, K, VK = ag.shape
    V = VK - K
    names = set(kernel.arg_names)
    values = {"h": h, "ag_hm": ag, "num_ranks": ranks, "pre_or_post_num_ranks": ranks, "rank": ranks,
              "seq_offsets": None, "init_offsets": None, "h0_seq_ids": None, "h0": None, "h_seq_idx": None,
              "HV": HV, "K": K, "V": V, "BK": triton.next_power_of_2(K), "FORWARD": True, "IS_INTRACARD": False,
              "INTRACARD_MODE": False, "N": 0, "NUM_SEQ_ENTRIES": 0, "STATE_V_FIRST": False,
              "NUM_RANKS_ON_DEVICE": False}
    heuristics = {"HAS_H0", "USE_INITIAL_STATE", "USE_H_SEQ_IDX", "BV"}  # set by the kernel's own decorators
    missing = names - set(values) - heuristics
    if missing:
        raise LookupError(f"the merge kernel takes arguments this probe does not know: {sorted(missing)}")
    kernel[lambda meta: (triton.cdiv(V, meta["BV"]), HV)](**{k: v for k, v in values.items() if k in names})


def _chain(ranks: int, HV: int, K: int, V: int, gen: torch.Generator, device: str) -> torch.Tensor:
    ag = torch.randn(ranks + 1, HV, K, V + K, generator=gen, dtype=torch.float64)
    for r in range(ranks + 1):
        for i in range(HV):
            q, _ = torch.linalg.qr(torch.randn(K, K, generator=gen, dtype=torch.float64))
            ag[r, i, :, V:] = 0.99 * q
    return ag.float().to(device)


def reference(ag: torch.Tensor, ranks: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The chain ``h <- M_r h + he_r`` over ``ranks`` ranks, on the CPU in ``dtype``."""
    a = ag.cpu().to(dtype)
    K = a.shape[2]
    V = a.shape[3] - K
    h = torch.zeros(a.shape[1], K, V, dtype=dtype)
    for r in range(ranks):
        h = a[r, :, :, V:] @ h + a[r, :, :, :V]
    return h


@probe(kind="correctness")
def merge_growth(ctx: ProbeContext) -> None:
    p = ctx.params
    HV, K, V = p.get("HV", 2), p.get("K", 32), p.get("V", 32)
    chains = p.get("ranks", [2, 8, 32])
    file, name, kernel = merge_kernel(ctx.tree)
    rel = os.path.relpath(file, ctx.tree)
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))  # fresh inputs every check
    errs, excess = [], []
    for ranks in chains:
        ag = _chain(ranks, HV, K, V, gen, ctx.device)
        h = torch.full((HV, K, V), float("nan"), device=ctx.device)  # poisoned: every element must be written
        run_merge(kernel, h, ag, ranks)
        exact = reference(ag, ranks)
        err = rel_err(h.cpu(), exact)
        floor = max(rel_err(reference(ag, ranks, torch.float32), exact), 1e-9)  # fp32 arithmetic's own error
        errs.append(ctx.metric(f"err_p{ranks}", err, better="lower"))
        excess.append(ctx.metric(f"excess_p{ranks}", err / floor, unit="x", better="lower"))
    # (no raw growth of the error: a plain fp32 chain's error grows with its length too, ~17x from 2 to 32
    # ranks here, so the excess over fp32 at each length is what tells a lower precision)
    worst = ctx.metric("excess_over_fp32", max(excess), unit="x", better="lower")
    at = chains[excess.index(worst)]
    ctx.check(worst <= p.get("max_excess", 100.0),
              f"the merged state's error is {worst:.0f}x fp32's own at {at} ranks (rel. error "
              f"{errs[excess.index(worst)]:.1e}): an fp32 chain at a lower dot precision (tf32?)",
              file=rel, kernel=name, condition=f"{chains[0]} to {chains[-1]} ranks, K={K}, V={V}")


@probe(kind="microbench")
def merge_time(ctx: ProbeContext) -> None:
    if ctx.device != "cuda":
        ctx.skip("timings need a GPU")
    p = ctx.params
    HV, K, V, ranks = p.get("HV", 32), p.get("K", 128), p.get("V", 128), p.get("ranks", 8)
    file, name, kernel = merge_kernel(ctx.tree)
    dev = ctx.device

    def make(i: int):
        # random contractions (spectral norm ~0.9), made on the device: fresh inputs for every timed call
        ag = torch.randn(ranks + 1, HV, K, V + K, device=dev)
        ag[..., V:] *= 0.45 / K ** 0.5
        return torch.full((HV, K, V), float("nan"), device=dev), ag

    def call(h, ag):
        run_merge(kernel, h, ag, ranks)
        return h

    def check(before, after, out) -> float:
        a = before[1].double()
        h = torch.zeros(HV, K, V, dtype=torch.float64, device=dev)
        for r in range(ranks):
            h = a[r, :, :, V:] @ h + a[r, :, :, :V]
        return rel_err(out, h)

    nbytes = (ranks * HV * K * (V + K) + HV * K * V) * 4
    # the precision itself is fla.cp.merge's to judge; here a result far off (not written, wrong rank) fails
    t = ctx.timed("merge", make=make, call=call, check=check, tol=p.get("tol", 5e-2), bytes_moved=nbytes,
                  file=os.path.relpath(file, ctx.tree), kernel=name, condition=f"{ranks} ranks, HV={HV}, K={K}, V={V}")
    ctx.metric("bandwidth_vs_copy", nbytes / t.median_s / t.copy_bytes_per_s, better="higher")
