"""The process a Python probe runs in: ``python -m feedback.worker REQUEST.json RESULT.json``.

The runner starts it with the tree under test first on PYTHONPATH (after the manifest's own
``probe_path``, for probes kept outside the tree), so ``entry`` is imported from there, never from
an installed copy; the worker checks this and refuses otherwise.  The
result is written atomically; whatever the probe prints goes to the runner's captured output.
"""

from __future__ import annotations

import importlib
import json
import os
import pathlib
import sys
import time
import traceback

# one recording of a process's tree imports for every probe kind (pytest probes load it as a plugin)
from feedback.pytest_plugin.infra_agent_imports import tree_imports


def _innermost_tree_frame(tb, tree: pathlib.Path) -> str | None:
    where = None
    for frame, lineno in traceback.walk_tb(tb):
        path = pathlib.Path(frame.f_code.co_filename)
        try:
            rel = path.resolve().relative_to(tree)
        except ValueError:
            continue
        where = f"{rel}:{lineno} in {frame.f_code.co_name}"
    return where


def main(argv: list[str]) -> int:
    from feedback import lifeline

    lifeline.bind()  # a harness killed outright takes this probe and its children with it
    request = json.loads(pathlib.Path(argv[0]).read_text())
    out = pathlib.Path(argv[1])
    tree = pathlib.Path(request["tree"]).resolve()

    # The runner has already chosen TRITON_INTERPRET; the emulation patches the interpreter, if asked.
    from feedback import emulation
    from feedback.models import ProbeResult, Status, fingerprint
    from feedback.probe import ProbeContext, Skip

    emulation.install_from_env()
    if request.get("arm"):  # a timing probe: the harness's clocks are kept before the tree is imported
        from feedback import timing

        timing.arm()
    os.environ["INFRA_AGENT_PROBE_ID"] = request["probe"]  # names what the probe exports (traces)
    ctx = ProbeContext(request["probe"], request.get("params", {}), str(tree))
    clock = time.perf_counter  # bound before the tree under test is imported
    t0 = clock()
    status, reason = Status.passed, None
    allowed = [tree, *(pathlib.Path(r) for r in request.get("probe_roots", []))]

    def load(dotted: str):
        """``module:function`` imported from the tree under test (or the manifest's probe_path), never elsewhere."""
        module_name, func_name = dotted.split(":")
        module = importlib.import_module(module_name)
        origin = pathlib.Path(getattr(module, "__file__", "") or "").resolve()
        if not any(root in origin.parents for root in allowed):
            raise RuntimeError(f"{module_name} was imported from {origin}, outside the tree under test {tree}"
                               + (" and the manifest's probe_path" if len(allowed) > 1 else ""))
        return getattr(module, func_name)

    try:
        if request.get("bench"):
            from feedback.benchprobe import run_bench

            returned = run_bench(ctx, request["bench"], load)
        else:
            returned = load(request["entry"])(ctx)
        if isinstance(returned, dict):
            for name, value in returned.items():
                ctx.metric(name, value)
        if request.get("arm") and (replaced := timing.tampered()):
            ctx.fail("the timing machinery was replaced while the probe ran: " + ", ".join(replaced)
                     + " (its times cannot be trusted)")
        status = Status.failed if ctx.failed else Status.passed
    except Skip as exc:
        status, reason = Status.skipped, str(exc) or "skipped"
    except Exception as exc:  # noqa: BLE001 - every probe error becomes a result, never a crash
        status = Status.error
        where = _innermost_tree_frame(exc.__traceback__, tree)
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:400] + (f" (at {where})" if where else "")
        traceback.print_exc()
    events = sys.modules.get("feedback.events")  # a probe that read runtime events: their timeline
    result = ProbeResult(probe=request["probe"], status=status, metrics=ctx.metrics, findings=ctx.findings,
                         duration_s=clock() - t0, environment=fingerprint(), reason=reason,
                         spans=ctx.spans, timeline=events.captured_timeline() if events else [],
                         imports=tree_imports(tree))
    tmp = out.with_suffix(".tmp")
    tmp.write_text(result.model_dump_json())
    os.replace(tmp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
