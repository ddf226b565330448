"""The agent loop: a backend proposes actions, the harness judges patches, everything is recorded.

Control flow is a handful of exceptions (:mod:`infra_agent.exceptions`): ``Submitted`` (the
backend finished), ``LimitsExceeded`` (steps, wall time, tokens/cost, or too many malformed
actions), ``FormatError`` (a malformed action: the model is told and may retry); Ctrl-C is
``KeyboardInterrupt``.  The looking tools run in :class:`infra_agent.tools.Environment`; the
trajectory is written as JSONL after every step; every attempt leaves an experiment record.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from collections.abc import Callable

from feedback.harness import judge
from feedback.models import FeedbackReport
from feedback.select import FAILING
from feedback.verdict import evidence, verdict
from infra_agent import Backend, Workspace, gate
from infra_agent.exceptions import FormatError, LimitsExceeded, Submitted
from infra_agent.experiments import attempt_record, new_id, write_record
from infra_agent.limits import Limits
from infra_agent.patch import Patch, PatchError
from infra_agent.prefetch import judge_ahead, judge_together
from infra_agent.review import ReviewQueue
from infra_agent.tools import Action, Environment, render_report
from infra_agent.trajectory import Trajectory
from infra_agent.workspace import commit_message


@dataclasses.dataclass
class Attempt:
    step: int
    hypothesis: str
    playbook: str | None
    verdict: str  # better / worse / incorrect / inconclusive / unchanged (feedback.verdict), invalid / refused
    decision: str  # accepted / held / discarded / refused
    reason: str
    commit: str | None = None
    branch: str | None = None
    report: FeedbackReport | None = None
    risk: list[str] = dataclasses.field(default_factory=list)
    diff: str = ""
    review_id: int | None = None
    record: pathlib.Path | None = None


@dataclasses.dataclass
class AgentState:
    goal: str
    messages: list[dict]
    feedback: FeedbackReport  # the latest report on the baseline
    tree: pathlib.Path  # the baseline worktree
    attempts: list[Attempt]
    step: int
    rejected_playbooks: list[str] = dataclasses.field(default_factory=list)  # by reviewers, earlier sessions


SYSTEM_PROMPT = """You are a performance and correctness engineer working on an LLM inference stack.
A harness judges every change you propose with local probes (correctness against float64
references, microbenchmarks, traces, runtime events, serving metrics) and tells you exactly which
kernel, file, parameter or input condition a problem is bound to. Work from that evidence:
state a hypothesis, propose the smallest patch that tests it (a unified diff against the
target root), read the verdict, and iterate. Probes, references, tests and the manifest are
protected: a patch touching them is refused. Patches touching numerics, concurrency or production
behaviour are held for a human reviewer. Call finish when nothing the feedback flags is left."""


class Agent:
    def __init__(self, backend: Backend, workspace: Workspace, goal: str, limits: Limits | None = None,
                 trajectory: pathlib.Path | None = None, jobs: int = 2,
                 on_event: Callable[[str, dict], None] | None = None, executor=None):
        self.backend = backend
        self.executor = executor  # where probes run: None (local subprocesses) or feedback.ray_executor
        self.ws = workspace
        self.goal = goal
        self.limits = limits or Limits()
        self.trajectory = Trajectory(trajectory or workspace.state_dir / "trajectory.jsonl")
        self.jobs = jobs
        # content-keyed, so shared by the baseline, the candidates and the other sessions of the target
        self.cache_dir = workspace.state.cache
        self.queue = ReviewQueue(workspace.state.review_db)
        self.experiments_dir = workspace.state.experiments
        self.env = Environment(workspace, jobs=jobs, cache_dir=self.cache_dir, executor=executor)
        self.emit = on_event or (lambda kind, data: None)
        self.attempts: list[Attempt] = []
        self.messages: list[dict] = []
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0, "cost_usd": 0.0}
        self.started = time.monotonic()
        self.format_errors = 0
        self.step = 0
        self.feedback: FeedbackReport | None = None
        self.initial: FeedbackReport | None = None
        self.outcome = "running"
        self.rejected_playbooks: list[str] = []
        self.summary_text = ""

    # -- running --

    def _probe_ended(self, side: str, result) -> None:
        self.emit("probe", {"side": side, "result": result})

    def judge_baseline(self) -> FeedbackReport:
        base = self.ws.baseline()
        self.emit("judging", {"what": "baseline", "tree": str(base.path)})
        report = judge(base.path, jobs=self.jobs, run_all=True, label=f"baseline {base.base[:10]}",
                       cache_dir=self.cache_dir, manifest=self.ws.judges(), executor=self.executor,
                       on_result=self._probe_ended)
        self.emit("feedback", {"report": report})
        return report

    def baseline_failing(self) -> list:
        """The baseline's failed, erroring or timed-out results: a patch is judged again on those that
        import a file it changes, whatever their covers say (:func:`feedback.select.rechecked`)."""
        return [r for r in (self.feedback.results if self.feedback else []) if r.status in FAILING]

    def run(self, restored: bool = False) -> str:
        """The session to its end.  ``restored``: the conversation, steps and attempts were put back by
        :func:`infra_agent.resume.restore`; the agent is told so, with fresh feedback on the baseline."""
        try:
            self.feedback = self.judge_baseline()
            if restored:
                self._say(f"The session was interrupted and is resumed at step {self.step}. "
                          f"Feedback on the baseline now:\n{render_report(self.feedback)}")
            else:
                self.initial = self.feedback
                self._open()
            while True:
                self.limits.check(self.step, time.monotonic() - self.started, self.usage)
                judge_ahead(self)  # --parallel N: the next candidates judged together (infra_agent/prefetch.py)
                self.step += 1
                self._one_step()
        except Submitted as s:
            self.outcome, self.summary_text = "finished", str(s)
        except LimitsExceeded as e:
            self.outcome, self.summary_text = "limits", str(e)
        except KeyboardInterrupt:
            self.outcome, self.summary_text = "interrupted", "stopped by the user"
        except RuntimeError as exc:  # the backend cannot go on (endpoint down after retries, say)
            self.outcome, self.summary_text = "error", str(exc)
        self.trajectory.write({"step": self.step, "role": "session", "outcome": self.outcome,
                               "summary": self.summary_text})
        return self.outcome

    def _open(self) -> None:
        """The opening messages: the task, what reviewers rejected before, the baseline's feedback."""
        rejected = self.queue.rejections(self.ws.target_label)
        self.rejected_playbooks = sorted({i.playbook for i in rejected if i.playbook})
        notes = "".join(f"\n- {i.playbook or 'patch'} ({i.hypothesis[:80]}): rejected by {i.settled_by}: {i.reason}"
                        for i in rejected[-10:])
        self.messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"Goal: {self.goal}\n\nTarget: {self.ws.target_label}\n"
                                        + (f"Reviewers rejected earlier patches on this target:{notes}\n"
                                           if notes else "")
                                        + f"Feedback on the baseline:\n{render_report(self.feedback)}"},
        ]
        for m in self.messages:
            self.trajectory.write({"step": 0, **m})

    def _say(self, text: str) -> None:
        message = {"role": "user", "content": text}
        self.messages.append(message)
        self.trajectory.write({"step": self.step, **message})

    def state(self) -> AgentState:
        return AgentState(goal=self.goal, messages=self.messages, feedback=self.feedback,
                          tree=self.ws.baseline().path, attempts=self.attempts, step=self.step,
                          rejected_playbooks=self.rejected_playbooks)

    def _one_step(self) -> None:
        try:
            action = self.backend.next_action(self.state()).redacted()
            action.validate()
        except FormatError as exc:
            self.format_errors += 1
            note = f"format error: {exc}"
            self.messages.append({"role": "user", "content": note})
            self.trajectory.write({"step": self.step, "role": "user", "content": note, "format_error": True})
            self.emit("format_error", {"message": str(exc)})
            if self.format_errors >= self.limits.max_format_errors:
                raise LimitsExceeded(f"{self.format_errors} malformed actions in a row") from exc
            return
        self.format_errors = 0
        for k in ("prompt_tokens", "completion_tokens", "cost_usd"):
            self.usage[k] = getattr(self.backend, "usage", {}).get(k, self.usage[k])
        message = action.message or {"role": "assistant", "content": None, "tool_calls": [
            {"id": action.call_id or f"call_{self.step}", "type": "function",
             "function": {"name": action.name, "arguments": json.dumps(action.args)}}]}
        self.messages.append(message)
        self.trajectory.write({"step": self.step, **message})
        lim = self.limits
        budget = (f"step {self.step}/{lim.max_steps}, {time.monotonic() - self.started:.0f}/{lim.time_limit_s:.0f}s, "
                  f"{self.usage['prompt_tokens'] + self.usage['completion_tokens']} tokens, "
                  f"${self.usage['cost_usd']:.2f}")
        self.emit("action", {"step": self.step, "name": action.name, "args": action.args, "budget": budget})
        judge_together(self, action)  # several patches in one reply, --parallel N: judged together first
        observation = self.execute(action)
        reply = {"role": "tool", "tool_call_id": action.call_id or f"call_{self.step}", "content": observation}
        self.messages.append(reply)
        self.trajectory.write({"step": self.step, **reply})
        self.emit("observation", {"step": self.step, "name": action.name, "text": observation})

    # -- actions --

    def execute(self, action: Action) -> str:
        """``finish`` and ``propose_patch`` change the session; the environment runs the rest."""
        if action.name == "finish":
            raise Submitted(action.args.get("summary", ""))
        if action.name == "propose_patch":
            a = action.args
            return self.propose_patch(a["hypothesis"], a["diff"], a.get("playbook_id"))
        try:
            return self.env.execute(action)
        except FormatError as exc:  # a path outside the target, a pattern no one can use: the model is told
            return f"error: {exc}"
        except (OSError, ValueError) as exc:  # the machine refused the tool: said, never the session's end
            return f"error: {action.name} failed: {type(exc).__name__}: {str(exc)[:300]}"

    def propose_patch(self, hypothesis: str, diff: str, playbook: str | None) -> str:
        base_commit = self.ws.head()
        try:
            return self._propose(hypothesis, diff, playbook)
        finally:
            self._record(self.attempts[-1], base_commit)

    def _record(self, a: Attempt, base_commit: str) -> None:
        """One experiment record per attempt, failures included; written atomically."""
        try:
            rec = attempt_record(a, self.ws, base_commit, self.backend.name, getattr(self.backend, "model", None),
                                 self.trajectory.path)
            a.record = write_record(self.experiments_dir, rec)
        except Exception as exc:  # noqa: BLE001 - a record that cannot be written is reported, not fatal
            self.emit("warning", {"message": f"experiment record not written: {exc}"})

    def _propose(self, hypothesis: str, diff: str, playbook: str | None) -> str:
        manifest = self.ws.manifest()
        record = Attempt(step=self.step, hypothesis=hypothesis, playbook=playbook, verdict="invalid",
                         decision="refused", reason="", diff=diff)
        self.attempts.append(record)
        try:
            patch = Patch.parse(diff, manifest)
            record.diff = patch.diff
        except PatchError as exc:
            record.reason = str(exc)
            record.verdict = "refused" if str(exc).startswith("refused") else "invalid"
            self.emit("attempt", {"attempt": record})
            return f"patch {record.verdict}: {exc}"
        assessment = gate.assess(patch, manifest, self.ws.baseline().path)
        record.risk = [f.render() for f in assessment.findings] + ([assessment.error] if assessment.error else [])
        cand = self.ws.new_candidate()
        try:
            self.ws.apply(cand, patch.diff)
        except ValueError as exc:
            self.ws.discard(cand)
            record.reason = str(exc)
            self.emit("attempt", {"attempt": record})
            return f"patch invalid: {exc}"
        self.emit("judging", {"what": cand.name, "files": patch.paths})
        base = self.ws.baseline()
        judges = self.ws.judges()
        report = judge(cand.path, changed=patch.paths, baseline_tree=base.path, baseline_label=base.base[:10],
                       label=cand.name, jobs=self.jobs, cache_dir=self.cache_dir, same_judges=True,
                       manifest=judges, baseline_manifest=judges, executor=self.executor,
                       on_result=self._probe_ended, failing=self.baseline_failing())
        record.report = report
        judgement = report.verdict or verdict(report)
        record.verdict, record.reason = judgement.name, judgement.reason
        lines = [f"verdict: {record.verdict} ({judgement.reason})", render_report(report)]
        if judgement.broken_probes:
            lines.append("note: these probes are broken on the baseline too (not your patch): "
                         + "; ".join(judgement.broken_probes[:4]))
        if record.verdict != "better":
            record.decision = "discarded"
            self.ws.discard(cand)
            lines.append("decision: discarded; the baseline is unchanged")
        elif assessment.held and (twin := self.queue.pending_twin(str(self.ws.root), patch.diff)) is not None:
            # a session before this one proposed the very same change and it waits for a person: one item, not
            # one per session (FlagGems: three identical tf32x3 items after three sessions)
            record.decision, record.review_id = "held", twin.id
            self.ws.discard(cand)
            lines.append(f"decision: held; the same change is pending as review item {twin.id} (session "
                         f"{twin.session}): no second item")
        elif assessment.held:
            record.decision = "held"
            record.branch = self.ws.keep_for_review(cand, commit_message(hypothesis, trailers={
                "playbook": playbook or "-", "held for review": ", ".join(assessment.categories)}))
            self.ws.discard(cand)
            record.review_id = self.queue.add(
                target=self.ws.target_label, repo=str(self.ws.root), session=self.ws.session,
                session_branch=self.ws.branch, candidate_branch=record.branch, hypothesis=hypothesis,
                playbook=playbook, diff=patch.diff, findings=[f.model_dump() for f in assessment.findings],
                evidence=evidence(report), validation=[r.probe for r in report.results],
                experiment=str(self.experiments_dir / f"{new_id(self.ws.session, record.step)}.yaml"))
            lines.append(f"decision: held for human review ({', '.join(assessment.categories)}); "
                         f"review item {record.review_id}, candidate branch {record.branch}")
            lines += [f"  gate: {r}" for r in gate.by_line(assessment.findings)[:8]]
        else:
            record.decision = "accepted"
            record.commit = self.ws.accept(cand, commit_message(hypothesis, trailers={"playbook": playbook or "-"}))
            self.ws.discard(cand)
            self.feedback = self.judge_baseline()
            lines.append(f"decision: accepted as {record.commit[:10]}; it is the new baseline")
        self.emit("attempt", {"attempt": record})
        return "\n".join(lines)
