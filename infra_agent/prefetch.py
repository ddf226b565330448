"""``infra-agent run --parallel N``: the next N candidate patches judged together, ahead of the loop.

A backend that can say what it would propose next (``peek(state, n)``; the offline policy can), or a
model that proposed several patches in one reply (the openai backend's ``queued()``), has
those patches applied in candidate trees and judged at once, in threads (or across a Ray cluster
with ``--executor ray``), by the probes that are judged by status (static, correctness, trace,
events).  Nothing is decided here: the loop then proposes them one at a time, exactly as without
``--parallel``, and finds their probes' results in the content-keyed cache.  So the verdicts and
decisions are those of a sequential session (a candidate proposed after an acceptance is another
tree against another baseline, and is judged afresh), and only the waiting is shared.  Performance
probes are never judged ahead: timings taken while other candidates run beside them are not evidence.
"""

from __future__ import annotations

import concurrent.futures as cf

from feedback.harness import judge
from feedback.select import select
from feedback.verdict import judged_by_performance
from infra_agent.patch import Patch, PatchError


def judge_ahead(agent) -> int:
    """Before a step: with ``limits.parallel`` > 1, judge ahead whenever the baseline has moved since the
    last time (a fresh session, an acceptance); returns how many candidates were judged."""
    if agent.limits.parallel < 2 or getattr(agent, "_ahead_of", None) == agent.ws.head():
        return 0
    agent._ahead_of = agent.ws.head()
    return prefetch(agent, agent.limits.parallel)


def prefetch(agent, n: int) -> int:
    """Judge ahead the next ``n`` proposals of ``agent.backend``; returns how many were judged."""
    peek = getattr(agent.backend, "peek", None)
    if peek is None or n < 2:
        return 0
    return _judge(agent, peek(agent.state(), n))


def judge_together(agent, action) -> int:
    """A model that proposed several patches in one reply (its backend's ``queued()``): with ``--parallel N``
    the one in hand and up to N-1 of the queued ones are judged together, before the loop takes them one
    at a time; returns how many were judged."""
    queued = getattr(agent.backend, "queued", None)
    if agent.limits.parallel < 2 or action.name != "propose_patch" or queued is None:
        return 0
    actions = [action, *(a for a in queued() if a.name == "propose_patch")][: agent.limits.parallel]
    return _judge(agent, actions) if len(actions) > 1 else 0


def _judge(agent, actions) -> int:
    """The status-judged probes of each proposal's candidate tree, in threads; nothing decided."""
    manifest = agent.ws.manifest()
    judges = agent.ws.judges()
    base = agent.ws.baseline()
    jobs = []
    for action in actions:
        try:
            patch = Patch.parse(action.args["diff"], manifest)
        except PatchError:
            continue  # the loop will say why when it is proposed
        ids = [s.id for s in select(judges or manifest, patch.paths, agent.baseline_failing())
               if not judged_by_performance(s.kind)]
        if not ids:
            continue
        cand = agent.ws.new_candidate()
        try:
            agent.ws.apply(cand, patch.diff)
        except ValueError:
            agent.ws.discard(cand)
            continue
        jobs.append((cand, ids))
    if not jobs:
        return 0
    agent.emit("judging", {"what": f"{len(jobs)} candidates ahead, together", "files": []})

    def one(cand, ids):
        try:
            # as the loop will judge it (the same cascade, stopping where it stops), less the timed probes
            judge(cand.path, probe_ids=ids, baseline_tree=base.path, jobs=agent.jobs, cache_dir=agent.cache_dir,
                  manifest=judges, baseline_manifest=judges, executor=agent.executor)
        finally:
            agent.ws.discard(cand)

    with cf.ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        for fut in [pool.submit(one, c, ids) for c, ids in jobs]:
            fut.result()
    return len(jobs)
