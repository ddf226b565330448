"""What a probe function sees: its parameters, and a context to report metrics and findings.

A probe is a plain function in the target's tree, named by the manifest's ``entry``::

    from feedback.probe import probe

    @probe
    def cp_error_growth(ctx):
        errs = ...
        ctx.metric("error_growth", errs[-1] / errs[0], unit="x", better="lower")
        if growth > 5:
            ctx.fail("error grows 41x from P=2 to P=64", file="target_stack/ops/kda/cp.py",
                     kernel="_kda_cp_merge_kernel", param="merge_precision='tf32'")

It returns nothing (or a dict of plain metrics); raising :class:`Skip` (``ctx.skip(reason)``)
reports ``skipped`` with the reason, any other exception ``error`` with the failing line.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from feedback.models import Finding, Location, Metric


class Skip(Exception):
    """Raised by a probe that cannot run here (no GPU, say); the report says why."""


class ProbeContext:
    def __init__(self, probe_id: str, params: dict[str, Any], tree: str):
        self.probe_id = probe_id
        self.params = dict(params)
        self.tree = tree
        self.metrics: dict[str, Metric] = {}
        self.findings: list[Finding] = []
        self.failed = False
        self.spans: dict[str, float] = {}
        self._device: str | None = None

    @property
    def device(self) -> str:
        """Where the probe should make its inputs and run: ``"cuda"`` when a GPU is usable, else ``"cpu"``.

        Read lazily, so a static probe never imports torch.  Under Triton's interpreter
        (``TRITON_INTERPRET=1``, no GPU) kernels take CPU tensors.
        """
        if self._device is None:
            import os

            import torch

            interp = os.environ.get("TRITON_INTERPRET") == "1"
            self._device = "cuda" if torch.cuda.is_available() and not interp else "cpu"
        return self._device

    def metric(self, name: str, value: float, unit: str = "", *, better: str | None = None,
               ci: tuple[float, float] | None = None, counted: bool = False) -> float:
        """Report a metric.  ``counted``: an exact count (work counted under the interpreter), judged
        against the base in any probe kind: any change beyond ``verdict.COUNT_TOLERANCE`` is one."""
        value = float(value)
        if math.isnan(value):
            value = math.inf  # a NaN error is as bad as it gets, and must not compare as "fine"
        self.metrics[name] = Metric(value=value, unit=unit, better=better, ci=ci, counted=counted)
        return value

    def finding(self, message: str, **location: str | None) -> None:
        self.findings.append(Finding(message=message, location=Location(**location)))

    def fail(self, message: str, **location: str | None) -> None:
        self.failed = True
        self.findings.append(Finding(message=message, location=Location(**location), failed=True))

    def check(self, ok: bool, message: str, **location: str | None) -> bool:
        if not ok:
            self.fail(message, **location)
        return ok

    def skip(self, reason: str) -> None:
        raise Skip(reason)

    def timed(self, name: str, *, make: Callable[[int], Any], call: Callable[..., Any],
              check: Callable[[Any, Any, Any], float] | None = None, tol: float = 1e-3, reps: int = 20,
              bytes_moved: float = 0.0, flops: float = 0.0, peak_flops: float = 0.0,
              **location: str | None):
        """Time ``call(*make(i))`` with the harness's defences (``feedback/timing.py``) and report it.

        Metrics: ``NAME_us`` (median per call), ``NAME_wall_us`` (with a device-wide synchronize) and
        ``NAME_rel_err_after_timing`` (with ``check``); the returned :class:`~feedback.timing.Timing`
        has the rest (the copy bandwidth measured beside it, with ``bytes_moved``).  Anything the
        defences caught fails the probe at ``location``.
        """
        from feedback.timing import measure

        t = measure(make, call, check, device=self.device, tag=name, reps=reps, tol=tol, bytes_moved=bytes_moved,
                    flops=flops, peak_flops=peak_flops)
        self.spans[name] = t.loop_s
        self.metric(f"{name}_us", t.median_s * 1e6, unit="us", better="lower")
        self.metric(f"{name}_wall_us", t.wall_median_s * 1e6, unit="us", better="lower")
        if check is not None:
            self.metric(f"{name}_rel_err_after_timing", t.max_rel_err, better="lower")
        for problem in t.problems:
            self.fail(problem, **location)
        return t


def probe(fn: Callable | None = None, *, kind: str | None = None):
    """Mark a function as a probe entry point (``@probe`` or ``@probe(kind="correctness")``)."""

    def mark(f: Callable) -> Callable:
        f.__infra_agent_probe__ = {"kind": kind}
        return f

    return mark(fn) if fn is not None else mark
