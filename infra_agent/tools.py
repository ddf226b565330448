"""The agent's tools: their schemas, the validation of an action against them, and the environment
that executes the ones that only look (files, probes on the baseline, playbooks).

``propose_patch`` and ``finish`` change the session, so the loop runs them itself
(:meth:`infra_agent.agent.Agent.execute`); every other tool runs here, on the baseline tree.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
from typing import TYPE_CHECKING, Any

import yaml

from feedback.harness import judge
from feedback.models import FeedbackReport, Status
from feedback.state import SKIP_PARTS
from infra_agent.exceptions import FormatError
from infra_agent.trajectory import redact
from playbooks.model import load_library

if TYPE_CHECKING:
    from infra_agent import Workspace

TOOLS: list[dict] = [
    {"name": "read_file", "description": "Read lines of a file of the target (1-based, inclusive).",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "start": {"type": "integer"},
                                                     "end": {"type": "integer"}}, "required": ["path"]}},
    {"name": "grep", "description": "Search the target's files for a regex; glob limits the files.",
     "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}, "glob": {"type": "string"}},
                    "required": ["pattern"]}},
    {"name": "list_files", "description": "List the files under a directory of the target.",
     "parameters": {"type": "object", "properties": {"dir": {"type": "string"}}}},
    {"name": "run_probes", "description": "Run probes of the manifest on the current baseline; returns the report.",
     "parameters": {"type": "object", "properties": {"ids": {"type": "array", "items": {"type": "string"}}},
                    "required": ["ids"]}},
    {"name": "propose_patch",
     "description": "Propose a change as a unified diff (paths relative to the target root). It is applied in a "
                    "fresh worktree and judged by the probes covering the changed files, against the baseline.",
     "parameters": {"type": "object", "properties": {
         "hypothesis": {"type": "string", "description": "what is wrong and why this change fixes or speeds it"},
         "diff": {"type": "string"}, "playbook_id": {"type": "string"}}, "required": ["hypothesis", "diff"]}},
    {"name": "list_playbooks", "description": "List the optimisation playbooks.",
     "parameters": {"type": "object", "properties": {}}},
    {"name": "show_playbook", "description": "Show one playbook: applicability, transformation, validation.",
     "parameters": {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]}},
    {"name": "finish", "description": "End the session with a summary of what was found and done.",
     "parameters": {"type": "object", "properties": {"summary": {"type": "string"}}, "required": ["summary"]}},
]
TOOL_NAMES = {t["name"] for t in TOOLS}
_TYPES = {"string": str, "integer": int, "array": list, None: object}


def openai_tools() -> list[dict]:
    return [{"type": "function", "function": t} for t in TOOLS]


@dataclasses.dataclass
class Action:
    name: str
    args: dict[str, Any]
    message: dict | None = None  # the assistant message that carried it (OpenAI format)
    call_id: str | None = None

    def redacted(self) -> Action:
        """The action with every string argument redacted (trajectory.redact): a key the model repeats
        must not reach a hypothesis, a summary, a commit message or a record."""

        def clean(v):
            if isinstance(v, str):
                return redact(v)
            if isinstance(v, list):
                return [clean(x) for x in v]
            if isinstance(v, dict):
                return {k: clean(x) for k, x in v.items()}
            return v

        return dataclasses.replace(self, args=clean(self.args))

    def validate(self) -> None:
        """Raise :class:`FormatError` unless this is a known tool with its required, well-typed arguments."""
        if self.name not in TOOL_NAMES:
            raise FormatError(f"unknown tool {self.name!r}; the tools are: {', '.join(sorted(TOOL_NAMES))}")
        spec = next(t for t in TOOLS if t["name"] == self.name)["parameters"]
        missing = [k for k in spec.get("required", []) if k not in self.args]
        if missing:
            raise FormatError(f"{self.name} needs {', '.join(missing)}")
        for k, v in self.args.items():
            want = spec["properties"].get(k, {}).get("type")
            if not isinstance(v, _TYPES.get(want, object)) or (want == "integer" and isinstance(v, bool)):
                raise FormatError(f"{self.name}: argument {k} must be a {want}")


def render_report(report: FeedbackReport, limit: int = 40) -> str:
    """The observation of a report, dense: one line per probe with its key metrics, then every
    localisation line and the acceptance criteria."""
    lines = []
    for r in report.results:
        ms = ", ".join(f"{k}={m.value:.3g}{m.unit and ' ' + m.unit}" for k, m in list(r.metrics.items())[:4])
        extra = f" ({r.reason})" if r.reason and r.status != Status.passed else ""
        lines.append(f"- {r.probe}: {r.status.value}{extra}" + (f"; {ms}" if ms else ""))
    lines += [f"x {ln}" for ln in report.localisations()]
    lines += [f"acceptance {a.name}: {a.expression} -> {'ok' if a.holds else 'FAILED' if a.holds is False else 'n/a'}"
              for a in report.acceptance]
    if report.stopped_at:
        lines.append(f"(cascade stopped after stage {report.stopped_at})")
    lines += [f"not exercised here: {path}: {why}" for path, why in list(report.unexercised.items())[:6]]
    return "\n".join(lines[:limit])


class Environment:
    """Runs the looking tools on the workspace's current baseline."""

    def __init__(self, workspace: Workspace, jobs: int = 2, cache_dir: pathlib.Path | None = None, executor=None):
        self.ws, self.jobs, self.cache_dir, self.executor = workspace, jobs, cache_dir, executor

    def execute(self, action: Action) -> str:
        a, tree = action.args, self.ws.baseline().path
        if action.name == "read_file":
            return read_file(tree, a["path"], a.get("start", 1), a.get("end"))
        if action.name == "grep":
            return grep(tree, a["pattern"], a.get("glob", "**/*"))
        if action.name == "list_files":
            return list_files(tree, a.get("dir", "."))
        if action.name == "run_probes":
            try:
                report = judge(tree, probe_ids=a["ids"], jobs=self.jobs, run_all=True, cache_dir=self.cache_dir,
                               manifest=self.ws.judges(), executor=self.executor)
            except ValueError as exc:
                return f"error: {exc}"
            return render_report(report)
        if action.name == "list_playbooks":
            return "\n".join(f"{p.id}: {p.title} [{', '.join(p.risk) or 'no risk category'}]"
                             for p in load_library().values())
        if action.name == "show_playbook":
            lib = load_library()
            if a["id"] not in lib:
                return f"error: unknown playbook {a['id']!r}; known: {', '.join(lib)}"
            return yaml.safe_dump(lib[a["id"]].model_dump(mode="json", exclude_none=True), sort_keys=False)
        raise FormatError(f"{action.name!r} is not a tool the environment runs")


# --- file tools -------------------------------------------------------------------------------------


def _inside(tree: pathlib.Path, rel: str) -> pathlib.Path:
    """``tree / rel`` resolved (symlinks followed), or a FormatError for the model: a path that leaves the
    tree, or one no file system takes (a NUL byte, a name too long)."""
    try:
        p = (tree / rel).resolve()
        p.exists()
    except (OSError, ValueError) as exc:
        raise FormatError(f"path {rel[:80]!r} is not a usable path: {exc}") from None
    if tree.resolve() not in (p, *p.parents):
        raise FormatError(f"path {rel[:80]!r} is outside the target")
    return p


def _visible(root: pathlib.Path, p: pathlib.Path) -> bool:
    """A file of the tree at ``root`` (resolved: its real path inside it, not through a symlink out) and not
    our state."""
    try:
        real = p.resolve()
        return p.is_file() and root in real.parents and not SKIP_PARTS & set(real.relative_to(root).parts)
    except (OSError, ValueError):
        return False


def read_file(tree: pathlib.Path, rel: str, start: int = 1, end: int | None = None) -> str:
    p = _inside(tree, rel)
    if not p.is_file():
        return f"error: no file {rel}"
    try:
        lines = p.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"error: cannot read {rel}: {exc.strerror or exc}"
    start = max(1, start)
    end = min(len(lines), end if end else start + 199)
    body = "\n".join(f"{i:5d}  {lines[i - 1]}" for i in range(start, end + 1))
    more = f"\n... ({len(lines) - end} more lines)" if end < len(lines) else ""
    return f"{rel} lines {start}-{end} of {len(lines)}\n{body}{more}"


def grep(tree: pathlib.Path, pattern: str, glob: str = "**/*", cap: int = 80) -> str:
    try:
        rx = re.compile(pattern)
    except (re.error, ValueError, RecursionError) as exc:
        raise FormatError(f"grep: invalid regex {pattern[:80]!r}: {exc}") from None
    parts = pathlib.PurePosixPath(glob).parts
    if not glob.strip() or glob.startswith(("/", "~")) or ".." in parts or "\0" in glob:
        raise FormatError(f"grep: glob {glob[:80]!r} must be a non-empty pattern relative to the target, without '..'")
    try:
        found = sorted(tree.glob(glob))
    except (OSError, ValueError, IndexError, NotImplementedError) as exc:
        raise FormatError(f"grep: glob {glob[:80]!r} is not a usable pattern: {exc}") from None
    hits, root = [], tree.resolve()
    for p in found:
        if not _visible(root, p):
            continue
        try:
            for i, line in enumerate(p.read_text().splitlines(), 1):
                if rx.search(line):
                    hits.append(f"{p.relative_to(tree)}:{i}: {line.strip()[:160]}")
        except (UnicodeDecodeError, OSError):
            continue
    more = f"\n... {len(hits) - cap} more matches" if len(hits) > cap else ""
    return ("\n".join(hits[:cap]) + more) if hits else "no matches"


def list_files(tree: pathlib.Path, rel: str = ".", cap: int = 300) -> str:
    d = _inside(tree, rel)
    if not d.is_dir():
        return f"error: no directory {rel}"
    root = tree.resolve()
    try:
        files = [str(p.relative_to(root)) for p in sorted(d.rglob("*")) if _visible(root, p)]
    except OSError as exc:
        return f"error: cannot list {rel}: {exc.strerror or exc}"
    more = f"\n... {len(files) - cap} more" if len(files) > cap else ""
    return "\n".join(files[:cap]) + more
