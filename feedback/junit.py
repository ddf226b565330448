"""What a ``pytest`` probe's JUnit XML says: counts, and each failure bound to where it happened.

A failing test names the test; what a person (or an agent) needs is the code under test.  The
traceback (``--tb=native``) is walked innermost first, and the failure is bound to the innermost
frame inside the tree that is not a test file (``tests/``, ``test_*.py``, ``*_test.py``,
``conftest.py``); failing that, to the innermost test frame; failing that, to the test itself.
"""

from __future__ import annotations

import pathlib
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

from feedback.models import Finding, Location

_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')


def is_test_file(rel: str) -> bool:
    p = pathlib.PurePosixPath(rel)
    return ("tests" in p.parts or "test" in p.parts or p.name.startswith("test_") or p.stem.endswith("_test")
            or p.name == "conftest.py")


def localise(traceback: str, tree: pathlib.Path) -> tuple[str, int, str] | None:
    """(file relative to ``tree``, line, function) of the frame a failure belongs to, or None."""
    root = tree.resolve()
    frames = []
    for line in traceback.splitlines():
        m = _FRAME.match(line)
        if not m:
            continue
        path = pathlib.Path(m["path"])
        path = path if path.is_absolute() else root / path
        try:
            rel = path.resolve().relative_to(root).as_posix()
        except ValueError:
            continue  # the standard library, site-packages, the harness
        frames.append((rel, int(m["line"]), m["func"]))
    for rel, line, func in reversed(frames):
        if not is_test_file(rel):
            return rel, line, func
    return frames[-1] if frames else None


@dataclass
class JUnitSummary:
    tests: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    findings: list[Finding] = field(default_factory=list)

    def counts(self) -> dict[str, float]:
        passed = self.tests - self.failed - self.errors - self.skipped
        return {"tests": self.tests, "passed": passed, "failed": self.failed, "errors": self.errors,
                "skipped": self.skipped}


def read_junit(path: pathlib.Path, tree: pathlib.Path, limit: int = 20) -> JUnitSummary:
    """Counts and localised findings from a pytest JUnit XML file (``ValueError`` if it is not one)."""
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as exc:
        raise ValueError(f"{path}: not JUnit XML ({exc})") from exc
    out = JUnitSummary()
    for case in root.iter("testcase"):
        out.tests += 1
        bad = case.find("failure")
        kind = "failed"
        if bad is None:
            bad, kind = case.find("error"), "error"
        if case.find("skipped") is not None and bad is None:
            out.skipped += 1
            continue
        if bad is None:
            continue
        if kind == "failed":
            out.failed += 1
        else:
            out.errors += 1
        name = f"{case.get('classname', '')}::{case.get('name', '')}".strip(":")
        message = (bad.get("message") or (bad.text or "").strip().splitlines()[-1:] or ["?"])
        message = message if isinstance(message, str) else message[0]
        site = localise(bad.text or "", tree)
        if len(out.findings) < limit:
            where = (Location(file=site[0], symbol=site[2], condition=f"line {site[1]}, in test {name}") if site
                     else Location(file=case.get("file"), condition=f"test {name}"))
            out.findings.append(Finding(message=f"{name} {kind}: {message.splitlines()[0][:300]}", location=where,
                                        failed=True))
    return out
