"""Scenarios: real engineering cases reproduced on the bundled target, each a starting change on top of
the clean ``target_stack`` that reintroduces a defect, with a goal for the agent, acceptance criteria
over probes, and the risk its fix carries.

A scenario is two files in ``target_stack/scenarios/``: ``NAME.patch`` (the defect, a unified diff
against the clean target) and ``NAME.yaml``::

    name: cp-tf32
    defect: the context-parallel merge's tl.dot at tf32 ...
    files: [target_stack/ops/kda/cp.py]
    goal: the CP prefill drifts from the unpartitioned one as partitions grow ...
    acceptance:
      - kda.cp.merge.error_growth <= 3
      - kda.cp.correctness.max_rel_err <= 1e-5
    risk: numerics

``infra-agent scenarios`` lists them; ``infra-agent run --scenario NAME`` (or ``all``) materialises the
defective stack and runs the agent on it; the session's summary says whether the acceptance holds on
the branch or on a candidate held for review.
"""

from __future__ import annotations

import pathlib
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from feedback.manifest import Criterion, Manifest, load_yaml
from feedback.models import CriterionResult, FeedbackReport
from feedback.targets import bundled_package_dir
from feedback.verdict import evaluate_acceptance


class ScenarioError(ValueError):
    pass


class Scenario(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    defect: str = Field(description="what the starting change breaks, and why it matters")
    files: list[str] = Field(min_length=1, description="the files the defect is in")
    goal: str = Field(description="the task given to the agent: the symptom, never the answer")
    acceptance: list[str] = Field(min_length=1, description="'<probe>.<metric> <op> <number>' criteria")
    risk: Literal["numerics", "concurrency", "production"]
    gpu_acceptance: list[str] = Field(default_factory=list, description="what only a GPU run can check, in words")
    patch: pathlib.Path | None = None  # set by the loader: NAME.patch beside the YAML

    @field_validator("acceptance")
    @classmethod
    def _criteria(cls, v: list[str]) -> list[str]:
        for expr in v:
            Criterion(name="scenario", expr=expr)  # raises with the expected form
        return v

    def criteria(self) -> list[Criterion]:
        return [Criterion(name=f"{self.name}[{i}]", expr=e) for i, e in enumerate(self.acceptance)]

    def check(self, manifest: Manifest, report: FeedbackReport) -> list[CriterionResult]:
        """The acceptance criteria against a report's results (None where a probe did not run)."""
        return evaluate_acceptance(manifest.model_copy(update={"acceptance": self.criteria()}), report.results)


def scenarios_dir() -> pathlib.Path:
    return bundled_package_dir() / "scenarios"


def load_scenarios(directory: pathlib.Path | None = None) -> dict[str, Scenario]:
    """Every scenario of ``directory`` (default: the bundled target's), by name, in name order."""
    directory = directory or scenarios_dir()
    out: dict[str, Scenario] = {}
    for path in sorted(directory.glob("*.yaml")):
        try:
            data = load_yaml(path.read_text())
            sc = Scenario.model_validate(data)
        except (yaml.YAMLError, ValidationError, TypeError) as exc:
            first = str(exc).splitlines()
            raise ScenarioError(f"{path}: not a valid scenario: {' '.join(first[:3])}") from exc
        if sc.name != path.stem:
            raise ScenarioError(f"{path}: its name is {sc.name!r}; a scenario's file is named after it")
        patch = path.with_suffix(".patch")
        if not patch.is_file():
            raise ScenarioError(f"{path}: no {patch.name} beside it (the starting change)")
        out[sc.name] = sc.model_copy(update={"patch": patch})
    return out


def resolve(name: str, directory: pathlib.Path | None = None) -> list[Scenario]:
    """``name``'s scenario, or every scenario for ``all``; a clear error naming the known ones."""
    known = load_scenarios(directory)
    if name == "all":
        return list(known.values())
    if name not in known:
        raise ScenarioError(f"unknown scenario {name!r}; known: {', '.join(known) or 'none'} (or 'all')")
    return [known[name]]
