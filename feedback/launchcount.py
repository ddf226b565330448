"""What a piece of host code launches, counted on any machine: aten ops, Triton kernels, host syncs.

A decode step at small batch is bound by how many kernels it launches and how often it waits for the
device, not by bytes.  Every aten op that is not a view or an allocation launches at least one kernel on a
GPU, every Triton launch one more, so their count is a device-free proxy for the step's launches; and a few
things read a tensor's value on the host (``item``, ``tolist``, ``nonzero``, boolean indexing ...), which on a
GPU waits for the device and breaks a CUDA graph's capture.  ``LaunchCount`` counts all three while active,
each attributed to the innermost function of the code under study that issued it (its *site*,
``path/to/file.py:Class.method``), so a change that adds a dtype conversion, unfuses a kernel or reads a value
on the host shows as that site's count, on a CPU, in the time the code takes to run once.

Usage::

    with LaunchCount(root=repo, within=["mystack/"], plumbing=["mystack/ops/launch.py"]) as lc:
        step(*inputs)
    lc.total, lc.kind_totals(), lc.host_syncs, lc.by_site()

Counts depend on the code, the shapes and the device's forms, not on values (an op whose count depends
on the data should be run with its data fixed).  What a Triton launch does inside (the interpreter's own
tensor work) is one launch.  ``.cpu()`` and ``.numpy()`` of a CPU tensor dispatch nothing; they are counted
as host syncs by wrapping the tensor methods themselves, so a CPU run sees what a GPU run would wait for.
``.to("cpu")`` is not counted (on a CPU machine it cannot be told from ``.to(other.device)``).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import sys
import threading
from collections import Counter
from collections.abc import Iterable

CONVERSIONS = frozenset({"_to_copy", "copy_", "to"})
MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_grouped_mm", "_scaled_mm"})
# ops that launch no kernel: allocations, and the reshape of a matmul's output
NO_LAUNCH = frozenset({"empty", "empty_strided", "new_empty", "empty_like", "new_empty_strided", "_unsafe_view",
                       "lift_fresh", "detach"})
# ops that read a tensor's value on the host, or size their output by it: a device sync on a GPU
HOST_SYNC_OPS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2",
                           "unique_dim", "unique_consecutive", "_assert_async", "equal"})
# tensor methods that read values on the host without dispatching anything for a CPU tensor
HOST_SYNC_METHODS = ("tolist", "cpu", "numpy")
KINDS = ("matmul", "conversion", "host_sync", "other", "triton")


class LaunchCountError(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class Site:
    """The innermost function of the code under study that issued an op: ``file`` relative to the root."""

    file: str
    function: str

    def __str__(self) -> str:
        return f"{self.file}:{self.function}"


UNKNOWN = Site("?", "?")


def kind_of(op: str, args: tuple = (), kwargs: dict | None = None) -> str:
    """``matmul``, ``conversion``, ``host_sync`` or ``other`` for the aten op (overload packet name) ``op``."""
    if op in HOST_SYNC_OPS or _data_dependent(op, args, kwargs or {}):
        return "host_sync"
    if op in MATMULS:
        return "matmul"
    if op in CONVERSIONS:
        return "conversion"
    return "other"


def _data_dependent(op: str, args: tuple, kwargs: dict) -> bool:
    """Ops whose output size is read from a tensor's values: boolean-mask indexing, repeat_interleave by
    a tensor of counts without ``output_size``."""
    import torch

    if op in ("index", "index_put", "index_put_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in indices or ())
    if op == "repeat_interleave":
        repeats = args[1] if len(args) > 1 else args[0] if args else kwargs.get("repeats")
        return isinstance(repeats, torch.Tensor) and repeats.numel() > 1 and kwargs.get("output_size") is None
    return False


class LaunchCount:
    """Counts the aten ops that launch, the Triton kernels launched and the host syncs, per site, while active.

    ``root``: the directory site files are named relative to; ``within``: the parts of it (directories or
    files, relative to ``root``) whose functions are sites (default: all of it); ``plumbing``: files in them
    that are never a site (a launch helper: its caller is); ``launchers``: extra ``(owner, attribute)`` entry
    points that launch a Triton kernel without Triton's own ``run`` (a cached compiled launcher)."""

    def __init__(self, root: str | os.PathLike, within: Iterable[str] = ("",), plumbing: Iterable[str] = (),
                 launchers: Iterable[tuple[object, str]] = ()):
        self.root = pathlib.Path(root).resolve()
        # a directory matches the files below it only (``mystack/`` is not ``mystack_extra/``)
        self._within = tuple(str(self.root / w) + (os.sep if (self.root / w).is_dir() else "") for w in within)
        self._plumbing = frozenset([str(self.root / p) for p in plumbing] + [str(pathlib.Path(__file__).resolve())])
        self._launchers = list(launchers)
        self.ops: Counter[tuple[str, str, Site]] = Counter()  # (aten op, kind, site)
        self.triton: Counter[tuple[str, Site]] = Counter()  # (kernel, site)
        # (site, entry): launches of a site reached through a call from another file of the code under study
        # (its *entry*: a helper's launches, seen from the function that called it), and the entry's lines
        self.entries: Counter[tuple[Site, Site]] = Counter()
        self.entry_lines: dict[tuple[Site, Site], set[int]] = {}
        self._paused = 0
        self._saved: list[tuple[object, str, object]] = []
        self._mode = None
        self._outer = None
        self._files: dict[str, str | None] = {}

    # --- results ------------------------------------------------------------------------------

    @property
    def total(self) -> int:
        """Every launch counted: aten ops that launch (host syncs among them) and Triton kernels."""
        return sum(self.ops.values()) + sum(self.triton.values())

    @property
    def host_syncs(self) -> int:
        return sum(n for (_, kind, _), n in self.ops.items() if kind == "host_sync")

    def kind_totals(self) -> dict[str, int]:
        out = dict.fromkeys(KINDS, 0)
        for (_, kind, _), n in self.ops.items():
            out[kind] += n
        out["triton"] = sum(self.triton.values())
        return out

    def by_name(self) -> Counter[str]:
        out: Counter[str] = Counter()
        for (name, _, _), n in self.ops.items():
            out[name] += n
        return out

    def by_site(self) -> dict[Site, dict[str, int]]:
        """Per site, its counts by kind, the sites with most launches first."""
        sites: dict[Site, Counter[str]] = {}
        for (_, kind, site), n in self.ops.items():
            sites.setdefault(site, Counter())[kind] += n
        for (_, site), n in self.triton.items():
            sites.setdefault(site, Counter())["triton"] += n
        return {s: dict(c) for s, c in sorted(sites.items(), key=lambda kv: (-sum(kv[1].values()), str(kv[0])))}

    def by_entry(self) -> dict[Site, dict[Site, int]]:
        """Per site, the launches it issued per entry: the innermost caller in another file of the code under
        study (a site called only from its own file, or from outside, has none)."""
        out: dict[Site, dict[Site, int]] = {}
        for (site, entry), n in sorted(self.entries.items(), key=lambda kv: (-kv[1], str(kv[0][1]))):
            out.setdefault(site, {})[entry] = n
        return out

    def syncs(self) -> list[tuple[str, Site, int]]:
        """(op or method, site, count) of every host sync."""
        return [(name, site, n) for (name, kind, site), n in self.ops.items() if kind == "host_sync"]

    # --- attribution ----------------------------------------------------------------------------

    def site(self) -> Site:
        """The innermost frame on the stack whose file is within the code under study (never this module's);
        its entry (the innermost caller in another file of the code under study, below the frame that entered
        the count) is counted with it."""
        f, site = sys._getframe(1), UNKNOWN
        while f is not None and f is not self._outer:
            rel = self._file(f.f_code.co_filename)
            if rel is not None and site is UNKNOWN:
                site = Site(rel, getattr(f.f_code, "co_qualname", f.f_code.co_name))
            elif rel is not None and rel != site.file:
                entry = Site(rel, getattr(f.f_code, "co_qualname", f.f_code.co_name))
                self.entries[site, entry] += 1
                self.entry_lines.setdefault((site, entry), set()).add(f.f_lineno)
                break
            f = f.f_back
        return site

    def _file(self, name: str) -> str | None:
        """``name`` relative to the root if it is a site's file, else None (cached per file name)."""
        try:
            return self._files[name]
        except KeyError:
            path = os.path.realpath(name)
            ok = path.startswith(self._within) and path not in self._plumbing
            rel = os.path.relpath(path, self.root).replace(os.sep, "/") if ok else None
            self._files[name] = rel
            return rel

    # --- hooks --------------------------------------------------------------------------------

    def __enter__(self) -> LaunchCount:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        lc = self
        self._outer = sys._getframe(1)  # the code that counts: no entry at or above it
        # the dispatch mode is the entering thread's; the launch and tensor-method wrappers are global, so they
        # count that thread only (a server's other threads are not the code under count)
        thread = threading.get_ident()

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                if not lc._paused and not func.is_view and name not in NO_LAUNCH:
                    lc.ops[name, kind_of(name, args, kwargs), lc.site()] += 1
                return func(*args, **(kwargs or {}))

        def patch(owner, attr, make):
            original = getattr(owner, attr)
            had = attr in vars(owner)
            self._saved.append((owner, attr, original if had else None))
            setattr(owner, attr, make(original))

        def launcher(original):
            def run(obj, *a, **kw):
                mine = threading.get_ident() == thread
                if mine and not lc._paused:
                    kernel = getattr(getattr(obj, "fn", obj), "__name__", type(obj).__name__)
                    lc.triton[kernel, lc.site()] += 1
                if not mine:
                    return original(obj, *a, **kw)
                lc._paused += 1  # what a launch does inside (binding, the interpreter's tensors) is the launch
                try:
                    return original(obj, *a, **kw)
                finally:
                    lc._paused -= 1
            return run

        def host_read(method, original):
            def read(t, *a, **kw):
                if threading.get_ident() != thread:
                    return original(t, *a, **kw)
                if not lc._paused:
                    lc.ops[method, "host_sync", lc.site()] += 1
                lc._paused += 1  # its own dispatches (a copy to the host) are the sync
                try:
                    return original(t, *a, **kw)
                finally:
                    lc._paused -= 1
            return read

        try:
            points = list(self._launchers)
            try:
                import triton.runtime.jit as jit

                points.append((jit.JITFunction, "run"))
                import triton.runtime.interpreter as interp

                if hasattr(interp, "InterpretedFunction"):
                    points.append((interp.InterpretedFunction, "run"))
            except ImportError:  # no Triton: aten ops only
                pass
            for owner, attr in points:
                if not hasattr(owner, attr):
                    raise LaunchCountError(f"{owner!r} has no {attr!r} to count launches through")
                patch(owner, attr, launcher)
            for method in HOST_SYNC_METHODS:
                patch(torch.Tensor, method, lambda original, method=method: host_read(method, original))
            self._mode = _Mode()
            self._mode.__enter__()
        except Exception:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None
        while self._saved:
            owner, attr, original = self._saved.pop()
            if original is None:
                delattr(owner, attr)  # it was inherited: uncover the inherited one
            else:
                setattr(owner, attr, original)


def report(ctx, lc: LaunchCount, per: float = 1.0, unit: str = "step", prefix: str = "", top: int | None = None
           ) -> None:
    """Counted metrics of ``lc`` (all lower-is-better, ``Metric.counted``: judged against the base exactly):
    ``launches``, ``aten_ops``, ``matmuls``, ``conversions``, ``triton_launches``, ``host_syncs`` over
    everything; ``<site>.launches`` per site as a part, shown with its move and not judged (launches moved from
    one function to another are no regression), and one finding per site with its counts, bound to the site's
    file and function: where a total regressed, the functions whose own launches grew localise it.  A site
    reached from another file of the code under study has a part per entry too, ``<entry>><function>.launches``
    with a finding bound to the entry's file: a caller that newly reaches a helper that launches localises there.
    ``top``: only the sites with most launches get a metric and a finding (the totals cover the rest)."""
    per = float(per)
    if per <= 0:
        raise ValueError(f"per must be positive, got {per}")
    kinds = lc.kind_totals()
    totals = {"launches": lc.total, "aten_ops": lc.total - kinds["triton"], "matmuls": kinds["matmul"],
              "conversions": kinds["conversion"], "triton_launches": kinds["triton"], "host_syncs": kinds["host_sync"]}
    for name, n in totals.items():
        ctx.metric(f"{prefix}{name}", n / per, unit=f"/{unit}", better="lower", counted=True)
    sites, entries = list(lc.by_site().items()), lc.by_entry()
    for site, counts in sites[:top] if top else sites:
        n = sum(counts.values())
        ctx.metric(f"{prefix}{site}.launches", n / per, unit=f"/{unit}", counted=True)  # a part: shown, not judged
        text = ", ".join(f"{counts[k] / per:.4g} {k}" for k in KINDS if counts.get(k))
        where = {"file": site.file, "symbol": site.function} if site != UNKNOWN else {}
        where["part"] = f"{prefix}{site}"
        callers = entries.get(site, {})
        lines = {e: ", ".join(map(str, sorted(lc.entry_lines[site, e]))) for e in callers}
        via = "; entered from " + ", ".join(f"{e} (line {lines[e]}: {m / per:.4g})" for e, m in callers.items()) \
            if callers else ""
        ctx.finding(f"{site}: {n / per:.4g} launches per {unit} ({text}){via}", **where)
        # each entry as a part of its own, bound to the caller's file: a function that newly calls a helper
        # which launches (a cache it now bypasses, a conversion it now asks for) shows at the caller
        for entry, m in callers.items():
            ctx.metric(f"{prefix}{entry}>{site.function}.launches", m / per, unit=f"/{unit}", counted=True)
            ctx.finding(f"{entry} calls {site} (line {lines[entry]}): "
                        f"{m / per:.4g} launches per {unit} there", file=entry.file, symbol=entry.function,
                        part=f"{prefix}{entry}>{site.function}")
