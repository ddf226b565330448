"""A pytest plugin for ``.ci/gpu``: every failure's report is appended to ``$GPU_CI_FAILURES`` the moment
it happens, so a run cut short by a device lease still says why each test failed (pytest itself
prints the tracebacks only at the end of the session)."""

from __future__ import annotations

import os


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get("GPU_CI_FAILURES")
    if path and report.failed:
        with open(path, "a") as out:
            out.write(f"=== {report.nodeid} ({report.when}, {report.duration:.1f} s) ===\n{report.longreprtext}\n\n")
