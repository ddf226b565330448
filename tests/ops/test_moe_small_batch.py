"""The two-launch small-batch MoE experts against float64, in fp32, on fresh random inputs (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from target_stack.model.layers import MoE, SwiGLU
from target_stack.ops.kda.testing import DEVICE, rel_err
from target_stack.ops.moe.reference import moe_reference
from target_stack.ops.moe.small_batch import small_batch_experts, stack_with_shared
from target_stack.ops.utils import interpreting

#: the error of one fp32 -> bf16 store against float64: a GPU rounds to nearest (half a step, at most 2^-8 of
#: a value), the Triton interpreter truncates (a whole step, at most 2^-7): at 2^-8 the interpreter's norm-wise
#: error is its expected value, and a fresh draw passed or failed by chance
BF16_STORE = 2.0**-7 if interpreting() else 2.0**-8


def _experts(E, D, H, gen):
    return [SwiGLU(D, H, gen).to(DEVICE) for _ in range(E + 1)]  # the last one is the shared expert


def _f64(m: SwiGLU):
    g, u, d = (p.detach().double() for p in (m.w_gate, m.w_up, m.w_down))
    return lambda x: (torch.nn.functional.silu(x @ g.t()) * (x @ u.t())) @ d.t()


def _definition(x, w, idx, experts, shared):
    """The routed experts and the shared one, in float64."""
    return moe_reference(x.double(), w.double(), idx, [_f64(m) for m in experts]) + _f64(shared)(x.double())


@pytest.mark.parametrize("T,D,H,E,top_k", [(1, 96, 40, 8, 2), (3, 64, 128, 5, 4), (16, 48, 24, 4, 1),
                                           (2, 130, 70, 6, 6)])
def test_every_chosen_expert_and_the_shared_one_are_summed_with_their_weights(T, D, H, E, top_k, gen):
    mods = _experts(E, D, H, gen)
    x = (torch.randn(T, D, generator=gen) * 2).to(DEVICE)
    idx = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(T)]).to(DEVICE)
    w = torch.rand(T, top_k, generator=gen).to(DEVICE) + 0.1
    sh = mods[E]
    w_gu, w_down = stack_with_shared(*([getattr(m, n).detach() for m in mods] for n in ("w_gate", "w_up", "w_down")),
                                     torch.float32)
    got = small_batch_experts(x, w, idx, w_gu, w_down)
    want = _definition(x, w, idx, mods[:E], sh)
    assert got.shape == (T, D) and got.dtype == torch.float32
    assert rel_err(got, want) < 1e-5
    # a weight of zero drops its expert: the same sum over the others
    w0 = w.clone()
    w0[:, 0] = 0
    want0 = _definition(x, w0, idx, mods[:E], sh)
    assert rel_err(small_batch_experts(x, w0, idx, w_gu, w_down), want0) < 1e-5


@pytest.mark.parametrize("T,D,H,E,top_k,tiles", [(1, 96, 40, 8, 2, None), (16, 48, 24, 4, 1, None),
                                                 (7, 130, 70, 12, 3, (16, 64, 32, 32)), (16, 64, 128, 5, 4, None)])
def test_the_expert_form_reads_each_expert_once_and_gives_the_same_sums(T, D, H, E, top_k, tiles, gen):
    """form='expert': a program per (expert, tile) over every (token, slot) pair the expert serves. Against
    float64 and the token form, with experts nobody chose, tiles that do not divide D or H, and a token that
    names one expert in two slots (its two weights both count)."""
    mods = _experts(E, D, H, gen)
    x = (torch.randn(T, D, generator=gen) * 2).to(DEVICE)
    idx = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(T)])
    if top_k > 1:
        idx[0, 1] = idx[0, 0]  # the same expert twice for token 0
    idx = idx.to(DEVICE)
    w = torch.rand(T, top_k, generator=gen).to(DEVICE) + 0.1
    w_gu, w_down = stack_with_shared(*([getattr(m, n).detach() for m in mods] for n in ("w_gate", "w_up", "w_down")),
                                     torch.float32)
    want = _definition(x, w, idx, mods[:E], mods[E])
    got = small_batch_experts(x, w, idx, w_gu, w_down, tiles=tiles, form="expert")
    assert got.shape == (T, D) and got.dtype == torch.float32
    assert rel_err(got, want) < 1e-5
    assert rel_err(got, small_batch_experts(x, w, idx, w_gu, w_down, form="token")) < 1e-5
    narrow = small_batch_experts(x, w, idx, w_gu, w_down, out_dtype=torch.bfloat16, form="expert")
    assert narrow.dtype == torch.bfloat16 and rel_err(narrow, want) < BF16_STORE
    with pytest.raises(ValueError, match="at least 16"):
        small_batch_experts(x, w, idx, w_gu, w_down, tiles=(8, 64, 32, 32), form="expert")
    with pytest.raises(ValueError, match="form"):
        small_batch_experts(x, w, idx, w_gu, w_down, form="pairs")


def test_the_layer_takes_the_kernels_for_small_batches_and_agrees_with_its_other_forms(gen):
    moe = MoE(64, 32, n_experts=8, top_k=2, generator=gen).to(DEVICE)
    x = torch.randn(5, 64, generator=gen).to(DEVICE)
    with torch.no_grad():
        moe.small_batch = False
        plain = moe.forward_static(x)
        moe.small_batch = True
        fused = moe.forward_static(x)
        moe.small_batch_form = "expert"  # the same layer through the expert form
        by_expert = moe.forward_static(x)
        moe.small_batch_form = "token"
        w, idx = moe.route(x)
        want = _definition(x, w, idx, moe.experts, moe.shared)
    assert rel_err(fused, want) < 1e-5 and rel_err(plain, want) < 1e-5 and rel_err(by_expert, want) < 1e-5
    with torch.no_grad():  # a changed shared expert is read again, not served from the layer's cache
        moe.shared.w_down.mul_(2)
        again = moe.forward_static(x)
        want2 = _definition(x, w, idx, moe.experts, moe.shared)
    assert rel_err(again, want2) < 1e-5


def test_shapes_that_do_not_fit_are_refused():
    x = torch.randn(2, 8, device=DEVICE)
    w, idx = torch.ones(2, 1, device=DEVICE), torch.zeros(2, 1, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="weights must be"):
        small_batch_experts(x, w, idx, torch.zeros(3, 6, 9, device=DEVICE), torch.zeros(3, 8, 3, device=DEVICE))
    with pytest.raises(ValueError):  # one gate for two ups
        stack_with_shared([torch.zeros(3, 8)], [torch.zeros(3, 8)] * 2, [torch.zeros(8, 3)], torch.float32)
    with pytest.raises(ValueError, match="x must be"):
        small_batch_experts(x[0], w, idx, torch.zeros(3, 6, 8, device=DEVICE), torch.zeros(3, 8, 3, device=DEVICE))


def test_every_tiling_gives_the_same_sums_and_a_narrower_output_is_rounded_once(gen):
    T, D, H, E, top_k = 3, 96, 80, 6, 2
    mods = _experts(E, D, H, gen)
    x = torch.randn(T, D, generator=gen).to(DEVICE)
    idx = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(T)]).to(DEVICE)
    w = torch.rand(T, top_k, generator=gen).to(DEVICE) + 0.1
    w_gu, w_down = stack_with_shared(*([getattr(m, n).detach() for m in mods] for n in ("w_gate", "w_up", "w_down")),
                                     torch.float32)
    want = _definition(x, w, idx, mods[:E], mods[E])
    for tiles in (None, (16, 32, 16, 32), (128, 16, 128, 16), (1, 128, 256, 1)):
        got = small_batch_experts(x, w, idx, w_gu, w_down, tiles=tiles)
        assert rel_err(got, want) < 1e-5, tiles
    # fp32 accumulation, one rounding at the store: what the layer used to get from a separate conversion
    narrow = small_batch_experts(x, w, idx, w_gu, w_down, out_dtype=torch.bfloat16)
    assert narrow.dtype == torch.bfloat16
    ulp = (got.abs() * 2.0**-7).clamp_min(1e-30)
    assert ((narrow.float() - got).abs() <= ulp).all()  # within one bf16 step of the fp32 sum
    assert rel_err(narrow, want) < BF16_STORE
    with pytest.raises(ValueError, match="powers of two"):
        small_batch_experts(x, w, idx, w_gu, w_down, tiles=(48, 32, 16, 32))
