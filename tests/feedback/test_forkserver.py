"""The fork server on real processes: warm probes that see nothing of the tree before them."""

from __future__ import annotations

import os
import pathlib
import signal
import time

import pytest

from feedback import forkserver
from feedback.manifest import ManifestError, parse_manifest
from feedback.models import Status
from feedback.runner import Runner
from tests.support.processes import alive
from tests.support.trees import probe_tree

pytestmark = pytest.mark.skipif(not forkserver.enabled(), reason="the fork server needs Linux (pidfd, SCM_RIGHTS)")

MANIFEST = """
schema_version: 1
name: leaky
python_path: ["."]
probes:
  - id: leaky.probe
    kind: correctness
    entry: leaky.probe:check
    params: {scratch: "%s"}
"""

# The same module in both trees (same name, same kernel name), differing only in what the kernel adds.
PROBE = '''
import sys
PRELOADED = "torch" in sys.modules  # before this module imports anything: was the probe forked warm?
import os, pathlib, random
import numpy, torch, triton, triton.language as tl
from feedback.probe import probe

TREE = "{tree}"

@triton.jit
def _add(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=m) + {add}, mask=m)

@probe(kind="correctness")
def check(ctx):
    scratch = pathlib.Path(ctx.params["scratch"])
    mine = pathlib.Path(__file__).resolve().parents[1]
    foreign = [n for n, m in list(sys.modules.items())
               if (f := getattr(m, "__file__", None)) and scratch in pathlib.Path(f).resolve().parents
               and mine not in pathlib.Path(f).resolve().parents]
    ctx.metric("foreign_modules", len(foreign))
    ctx.metric("globals_left", float(hasattr(torch, "_leaky_mark") or hasattr(tl, "_leaky_mark")))
    torch._leaky_mark = tl._leaky_mark = TREE  # left behind on purpose: the next probe must not see them
    x = torch.randn(16, device=ctx.device)
    y = x.clone()
    _add[(1,)](y, 16, BLOCK=16)
    ctx.metric("added", (y - x).mean().item())
    ctx.metric("preloaded", float(PRELOADED))
    ctx.metric("pid", float(os.getpid()))
    ctx.metric("draw", random.random() + float(numpy.random.rand()))
    ctx.metric("cwd_is_tree", float(pathlib.Path.cwd().resolve() == mine))
    want = os.environ.get("TRITON_CACHE_DIR")
    try:
        seen = triton.knobs.cache.dir
    except AttributeError:  # a Triton before knobs
        from triton.runtime.cache import default_cache_dir
        seen = default_cache_dir()
    ctx.metric("own_cache_dir", float(want is None or seen == want))
'''


def _tree(root: pathlib.Path, scratch: pathlib.Path, name: str, add: float) -> pathlib.Path:
    (root / "leaky").mkdir(parents=True)
    (root / "leaky" / "__init__.py").write_text("")
    (root / "leaky" / "probe.py").write_text(PROBE.format(tree=name, add=add))
    (root / "infra-agent.yaml").write_text(MANIFEST % scratch)
    return root


def _run(tree: pathlib.Path, **env: str) -> dict[str, float]:
    runner = Runner(tree, parse_manifest((tree / "infra-agent.yaml").read_text()), use_cache=False, extra_env=env)
    (res,) = runner.run(runner.manifest.probes)
    assert res.status == Status.passed, (res.reason, res.stderr[-2000:])
    return {k: m.value for k, m in res.metrics.items()}


@pytest.fixture
def home(tmp_path, monkeypatch) -> pathlib.Path:
    """A state home of the test's own, so the servers counted are this test's; stopped after it."""
    home = tmp_path / "home"
    monkeypatch.setenv("INFRA_AGENT_HOME", str(home))
    yield home
    forkserver.shutdown(home)


def test_a_warm_probe_sees_no_module_global_or_kernel_of_the_tree_before_it(tmp_path, home):
    a = _tree(tmp_path / "a", tmp_path, "a", 1.0)
    b = _tree(tmp_path / "b", tmp_path, "b", 2.0)
    runs = [_run(a), _run(b), _run(a), _run(b)]
    assert [r["added"] for r in runs] == pytest.approx([1.0, 2.0, 1.0, 2.0])  # each tree's own kernel
    for r in runs:
        assert r["foreign_modules"] == 0 and r["globals_left"] == 0 and r["cwd_is_tree"] == 1
        assert r["preloaded"] == 1  # served warm: torch was there before the probe's first line
    assert len({r["pid"] for r in runs}) == 4  # a process per probe
    assert len({r["draw"] for r in runs}) == 4  # each with random state of its own, as a cold process has
    assert len(forkserver.servers(home)) == 1  # all four from one server


def test_probes_with_triton_caches_of_their_own_share_one_server_and_keep_their_caches(tmp_path, home):
    """The Ray executor gives each worker a Triton cache of its own: a variable read only where it is used
    does not split the servers, and each probe still runs with its own value."""
    tree = _tree(tmp_path / "a", tmp_path, "a", 1.0)
    for name in ("worker-1", "worker-2", "worker-1"):
        r = _run(tree, TRITON_CACHE_DIR=str(tmp_path / name))
        assert r["own_cache_dir"] == 1 and r["preloaded"] == 1 and r["added"] == pytest.approx(1.0)
    assert len(forkserver.servers(home)) == 1


def test_a_server_that_cannot_start_leaves_the_probes_cold_and_their_verdicts_unchanged(tmp_path, home,
                                                                                        monkeypatch):
    monkeypatch.setattr(forkserver, "PRELOAD", ("no_such_module_for_the_fork_server",))
    monkeypatch.setattr(forkserver, "_cold", {})
    r = _run(_tree(tmp_path / "a", tmp_path, "a", 1.0))
    assert r["added"] == pytest.approx(1.0) and r["preloaded"] == 0  # run cold, and right
    (why,) = forkserver._cold.values()
    assert "no_such_module_for_the_fork_server" in why
    assert forkserver.servers(home) == []


def test_a_server_is_per_environment_and_retires_when_idle(tmp_path, home, monkeypatch):
    # idle long enough that a server is still there when its run returns, on a loaded machine too (at 2 s, a
    # GPU host running 12 test workers saw the first server retire before its pid file was read)
    monkeypatch.setenv("INFRA_AGENT_FORKSERVER_IDLE_S", "8")
    tree = _tree(tmp_path / "a", tmp_path, "a", 1.0)

    def running() -> dict[str, int]:
        return {p.stem: int(p.read_text()) for p in (home / "forkserver").glob("*.pid")}

    _run(tree)
    seen = running()
    monkeypatch.setenv("SOME_SETTING_A_LIBRARY_READS_AT_IMPORT", "1")
    _run(tree)
    seen |= running()
    assert len(seen) == 2  # another environment, another server
    deadline = time.monotonic() + 40
    while any(alive(p) for p in seen.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in seen.values()), "an idle server did not exit"
    assert running() == {} and not any(forkserver.socket_path(key).exists() for key in seen)


def test_the_harness_killing_a_warm_probe_kills_its_process_group(tmp_path, home):
    tree = probe_tree(tmp_path / "t", "sleepy", "import subprocess, sys, time, pathlib\n"
                      "def hang(ctx):\n"
                      "    child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
                      "    pathlib.Path('child.pid').write_text(str(child.pid))\n"
                      "    time.sleep(600)\n",
                      "  - {id: sleepy.hang, kind: correctness, entry: 'sleepy.probes:hang', budget_s: 3}\n")
    runner = Runner(tree, parse_manifest((tree / "infra-agent.yaml").read_text()), use_cache=False)
    (res,) = runner.run(runner.manifest.probes)
    assert res.status == Status.timeout and "budget_s=3" in res.reason
    child = int((tree / "child.pid").read_text())
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child), "the warm probe's child outlived its budget"
    assert len(forkserver.servers(home)) == 1 and all(alive(p) for p in forkserver.servers(home))


def test_stopping_a_server_removes_its_socket_first(tmp_path, home):
    _run(_tree(tmp_path / "a", tmp_path, "a", 1.0))
    (pid,) = forkserver.servers(home)
    (sock,) = [forkserver.socket_path(p.stem) for p in (home / "forkserver").glob("*.pid")]
    assert sock.exists()
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid) and not sock.exists()


PRELOAD_PROBE = '''
import sys
WARM = "torch" in sys.modules
MIME = "email.mime.text" in sys.modules
from feedback.probe import probe
import shadowpkg

@probe(kind="correctness")
def check(ctx):
    ctx.metric("warm", float(WARM))
    ctx.metric("mime_preloaded", float(MIME))
    ctx.metric("installed_copy", float(shadowpkg.INSTALLED))
'''


def _preload_tree(root: pathlib.Path, preload: list[str]) -> pathlib.Path:
    (root / "pre").mkdir(parents=True)
    (root / "pre" / "__init__.py").write_text("")
    (root / "pre" / "probe.py").write_text(PRELOAD_PROBE)
    (root / "shadowpkg").mkdir()
    (root / "shadowpkg" / "__init__.py").write_text("INSTALLED = False\n")  # the tree's own copy
    (root / "infra-agent.yaml").write_text(
        f"schema_version: 1\nname: pre\npython_path: ['.']\npreload: {preload}\nprobes:\n"
        "  - {id: pre.probe, kind: correctness, entry: 'pre.probe:check'}\n")
    return root


def test_a_manifest_preloads_more_and_never_an_installed_copy_of_the_tree(tmp_path, home, monkeypatch):
    """``preload`` adds third-party imports to the warm server (one server per list); a preloaded module that
    pulls in an installed copy of a package the tree provides makes that tree's probes run cold, so the probe
    imports the tree's own copy, never the server's."""
    site = tmp_path / "site"
    (site / "shadowpkg").mkdir(parents=True)
    (site / "shadowpkg" / "__init__.py").write_text("INSTALLED = True\n")  # installed, shadowed by the tree's
    (site / "pullsin.py").write_text("import shadowpkg\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setattr(forkserver, "_clashes", {})
    plain, more = _run(_preload_tree(tmp_path / "a", [])), _run(_preload_tree(tmp_path / "b", ["email.mime.text"]))
    assert plain["warm"] == 1 and plain["mime_preloaded"] == 0 and plain["installed_copy"] == 0
    assert more["warm"] == 1 and more["mime_preloaded"] == 1 and more["installed_copy"] == 0
    assert len(forkserver.servers(home)) == 2  # one per preload list
    pulled = _run(_preload_tree(tmp_path / "c", ["email.mime.text", "pullsin"]))
    assert pulled["installed_copy"] == 0  # the tree's own shadowpkg was judged
    assert pulled["warm"] == 0  # run cold: the warm server holds the installed shadowpkg
    assert any("shadowpkg" in why for why in forkserver._clashes.values())


def test_a_preload_entry_must_be_a_module_name():
    with pytest.raises(ManifestError, match="not a module name"):
        parse_manifest("schema_version: 1\nname: x\npreload: ['os; rm -rf /']\nprobes:\n"
                       "  - {id: x.p, kind: correctness, entry: 'x.p:check'}\n")


def test_the_server_sees_the_files_it_holds_open(tmp_path):
    """What a server checks after its imports: a driver file held open (CUDA initialised before the fork)."""
    held = tmp_path / "driver-like"
    with open(held, "w"):
        assert forkserver.opened_files(str(tmp_path)) == [str(held)]
    assert forkserver.opened_files(str(tmp_path)) == []


DRIVER_PROBE = '''
import sys
WARM = "torch" in sys.modules
MIME = "email.mime.text" in sys.modules
OPENER = "opensdriver" in sys.modules
from feedback.probe import probe

@probe(kind="correctness")
def check(ctx):
    ctx.metric("warm", float(WARM))
    ctx.metric("mime_preloaded", float(MIME))
    ctx.metric("opener_preloaded", float(OPENER))
'''


def test_a_preload_that_opens_the_gpu_driver_is_left_out_and_the_rest_stay_warm(tmp_path, home, monkeypatch,
                                                                                capfd):
    """On a GPU machine ``torch._inductor.compile_fx`` opened ``/dev/nvidiactl`` at import (fla's manifest,
    2026-12-03): a server holding the driver cannot hand the GPU to a fork.  The server names the import
    that opened it, and the harness starts one without that module; the others stay preloaded, the probe
    runs warm and imports the left-out module itself."""
    driver = tmp_path / "fake-driver"
    site = tmp_path / "site"
    site.mkdir()
    (site / "opensdriver.py").write_text(f"HANDLE = open({str(driver) + 'ctl'!r}, 'w')  # held, as a runtime would\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("INFRA_AGENT_FORKSERVER_DRIVERS", str(driver))
    monkeypatch.setattr(forkserver, "_opens_driver", {})
    root = tmp_path / "t"
    (root / "pre").mkdir(parents=True)
    (root / "pre" / "__init__.py").write_text("")
    (root / "pre" / "probe.py").write_text(DRIVER_PROBE)
    (root / "infra-agent.yaml").write_text(
        "schema_version: 1\nname: pre\npython_path: ['.']\npreload: [email.mime.text, opensdriver]\nprobes:\n"
        "  - {id: pre.probe, kind: correctness, entry: 'pre.probe:check'}\n")
    first = _run(root)
    assert first == {"warm": 1.0, "mime_preloaded": 1.0, "opener_preloaded": 0.0}
    assert forkserver._opens_driver == {"opensdriver": str(driver) + "ctl"}
    err = capfd.readouterr().err
    assert err.count("leaves out opensdriver") == 1 and "fake-driverctl" in err
    assert _run(root) == first  # the next probe goes straight to the server without it
    assert "leaves out" not in capfd.readouterr().err
    assert len(forkserver.servers(home)) == 1
