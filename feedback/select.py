"""Change-impact selection: from the files a change touched (:mod:`feedback.changes`) to the probes bound to them."""

from __future__ import annotations

from feedback.manifest import STAGE_ORDER, Manifest, ProbeSpec
from feedback.models import ProbeResult, Status

#: the statuses of a baseline result that a change may fix (a skip is not one: the machine decides it)
FAILING = (Status.failed, Status.error, Status.timeout)


def order(specs: list[ProbeSpec]) -> list[ProbeSpec]:
    """Cheapest first: by cascade stage, then by time budget."""
    return sorted(specs, key=lambda s: (STAGE_ORDER[s.kind], s.budget_s, s.id))


def select(manifest: Manifest, changed: list[str], failing: list[ProbeResult] | None = None) -> list[ProbeSpec]:
    """The probes whose ``covers`` match any changed file, and those :func:`rechecked`, cheapest first."""
    again = rechecked(manifest, changed, failing)
    return order([p for p in manifest.probes if p.id in again or any(p.covers.matches(f) for f in changed)])


def rechecked(manifest: Manifest, changed: list[str], failing: list[ProbeResult] | None) -> set[str]:
    """Of ``failing`` (the baseline's results; those with a :data:`FAILING` status count), the probes
    that imported a changed file their covers do not name.  A manifest's covers can miss a dependency
    (a merge probe whose local states come from another kernel's file); a fix in that file must still be
    seen to fix the probe.  Only failing probes are asked again so: they are few, where selecting every
    importer of a changed file would run most probes of a package after any one-line change."""
    touched = set(changed)
    ids = {r.probe for r in failing or [] if r.status in FAILING and touched.intersection(r.imports)}
    return {p.id for p in manifest.probes
            if p.id in ids and not any(p.covers.matches(f) for f in changed)}


def stages(specs: list[ProbeSpec]) -> list[tuple[str, list[ProbeSpec]]]:
    """Group probes into the cascade's stages: static, correctness, microbench, trace, events, e2e."""
    groups: dict[str, list[ProbeSpec]] = {}
    for s in order(specs):
        groups.setdefault(s.kind, []).append(s)
    return sorted(groups.items(), key=lambda kv: STAGE_ORDER[kv[0]])
