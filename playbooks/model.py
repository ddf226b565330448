"""Playbook schema, loader and applicability evaluation."""

from __future__ import annotations

import fnmatch
import operator
import pathlib
import re
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from feedback.manifest import load_yaml, path_matches
from feedback.models import FeedbackReport
from feedback.state import SKIP_PARTS

LIBRARY = pathlib.Path(__file__).resolve().parent / "library"
_OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq}


class PlaybookError(Exception):
    pass


class MetricPredicate(BaseModel):
    """A metric of some probe compared with a number, e.g. ``*.bandwidth_vs_copy < 0.6``."""

    model_config = ConfigDict(extra="forbid")

    probe: str = Field("*", description="glob over probe ids")
    metric: str = Field(description="glob over metric names")
    op: Literal["<", "<=", ">", ">=", "=="]
    value: float

    def hits(self, report: FeedbackReport) -> list[tuple[str, str]]:
        """(probe, evidence) for every metric of the report that satisfies the predicate."""
        out = []
        for r in report.results:
            if not fnmatch.fnmatchcase(r.probe, self.probe):
                continue
            for name, m in r.metrics.items():
                if fnmatch.fnmatchcase(name, self.metric) and _OPS[self.op](m.value, self.value):
                    out.append((r.probe, f"{r.probe}.{name} = {m.value:.4g} {self.op} {self.value:g}"))
        return out

    def evidence(self, report: FeedbackReport) -> list[str]:
        return [text for _, text in self.hits(report)]

    def observed(self, report: FeedbackReport) -> list[str]:
        """Every value of the metric in the report, whether or not it satisfies the predicate."""
        return [f"{r.probe}.{name} = {m.value:.4g}" for r in report.results if fnmatch.fnmatchcase(r.probe, self.probe)
                for name, m in r.metrics.items() if fnmatch.fnmatchcase(name, self.metric)]


class FindingPredicate(BaseModel):
    """A finding (or failure reason) of some probe whose message matches a regex."""

    model_config = ConfigDict(extra="forbid")

    probe: str = Field("*", description="glob over probe ids")
    message: str = Field(description="regex searched in finding messages and failure reasons")
    failed: bool = Field(False, description="only the findings of a failed check: not a site the manifest "
                                            "tolerates or the baseline had too, not an observation on the way")

    @field_validator("message")
    @classmethod
    def _regex(cls, v: str) -> str:
        re.compile(v)
        return v

    def hits(self, report: FeedbackReport) -> list[tuple[str, str]]:
        pat = re.compile(self.message)
        out = []
        for r in report.results:
            if not fnmatch.fnmatchcase(r.probe, self.probe):
                continue
            findings = [f for f in r.findings if f.failed] if self.failed else r.findings
            texts = [f.message + (f" [{f.location.render()}]" if f.location.render() else "") for f in findings]
            texts += [r.reason] if r.reason and not self.failed else []
            out += [(r.probe, f"{r.probe}: {t}") for t in texts if pat.search(t)]
        return out

    def evidence(self, report: FeedbackReport) -> list[str]:
        return [text for _, text in self.hits(report)]


Predicate = MetricPredicate | FindingPredicate


class Signals(BaseModel):
    model_config = ConfigDict(extra="forbid")

    all_of: list[Predicate] = Field(default_factory=list, description="every one must hold")
    any_of: list[Predicate] = Field(default_factory=list, description="at least one must hold, if given")
    none_of: list[Predicate] = Field(default_factory=list, description="evidence against: any one declines")


class CodePattern(BaseModel):
    model_config = ConfigDict(extra="forbid")

    paths: list[str] = Field(default_factory=lambda: ["**/*.py"])
    regex: str
    description: str = ""

    @field_validator("regex")
    @classmethod
    def _regex(cls, v: str) -> str:
        re.compile(v, re.MULTILINE)
        return v


class ApplicabilitySpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    signals: Signals
    code: list[CodePattern] = Field(default_factory=list, description="at least one must match, if given")

    @model_validator(mode="after")
    def _rests_on_evidence(self) -> ApplicabilitySpec:
        if not (self.signals.all_of or self.signals.any_of):
            raise ValueError("applicability must rest on feedback signals (all_of or any_of), not on code alone")
        return self


class Transformation(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str = Field(description="how to apply the technique, for a model or a person")
    transform: str | None = Field(None, description="executable transform, module:function")
    knobs: dict[str, Any] = Field(default_factory=dict, description="parameters the transform may set")

    @field_validator("transform")
    @classmethod
    def _entry(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", v):
            raise ValueError(f"transform must look like module.path:function, got {v!r}")
        return v


class Validation(BaseModel):
    model_config = ConfigDict(extra="forbid")

    probes: list[str] = Field(default_factory=list, description="probe id globs that must pass afterwards")
    criteria: list[str] = Field(default_factory=list, description="'<probe>.<metric> <op> <number>' after the change")


class Playbook(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(pattern=r"^[a-z0-9][a-z0-9\-]*$")
    title: str
    sources: list[str] = Field(min_length=1, description="where the technique comes from")
    summary: str
    applicability: ApplicabilitySpec
    transformation: Transformation
    constraints: dict[str, Any] = Field(default_factory=dict, description="registers, shared memory, precision, "
                                                                             "platforms")
    validation: Validation = Field(default_factory=Validation)
    risk: list[Literal["numerics", "concurrency", "production"]] = Field(default_factory=list)


class CodeMatch(BaseModel):
    file: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.text.strip()[:120]}"


class Applicability(BaseModel):
    playbook: str
    applies: bool
    evidence: list[str] = Field(default_factory=list)
    code_matches: list[CodeMatch] = Field(default_factory=list)
    reason: str = ""
    # the probes whose results gave the evidence for it, and whether one of them failed: a fix for a
    # failing probe comes before an optimisation a passing one suggests
    evidence_probes: list[str] = Field(default_factory=list)
    for_a_failure: bool = False
    # the probe each entry of ``evidence`` came from (where it applies)
    evidence_by: list[str] = Field(default_factory=list)


def _match_code(pattern: CodePattern, tree: pathlib.Path) -> list[CodeMatch]:
    rx = re.compile(pattern.regex, re.MULTILINE)
    hits: list[CodeMatch] = []
    seen: set[pathlib.Path] = set()
    for glob in pattern.paths:
        for path in sorted(tree.glob(glob)):
            rel = path.relative_to(tree)
            if path in seen or not path.is_file() or SKIP_PARTS & set(rel.parts):
                continue
            seen.add(path)
            try:
                text = path.read_text()
            except (UnicodeDecodeError, OSError):
                continue
            for m in rx.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                hits.append(CodeMatch(file=str(rel), line=line, text=text.splitlines()[line - 1]))
    return hits


def evaluate(pb: Playbook, report: FeedbackReport, tree: str | pathlib.Path,
             covers: dict[str, list[str]] | None = None) -> Applicability:
    """Does ``pb`` apply to ``tree`` given the feedback ``report``?  Evidence is returned either way.

    With ``covers`` (probe id -> the file globs its manifest entry covers), evidence is bound to code:
    the code patterns count only in the files the evidence's probes are about (their covers and where
    their findings point), and evidence against counts only from probes about a file the patterns
    match.  A slow decode kernel is then no reason to rewrite a norm in another module, and a fast
    kernel elsewhere is no reason to leave a slow one alone."""
    tree = pathlib.Path(tree)
    sig = pb.applicability.signals
    matches = [m for pat in pb.applicability.code for m in _match_code(pat, tree)]
    files = {m.file for m in matches}
    for pred in sig.none_of:
        against = [e for p, e in pred.hits(report)
                   if covers is None or not files or (sc := _scope([p], report, covers)) is None
                   or any(_in(f, sc) for f in files)]
        if against:
            return Applicability(playbook=pb.id, applies=False, evidence=against,
                                 reason=f"declined: evidence against it: {against[0]}")
    hits: list[tuple[str, str]] = []
    for pred in sig.all_of:
        found = pred.hits(report)
        if not found:
            return Applicability(playbook=pb.id, applies=False, evidence=[e for _, e in hits],
                                 reason=f"declined: no evidence for {_describe(pred, report)}")
        hits += found
    if sig.any_of:
        found = [h for pred in sig.any_of for h in pred.hits(report)]
        if not found:
            return Applicability(playbook=pb.id, applies=False, evidence=[e for _, e in hits],
                                 reason="declined: none of " + "; ".join(_describe(p, report) for p in sig.any_of))
        hits += found
    probes = list(dict.fromkeys(p for p, _ in hits))
    if covers is not None and matches:
        scope = _scope(probes, report, covers)
        if scope is not None:
            bound = [m for m in matches if _in(m.file, scope)]
            if not bound:
                return Applicability(
                    playbook=pb.id, applies=False, evidence=[e for _, e in hits],
                    reason=f"declined: the evidence ({', '.join(probes[:3])}) is about {', '.join(sorted(scope)[:4])}; "
                           f"the code pattern matches only elsewhere ({matches[0]})")
            matches = bound
            # what is cited is what is about the code changed: a slow kernel elsewhere is no evidence here
            about = {p for p in probes if (own := _scope([p], report, covers)) is None
                     or any(_in(m.file, own) for m in bound)}
            if about and (not sig.all_of or about == set(probes)):
                hits = [(p, e) for p, e in hits if p in about]
                probes = [p for p in probes if p in about]
    matches = _where_pointed(matches, report, probes)
    if pb.applicability.code and not matches:
        return Applicability(playbook=pb.id, applies=False, evidence=[e for _, e in hits],
                             reason="declined: the feedback fits but no code pattern matches in the target")
    status = {r.probe: r.status.value for r in report.results}
    evidence = [e for _, e in hits]
    return Applicability(playbook=pb.id, applies=True, evidence=evidence, code_matches=matches,
                         reason=f"applies: {evidence[0]}" + (f"; code {matches[0]}" if matches else ""),
                         evidence_probes=probes, for_a_failure=any(status.get(p) == "fail" for p in probes),
                         evidence_by=[p for p, _ in hits])


def _scope(probes: list[str], report: FeedbackReport, covers: dict[str, list[str]]) -> set[str] | None:
    """The files ``probes`` are about: their covers and the files their findings name; None where one of
    them names none (a probe of the whole target), so that nothing can be ruled out."""
    by_id = {r.probe: r for r in report.results}
    scope: set[str] = set()
    for p in probes:
        mine = set(covers.get(p, ()))
        if (r := by_id.get(p)) is not None:
            mine |= _finding_files(r)
        if not mine:
            return None
        scope |= mine
    return scope


def _finding_files(result, failed_only: bool = False) -> set[str]:
    """The files a probe result's findings name (a location may list several, comma-separated); ``failed_only``:
    those of the findings that failed (not a site the baseline had too, or one the manifest tolerates)."""
    return {part.strip() for f in result.findings if f.location.file and (f.failed or not failed_only)
            for part in f.location.file.split(",") if part.strip()}


def _in(path: str, globs: set[str]) -> bool:
    return any(path_matches(path, g) for g in globs)


def _where_pointed(matches: list[CodeMatch], report: FeedbackReport, probes: list[str]) -> list[CodeMatch]:
    """The code matches in the files the failing probes' findings point at, those of the evidence's
    ``probes`` first; else all.

    A pattern such as "a dot without a precision" matches all over a large repository; the feedback
    says which file is at fault, and the change belongs there: the file a new division in a kernel's
    loop was found in, not the one another check's failure names."""
    def pointed(results) -> set[str]:
        # a finding located by a glob (a count over its threshold, located at the probe's paths) points at no file
        return {path for r in results if r.status.value == "fail"
                for path in (_finding_files(r, failed_only=True) or _finding_files(r))
                if not any(c in path for c in "*?[")}

    for files in (pointed(r for r in report.results if r.probe in probes), pointed(report.results)):
        near = [m for m in matches if any(path_matches(m.file, pat) for pat in files)]
        if near:
            return near
    return matches


def _describe(pred: Predicate, report: FeedbackReport | None = None) -> str:
    """The predicate in words; with a report, what was measured instead (the evidence of a decline)."""
    if isinstance(pred, MetricPredicate):
        text = f"{pred.probe}.{pred.metric} {pred.op} {pred.value:g}"
        seen = pred.observed(report) if report is not None else []
        if report is not None:
            text += f" (measured: {', '.join(seen[:3])})" if seen else " (not measured here)"
        return text
    return f"a finding of {pred.probe} matching /{pred.message}/"


def load_playbook(path: str | pathlib.Path) -> Playbook:
    path = pathlib.Path(path)
    try:
        data = load_yaml(path.read_text())
        return Playbook.model_validate(data)
    except yaml.YAMLError as exc:
        raise PlaybookError(f"{path}: not valid YAML: {exc}") from exc
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        raise PlaybookError(f"{path}: {loc}: {first['msg']}") from None


def load_library(directory: str | pathlib.Path | None = None) -> dict[str, Playbook]:
    out: dict[str, Playbook] = {}
    for path in sorted(pathlib.Path(directory or LIBRARY).glob("*.yaml")):
        pb = load_playbook(path)
        if pb.id in out:
            raise PlaybookError(f"{path}: duplicate playbook id {pb.id!r}")
        out[pb.id] = pb
    return out


def run_transform(pb: Playbook, tree: str | pathlib.Path, applicability: Applicability,
                  knobs: dict[str, Any] | None = None) -> list[str]:
    """Apply the playbook's executable transform in ``tree``; returns the files it changed."""
    if pb.transformation.transform is None:
        raise PlaybookError(f"playbook {pb.id} has no executable transform (text only)")
    import importlib

    module, func = pb.transformation.transform.split(":")
    fn = getattr(importlib.import_module(module), func)
    return fn(pathlib.Path(tree), applicability.code_matches, {**pb.transformation.knobs, **(knobs or {})})
