"""The endpoint probe (engine.http) against the real server and engine: it passes on the clean server, and a
server whose engine lock is broken (requests in flight stepping one engine, a lock a refusal leaves held, a
server that answers nothing) is a failure named at target_stack/serve.py within the probe's timeouts.

Defects are planted by text edits of serve.py, loaded as a module in place of target_stack.serve for the
probe's import (the engine, the HTTP server and the clients are the real ones)."""

from __future__ import annotations

import pathlib
import sys
import time
import types

import pytest

import target_stack.serve
from feedback.probe import ProbeContext
from target_stack.probes.http import completions

SERVE = "target_stack/serve.py"
PARAMS = dict(stem=70, max_tokens=4, page_size=16, timeout_s=20, concurrent=6, concurrent_timeout_s=10,
              liveness_timeout_s=2)
LOCKED = '''            with self.lock:
                prefix = self.engine.prefix
                before = prefix.stats["reused_tokens"] if prefix else 0
                outs = self.engine.generate(tokens, params)
                cached = prefix.stats["reused_tokens"] - before if prefix else 0
'''


def _run(monkeypatch, edit: tuple[str, str] | None = None, **params) -> tuple[ProbeContext, float]:
    if edit is not None:
        source = pathlib.Path(target_stack.serve.__file__).read_text()
        assert source.count(edit[0]) == 1, "the text to replace is not in serve.py exactly once"
        module = types.ModuleType("target_stack.serve")
        module.__file__ = target_stack.serve.__file__
        exec(compile(source.replace(*edit), module.__file__, "exec"), module.__dict__)
        monkeypatch.setitem(sys.modules, "target_stack.serve", module)
    ctx = ProbeContext("engine.http", {**PARAMS, **params}, tree=".")
    start = time.monotonic()
    completions(ctx)
    return ctx, time.monotonic() - start


def _located(ctx: ProbeContext) -> list[tuple[str, str, str]]:
    return [(f.location.file, f.location.symbol, f.message) for f in ctx.findings if f.failed]


def test_the_clean_server_passes_with_clients_at_once_and_every_refusal(monkeypatch):
    ctx, _ = _run(monkeypatch)
    assert not ctx.failed, _located(ctx)
    assert ctx.metrics["concurrent_calls"].value == 6 and ctx.metrics["refusals"].value >= 10
    assert ctx.metrics["mismatches"].value == 0


def test_requests_in_flight_stepping_one_engine_are_caught(monkeypatch):
    # a lock of its own for every call: one request at a time is served as before, two at once step one engine
    ctx, _ = _run(monkeypatch, (LOCKED, LOCKED.replace("with self.lock:", "with threading.Lock():")))
    found = _located(ctx)
    assert ctx.failed and found and all(f == SERVE for f, _, _ in found), found
    assert any(s == "Server.complete" and "in flight" in m for _, s, m in found), found


PARAMS_UNDER_LOCK = '''            self.lock.acquire()
            params = SamplingParams(max_tokens=body.get("max_tokens", 16), temperature=body.get("temperature", 0.0),
                                    top_p=body.get("top_p", 1.0), seed=body.get("seed"))
            try:
                prefix = self.engine.prefix
                before = prefix.stats["reused_tokens"] if prefix else 0
                outs = self.engine.generate(tokens, params)
                cached = prefix.stats["reused_tokens"] - before if prefix else 0
            finally:
                self.lock.release()
'''


@pytest.mark.parametrize("refused_where", ["engine", "parameters"])
def test_a_lock_left_held_by_a_refusal_is_caught_within_the_liveness_timeout(monkeypatch, refused_where):
    # a request refused while the lock is held leaves it held, and every later request waits forever: the
    # engine's refusal inside generate (acquire/release instead of a with-block), or a bad sampling parameter
    # (the lock taken before the parameters are checked, released only around generate)
    if refused_where == "engine":
        held = LOCKED.replace("            with self.lock:\n", "            self.lock.acquire()\n").replace(
            "\n                ", "\n            ") + "            self.lock.release()\n"
        edit = (LOCKED, held)
    else:
        source = pathlib.Path(target_stack.serve.__file__).read_text()
        start = source.index("            params = SamplingParams(")
        edit = (source[start:source.index(LOCKED) + len(LOCKED)], PARAMS_UNDER_LOCK)
    ctx, seconds = _run(monkeypatch, edit)
    found = _located(ctx)
    assert ctx.failed and all(f == SERVE for f, _, _ in found), found
    assert any("was refused, a good request" in m and "no answer" in m for _, _, m in found), found
    if refused_where == "parameters":
        assert not any("an empty prompt was refused" in m for _, _, m in found), found  # the engine's are fine
    assert seconds < 2 * PARAMS["liveness_timeout_s"] + 30, seconds  # one timeout waited out, not one per request


def test_a_server_that_answers_nothing_fails_the_probe_within_one_timeout(monkeypatch):
    # the lock taken twice: the first request deadlocks its handler thread, and the probe must not wait on the rest
    ctx, seconds = _run(monkeypatch, (LOCKED, "            self.lock.acquire()\n" + LOCKED), timeout_s=2)
    found = _located(ctx)
    assert ctx.failed and any(f == SERVE and s == "Server.complete" and "no answer" in m for f, s, m in found), found
    assert seconds < 2 + 20, seconds
