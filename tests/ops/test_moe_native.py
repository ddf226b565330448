"""The native MoE dispatch extension: built with the machine's compiler at first use, equal to the
torch reference, and releasing the GIL (a Python thread keeps running during a long call)."""

from __future__ import annotations

import ctypes
import time

import pytest
import torch

from feedback.events import Heartbeat
from target_stack.model.layers import MoE
from target_stack.ops.kda.testing import rel_err
from target_stack.ops.moe import native


def test_native_moe_equals_the_reference_and_is_cached(gen, tmp_path, monkeypatch):
    monkeypatch.setenv("TARGET_STACK_CACHE", str(tmp_path))
    path = native.build()
    assert path.is_relative_to(tmp_path) and path.stat().st_size > 0
    assert native.build() == path  # second call: the cached library, no rebuild
    moe = MoE(dim=40, hidden=24, n_experts=6, top_k=3, generator=gen, backend="native")
    x = torch.randn(37, 40, generator=gen)
    with torch.no_grad():
        out = moe(x)
        ref = moe.reference(x)
    assert rel_err(out, ref) < 1e-5
    with pytest.raises(ValueError, match="expert ids"):
        native.moe_dispatch_combine(x, torch.full((37, 3), 6), torch.ones(37, 3), *moe.stacked_weights())
    with pytest.raises(ValueError, match="CPU float32"):
        native.moe_dispatch_combine(x.double(), torch.zeros(37, 3, dtype=torch.long), torch.ones(37, 3),
                                    *moe.stacked_weights())


def test_a_broken_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TARGET_STACK_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    with pytest.raises(native.NativeBuildError, match="failed"):
        native.build()


def _heartbeat_during(call) -> float:
    with Heartbeat(interval_s=0.001) as hb:
        time.sleep(0.01)
        t0 = time.perf_counter()
        call()
        wall = time.perf_counter() - t0
    return hb.report().max_gap_s, wall


def test_the_native_call_releases_the_gil_and_a_pydll_load_would_not(gen):
    moe = MoE(dim=256, hidden=512, n_experts=8, top_k=2, generator=gen, backend="native")
    x = torch.randn(256, 256, generator=gen)
    w, idx = moe.route(x)
    weights = moe.stacked_weights()
    native.moe_dispatch_combine(x, idx, w, *weights)  # build and warm
    gap, wall = _heartbeat_during(lambda: native.moe_dispatch_combine(x, idx, w, *weights))
    assert wall > 0.02, "the call must be long enough to measure against"
    assert gap < wall / 2, f"heartbeat starved for {gap * 1e3:.1f} ms during a {wall * 1e3:.1f} ms call"
    # the same library loaded so that the GIL is held: the heartbeat stops for the whole call
    held = ctypes.PyDLL(str(native.build())).ts_moe_dispatch_combine
    held.restype, held.argtypes = ctypes.c_int, [ctypes.c_int64] * 5 + [ctypes.c_void_p] * 7
    out = torch.empty(256, 256)
    E, H, D = weights[0].shape
    tensors = (x, idx.contiguous(), w.contiguous(), *weights, out)
    args = [256, D, H, E, 2] + [ctypes.c_void_p(t.data_ptr()) for t in tensors]
    gap_held, wall_held = _heartbeat_during(lambda: held(*args))
    assert gap_held > 0.8 * wall_held


def test_layout_wait_blocks_until_the_flag_then_sorts_pairs_by_expert(gen):
    """The GPU path's dispatch waits for a flag the device writes; here a Python thread writes it,
    which it can only do because the waiting call has released the GIL."""
    import threading

    flag = torch.zeros(1, dtype=torch.int32)
    experts = torch.randint(0, 6, (53,), generator=gen)
    order, ends = torch.empty(53, dtype=torch.int64), torch.empty(6, dtype=torch.int64)
    setter = threading.Timer(0.05, lambda: flag.fill_(3))
    setter.start()
    t0 = time.perf_counter()
    got, got_ends = native.moe_layout_wait(flag, 3, experts, 6, order, ends, timeout_s=10)
    waited = time.perf_counter() - t0
    assert 0.04 < waited < 5
    assert torch.equal(got, torch.argsort(experts, stable=True))
    assert got_ends.tolist() == torch.bincount(experts, minlength=6).cumsum(0).tolist()
    with pytest.raises(TimeoutError, match="did not publish"):
        native.moe_layout_wait(flag, 4, experts, 6, order, ends, timeout_s=0.05)
    with pytest.raises(ValueError, match="expert ids"):
        native.moe_layout_wait(flag, 3, torch.full((53,), 9), 6, order, ends)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU-native MoE path needs CUDA")
def test_gpu_native_moe_equals_the_reference_for_several_layers_in_a_row(gen):
    """The GPU prefill's MoE (host-made layout through the native wait, then grouped GEMMs where
    they verify, per-expert chains otherwise) against the float reference; several calls in a
    row reuse the pinned buffers, which must not race with the previous call's uploads."""
    moe = MoE(dim=256, hidden=128, n_experts=16, top_k=4, generator=gen, backend="native").cuda().bfloat16()
    eager = MoE(dim=256, hidden=128, n_experts=16, top_k=4, backend="torch").cuda().bfloat16()
    eager.load_state_dict(moe.state_dict())
    with torch.no_grad():
        for T in (1000, 37, 513):
            x = torch.randn(T, 256, generator=gen).cuda().bfloat16()
            out, ref = moe(x), moe.reference(x).float()
            assert rel_err(out.float(), ref) < 1e-3, T  # H200: 1e-5..1.2e-4
            assert rel_err(out.float(), eager(x).float()) < 1e-3, T
