"""The runner on real subprocesses: every fault a clear status, the tree under test and nothing else, the cache."""

from __future__ import annotations

import pathlib
import time

from feedback import machine
from feedback.harness import judge
from feedback.manifest import load_manifest
from feedback.models import Status
from feedback.targets import materialize_bundled
from tests.support.processes import alive
from tests.support.toy_harness import TOY_MANIFEST, by_id


def test_every_fault_is_a_clear_status_and_the_harness_survives(toy):
    t0 = time.perf_counter()
    report = judge(toy, probe_ids=["toy.ok", "toy.bad", "toy.raises", "toy.hangs", "toy.segfault", "toy.memory",
                                   "toy.skips", "toy.garbage", "toy.cmd"], run_all=True, use_cache=False, jobs=4)
    r = by_id(report)
    assert r["toy.ok"].status == Status.passed and r["toy.ok"].metrics["err"].value == 1e-7
    assert r["toy.bad"].status == Status.failed
    assert "err = 0.5 violates <= 1e-05" in r["toy.bad"].findings[-1].message
    assert r["toy.raises"].status == Status.error
    assert "ZeroDivisionError: deliberate" in r["toy.raises"].reason and "toy/probes.py" in r["toy.raises"].reason
    assert r["toy.hangs"].status == Status.timeout and "budget_s=2" in r["toy.hangs"].reason
    assert r["toy.segfault"].status == Status.error and "SIGSEGV" in r["toy.segfault"].reason
    assert "(at toy/probes.py:" in r["toy.segfault"].reason and "in segfault)" in r["toy.segfault"].reason
    assert r["toy.memory"].status == Status.error and "MemoryError" in r["toy.memory"].reason
    assert r["toy.skips"].status == Status.skipped and r["toy.skips"].reason == "needs a widget"
    assert r["toy.garbage"].status == Status.error and "no JSON result" in r["toy.garbage"].reason
    assert r["toy.cmd"].status == Status.passed and r["toy.cmd"].metrics["ttft_ms"].value == 12.5
    assert time.perf_counter() - t0 < 60
    # the hung probe's child died with its process group
    pid = int((toy / "child.pid").read_text())
    deadline = time.time() + 5
    while alive(pid) and time.time() < deadline:
        time.sleep(0.05)
    assert not alive(pid)




def test_probe_sees_a_change_made_only_in_the_scratch_tree(tmp_path):
    """The static probe imports target_stack from the scratch copy: a tl.dot added only there fails it."""
    tree = materialize_bundled(tmp_path / "scratch")
    clean = judge(tree, probe_ids=["kda.static.dot_precision"], use_cache=False)
    assert clean.results[0].status == Status.passed
    cp = tree / "target_stack" / "ops" / "kda" / "cp.py"
    cp.write_text(cp.read_text().replace("tl.dot(b_M, b_h, input_precision=MERGE_PRECISION)", "tl.dot(b_M, b_h)"))
    dirty = judge(tree, probe_ids=["kda.static.dot_precision"], use_cache=False)
    res = dirty.results[0]
    assert res.status == Status.failed
    assert any(f.location.file.startswith("target_stack/ops/kda/cp.py:") and
               f.location.kernel == "_kda_cp_merge_kernel" for f in res.findings)
    # the installed copy is untouched: the repository's own source still passes
    import target_stack.ops.kda.cp as installed

    assert "input_precision=MERGE_PRECISION" in pathlib.Path(installed.__file__).read_text()


def test_worker_refuses_an_entry_imported_from_outside_the_tree(toy):
    # json is importable in the probe process, but not from the tree under test
    (toy / "infra-agent.yaml").write_text(
        TOY_MANIFEST.replace("probes:\n", "probes:\n  - {id: toy.outside, kind: static, entry: \"json:dumps\"}\n", 1))
    m = load_manifest(toy)
    report = judge(toy, manifest=m, probe_ids=["toy.outside"], use_cache=False)
    assert report.results[0].status == Status.error and "outside the tree under test" in report.results[0].reason


def test_cache_serves_unchanged_probes_and_misses_after_a_covered_change(toy):
    first = judge(toy, probe_ids=["toy.ok"])
    assert not first.results[0].cached
    again = judge(toy, probe_ids=["toy.ok"])
    assert again.results[0].cached and again.results[0].metrics == first.results[0].metrics
    (toy / "toy" / "value.txt").write_text("2")
    changed = judge(toy, probe_ids=["toy.ok"])
    assert not changed.results[0].cached and changed.results[0].metrics["marker"].value == 2.0
    # the probe's own exception is what these files raise here: served from the cache like a result
    raised = judge(toy, probe_ids=["toy.raises"]).results[0]
    again = judge(toy, probe_ids=["toy.raises"]).results[0]
    assert raised.status == again.status == Status.error and again.cached and again.reason == raised.reason
    # a crashed probe process (no result written) is re-run every time
    judge(toy, probe_ids=["toy.segfault"])
    crashed = judge(toy, probe_ids=["toy.segfault"]).results[0]
    assert crashed.status == Status.error and not crashed.cached


def test_a_cached_result_holds_only_while_the_tree_files_its_probe_imported_are_unchanged(toy):
    # the probe's covers name value.txt only; the module it imports is observed, not declared
    (toy / "toy" / "helper.py").write_text("SCALE = 3\n")
    (toy / "toy" / "uses_helper.py").write_text(
        "from feedback.probe import probe\nfrom toy import helper\n\n\n@probe\n"
        "def scale(ctx):\n    ctx.metric('scale', float(helper.SCALE))\n")
    (toy / "infra-agent.yaml").write_text(TOY_MANIFEST.replace("probes:\n", "probes:\n  - {id: toy.helper, kind: "
                                          "correctness, entry: \"toy.uses_helper:scale\", covers: {files: "
                                          "[\"toy/value.txt\"]}}\n", 1))
    m = load_manifest(toy)
    first = judge(toy, manifest=m, probe_ids=["toy.helper"]).results[0]
    assert first.metrics["scale"].value == 3.0 and not first.cached
    assert {"toy/helper.py", "toy/uses_helper.py"} <= first.imports.keys()
    assert judge(toy, manifest=m, probe_ids=["toy.helper"]).results[0].cached
    (toy / "toy" / "helper.py").write_text("SCALE = 4\n")
    after = judge(toy, manifest=m, probe_ids=["toy.helper"]).results[0]
    assert not after.cached and after.metrics["scale"].value == 4.0
    assert judge(toy, manifest=m, probe_ids=["toy.helper"]).results[0].cached
    (toy / "toy" / "helper.py").unlink()  # gone: a miss, and the probe's own error
    gone = judge(toy, manifest=m, probe_ids=["toy.helper"]).results[0]
    assert not gone.cached and gone.status == Status.error


def test_a_work_counting_probe_gets_the_interpreter_and_no_gpu_on_a_gpu_machine(toy, monkeypatch):
    """``interpret: true``: the counts are the interpreter's, on every machine; other probes keep the GPU."""
    import feedback.runner as runner_mod

    manifest = load_manifest(toy)
    counting = manifest.probes[0].model_copy(update={"interpret": True})
    plain = manifest.probes[0]
    monkeypatch.setattr(machine, "gpu_present", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    r = runner_mod.Runner(toy, manifest)
    env = r.env(counting)
    assert env["TRITON_INTERPRET"] == "1" and env["CUDA_VISIBLE_DEVICES"] == ""
    env = r.env(plain)
    assert "TRITON_INTERPRET" not in env and "CUDA_VISIBLE_DEVICES" not in env


def test_probes_get_no_credentials(toy, monkeypatch):
    import feedback.runner as runner_mod

    monkeypatch.setenv("OPENAI_API_KEY", "zq-not-for-probes-123456")
    monkeypatch.setenv("HF_TOKEN", "hf-not-for-probes")
    monkeypatch.setenv("INFRA_AGENT_KEEP", "1")
    env = runner_mod.Runner(toy, load_manifest(toy)).env()
    assert "OPENAI_API_KEY" not in env and "HF_TOKEN" not in env and env["INFRA_AGENT_KEEP"] == "1"


def test_a_probe_runs_with_its_manifests_env_and_the_env_is_part_of_its_cache_key(toy, monkeypatch):
    import feedback.runner as runner_mod

    monkeypatch.setenv("TOY_LEVEL", "from-the-shell")  # the manifest's value wins over the caller's
    reads = ('python3 -c "import json, os; print(json.dumps({\'metrics\': {\'level\': float(os.environ['
             '\'TOY_LEVEL\'])}}))"')
    manifest = load_manifest(toy)
    spec = manifest.probe("toy.cmd").model_copy(update={"command": reads, "env": {"TOY_LEVEL": "7"}})
    other = spec.model_copy(update={"env": {"TOY_LEVEL": "8"}})
    r = runner_mod.Runner(toy, manifest, use_cache=True, cache_dir=str(toy / ".cache"))
    (seven,) = r.run([spec])
    (eight,) = r.run([other])
    assert seven.status.value == "pass" and seven.metrics["level"].value == 7.0, seven.reason
    assert eight.metrics["level"].value == 8.0 and not eight.cached  # another env: not served from the cache
    assert r.cache_key(spec) != r.cache_key(other)
    (again,) = r.run([spec])
    assert again.cached and again.metrics["level"].value == 7.0


def test_a_probe_that_needs_more_gpus_than_the_machine_has_is_skipped_with_the_count(toy, monkeypatch):
    import feedback.runner as runner_mod

    manifest = load_manifest(toy)
    ranks = manifest.probe("toy.ok").model_copy(update={"gpus": 4})
    monkeypatch.setattr(machine, "gpu_present", lambda: True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    (r,) = runner_mod.Runner(toy, manifest, use_cache=False).run([ranks])
    assert r.status.value == "skipped" and r.reason == "needs 4 GPUs together; this machine has 2"
    monkeypatch.setattr(machine, "gpu_present", lambda: False)
    (r,) = runner_mod.Runner(toy, manifest, use_cache=False).run([ranks])
    assert r.status.value == "skipped" and "none on this machine" in r.reason


LOUD = '''
import sys
from feedback.probe import probe

@probe
def loud(ctx):
    line = ("x" * 1023 + "\\n").encode()
    for _ in range(ctx.params["megabytes"] * 1024):
        sys.stdout.buffer.write(line)
    sys.stdout.flush()
    ctx.metric("ok", 1.0)
'''


def test_a_probe_that_prints_a_gigabyte_is_read_to_its_end_and_only_its_tail_kept(tmp_path):
    import resource

    from feedback.manifest import parse_manifest

    root = tmp_path / "loud"
    (root / "ld").mkdir(parents=True)
    (root / "ld" / "__init__.py").write_text("")
    (root / "ld" / "probes.py").write_text(LOUD)
    text = ("schema_version: 1\nname: loud\nprobes:\n  - {id: l, kind: correctness, entry: 'ld.probes:loud', "
            "params: {megabytes: 1024}, budget_s: 120, covers: {files: ['ld/*.py']}}\n")
    (root / "infra-agent.yaml").write_text(text)
    manifest = parse_manifest(text)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    (r,) = _run_all(root, manifest)
    grew_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert r.status.value == "pass", (r.reason, r.stderr[-500:])
    assert r.stdout.startswith("[") and "earlier bytes of output not kept" in r.stdout.splitlines()[0]
    assert len(r.stdout) < 4200 and r.stdout.rstrip().endswith("x" * 100)
    assert grew_mb < 200, f"the harness kept {grew_mb:.0f} MB of a probe's output"


def _run_all(root, manifest):
    from feedback.runner import Runner

    return Runner(root, manifest, use_cache=False, cache_dir=str(root.parent / "cache")).run(manifest.probes)


def test_a_result_cached_on_one_gpu_model_is_not_served_on_another(toy, tmp_path, monkeypatch):
    """A state folder on a shared file system: the GPU model (the driver's record, no torch) is in the key."""
    import feedback.runner as runner_mod

    driver = tmp_path / "driver"
    for bus, model in (("0000:19:00.0", "NVIDIA H200"), ("0000:3b:00.0", "NVIDIA H200")):
        (driver / bus).mkdir(parents=True)
        (driver / bus / "information").write_text(f"Model: \t\t {model}\nIRQ:   \t\t 123\nGPU UUID: \t GPU-1\n")
    assert machine.driver_gpu_model(str(driver)) == "NVIDIA H200"
    assert machine.driver_gpu_model(str(tmp_path / "none")) is None
    manifest = load_manifest(toy)
    monkeypatch.setattr(machine, "gpu_present", lambda: True)
    keys = {}
    for model in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", None):
        monkeypatch.setattr(machine, "driver_gpu_model", lambda model=model: model)
        keys[model] = runner_mod.Runner(toy, manifest, cache_dir=str(toy / ".cache")).cache_key(manifest.probes[0])
    assert len(set(keys.values())) == 3


_THREADS_PROBE = '''
import torch
from feedback.probe import probe

@probe
def threads(ctx):
    ctx.metric("threads", float(torch.get_num_threads()))
'''


def test_parallel_probes_share_the_cores_and_a_thread_count_that_is_set_is_kept(tmp_path, monkeypatch):
    """Each probe's torch gets the cores divided among the probes that run at once (warm from the fork server
    or cold); an ``OMP_NUM_THREADS`` the caller set is left as it is."""
    (tmp_path / "th").mkdir()
    (tmp_path / "th" / "__init__.py").write_text("")
    (tmp_path / "th" / "probes.py").write_text(_THREADS_PROBE)
    (tmp_path / "infra-agent.yaml").write_text(
        "schema_version: 1\nname: threads\nprobes:\n"
        "  - {id: t, kind: correctness, entry: 'th.probes:threads'}\n")
    # two cores however many this machine has (torch takes no more threads than the machine's cores)
    monkeypatch.setattr(machine, "cpu_cores", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for jobs, warm, want in [(1, "1", 2), (2, "1", 1), (2, "0", 1), (1, "0", 2)]:
        monkeypatch.setenv("INFRA_AGENT_FORKSERVER", warm)
        report = judge(tmp_path, run_all=True, jobs=jobs, use_cache=False)
        assert report.results[0].metrics["threads"].value == want, (jobs, warm, report.results[0].reason)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    report = judge(tmp_path, run_all=True, jobs=1, use_cache=False)
    assert report.results[0].metrics["threads"].value == 1


def test_a_result_cached_by_one_harness_is_not_served_by_another(toy, tmp_path, monkeypatch):
    """The harness's own source is part of every cache key: a changed check or probe helper judges anew."""
    import feedback.runner as runner_mod

    harness = tmp_path / "harness"
    for part in ("feedback", "infra_agent"):
        (harness / part / "__pycache__").mkdir(parents=True)
        (harness / part / "a.py").write_text(f"X = '{part}'\n")
    monkeypatch.setattr(runner_mod, "HARNESS_ROOT", harness)
    digest = runner_mod.harness_digest.__wrapped__
    first = digest()
    (harness / "feedback" / "__pycache__" / "a.cpython-312.pyc").write_bytes(b"\0")  # compiled: not source
    assert digest() == first
    (harness / "infra_agent" / "a.py").write_text("X = 'changed'\n")
    assert digest() != first

    manifest = load_manifest(toy)
    keys = set()
    for value in ("one", "another"):
        monkeypatch.setattr(runner_mod, "harness_digest", lambda value=value: value)
        keys.add(runner_mod.Runner(toy, manifest, cache_dir=str(toy / ".cache")).cache_key(manifest.probes[0]))
    assert len(keys) == 2
