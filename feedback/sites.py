"""Which of a static check's sites a candidate added, and which its baseline had already.

A starter manifest bounds each static check at the count the tree had when it began (a ratchet:
``thresholds: {misplaced_arguments: {max: 3}}``).  A candidate that adds a fourth site breaks the bound,
and the runner marks every counted site as failed (:meth:`feedback.runner.Runner._run_check`): four
lines, one of them new.  With the baseline's results beside the candidate's, the sites the baseline
had too are told apart here: they stay in the report, marked ``(on the baseline too)`` and no longer
failed, so the headline and the localisation name the new site.

A site is known by its file, its symbol, its message (line numbers in it left out) and the text of
its source line: an edit above it moves its line number, not its identity.  Identical sites are
counted, so a second copy of a known line is still new.
"""

from __future__ import annotations

import pathlib
import re
from collections import Counter
from collections.abc import Callable

from feedback.manifest import Manifest
from feedback.models import Finding, ProbeResult, Status

KNOWN = " (on the baseline too)"
_AT_LINE = re.compile(r"^line (\d+)")
_NUMBERS = re.compile(r":\d+\b|\bline \d+")
# what a site's message says of its callee's whole declaration (the argument-order check's ``declares (q, k, ...)``):
# not its identity, or a parameter added at the end of a callee would make every tolerated call of it new
_DECLARED = re.compile(r" declares \([^()]*\)")


def identity(message: str) -> str:
    """A site's message as its identity: line numbers and the callee's declared parameters left out."""
    return _DECLARED.sub(" declares (...)", _NUMBERS.sub("", message)).strip()

SiteKey = tuple[str, str, str, str]


TOLERATED = " (tolerated in the manifest)"


def tolerated_key(file: str, symbol: str | None, message: str) -> str:
    """How a manifest names a site it tolerates (a static check's ``params.tolerated``, written by ``init`` for
    what the tree had then): ``file: symbol: message``, the line numbers in the message left out, so that an
    edit above the site does not make it new."""
    return f"{file}: {symbol or '-'}: {identity(message)}"


class Tolerated:
    """The sites a manifest tolerates (``params.tolerated`` entries), counted: each entry tolerates one site, so a
    second identical site is new."""

    def __init__(self, keys: list[str]) -> None:
        self.left = Counter(identity(k) for k in keys)  # as written by `init`, before identities were narrowed

    def take(self, site) -> bool:
        """Whether ``site`` (a ``feedback.checks.Site``) is tolerated; an entry that tolerates it is used up."""
        key = tolerated_key(site.file, site.symbol, site.message)
        if self.left[key] > 0:
            self.left[key] -= 1
            return True
        return False


def split_tolerated(sites: list, tolerated: list[str]) -> tuple[list, list, list[str]]:
    """(the sites the manifest does not tolerate, the tolerated ones, the tolerated entries that matched no site)."""
    left = Tolerated(tolerated)
    new, kept = [], []
    for site in sites:
        (kept if left.take(site) else new).append(site)
    return new, kept, list(left.left.elements())


def _reader(tree: pathlib.Path) -> Callable[[str, int], str | None]:
    lines: dict[str, list[str]] = {}

    def line(rel: str, n: int) -> str | None:
        if rel not in lines:
            try:
                lines[rel] = (tree / rel).read_text(errors="replace").splitlines()
            except OSError:
                lines[rel] = []
        text = lines[rel]
        return text[n - 1].strip() if 0 < n <= len(text) else None

    return line


def _key(finding: Finding, line: Callable[[str, int], str | None]) -> SiteKey | None:
    """The site's identity, or None for a finding that is not at a source line (a bound, a note)."""
    loc = finding.location
    at = _AT_LINE.match(loc.condition or "")
    if not (at and loc.file):
        return None
    text = line(loc.file, int(at[1]))
    if text is None:
        return None
    return loc.file, loc.symbol or "", identity(finding.message), text


def mark_known(manifest: Manifest, tree: str | pathlib.Path, results: list[ProbeResult],
               base_tree: str | pathlib.Path, base_results: list[ProbeResult]) -> list[ProbeResult]:
    """``results`` with each failed static site that the baseline's result of the same probe also reported
    marked as known (:data:`KNOWN`, not failed); the rest unchanged."""
    base = {r.probe: r for r in base_results if r.status in (Status.passed, Status.failed)}
    static = {p.id for p in manifest.probes if p.kind == "static"}
    cand_line, base_line = _reader(pathlib.Path(tree)), _reader(pathlib.Path(base_tree))
    out = []
    for result in results:
        before = base.get(result.probe)
        if result.probe not in static or result.status != Status.failed or before is None:
            out.append(result)
            continue
        known = Counter(k for f in before.findings if (k := _key(f, base_line)) is not None)
        findings = []
        for f in _relocated(result.findings, before.findings, pathlib.Path(tree), pathlib.Path(base_tree)):
            if f.failed and (k := _key(f, cand_line)) is not None and known[k] > 0:
                known[k] -= 1
                f = f.model_copy(update={"failed": False, "message": f.message + KNOWN})
            findings.append(f)
        out.append(result.model_copy(update={"findings": findings}))
    return out


def _bare(message: str) -> str:
    return identity(message.removesuffix(TOLERATED).removesuffix(KNOWN))


def _relocated(findings: list[Finding], base: list[Finding], tree: pathlib.Path, base_tree: pathlib.Path
               ) -> list[Finding]:
    """``findings`` with a new copy of a tolerated site failed where it was added, not at whichever copy came
    last.  A manifest tolerates sites by name and count, so of three identical divisions where it lists two the
    runner fails the third in file order (flash-attention: a copy added at layer_norm.py:606 was reported at the
    untouched :619); beside the baseline, the copies whose lines the baseline had (its file matched to this one
    line by line) are the old ones."""
    at = re.compile(r"^line (\d+)")
    groups: dict[tuple, list[int]] = {}
    for i, f in enumerate(findings):
        if f.location.file and (m := at.match(f.location.condition or "")):
            groups.setdefault((f.location.file, f.location.symbol, _bare(f.message)), []).append(i)
    before = {(f.location.file, f.location.symbol, _bare(f.message), int(m[1])) for f in base
              if f.location.file and (m := at.match(f.location.condition or ""))}
    out, maps = list(findings), {}
    for (file, symbol, bare), members in groups.items():
        failed = [i for i in members if findings[i].failed]
        if not failed or len(failed) == len(members):
            continue
        if file not in maps:
            maps[file] = _line_map(base_tree / file, tree / file)
        new = [i for i in members if (file, symbol, bare, maps[file].get(_line(findings[i]))) not in before]
        if len(new) != len(failed) or set(new) == set(failed):
            continue  # no clearer answer than the count's
        for old_i, new_i in zip(sorted(set(failed) - set(new)), sorted(set(new) - set(failed)), strict=True):
            # the two trade what they say: the old copy is the tolerated one, the added copy the failure
            kept, added = findings[new_i], findings[old_i]
            suffix = next((x for x in (TOLERATED, KNOWN) if kept.message.endswith(x)), "")
            out[old_i] = added.model_copy(update={"failed": False, "message": added.message + suffix})
            out[new_i] = kept.model_copy(update={"failed": True, "message": kept.message.removesuffix(suffix)})
    return out


def _line(f: Finding) -> int:
    return int(re.match(r"^line (\d+)", f.location.condition or "")[1])


def _line_map(base_file: pathlib.Path, file: pathlib.Path) -> dict[int, int]:
    """Each line of ``file`` that the baseline's ``base_file`` has unchanged -> its line there."""
    import difflib

    try:
        old = base_file.read_text(errors="replace").splitlines()
        new = file.read_text(errors="replace").splitlines()
    except OSError:
        return {}
    out: dict[int, int] = {}
    for a, b, size in difflib.SequenceMatcher(None, old, new, autojunk=False).get_matching_blocks():
        out.update({b + k + 1: a + k + 1 for k in range(size)})
    return out
