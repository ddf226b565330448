"""``infra-agent report``: a real session's page (a model proposes a fix through the real ``openai`` client,
the harness judges it), its plots drawn from the records, then loaded in a real headless Chromium."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import git
import pytest

from tests.support.chat import ScriptedServer, ok, tool_call

CORE = "SCALE = {scale}\n"
PROBES = '''
import time
from feedback.probe import probe
from rp import core

@probe
def chain(ctx):
    for ranks in (2, 8, 32):  # an error that grows with the chain, as a tf32 merge's does
        ctx.metric(f"err_p{ranks}", core.SCALE * ranks, better="lower")
    ctx.check(core.SCALE < 1e-6, "error grows with the number of ranks", file="rp/core.py")

@probe
def bench(ctx):
    t0 = time.perf_counter()
    s = 0
    for i in range(20000):
        s += i * i
    ctx.metric("step_us", (time.perf_counter() - t0) * 1e6, unit="us", better="lower")
    ctx.metric("bandwidth_vs_copy", 0.4 if core.SCALE > 1e-6 else 0.8, better="higher")
'''
MANIFEST = '''
schema_version: 1
name: report-toy
probes:
  - {id: rp.chain, kind: correctness, entry: "rp.probes:chain", covers: {files: ["rp/core.py"]}}
  - {id: rp.bench, kind: microbench, entry: "rp.probes:bench", repeats: 3, covers: {files: ["rp/core.py"]}}
protected: [rp/probes.py]
'''
FIX = "--- a/rp/core.py\n+++ b/rp/core.py\n@@ -1 +1 @@\n-SCALE = 0.001\n+SCALE = 1e-08\n"


def _session(tmp_path: pathlib.Path) -> tuple[pathlib.Path, dict]:
    root = tmp_path / "target"
    for rel, text in {"rp/__init__.py": "", "rp/core.py": CORE.format(scale=0.001), "rp/probes.py": PROBES,
                      "infra-agent.yaml": MANIFEST}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    repo = git.Repo.init(root, initial_branch="main")
    repo.git.add(A=True)
    repo.index.commit("toy", author=git.Actor("t", "t@t"), committer=git.Actor("t", "t@t"))
    env = {**os.environ, "OPENAI_API_KEY": "sk-test-report-0123456789", "COLUMNS": "160"}
    with ScriptedServer([ok(tool_call("propose_patch", hypothesis="the chain loses accuracy", diff=FIX)),
                         ok(tool_call("finish", summary="fixed"))]) as server:
        out = subprocess.run([sys.executable, "-m", "infra_agent.cli", "run", "--target", str(root), "--backend",
                              "openai", "--model", "m", "--base-url", server.url, "--json"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=600)
    assert out.returncode in (0, 1), out.stderr[-3000:]
    return root, json.loads(out.stdout)


def test_a_sessions_report_draws_its_evidence_and_opens_in_a_browser(tmp_path):
    root, summary = _session(tmp_path)
    page = pathlib.Path(summary["report"])  # every session writes its page
    assert page.is_file()
    out = subprocess.run([sys.executable, "-m", "infra_agent.cli", "report", "--target", str(root), "--html",
                          str(tmp_path / "r.html")], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    text = (tmp_path / "r.html").read_text()
    assert "the chain loses accuracy" in text and "verdict better" in text and "SCALE = 1e-08" in text
    assert "rp.chain: err against p" in text  # error against the number of ranks, baseline and candidate
    assert "rp.bench.step_us" in text and "95% interval" in text  # the A/B distribution of the repeats
    assert "rp.bench.bandwidth_vs_copy" in text  # the roofline position
    assert text.count("<svg") >= 3 and "<script" not in text and "http://" not in text.replace(
        'xmlns="http://www.w3.org/2000/svg"', "")  # self-contained: nothing to fetch
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no Chromium here (.ci/run installs Debian's chromium)")
    args = [browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
            f"--user-data-dir={tmp_path / 'profile'}"]
    shot = tmp_path / "report.png"
    seen = subprocess.run([*args, f"--screenshot={shot}", "--window-size=1200,2400", (tmp_path / "r.html").as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert shot.is_file() and shot.stat().st_size > 10_000, seen.stderr[-2000:]
    console = [ln for ln in seen.stderr.splitlines() if "CONSOLE" in ln or "Uncaught" in ln]
    assert not console, console
    dom = subprocess.run([*args, "--dump-dom", (tmp_path / "r.html").as_uri()], capture_output=True, text=True,
                         timeout=120).stdout
    assert dom.count("<svg") >= 3 and dom.count('class="point"') >= 9  # the plots are there, with their data
    assert 'class="series"' in dom and 'class="bar"' in dom


def test_the_committed_records_make_one_page(tmp_path):
    """``report --experiments``: what CI replays, drawn: every committed record, with its plots."""
    repo = pathlib.Path(__file__).resolve().parents[2]
    records = sorted((repo / "experiments").glob("*.yaml"))
    out = subprocess.run([sys.executable, "-m", "infra_agent.cli", "report", "--experiments", str(repo / "experiments"),
                          "--html", str(tmp_path / "x.html")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    text = (tmp_path / "x.html").read_text()
    assert f"{len(records)} record(s)" in text
    assert all(f'id="{r.stem}"' in text for r in records)
    assert "kda.cp.merge: err against p" in text  # the cp-tf32 fix: error against partitions, before and after
    spans = text.count('class="span"')
    assert "engine.kv_transfer.events: runtime events per thread" in text and spans > 0  # the GIL fix's timeline
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is not None:  # as a person sees it: every span drawn, nothing complained of
        args = [browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
                f"--user-data-dir={tmp_path / 'profile'}"]
        seen = subprocess.run([*args, "--dump-dom", (tmp_path / "x.html").as_uri()], capture_output=True, text=True,
                              timeout=120)
        assert seen.stdout.count('class="span"') == spans, seen.stderr[-2000:]
        assert not [ln for ln in seen.stderr.splitlines() if "CONSOLE" in ln or "Uncaught" in ln]
    bad = subprocess.run([sys.executable, "-m", "infra_agent.cli", "report", "--experiments", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no such folder" in bad.stderr


def test_an_events_probes_timeline_is_drawn_per_thread_before_and_after(tmp_path):
    """The bundled KV-transfer probe, run for real: its result keeps the spans it read, and the page draws
    them per thread (the transfer thread its own row) on one time axis for both sides."""
    import xml.etree.ElementTree as ET

    from feedback.models import ProbeResult
    from infra_agent import report

    def judged(tree_args: list[str]) -> ProbeResult:
        run = subprocess.run([sys.executable, "-m", "infra_agent.cli", "feedback", *tree_args, "--probe",
                              "engine.kv_transfer.events", "--no-cache", "--json"], cwd=tmp_path, capture_output=True,
                             text=True, timeout=600)
        assert run.returncode in (0, 1), run.stderr[-2000:]
        return ProbeResult.model_validate(json.loads(run.stdout)["results"][0])

    res = judged([])
    threads = {s.thread for s in res.timeline}
    assert "kv-transfer" in threads and len(threads) >= 2, threads
    assert any(s.name == "kv_transfer" and s.dur_ms > 0 for s in res.timeline)
    assert any(s.name == "dispatch" and s.dur_ms > 0 for s in res.timeline)  # the native MoE calls
    (plot,) = report.timelines({"engine.kv_transfer.events": (res, res.model_copy(update={"timeline": []}))})
    root = ET.fromstring(plot)  # well-formed SVG
    ns = {"s": "http://www.w3.org/2000/svg"}
    rects = [r for r in root.iter(f"{{{ns['s']}}}rect") if r.get("class") == "span"]
    assert len(rects) == len(res.timeline)
    labels = {t.text for t in root.iter(f"{{{ns['s']}}}text")}
    assert {"baseline (no events)", "candidate"} <= labels and "kv-transfer" in labels
    assert all(float(r.get("width")) > 0 for r in rects)
