"""feedback/jobserver.py: the harness's idle slots lent to a probe, and given back also by a process that dies."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import threading
import time

from feedback import jobserver
from feedback.harness import judge


def test_a_slot_is_lent_only_while_nobody_holds_it(monkeypatch):
    slots = jobserver.Slots(2)
    try:
        monkeypatch.setenv(jobserver.SLOTS_VAR, str(slots.path))
        mine = slots.acquire()  # the harness's probe
        lent = jobserver.lend()
        assert lent is not None and lent.index != mine.index
        assert jobserver.lend() is None  # both held
        lent.release()
        again = jobserver.lend()
        assert again is not None
        again.release()
        mine.release()
    finally:
        slots.close()
    assert jobserver.lend() is None  # the folder is gone: nothing to lend, no error


def test_without_a_harness_that_lends_nothing_is_lent(monkeypatch):
    monkeypatch.delenv(jobserver.SLOTS_VAR, raising=False)
    assert jobserver.lend() is None
    assert jobserver.lend("/nonexistent/infra-agent-slots") is None


def test_the_harness_waits_for_a_lent_slot_and_stops_waiting_when_told(monkeypatch):
    slots = jobserver.Slots(1)
    try:
        lent = jobserver.lend(slots.path)
        got: list = []
        waiter = threading.Thread(target=lambda: got.append(slots.acquire()))
        waiter.start()
        time.sleep(0.3)
        assert not got  # every slot is lent: the harness's next probe waits
        lent.release()
        waiter.join(timeout=5)
        assert got and got[0] is not None
        stop = threading.Event()
        stop.set()
        assert slots.acquire(stop) is None  # held by got[0], and the run is stopping: no wait
        got[0].release()
    finally:
        slots.close()


def test_a_borrower_that_is_killed_gives_its_slot_back(tmp_path):
    slots = jobserver.Slots(1)
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", "import sys, time; from feedback import jobserver; "
             f"s = jobserver.lend({str(slots.path)!r}); print(s is not None, flush=True); time.sleep(60)"],
            stdout=subprocess.PIPE, text=True, cwd=pathlib.Path(jobserver.__file__).parents[1])
        assert child.stdout.readline().strip() == "True"
        assert jobserver.lend(slots.path) is None  # the child holds it
        child.kill()
        child.wait(timeout=10)
        back = jobserver.lend(slots.path)  # no bookkeeping: the kernel dropped the dead process's lock
        assert back is not None
        back.release()
    finally:
        slots.close()


_PROBES = '''
import time
from feedback import jobserver
from feedback.probe import probe

@probe
def short(ctx):
    time.sleep(ctx.params["sleep"])
    with open(ctx.params["log"], "a") as f:
        f.write(f"short-end {time.time()}\\n")

@probe
def borrower(ctx):
    t0 = time.time()
    while time.time() - t0 < ctx.params["wait"]:
        slot = jobserver.lend()
        if slot is not None:
            with open(ctx.params["log"], "a") as f:
                f.write(f"lent {time.time()}\\n")
            slot.release()
            return
        time.sleep(0.02)
    with open(ctx.params["log"], "a") as f:
        f.write(f"none {time.time()}\\n")
'''


def _tree(root: pathlib.Path, log: pathlib.Path, wait: float) -> pathlib.Path:
    (root / "jb").mkdir(parents=True)
    (root / "jb" / "__init__.py").write_text("")
    (root / "jb" / "probes.py").write_text(_PROBES)
    (root / "infra-agent.yaml").write_text(
        "schema_version: 1\nname: lending\nprobes:\n"
        f"  - {{id: a, kind: correctness, entry: 'jb.probes:short', params: {{log: '{log}', sleep: 1.0}}}}\n"
        f"  - {{id: b, kind: correctness, entry: 'jb.probes:borrower', params: {{log: '{log}', wait: {wait}}}}}\n")
    return root


def _log(log: pathlib.Path) -> dict[str, float]:
    return {what: float(t) for what, t in (line.split() for line in log.read_text().splitlines())}


def test_the_harness_lends_a_slot_once_the_probe_beside_has_ended(tmp_path):
    log = tmp_path / "log.txt"
    report = judge(_tree(tmp_path / "t", log, wait=30), run_all=True, jobs=2, use_cache=False)
    assert report.passed, report.results
    stamps = _log(log)
    assert "lent" in stamps, stamps
    assert stamps["lent"] >= stamps["short-end"]  # not while the other probe held its slot


def test_one_job_lends_nothing(tmp_path):
    log = tmp_path / "log.txt"
    report = judge(_tree(tmp_path / "t", log, wait=2.0), run_all=True, jobs=1, use_cache=False)
    assert report.passed, report.results
    assert "none" in _log(log) and "lent" not in _log(log)


def test_a_runner_s_slots_folder_goes_with_it(tmp_path):
    import gc

    from feedback.manifest import load_manifest
    from feedback.runner import Runner

    tree = _tree(tmp_path / "t", tmp_path / "log.txt", wait=0.1)
    runner = Runner(tree, load_manifest(tree), jobs=1, use_cache=False)
    (result,) = runner.run([runner.manifest.probe("b")])
    assert result.status.value == "pass", result.reason
    folder = runner._slots.path
    assert folder.is_dir()
    del runner
    gc.collect()
    assert not folder.exists()
