"""bench/decode_ops.py on the tiny preset: it counts a real decode step, by the function that issues each op,
and the fused kernels take fewer launches than the torch forms (a count, not a timing)."""

from __future__ import annotations

from bench.decode_ops import count_step


def test_the_fused_kernels_dispatch_fewer_launches_and_every_op_has_its_site():
    fused = count_step("tiny", "fp32", batch=2)
    plain = count_step("tiny", "fp32", batch=2, fused=False)
    assert fused["layers"] == plain["layers"] == 4 and fused["total"] > 0
    # 4 layers: 9 norms (2 per block and the last), 3 KDA output norms and 3 KDA decode inputs: one launch each;
    # 3 MoE routers (the first layer's MLP is dense) and the sparse-attention layer's decode attention: two each
    assert fused["triton_launches"] - plain["triton_launches"] == 9 + 3 + 3 + 3 * 2 + 2
    assert fused["total"] + fused["triton_launches"] < plain["total"] + plain["triton_launches"] - 3 * 15 - 3 * 6 - 20
    sites = fused["by_site"]
    assert "target_stack/ops/moe/route.py:moe_route" in sites and "target_stack/model/layers.py:MoE.route" not in sites
    assert "target_stack/model/layers.py:sparse_decode_attention" not in fused["by_site"]
    assert plain["conversions"] == fused["conversions"]  # fp32: the torch norms convert nothing here
    assert "target_stack/ops/norm.py:rms_norm" in sites and "target_stack/ops/norm.py:rms_norm" not in plain["by_site"]
    assert sum(sum(c.values()) for c in fused["by_site"].values()) == fused["total"] + fused["triton_launches"]
    assert "?:?" not in fused["by_site"]  # every op was issued by a target_stack function


def test_the_small_batch_experts_take_two_launches_per_moe_layer_for_the_torch_experts():
    fused = count_step("tiny", "fp32", batch=2)
    small = count_step("tiny", "fp32", batch=2, small_batch=True)
    # 3 MoE layers: the routed and the shared experts in two launches each, the torch forms gone
    assert small["triton_launches"] - fused["triton_launches"] == 3 * 2
    assert small["by_site"]["target_stack/ops/moe/small_batch.py:small_batch_experts"]["triton"] == 3 * 2
    assert "target_stack/ops/moe/grouped.py:masked_dense" in fused["by_site"]
    assert "target_stack/ops/moe/grouped.py:masked_dense" not in small["by_site"]
    assert small["total"] + small["triton_launches"] < fused["total"] + fused["triton_launches"] - 3 * 10
