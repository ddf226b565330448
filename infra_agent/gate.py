"""The risk gate's seam: a deterministic classifier over the diff itself, never the model's label.

This first version applies the manifest's ``risk`` rules (path globs and regexes over added and
removed lines).  The full gate (built-in numerics / concurrency / production rules, AST checks,
the review queue) is issue 5; the loop already holds every patch with a finding for review.
"""

from __future__ import annotations

import fnmatch
import re

from pydantic import BaseModel, Field

from feedback.manifest import Manifest
from infra_agent.patch import Patch


class RiskFinding(BaseModel):
    rule: str
    category: str
    file: str
    line: int
    text: str

    def render(self) -> str:
        return f"{self.category}: {self.rule} at {self.file}:{self.line}: {self.text.strip()[:100]}"


class Assessment(BaseModel):
    findings: list[RiskFinding] = Field(default_factory=list)
    error: str | None = None  # an error inside the classifier counts as high risk

    @property
    def held(self) -> bool:
        return bool(self.findings) or self.error is not None

    @property
    def categories(self) -> list[str]:
        return sorted({f.category for f in self.findings} | ({"error"} if self.error else set()))


def assess(patch: Patch, manifest: Manifest) -> Assessment:
    try:
        findings = []
        for rule in manifest.risk:
            rx = re.compile(rule.pattern) if rule.pattern else None
            for f in patch.files:
                if not any(fnmatch.fnmatchcase(f.path, g) for g in rule.paths):
                    continue
                for no, text in [*f.added, *f.removed]:
                    if rx is None or rx.search(text):
                        findings.append(RiskFinding(rule=rule.id, category=rule.category, file=f.path, line=no,
                                                    text=text))
        return Assessment(findings=findings)
    except Exception as exc:  # noqa: BLE001 - a classifier error must hold the patch, not pass it
        return Assessment(error=f"{type(exc).__name__}: {exc}")
