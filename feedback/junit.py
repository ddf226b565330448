"""What a ``pytest`` probe's JUnit XML says: counts, and each failure bound to where it happened.

A failing test names the test; what a person (or an agent) needs is the code under test.  The
traceback (``--tb=native``, or pytest's own ``path:line: in func`` lines, which it prints for a module
that fails to import) is walked innermost first, and the failure is bound to the innermost frame
inside the tree that is not a test file (``tests/``, ``test_*.py``, ``*_test.py``, ``conftest.py``);
failing that, to the innermost test frame; failing that, to the test itself.

Tests that fail the same way at the same place (one broken fixture, one bad import) are one finding
that counts them.  A test that cannot run on this machine (no GPU, a package the tree imports but
does not provide: ``feedback.needs``) is counted as ``unrunnable``, not as a failure of the code.
"""

from __future__ import annotations

import pathlib
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from dataclasses import dataclass, field

from feedback.models import Finding, Location
from feedback.needs import lacks

_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)'
                    r'|^(?P<spath>[^\s:"<]+\.py):(?P<sline>\d+): in (?P<sfunc>\S+)')
_EXCEPTION = re.compile(r"^(E\s+)?(?P<line>[\w.]+(Error|Exception|Exit|Interrupt)\b.*)")
# where a SyntaxError (IndentationError, TabError) was found: the parser's own line, no function, after the frames
_PARSED_AT = re.compile(r'^(E\s+)?\s*File "(?P<path>[^"]+)", line (?P<line>\d+)\s*$')


def is_test_file(rel: str) -> bool:
    p = pathlib.PurePosixPath(rel)
    return ("tests" in p.parts or "test" in p.parts or p.name.startswith("test_") or p.stem.endswith("_test")
            or p.name == "conftest.py")


def localise(traceback: str, tree: pathlib.Path) -> tuple[str, int, str] | None:
    """(file relative to ``tree``, line, function) of the frame a failure belongs to, or None."""
    root = tree.resolve()
    frames = []
    for line in traceback.splitlines():
        if (p := _PARSED_AT.match(line)) and (at := _in_tree(p["path"], root)):
            # a file of the tree that does not parse: the fault is there, not at the import that reached it
            return at, int(p["line"]), "<module>"
        m = _FRAME.match(line)
        if not m:
            continue
        raw, num, func = (m["path"], m["line"], m["func"]) if m["path"] else (m["spath"], m["sline"], m["sfunc"])
        # "<frozen importlib._bootstrap>", "<string>", the standard library, site-packages, the harness: not the tree's
        if rel := _in_tree(raw, root):
            frames.append((rel, int(num), func))
    for rel, line, func in reversed(frames):
        if not is_test_file(rel):
            return rel, line, func
    return frames[-1] if frames else None


def _in_tree(raw: str, root: pathlib.Path) -> str | None:
    """``raw`` (a traceback's path, absolute or relative to the tree) relative to ``root``, or None outside it."""
    if raw.startswith("<"):
        return None
    path = pathlib.Path(raw)
    try:
        return (path if path.is_absolute() else root / path).resolve().relative_to(root).as_posix()
    except ValueError:
        return None


def _short(name: str) -> str:
    """A test's name without its module path: ``test_x[case]``, ``TestX::test_x``, or the module for a file."""
    module, _, test = name.partition("::")
    return test or module.rsplit(".", 1)[-1]


def exception_line(text: str) -> str | None:
    """The innermost exception of a traceback's text ("ModuleNotFoundError: No module named 'x'"), or None."""
    for line in reversed(text.strip().splitlines()):
        if m := _EXCEPTION.match(line.strip()):
            return m["line"].strip()
    return None


@dataclass
class JUnitSummary:
    tests: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    unrunnable: int = 0
    findings: list[Finding] = field(default_factory=list)
    # what this machine lacks -> the tests that needed it (``feedback.needs``)
    needs: dict[str, list[str]] = field(default_factory=dict)
    skip_reasons: dict[str, int] = field(default_factory=dict)  # pytest's skip message -> tests
    failing: list[str] = field(default_factory=list)  # the ids of the tests that failed or errored
    uncollected: set[str] = field(default_factory=set)  # the test files among them that failed to import

    def counts(self) -> dict[str, float]:
        passed = self.tests - self.failed - self.errors - self.skipped - self.unrunnable
        out = {"tests": self.tests, "passed": passed, "failed": self.failed, "errors": self.errors,
               "skipped": self.skipped}
        if self.unrunnable:
            out["unrunnable"] = self.unrunnable
        return out

    def lacking(self) -> str:
        """One line: what the tests that could not run here needed ("12 tests need a CUDA GPU (...)")."""
        parts = []
        for need, names in self.needs.items():
            files = sum(n in self.uncollected for n in names)
            tests = len(names) - files
            subject = " and ".join(
                ([f"{tests} test{'s' if tests > 1 else ''}"] if tests else [])
                + ([f"the import of {files} test file{'s' if files > 1 else ''}"] if files else []))
            parts.append(f"{subject} need{'' if tests > 1 or (tests and files) else 's'} {need} "
                         f"(e.g. {_short(names[0])})")
        return "; ".join(parts)

    def not_run(self) -> str:
        """Why no test ran: what the machine lacks, and pytest's own skip reasons, most frequent first."""
        skips = sorted(self.skip_reasons.items(), key=lambda kv: -kv[1])
        parts = ([f"cannot run on this machine: {self.lacking()}"] if self.needs else []) + (
            [f"{self.skipped} skipped by the tests: " + "; ".join(f"{why} ({n})" for why, n in skips[:3])]
            if skips else [])
        return "; ".join(parts)


def read_junit(path: pathlib.Path, tree: pathlib.Path, limit: int = 20,
               roots: Iterable[pathlib.Path] = ()) -> JUnitSummary:
    """Counts and localised findings from a pytest JUnit XML file (``ValueError`` if it is not one).

    ``roots``: the tree's import roots besides ``tree`` itself (a module found under one is the tree's own:
    a failure to import it is a defect, not a package missing from the machine)."""
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as exc:
        raise ValueError(f"{path}: not JUnit XML ({exc})") from exc
    roots = [tree, *roots]
    out = JUnitSummary()
    groups: dict[tuple, list] = {}  # (kind, message, site) -> [names, location]
    for case in root.iter("testcase"):
        out.tests += 1
        bad = case.find("failure")
        kind = "failed"
        if bad is None:
            bad, kind = case.find("error"), "error"
        if (skip := case.find("skipped")) is not None and bad is None:
            out.skipped += 1
            why = skip.get("message") or "skipped"
            if why == "collection skipped" and (m := re.search(r"Skipped: (.+?)['\"]\)\s*$", skip.text or "")):
                why = m[1]  # a module that skipped itself: pytest's message is in the (file, line, reason) text
            why = (why.strip().splitlines() or ["skipped"])[0][:160]
            out.skip_reasons[why] = out.skip_reasons.get(why, 0) + 1
            continue
        if bad is None:
            continue
        name = f"{case.get('classname', '')}::{case.get('name', '')}".strip(":")
        text = bad.text or ""
        message = ((bad.get("message") or (text.strip().splitlines()[-1:] or ["?"])[0]).splitlines() or ["?"])[0]
        if message == "collection failure" and (innermost := exception_line(text)):
            message = f"{message}: {innermost}"  # which import failed, not only that one did
        message = message[:300]
        if need := lacks(f"{text}\n{message}", roots):
            out.unrunnable += 1
            out.needs.setdefault(need, []).append(name)
            if message.startswith("collection failure"):
                out.uncollected.add(name)
            continue
        if kind == "failed":
            out.failed += 1
        else:
            out.errors += 1
        out.failing.append(name)
        site = localise(text, tree)
        where = (Location(file=site[0], symbol=site[2], condition=f"line {site[1]}, in test {name}") if site
                 else Location(file=case.get("file"), condition=f"test {name}"))
        key = (kind, message, site or case.get("file"))
        groups.setdefault(key, [[], where])[0].append(name)
    for (kind, message, _), (names, where) in list(groups.items())[:limit]:
        more = (f" (and {len(names) - 1} more test{'s' if len(names) > 2 else ''} that {kind} the same way here: "
                + ", ".join(_short(n) for n in names[1:4]) + (", ..." if len(names) > 4 else "") + ")"
                if len(names) > 1 else "")
        out.findings.append(Finding(message=f"{names[0]} {kind}: {message}{more}", location=where, failed=True))
    return out
