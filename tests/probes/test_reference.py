"""The float64 reference model's per-position margins (what the engine probe's tie rule reads)."""

from __future__ import annotations

import math

import torch

from target_stack.model.model import HybridModel, ModelConfig
from target_stack.probes import reference as ref


def test_per_position_margins_are_causal_and_agree_with_the_sequence_margin():
    seed = int(torch.randint(2**31 - 1, (1,)))
    model = HybridModel(ModelConfig(seed=seed))
    tokens = torch.randint(model.cfg.vocab, (40,), generator=torch.Generator().manual_seed(seed)).tolist()
    logits, margins = ref.hybrid_logits_by_position(model, tokens)
    whole, margin = ref.hybrid_logits(model, tokens)
    assert margins.shape == (len(tokens),) and torch.equal(logits, whole)
    assert margins.min().item() == margin and math.isfinite(margin)
    # the choices at a position see only the tokens up to it: a prefix gives the same margins there
    for end in (1, 17, 33):
        head, head_margins = ref.hybrid_logits_by_position(model, tokens[:end])
        torch.testing.assert_close(head_margins, margins[:end], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(head, logits[:end], rtol=1e-9, atol=1e-12)


def test_a_device_fault_is_one_located_failure_and_the_probes_later_device_work_is_skipped(tmp_path):
    # a probe that runs on "cuda" where no CUDA device answers: its synchronisation fails as a faulted device's
    # does (the error is sticky), so isolated takes the fault path with a real torch error
    from feedback.probe import ProbeContext

    if torch.cuda.is_available():
        import pytest

        pytest.skip("needs a device that cannot synchronise")
    ctx = ProbeContext("p", {}, str(tmp_path))
    ctx._device = "cuda"
    chk = ref.Checker(ctx, 1e-4)
    ran = []

    def kernel_that_faults():
        ran.append(1)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    done, _ = ref.isolated(ctx, kernel_that_faults, chk, file="engine.py", symbol="LLMEngine.generate",
                           condition="config 4")
    assert not done and ref.device_lost(ctx) and ctx.failed and chk.worst == math.inf
    [finding] = ctx.findings
    assert finding.message.startswith(ref.DEVICE_FAULT) and finding.location.condition == "config 4"
    assert "compute-sanitizer" in finding.message
    done, _ = ref.isolated(ctx, lambda: ran.append(2), chk, file="engine.py")
    assert not done and ran == [1] and len(ctx.findings) == 1  # skipped, nothing new claimed


def _tree_with_a_raising_helper(tmp_path):
    """A tree whose kernel file calls a helper in another file that raises, loaded from its files."""
    import importlib.util

    ops = tmp_path / "target_stack" / "ops"
    ops.mkdir(parents=True)
    (ops / "helper.py").write_text("def bad():\n    raise TypeError('only 0-dimensional arrays')\n")
    (ops / "kern.py").write_text("def kernel(fn):\n    return fn() + 1\n")
    mods = {}
    for name in ("helper", "kern"):
        spec = importlib.util.spec_from_file_location(f"_tree_{name}", ops / f"{name}.py")
        mods[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mods[name])
    return mods["kern"], mods["helper"]


def _launch(kern, helper, suppress=False):
    """What an interpreter outside the tree does: run the kernel, raise an error of its own around the kernel's."""
    try:
        kern.kernel(helper.bad)
    except TypeError as exc:
        if suppress:
            raise RuntimeError(f"launch failed: {exc!r}") from None
        raise RuntimeError(f"launch failed: {exc!r}") from exc


def test_a_raised_error_is_traced_through_the_chain_to_the_file_where_it_began(tmp_path):
    import pytest

    from feedback.probe import ProbeContext

    kern, helper = _tree_with_a_raising_helper(tmp_path)
    with pytest.raises(RuntimeError) as info:
        _launch(kern, helper)
    # the outer error's own frames are all outside the tree; the one it wraps began in helper.py
    assert ref.culprit(info.value, tmp_path) == ("target_stack/ops/helper.py", "bad (line 2)")
    with pytest.raises(RuntimeError) as info:
        _launch(kern, helper, suppress=True)
    assert ref.culprit(info.value, tmp_path) is None  # `from None`: the chain is cut, nothing of the tree raised

    # isolated() names that file rather than the one the check was about, keeping the input condition
    ctx = ProbeContext("p", {}, str(tmp_path))
    ctx._device = "cpu"
    done, _ = ref.isolated(ctx, lambda: _launch(kern, helper), file="target_stack/ops/kern.py",
                           kernel="kernel", condition="T=1")
    [finding] = ctx.findings
    assert not done and ctx.failed and finding.message.startswith("raised RuntimeError: launch failed")
    loc = finding.location
    assert (loc.file, loc.symbol, loc.kernel, loc.condition) == ("target_stack/ops/helper.py", "bad (line 2)",
                                                                 None, "T=1")


def test_running_out_of_device_memory_is_located_at_the_check_not_at_the_failed_allocation(tmp_path):
    import pytest

    from feedback.probe import ProbeContext

    ops = tmp_path / "target_stack" / "ops"
    ops.mkdir(parents=True)
    (ops / "alloc.py").write_text("import torch\n\n\ndef grow(n):\n    raise torch.OutOfMemoryError("
                                  "f'CUDA out of memory. Tried to allocate {n} GiB')\n\n\n"
                                  "def load():\n    raise RuntimeError('Triton Error [CUDA]: out of memory')\n")
    import importlib.util

    spec = importlib.util.spec_from_file_location("_tree_alloc", ops / "alloc.py")
    alloc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(alloc)
    with pytest.raises(torch.OutOfMemoryError) as info:
        alloc.grow(3)
    assert ref.culprit(info.value, tmp_path) == ("target_stack/ops/alloc.py", "grow (line 5)")

    # the CPU path runs the check in a forked child: its finding comes back, located at the check
    ctx = ProbeContext("p", {}, str(tmp_path))
    ctx._device = "cpu"
    chk = ref.Checker(ctx, 1e-4)
    done, _ = ref.isolated(ctx, lambda: alloc.grow(3), chk, file="target_stack/engine/engine.py",
                           symbol="LLMEngine.generate", condition="batch 8")
    assert not done and ctx.failed
    [finding] = ctx.findings
    assert finding.message.startswith(ref.OUT_OF_MEMORY) and "Tried to allocate 3 GiB" in finding.message
    assert "in target_stack/ops/alloc.py grow (line 5)" in finding.message  # where it failed: named, not blamed
    assert (finding.location.file, finding.location.symbol, finding.location.condition) == \
        ("target_stack/engine/engine.py", "LLMEngine.generate", "batch 8")

    # a native library's error that says so (a module load under memory pressure), through the guard, and
    # wrapped in another error: the same; any other error is still traced to its frame
    ctx = ProbeContext("p", {}, str(tmp_path))
    chk = ref.Checker(ctx, 1e-4)
    with chk.guard(file="target_stack/model/layer.py", symbol="Layer.forward"):
        try:
            alloc.load()
        except RuntimeError as exc:
            raise ValueError("launch failed") from exc
    with chk.guard(file="target_stack/model/layer.py", symbol="Layer.forward"):
        alloc.grow.__globals__["torch"] = None  # an AttributeError raised inside alloc.grow itself
        alloc.grow(1)
    oom, other = ctx.findings
    assert oom.message.startswith(ref.OUT_OF_MEMORY) and "Triton Error [CUDA]" in oom.message
    assert (oom.location.file, oom.location.symbol) == ("target_stack/model/layer.py", "Layer.forward")
    assert not other.message.startswith(ref.OUT_OF_MEMORY)
    assert (other.location.file, other.location.symbol) == ("target_stack/ops/alloc.py", "grow (line 5)")
    assert chk.worst == math.inf



def _spans(n: int, sleep: float, crash: int | None = None):
    """n independent calls that each report a finding, take ``sleep`` seconds and return their (start, end)
    times; call ``crash`` kills its own process instead."""
    import os
    import signal
    import time

    def call(i: int, ctx):
        def run():
            t0 = time.time()
            if i == crash:
                os.kill(os.getpid(), signal.SIGSEGV)
            time.sleep(sleep)
            ctx.check(False, f"case {i}", file="target_stack/ops/kern.py", condition=f"case={i}")
            return t0, time.time()
        return run, dict(file="target_stack/ops/kern.py", condition=f"case={i}")

    return call


def test_independent_checks_run_at_once_only_on_the_slots_the_harness_lends(tmp_path, monkeypatch):
    from feedback import jobserver
    from feedback.probe import ProbeContext

    call = _spans(3, 0.6)
    monkeypatch.delenv(jobserver.SLOTS_VAR, raising=False)
    ctx = ProbeContext("p", {}, str(tmp_path))
    ctx._device = "cpu"
    alone = ref.isolated_all(ctx, [call(i, ctx) for i in range(3)])
    assert all(done for done, _ in alone)
    spans = [v for _, v in alone]
    assert all(spans[i + 1][0] >= spans[i][1] for i in range(2))  # nothing lent: one after another
    assert [f.message for f in ctx.findings] == ["case 0", "case 1", "case 2"]

    slots = jobserver.Slots(3)  # the harness holds one for this probe; the other two idle
    try:
        mine = slots.acquire()
        monkeypatch.setenv(jobserver.SLOTS_VAR, str(slots.path))
        ctx = ProbeContext("p", {}, str(tmp_path))
        ctx._device = "cpu"
        together = ref.isolated_all(ctx, [call(i, ctx) for i in range(3)])
        spans = [v for _, v in together]
        assert max(s for s, _ in spans) < min(e for _, e in spans)  # all three at once
        assert [f.message for f in ctx.findings] == ["case 0", "case 1", "case 2"]  # reported in order
        lent = [jobserver.lend() for _ in range(2)]
        assert all(s is not None for s in lent)  # both borrowed slots are back
        for s in lent:
            s.release()
        mine.release()
    finally:
        slots.close()


def test_a_check_that_crashes_beside_others_is_located_and_the_others_complete(tmp_path, monkeypatch):
    from feedback import jobserver
    from feedback.probe import ProbeContext

    slots = jobserver.Slots(2)
    try:
        monkeypatch.setenv(jobserver.SLOTS_VAR, str(slots.path))
        ctx = ProbeContext("p", {}, str(tmp_path))
        ctx._device = "cpu"
        call = _spans(3, 0.2, crash=1)
        results = ref.isolated_all(ctx, [call(i, ctx) for i in range(3)])
        assert [done for done, _ in results] == [True, False, True]
        messages = [f.message for f in ctx.findings]
        assert messages[0] == "case 0" and messages[2] == "case 2"
        assert "crashed the process (SIGSEGV)" in messages[1] and ctx.findings[1].location.condition == "case=1"
    finally:
        slots.close()


def test_an_output_of_the_wrong_shape_fails_at_the_code_under_test_not_in_the_comparison(tmp_path):
    from feedback.probe import ProbeContext

    ctx = ProbeContext("p", {}, str(tmp_path))
    chk = ref.Checker(ctx, 1e-4)
    want = torch.randn(2, 3, 37, dtype=torch.float64)
    err = chk.compare(want[..., :36].float(), want, "logits of rank 0", file="target_stack/engine/tp.py",
                      symbol="TPModel.forward", condition="2 ranks, vocab 37")
    assert err == math.inf and chk.worst == math.inf and ctx.failed
    [finding] = ctx.findings
    assert finding.location.file == "target_stack/engine/tp.py" and finding.location.condition == "2 ranks, vocab 37"
    assert "(2, 3, 36)" in finding.message and "(2, 3, 37)" in finding.message
    assert chk.compare(want.float(), want, "the same, right") < 1e-6  # a right one after it still compares
