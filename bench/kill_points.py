"""``kill -9`` of ``infra-agent run`` at random moments, then ``--resume``: nothing acknowledged is lost.

    python bench/kill_points.py [--kills 8] [--json bench/out/kill_points.json]

One session on the toy target (the real CLI; the real ``openai`` client against a scripted server on
127.0.0.1; the harness judging the proposed patch in its worktree) is timed once whole.  Each trial
then starts the same session afresh and kills it with SIGKILL at a moment drawn uniformly (from
``os.urandom``) between its trajectory's first line and its end: judging the baseline, proposing,
judging the candidate in its worktree, merging, writing the record and the trajectory; and checks:

* no process of the session is left 10 s later: none whose working directory lies in the trial's
  folders (the probes run there, forked or cold);
* the user's branch and working tree never moved;
* everything written parses: every trajectory line but a torn last one, every experiment record;
* ``infra-agent run --resume SESSION`` (when the session had begun) ends finished with the fix on the
  session branch, or says plainly that it already finished; a session killed before it began leaves
  no session behind.

The deterministic kill points (mid-probe, mid-approval, mid-queue-write) are CI tests
(``tests/infra_agent/test_resume.py``, ``test_review.py``); this is the randomised run.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.chat import ScriptedServer, ok, tool_call  # noqa: E402
from tests.support.processes import alive  # noqa: E402
from tests.support.toy_agent import FIX, make_toy  # noqa: E402


def _script() -> list:
    return [ok(tool_call("read_file", path="toy/core.py")),
            ok(tool_call("propose_patch", hypothesis="compute is off by 0.5", diff=FIX)),
            ok(tool_call("finish", summary="fixed"))]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "infra_agent.cli", *args]


def _left_behind(folder: pathlib.Path) -> list[str]:
    """Processes whose working directory lies in ``folder`` (but this one's own: GitPython's readers)."""
    out = []
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cwd = pathlib.Path(os.readlink(proc / "cwd"))
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid():
            continue
        if cwd.is_relative_to(folder) and alive(int(proc.name)):
            out.append(f"{proc.name}: {cmd}")
    return out


def _session(root: pathlib.Path, env: dict, script: list, kill_after: float | None,
             cwd: pathlib.Path) -> tuple[float, float]:
    """Run a session to its end (``kill_after`` None: returns when its trajectory began and when it ended,
    in seconds from the start) or kill it ``kill_after`` seconds in."""
    from feedback.state import StateDir

    with ScriptedServer(script) as server:
        t0 = time.perf_counter()
        proc = subprocess.Popen(_cli("run", "--target", str(root), "--backend", "openai", "--model", "m",
                                     "--base-url", server.url, "--max-steps", "6", "--json"),
                                cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if kill_after is None:
            sessions, begun = StateDir.for_target(root).workspaces, None
            while proc.poll() is None:
                if begun is None and sessions.is_dir() and any(sessions.glob("*/trajectory.jsonl")):
                    begun = time.perf_counter() - t0
                time.sleep(0.005)
            proc.communicate()
            end = time.perf_counter() - t0
            return (begun if begun is not None else end), end
        try:
            proc.wait(timeout=kill_after)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
        proc.communicate()
        return kill_after, time.perf_counter() - t0


def window(base: pathlib.Path, env: dict) -> tuple[float, float]:
    """When a session's trajectory begins and when it ends, from its start, as the trials will see it (the
    second of two runs: the fork server up).  Before the first line nothing is written, so the kills are
    drawn between the two."""
    for warm in ("cold", "warm"):
        begun, end = _session(make_toy(base / warm / "toy_target"), env, _script(), None, base / warm)
    return begun, end


def trial(work: pathlib.Path, env: dict, kill_after: float) -> dict:
    import git

    from feedback.state import StateDir
    from infra_agent.experiments import RecordError, load_record
    from infra_agent.resume import ResumeError, read_trajectory

    root = make_toy(work / "toy_target")
    head = git.Repo(root).head.commit.hexsha
    _session(root, env, _script(), kill_after, work)
    problems = []
    deadline = time.monotonic() + 10
    while (left := _left_behind(work)) and time.monotonic() < deadline:
        time.sleep(0.1)
    problems += [f"left running: {p}" for p in left]
    repo = git.Repo(root)
    if repo.active_branch.name != "main" or repo.head.commit.hexsha != head or repo.is_dirty(untracked_files=True):
        problems.append("the user's branch or working tree moved")
    state = StateDir.for_target(root)
    sessions = sorted(state.workspaces.iterdir()) if state.workspaces.is_dir() else []
    for folder in sessions:
        try:
            read_trajectory(folder / "trajectory.jsonl")
        except ResumeError as exc:
            if "no trajectory" not in str(exc):
                problems.append(f"trajectory: {exc}")
    for record in sorted(state.experiments.glob("*.yaml")) if state.experiments.is_dir() else []:
        try:
            load_record(record)
        except RecordError as exc:
            problems.append(f"half-written record {record.name}: {exc}")
    outcome = "not begun"
    if sessions:
        (folder,) = sessions
        with ScriptedServer(_script()[1:]) as server:
            out = subprocess.run(_cli("run", "--resume", folder.name, "--target", str(root), "--base-url",
                                      server.url, "--json"), cwd=work, env=env, capture_output=True, text=True,
                                 timeout=600)
        if out.returncode == 2 and "already finished" in out.stderr:
            outcome = "already finished"
        elif out.returncode == 0 and json.loads(out.stdout)["outcome"] == "finished":
            outcome = "resumed"
        elif out.returncode == 2 and "no trajectory" in out.stderr:
            outcome = "not begun"  # killed before its first line: nothing was acknowledged
        else:
            problems.append(f"resume failed (exit {out.returncode}): {(out.stderr or out.stdout).strip()[-300:]}")
            outcome = "failed"
        if outcome in ("resumed", "already finished"):
            fixed = repo.git.show(f"infra-agent/{folder.name}:toy/core.py")
            if "return 1.0" not in fixed:
                problems.append("the session branch lacks the fix after resuming")
    return dict(kill_after_s=round(kill_after, 2), outcome=outcome, problems=problems)


def run(kills: int, on_trial=None) -> dict:
    """The whole randomised run in a scratch folder (a state home of its own, removed after): the session's
    window, then ``kills`` trials, each passed to ``on_trial`` as it ends."""
    base = pathlib.Path(tempfile.mkdtemp(prefix="infra-agent-kills-"))
    env = {k: v for k, v in os.environ.items() if not k.endswith("API_KEY")}
    env.update(OPENAI_API_KEY="sk-test-kills-0123456789", COLUMNS="120", INFRA_AGENT_HOME=str(base / "home"))
    saved = os.environ.get("INFRA_AGENT_HOME")
    os.environ["INFRA_AGENT_HOME"] = env["INFRA_AGENT_HOME"]  # where this process looks for what they wrote
    try:
        begun, whole = window(base, env)
        trials = []
        for i in range(kills):
            at = begun + int.from_bytes(os.urandom(4), "little") / 2**32 * (whole - begun)
            (base / f"t{i}").mkdir()
            trials.append(trial(base / f"t{i}", env, at))
            if on_trial:
                on_trial(trials[-1])
        return {"trajectory_begins_s": round(begun, 2), "whole_session_s": round(whole, 2), "trials": trials}
    finally:
        if saved is None:
            os.environ.pop("INFRA_AGENT_HOME", None)
        else:
            os.environ["INFRA_AGENT_HOME"] = saved
        shutil.rmtree(base, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=8)
    ap.add_argument("--json", type=pathlib.Path, default=ROOT / "bench" / "out" / "kill_points.json")
    args = ap.parse_args()

    def show(t: dict) -> None:
        print(f"  kill at {t['kill_after_s']:5.1f} s: {t['outcome']:<17} "
              + ("; ".join(t["problems"]) if t["problems"] else "ok"), flush=True)

    out = run(args.kills, show)
    lost = sum(1 for t in out["trials"] if t["problems"])
    print(f"the session's trajectory begins at {out['trajectory_begins_s']:.2f} s, it ends at "
          f"{out['whole_session_s']:.2f} s")
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), **out, "kills": args.kills, "with_problems": lost}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"{args.kills} kills, {lost} with a problem; wrote {args.json}")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
