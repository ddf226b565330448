"""target_stack model layers and quantisation against their references, on fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from target_stack.model.layers import MoE, RMSNorm, dense_causal_attention, sparse_attention
from target_stack.model.quant import W8A8Linear, dequantize_kv, quantize_kv
from target_stack.ops.kda.testing import rel_err


def test_rmsnorm_matches_float64_reference(gen):
    n = RMSNorm(64)
    with torch.no_grad():
        n.weight.copy_(torch.rand(64, generator=gen) + 0.5)
    x = torch.randn(7, 64, generator=gen)
    assert rel_err(n(x), n.reference(x.double())) < 1e-6


def test_moe_grouped_equals_dense_reference_and_uses_every_chosen_expert(gen):
    moe = MoE(dim=32, hidden=48, n_experts=8, top_k=2, generator=gen)
    x = torch.randn(50, 32, generator=gen)
    with torch.no_grad():
        out, ref = moe(x), moe.reference(x)
        w, idx = moe.route(x)
    assert rel_err(out, ref) < 1e-5
    assert torch.allclose(w.sum(-1), torch.ones(50)) and idx.shape == (50, 2)
    assert len(set(idx.flatten().tolist())) > 2  # tokens really spread over experts
    with pytest.raises(ValueError, match="top_k"):
        MoE(8, 8, 4, 5)


def test_the_moe_s_derived_layouts_follow_every_weight_change(gen):
    """The fp32 stacks, the grouped GEMMs' layout and the small-batch stack are remade after an in-place
    write to one expert's weight and after a weight is replaced, and per dtype: each is what its builder
    makes from the weights as they are now (a stale layout would compute with the old weights)."""
    moe = MoE(dim=16, hidden=24, n_experts=4, top_k=2, generator=gen)

    def fresh():
        wg, wu, wd = (torch.stack([getattr(e, n).float() for e in moe.experts]) for n in ("w_gate", "w_up", "w_down"))
        return (wg, wu, wd), (torch.cat([wg, wu], 1).transpose(1, 2), wd.transpose(1, 2))

    def check(dtype):
        stacks, grouped = fresh()
        assert all(torch.equal(a, b) for a, b in zip(moe.stacked_weights(), stacks, strict=True))
        got = moe._grouped_weights(dtype)
        assert all(a.dtype == dtype and torch.equal(a, b.to(dtype)) for a, b in zip(got, grouped, strict=True))
        gu, down = moe._small_weights(dtype)
        assert torch.equal(gu[-1], torch.cat([moe.shared.w_gate, moe.shared.w_up]).to(dtype))
        assert torch.equal(down[2], moe.experts[2].w_down.to(dtype))

    check(torch.float32)
    with torch.no_grad():
        moe.experts[1].w_up.mul_(-3.0)  # in place: the version counter moves
        moe.shared.w_gate.add_(1.0)
    check(torch.float32)
    with torch.no_grad():
        moe.experts[2].w_down.data = torch.randn(moe.experts[2].w_down.shape, generator=gen)  # new storage
    check(torch.float32)
    check(torch.bfloat16)
    first = moe._grouped_weights(torch.float32)
    assert moe._grouped_weights(torch.float32)[0] is first[0]  # unchanged weights: the cached layout


def test_sparse_attention_equals_dense_within_top_k(gen):
    T, H, D, Di, block = 40, 2, 16, 8, 8
    q, k, v = (torch.randn(T, H, D, generator=gen) for _ in range(3))
    iq, ik = torch.randn(T, Di, generator=gen), torch.randn(T, Di, generator=gen)
    dense = dense_causal_attention(q, k, v)
    within = sparse_attention(q, k, v, iq, ik, block=block, top_k=5, window=4)  # 5 blocks cover T=40
    assert rel_err(within, dense) < 1e-5
    sparse = sparse_attention(q, k, v, iq, ik, block=block, top_k=1, window=4)
    assert rel_err(sparse, dense) > 1e-3  # really sparse when top-k does not cover the sequence
    assert torch.isfinite(sparse).all()


def test_w8a8_linear_within_common_practice_tolerance(gen):
    lin = torch.nn.Linear(256, 128)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(128, 256, generator=gen) * 0.05)
        lin.bias.copy_(torch.randn(128, generator=gen) * 0.1)
    x = torch.randn(33, 256, generator=gen)
    q = W8A8Linear.from_linear(lin)
    assert q.qweight.dtype == torch.int8
    with torch.no_grad():
        ref, out = lin(x), q(x)
    mean_rel = ((out - ref).abs().mean() / ref.abs().mean()).item()
    assert mean_rel < 0.05, mean_rel


@pytest.mark.parametrize("kind", ["int8", "fp8", "bf16", "fp32"])
def test_kv_storage_round_trip(kind, gen):
    x = torch.randn(17, 4, 64, generator=gen)
    values, scale = quantize_kv(x, kind)
    back = dequantize_kv(values, scale)
    if kind == "int8":
        assert values.dtype == torch.int8 and scale.shape == (17, 4, 1)
        assert ((back - x).abs() <= scale / 2 + 1e-7).all()  # within half a scale step
    elif kind == "fp8":
        assert values.dtype == torch.float8_e4m3fn
        assert torch.allclose(back, x, atol=1e-3, rtol=0.1)
    elif kind == "bf16":
        assert torch.allclose(back, x, rtol=1e-2, atol=1e-3)
    else:
        assert torch.equal(back, x)
    with pytest.raises(ValueError, match="KV storage kind"):
        quantize_kv(x, "int4")


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_kda_layer_prefill_matches_reference_and_decode_continues_it(gen, backend):
    from target_stack.model.kda_layer import KDALayer

    dev = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"  # Triton: the GPU's tensors
    layer = KDALayer(dim=48, heads=2, head_k=16, head_v=16, generator=gen, backend=backend).to(dev)
    x = torch.randn(2, 23, 48, generator=gen).to(dev)
    with torch.no_grad():
        full = layer(x)
        assert rel_err(full, layer.reference(x)) < 1e-5
        # prefill 20 tokens, then decode 3 one at a time with the carried conv and KDA states
        out, state = layer.prefill(x[:, :20])
        steps = [out]
        for t in range(20, 23):
            y, state = layer.decode(x[:, t:t + 1], state)
            steps.append(y)
    assert rel_err(torch.cat(steps, dim=1), full) < 1e-5


def test_the_fused_norms_are_their_torch_forms(gen):
    """The one-launch norms (on a GPU natively, elsewhere through the interpreter) against their torch forms."""
    from target_stack.model.kda_layer import KDALayer

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    layer = KDALayer(dim=40, heads=3, head_k=8, head_v=24, generator=gen).to(dev)
    with torch.no_grad():
        layer.norm_w.copy_(torch.rand(24, generator=gen) + 0.5)
        o, x = (torch.randn(*shape, generator=gen).to(dev) for shape in ((2, 5, 3, 24), (2, 5, 40)))
        assert rel_err(layer._output(o, x, fused=True), layer._output(o, x, fused=False)) < 1e-6
        norm = RMSNorm(40).to(dev)
        norm.weight.copy_(torch.rand(40, generator=gen) + 0.5)
        torch_form = norm(x)
        norm.fused = True
        assert rel_err(norm(x), torch_form) < 1e-6


def test_hybrid_model_serving_path_matches_the_reference_path(gen):
    from target_stack.model.model import HybridModel, ModelConfig

    dev = "cuda" if torch.cuda.is_available() else "cpu"  # Triton kernels: the GPU, or the interpreter
    model = HybridModel(ModelConfig(kda_backend="triton")).to(dev)
    kinds = ["attn" if b.is_attn else "kda" for b in model.blocks]
    assert kinds == ["kda", "kda", "kda", "attn"]
    T = model.cfg.block * model.cfg.top_k_blocks  # sparse attention is exact up to top_k * block tokens
    tokens = torch.randint(0, model.cfg.vocab, (2, T), generator=gen).to(dev)
    logits = model(tokens)
    assert logits.shape == (2, T, model.cfg.vocab) and torch.isfinite(logits).all()
    assert rel_err(logits, model.reference(tokens)) < 1e-4
    with pytest.raises(ValueError, match="token ids"):
        model(torch.full((1, 3), model.cfg.vocab, device=dev))
    with pytest.raises(ValueError, match="unknown preset"):
        HybridModel("huge")


def test_the_attention_projections_in_one_product_are_the_two(gen):
    """With the kernels on, the attention layer projects through its stacked weights: the same q, k, v and
    indexer query and key as its two separate products, and a weight changed in place is seen."""
    from target_stack.model.model import PRESETS, SparseAttentionLayer

    layer = SparseAttentionLayer(PRESETS["tiny"], gen)
    x = torch.randn(5, PRESETS["tiny"].dim, generator=gen)
    with torch.no_grad():
        layer.fused = False
        want = layer.project(x)
        layer.fused = True
        got = layer.project(x)
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape and rel_err(a, b) < 1e-6
        layer.w_idx.mul_(2.0)
        assert rel_err(layer.project(x)[3], 2 * want[3]) < 1e-6
