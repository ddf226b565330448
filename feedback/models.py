"""The harness's data contracts: probe results and feedback reports (pydantic, versioned)."""

from __future__ import annotations

import enum
import math
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

SCHEMA_VERSION = 1


class _Model(BaseModel):
    # An infinite error (a NaN output counts as one) must survive the result file and the cache:
    # JSON has no Infinity, so it is written as the string "Infinity" and read back as a float.
    model_config = ConfigDict(ser_json_inf_nan="strings")


class Status(str, enum.Enum):
    passed = "pass"
    failed = "fail"
    error = "error"
    timeout = "timeout"
    skipped = "skipped"


class Metric(_Model):
    model_config = ConfigDict(extra="forbid")

    value: float
    unit: str = ""
    # Optional uncertainty: a confidence interval (low, high) at 95% when the probe measured one.
    ci: tuple[float, float] | None = None
    # Which way is better, so a comparison can say improved / regressed ("lower", "higher", None).
    better: str | None = None
    # Every run's value when the runner repeated the probe (``value`` is then their median).
    samples: list[float] = Field(default_factory=list)
    # An exact count, not a measurement (bytes a kernel loads, operations, launches, counted under the
    # interpreter): the same code and shapes give the same value on any machine, so it is judged against
    # the base in every probe kind, with no noise floor (``verdict.compare_metric``).
    counted: bool = False

    @field_validator("value")
    @classmethod
    def _finite_or_inf(cls, v: float) -> float:
        if math.isnan(v):
            raise ValueError("metric value is NaN")
        return v


class Location(_Model):
    """Where a finding is bound: a file, a symbol or kernel, a launch parameter, an input condition."""

    model_config = ConfigDict(extra="forbid")

    file: str | None = None
    symbol: str | None = None
    kernel: str | None = None
    param: str | None = None
    condition: str | None = None
    # the counted part the finding states: the stem of its metrics' names (``<part>.<count>``), where one report
    # counts several calls of one kernel (``tokens.`` before the second call's) or a function from several callers
    part: str | None = None

    def render(self) -> str:
        """``at file:line symbol; param ...; input ...``: a condition that is a source line (``line 16``, or
        ``line 12, in test t`` from a test's traceback) goes with the file, as an editor opens it."""
        parts = []
        line = re.fullmatch(r"line (\d+)(?:, (.*))?", self.condition or "", re.S) if self.file else None
        if self.file:
            what = self.kernel or self.symbol
            parts.append(f"at {self.file}" + (f":{line[1]}" if line else "") + (f" {what}" if what else ""))
        elif self.kernel or self.symbol:
            parts.append(f"in {self.kernel or self.symbol}")
        if self.param:
            parts.append(f"param {self.param}")
        if line:
            if line[2]:
                parts.append(line[2])
        elif self.condition:
            parts.append(f"input {self.condition}")
        return "; ".join(parts)


class Finding(_Model):
    model_config = ConfigDict(extra="forbid")

    message: str
    location: Location = Field(default_factory=Location)
    # a check that failed (``ProbeContext.fail``, a threshold, a failing test), not what a probe observed on
    # the way (a kernel's counts, a note): the headline of a failure and the lines that localise it come
    # from these first (records from before the field have none: all of their findings count)
    failed: bool = False


def failures(findings: list[Finding]) -> list[Finding]:
    """The failed checks among ``findings``, or all of them where none is marked (an older record)."""
    marked = [f for f in findings if f.failed]
    return marked or list(findings)


class Fingerprint(_Model):
    """The environment a probe ran in: results from different environments are not comparable."""

    model_config = ConfigDict(extra="forbid")

    python: str = ""
    platform: str = ""
    torch: str | None = None
    triton: str | None = None
    device: str = "cpu"
    mode: str = "native"  # "native" or "interpreter"
    emulation: str | None = None  # dot-precision emulation in force, if any

    def key(self) -> str:
        return "|".join(str(x) for x in (self.python, self.torch, self.triton, self.device, self.mode, self.emulation))


def fingerprint() -> Fingerprint:
    """The fingerprint of this process (call it where the probe ran).

    Versions come from package metadata; the device is read only if the probe imported torch,
    so a static probe stays cheap.
    """
    import sys

    from feedback.pytest_plugin.infra_agent_imports import environment  # (a pytest probe's plugin says the same)

    fp = Fingerprint(**environment())
    emulation = sys.modules.get("feedback.emulation")
    if emulation is not None:
        fp.emulation = emulation.active()
    return fp


class Span(_Model):
    """One span of the runtime events a probe read (``feedback/events.py``): the thread, what, when."""
    model_config = ConfigDict(extra="forbid")

    thread: str
    name: str
    start_ms: float  # from the first event the probe read
    dur_ms: float
    depth: int = 0  # nested in that many spans around it on its thread


class ProbeResult(_Model):
    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA_VERSION
    probe: str
    status: Status
    metrics: dict[str, Metric] = Field(default_factory=dict)
    findings: list[Finding] = Field(default_factory=list)
    duration_s: float = 0.0
    environment: Fingerprint = Field(default_factory=Fingerprint)
    reason: str | None = None  # why skipped / error / timeout, in one line
    # The harness or the machine failed (not the probe's code): never blamed on a candidate, never cached.
    environment_failure: bool = False
    stdout: str = ""
    stderr: str = ""
    cached: bool = False
    # Seconds of each timed loop (feedback/timing.py) by the probe's clock; the runner holds them
    # against the harness process's own clock (the witness) and fails a probe where they disagree.
    spans: dict[str, float] = Field(default_factory=dict)
    # where it ran when not in this process's machine: "ray node 3f2a... (host, device)"
    ran_on: str | None = None
    # the spans of the runtime events it read, per thread (the longest ``events.TIMELINE_SPANS``): the
    # report draws them, baseline above candidate
    timeline: list[Span] = Field(default_factory=list)
    # the tree's source files whose modules the probe imported (a Python probe), path -> sha256: a cached
    # result holds only while they are unchanged, those its covers name or not
    imports: dict[str, str] = Field(default_factory=dict)
    # the ids of the tests that failed or errored (a pytest probe): a probe that fails on both sides is judged
    # test by test, so a candidate that breaks one more test, or fixes some, says so (feedback.verdict)
    failing: list[str] = Field(default_factory=list)
    # the packages its tests could not import (``feedback.needs``): outside the tree and the cache's key, so a
    # cached result holds only while none of them can be imported yet (installed since, a submodule checked out)
    absent: list[str] = Field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status in (Status.passed, Status.skipped)


class MetricDelta(_Model):
    model_config = ConfigDict(extra="forbid")

    name: str
    baseline: float | None
    candidate: float | None
    unit: str = ""
    change: float | None = None  # candidate / baseline
    ci: tuple[float, float] | None = None  # 95% interval of the change (performance metrics)
    noise: float | None = None  # the A/A noise floor the change was held against (relative)
    samples: int = 0  # repeats behind the smaller side
    verdict: str = "n/a"  # improved / regressed / unchanged / new / gone / n/a (shown, not judged)
    note: str = ""  # why a performance change was called unchanged


class ProbeComparison(_Model):
    model_config = ConfigDict(extra="forbid")

    probe: str
    kind: str
    baseline: Status | None
    candidate: Status
    deltas: list[MetricDelta] = Field(default_factory=list)
    localisation: list[str] = Field(default_factory=list)


class CriterionResult(_Model):
    model_config = ConfigDict(extra="forbid")

    name: str
    expression: str
    value: float | None
    holds: bool | None  # None: the metric was not measured in this run
    reason: str = ""


class Verdict(_Model):
    """The judgement of a candidate against its baseline (made by :mod:`feedback.verdict`)."""

    model_config = ConfigDict(extra="forbid")

    name: Literal["incorrect", "inconclusive", "worse", "better", "unchanged"]
    reason: str
    broke: list[str] = Field(default_factory=list)  # held on the baseline, fails on the candidate
    fixed: list[str] = Field(default_factory=list)  # failed on the baseline, holds on the candidate
    broken_probes: list[str] = Field(default_factory=list)  # error/timeout on both sides, or the environment
    still_failing: list[str] = Field(default_factory=list)
    regressed: list[str] = Field(default_factory=list)
    improved: list[str] = Field(default_factory=list)


class FeedbackReport(_Model):
    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA_VERSION
    target: str
    candidate: str  # a label for the tree judged (path, worktree or commit)
    baseline: str | None = None
    selection: str = "all"  # how the probes were chosen
    results: list[ProbeResult]
    baseline_results: list[ProbeResult] = Field(default_factory=list)
    comparisons: list[ProbeComparison] = Field(default_factory=list)
    acceptance: list[CriterionResult] = Field(default_factory=list)
    baseline_acceptance: list[CriterionResult] = Field(default_factory=list)
    verdict: Verdict | None = None  # the candidate's judgement, when there is a baseline
    hashes: dict[str, str] = Field(default_factory=dict)  # probe and reference files -> sha256
    # what was found changed in the judges (the hashes above): against the baseline's, where they must be
    # the same, or while the candidate's probes ran; any entry makes the verdict "incorrect"
    judges_changed: list[str] = Field(default_factory=list)
    stopped_at: str | None = None  # the cascade stage that failed, when the cascade stopped early
    # changed source files whose code no probe ran here (``feedback.harness.unexercised``): file -> why
    unexercised: dict[str, str] = Field(default_factory=dict)
    duration_s: float = 0.0

    @property
    def passed(self) -> bool:
        return all(r.ok for r in self.results) and all(c.holds is not False for c in self.acceptance)

    def localisations(self) -> list[str]:
        return [line for c in self.comparisons for line in c.localisation]


def dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json")
