"""The MoE op's forms against its definition, on fresh random routings (every expert chosen by some
token, some chosen by none), in float64 for the reference and fp32 for the serving forms."""

from __future__ import annotations

import torch

from target_stack.model.layers import SwiGLU
from target_stack.ops.kda.testing import rel_err
from target_stack.ops.moe import expert_groups, masked_dense, moe_reference, sort_pairs


def _routing(gen: torch.Generator, T: int, E: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=gen) + 0.1
    return w / w.sum(-1, keepdim=True), idx


def _by_loop(x, w, idx, experts) -> torch.Tensor:
    """The definition spelled as a loop over tokens and choices, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = experts[int(idx[t, j])]
            out[t] += w[t, j].double() * torch.nn.functional.linear(
                torch.nn.functional.silu(x[t].double() @ e.w_gate.double().T) * (x[t].double() @ e.w_up.double().T),
                e.w_down.double())
    return out


def test_every_form_is_the_weighted_sum_of_the_chosen_experts(gen):
    T, D, H, E, k = 37, 24, 40, 6, 2
    experts = [SwiGLU(D, H, gen) for _ in range(E)]
    x = torch.randn(T, D, generator=gen)
    w, idx = _routing(gen, T, E, k)
    want = _by_loop(x, w, idx, experts)
    stacked = [torch.stack([getattr(e, n).detach() for e in experts]) for n in ("w_gate", "w_up", "w_down")]
    with torch.no_grad():
        assert rel_err(moe_reference(x.double(), w.double(), idx, [lambda v, e=e: _f64(e, v) for e in experts]),
                       want) < 1e-12
        assert rel_err(expert_groups(x, w, *sort_pairs(idx, E), experts, k), want) < 1e-5
        assert rel_err(masked_dense(x, w, idx, *stacked), want) < 1e-5


def test_expert_groups_skips_experts_nobody_chose(gen):
    T, D, H, E, k = 5, 8, 8, 8, 1
    experts = [SwiGLU(D, H, gen) for _ in range(E)]
    x = torch.randn(T, D, generator=gen)
    w, idx = torch.ones(T, 1), torch.zeros(T, 1, dtype=torch.long)  # all on expert 0
    order, ends = sort_pairs(idx, E)
    assert ends == [T] * E  # every later group is empty
    with torch.no_grad():
        assert rel_err(expert_groups(x, w, order, ends, experts, k), experts[0](x).double()) < 1e-6


def _f64(e: SwiGLU, v: torch.Tensor) -> torch.Tensor:
    f = torch.nn.functional
    return f.linear(f.silu(f.linear(v, e.w_gate.double())) * f.linear(v, e.w_up.double()), e.w_down.double())
