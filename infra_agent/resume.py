"""``infra-agent run --resume SESSION``: a session killed or stopped part-way goes on from its trajectory.

What a session acknowledged is on disk before the next step (the trajectory is synced per line,
each attempt's experiment record is written atomically, the review queue is SQLite): so the
conversation, the step count and the attempts are rebuilt from them, and the agent continues
against the session branch as it stands.  A line torn by the kill is dropped; a tool call that
never got its observation is answered, truthfully: judged (its record says how) or not done.
"""

from __future__ import annotations

import json
import pathlib

from feedback.harness import judge
from feedback.models import FeedbackReport
from infra_agent.experiments import RecordError, load_record, new_id

MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")
_ATTEMPT_DECISIONS = {"accepted", "held", "discarded", "refused"}


class ResumeError(Exception):
    """A session that cannot be resumed, with the reason."""


def read_trajectory(path: pathlib.Path) -> list[dict]:
    """Every whole line of a trajectory; a last line torn by a kill is dropped, a torn line elsewhere is an error."""
    if not path.is_file():
        raise ResumeError(f"no trajectory at {path}: nothing to resume from")
    lines = path.read_text().splitlines()
    records = []
    for n, line in enumerate(lines, 1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            if n == len(lines):
                break  # the write the kill interrupted: it was never acknowledged
            raise ResumeError(f"{path}:{n} is not JSON ({exc}); the trajectory is damaged") from exc
        if isinstance(rec, dict):
            records.append(rec)
    if not any(r.get("role") == "system" for r in records):
        raise ResumeError(f"{path} has no opening messages: the session never started its conversation")
    return records


def restore_messages(records: list[dict]) -> tuple[list[dict], int, dict | None]:
    """(messages, last step, the assistant message whose tool call got no observation, if any)."""
    messages, step, pending = [], 0, None
    for rec in records:
        step = max(step, int(rec.get("step") or 0))
        role = rec.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            continue  # session markers (an earlier end, a resume)
        msg = {k: rec[k] for k in MESSAGE_KEYS if k in rec}
        if role == "assistant" and msg.get("tool_calls"):
            pending = msg
        elif role == "tool":
            if pending is not None and "tool_call_id" not in msg:  # trajectories written before the id was kept
                msg["tool_call_id"] = pending["tool_calls"][0].get("id", "")
            pending = None
        messages.append(msg)
    return messages, step, pending


def attempts_of(experiments: pathlib.Path, session: str, manifest_target: str) -> list:
    """The session's attempts, from their experiment records, in step order."""
    from infra_agent.agent import Attempt

    out = []
    for path in sorted(experiments.glob(f"{new_id(session, 0)[:-3]}*.yaml")):
        try:
            rec = load_record(path)
        except RecordError:
            continue  # a record is written atomically; a damaged one was never acknowledged
        status = rec.decision.status
        settled = status in ("approved", "rejected")  # a held attempt a reviewer has decided since
        decision = status if status in _ATTEMPT_DECISIONS else "held" if settled else "refused"
        report = FeedbackReport(target=manifest_target, candidate=rec.id, results=[p.result for p in rec.probes],
                                hashes=rec.judges) if rec.probes else None
        out.append(Attempt(step=int(rec.id.rsplit("-", 1)[1]), hypothesis=rec.hypothesis, playbook=rec.playbook,
                           verdict=rec.verdict, decision=decision, reason=rec.decision.reason or "",
                           commit=rec.decision.commit, branch=rec.decision.branch, report=report, risk=rec.risk,
                           diff=rec.diff, review_id=rec.decision.review_item, record=path))
    return sorted(out, key=lambda a: a.step)


def restore(agent, base_commit: str) -> str:
    """Put a fresh :class:`~infra_agent.agent.Agent` where its session stopped; a line saying where."""
    records = read_trajectory(agent.trajectory.path)
    ends = [r for r in records if r.get("role") == "session" and r.get("outcome")]
    if ends and ends[-1]["outcome"] == "finished":
        raise ResumeError(f"session {agent.ws.session} already finished ({ends[-1].get('summary') or 'no summary'}); "
                          "start a new one")
    messages, step, pending = restore_messages(records)
    agent.attempts = attempts_of(agent.experiments_dir, agent.ws.session, agent.ws.target_label)
    agent.step = max([step] + [a.step for a in agent.attempts])
    if pending is not None:
        call = pending["tool_calls"][0]
        name = call.get("function", {}).get("name", "?")
        done = next((a for a in agent.attempts if a.step == step), None) if name == "propose_patch" else None
        text = (f"(resumed) this patch was judged before the session stopped: verdict {done.verdict}, decision "
                f"{done.decision}: {done.reason}" if done else
                f"(resumed) the session stopped before this {name} call completed; nothing of it was kept")
        tool = {"role": "tool", "tool_call_id": call.get("id", ""), "content": text}
        messages.append(tool)
        agent.trajectory.write({"step": step, **tool})
    agent.messages = messages
    agent.rejected_playbooks = sorted({i.playbook for i in agent.queue.rejections(agent.ws.target_label)
                                       if i.playbook})
    base = agent.ws.tree_at(base_commit, "session-base")
    try:
        agent.initial = judge(base, jobs=agent.jobs, run_all=True, label=f"session base {base_commit[:10]}",
                              cache_dir=agent.cache_dir, manifest=agent.ws.judges(), executor=agent.executor)
    finally:
        agent.ws.drop_tree(base)
    state = (f"resumed at step {agent.step} with {len(agent.attempts)} attempt(s) on record"
             + (f"; the interrupted {pending['tool_calls'][0].get('function', {}).get('name', '?')} call was answered"
                if pending is not None else ""))
    agent.trajectory.write({"step": agent.step, "role": "session", "event": "resumed", "summary": state})
    return state
