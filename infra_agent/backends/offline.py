"""The offline backend: a deterministic playbook policy, no model and no network.

Each step it evaluates the playbooks against the latest feedback on the baseline and the
baseline's code (each probe's evidence bound to the files its manifest entry covers), takes the
first applicable playbook with an executable transform that it has not tried (one that answers a
failing probe before one that optimises a passing one), runs the transform in a scratch worktree
to obtain the diff, and proposes it.  When no playbook applies it finishes.  It holds no answer
for any particular defect: whatever it does comes from the feedback signals and the code patterns
the playbooks declare.
"""

from __future__ import annotations

from feedback.changes import files_in_diff
from feedback.manifest import path_matches
from infra_agent.agent import AgentState
from infra_agent.tools import Action
from playbooks.model import Applicability, Playbook, evaluate, load_library, run_transform


class OfflineBackend:
    name = "offline"
    model = None

    def __init__(self, workspace, library: dict[str, Playbook] | None = None):
        self.ws = workspace
        self.library = library if library is not None else load_library()
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0, "cost_usd": 0.0}
        self._tried: set[str] = set()

    def _manifest(self):
        """The manifest that judges the session, or None for a workspace without a readable one."""
        try:
            return self.ws.judges() or self.ws.manifest()
        except Exception:  # noqa: BLE001 - no readable manifest: evidence stays unbound, nothing tolerated
            return None

    def _tolerated(self) -> list[str]:
        """The sites the manifest's static checks tolerate: a transform leaves them alone."""
        manifest = self._manifest()
        return [t for p in manifest.probes if p.check for t in p.params.get("tolerated", [])] if manifest else []

    def _covers(self) -> dict[str, list[str]] | None:
        """probe id -> the files its manifest entry covers: evidence is bound to the code it is about."""
        manifest = self._manifest()
        return {p.id: list(p.covers.files) for p in manifest.probes} if manifest else None

    def _ranked(self, state: AgentState, tried: set[str]) -> list[tuple[Playbook, Applicability]]:
        """Every untried playbook evaluated: those fixing a failing probe first, then the library's order."""
        covers = self._covers()
        apps = [(pb, evaluate(pb, state.feedback, state.tree, covers)) for pb in self.library.values()
                if pb.id not in tried]
        return sorted(apps, key=lambda x: not (x[1].applies and x[1].for_a_failure))

    def next_action(self, state: AgentState) -> Action:
        tried = self._tried | {a.playbook for a in state.attempts if a.playbook} | set(state.rejected_playbooks)
        notes = [f"{p} was rejected by a reviewer earlier: not proposed again" for p in state.rejected_playbooks]
        for pb, app in self._ranked(state, tried):
            if not app.applies:
                if app.reason.startswith(("declined: evidence against it", "declined: the evidence")):
                    notes.append(f"{pb.id} {app.reason}")  # measured evidence said no, or said it of other code
                continue
            if pb.transformation.transform is None:
                notes.append(f"{pb.id} applies ({app.reason}) but is text only: left for a model or a person")
                self._tried.add(pb.id)
                continue
            self._tried.add(pb.id)
            diff = self._diff(pb, app)
            if not diff.strip():
                notes.append(f"{pb.id} applies but its transform changed nothing")
                continue
            evidence, code = self._cited(app, diff)
            hypothesis = f"{pb.title}. Evidence: {'; '.join(evidence[:3])}. Code: {', '.join(map(str, code[:3]))}."
            return Action("propose_patch", {"hypothesis": hypothesis, "diff": diff, "playbook_id": pb.id})
        accepted = [a for a in state.attempts if a.decision == "accepted"]
        held = [a for a in state.attempts if a.decision == "held"]
        summary = (f"No playbook applies to the remaining feedback. {len(state.attempts)} attempt(s): "
                   f"{len(accepted)} accepted, {len(held)} held for review."
                   + (" " + " ".join(notes) if notes else ""))
        return Action("finish", {"summary": summary})

    def peek(self, state: AgentState, n: int) -> list[Action]:
        """The next ``n`` proposals this policy would make against the current feedback, without making
        them (``infra-agent run --parallel N`` judges them ahead, together; the diffs are deterministic,
        so the proposals made afterwards are the same trees, and their judgements come from the cache)."""
        tried = self._tried | {a.playbook for a in state.attempts if a.playbook} | set(state.rejected_playbooks)
        out = []
        for pb, app in self._ranked(state, tried):
            if len(out) >= n:
                break
            if pb.transformation.transform is None:
                continue
            if app.applies and (diff := self._diff(pb, app)).strip():
                out.append(Action("propose_patch", {"hypothesis": pb.title, "diff": diff, "playbook_id": pb.id}))
        return out

    def _cited(self, app: Applicability, diff: str) -> tuple[list[str], list]:
        """What a proposal cites: the code its diff changed, and the evidence of the probes about those files
        (a playbook's pattern can match, and its evidence come from, files its transform then leaves alone);
        everything the playbook found where none of it is about the changed files."""
        changed = set(files_in_diff(diff))
        code = _nearest(app.code_matches, diff) or [m for m in app.code_matches if m.file in changed] \
            or app.code_matches
        covers = self._covers() or {}

        def about(probe: str) -> bool:
            globs = covers.get(probe)
            return globs is None or any(path_matches(f, g) for f in changed for g in globs)

        by = app.evidence_by if len(app.evidence_by) == len(app.evidence) else [""] * len(app.evidence)
        evidence = [e for p, e in zip(by, app.evidence, strict=True) if not p or about(p)] or app.evidence
        return evidence, code

    def _diff(self, pb: Playbook, app) -> str:
        scratch = self.ws.new_candidate()
        try:
            # the digests the runner's whole-tree checks keep: a transform that reads the whole tree reads them
            changed = run_transform(pb, scratch.path, app, knobs={"digest_store": str(self.ws.state.cache / "digests"),
                                                                  "tolerated": self._tolerated()})
            return self.ws.diff(scratch) if changed else ""
        finally:
            self.ws.discard(scratch)


def _nearest(matches: list, diff: str) -> list:
    """The code matches the diff's changes lie in: for each run of changed lines, the nearest match at or above
    its first line (a launch written one argument a line matches at its first line, ten lines above the swap),
    in the tree before the change; none where the diff does not parse."""
    from infra_agent.patch import Patch, PatchError

    try:
        files = Patch.parse(diff).files
    except PatchError:
        return []
    out = []
    for f in files:
        mine = sorted((m for m in matches if m.file == f.path), key=lambda m: m.line)
        for removed, added in f.blocks:
            first = removed[0][0] if removed else added[0][0] if added else None
            above = [m for m in mine if first is not None and m.line <= first]
            if above and above[-1] not in out:
                out.append(above[-1])
    return out
