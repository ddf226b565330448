"""bench/decode_sweep.py's kernel variants: each one's edits still apply to today's decode kernel, and each
variant computes one pooled decode step right (the interpreter here), so a sweep on a GPU times real kernels."""

from __future__ import annotations

import torch

from bench.decode_sweep import VARIANTS, launch, load_variants
from target_stack.ops.kda import naive_recurrent_kda
from target_stack.ops.kda.testing import DEVICE, make_inputs, rel_err


def test_every_variant_applies_and_steps_the_pool_like_the_reference(tmp_path):
    mods = load_variants(tmp_path)
    assert set(mods) == set(VARIANTS)  # a variant whose anchor text went missing would be skipped silently
    batch, H, K, V = 3, 2, 32, 32
    # on the machine's device: the interpreter here, the compiled kernels on a GPU
    q, k, v, g, beta = make_inputs(batch, 1, H, K, V, dtype=torch.float32, device=DEVICE, decay_shift=3.0)
    q, k = (3 * torch.randn_like(t) for t in (q, k))
    pool = torch.randn(batch + 2, H, K, V, device=DEVICE) * 0.1
    slots = torch.tensor([4, 1, 2], dtype=torch.int32, device=DEVICE)  # out of order; slot 3 unused, 0 the null slot
    qn, kn = (torch.nn.functional.normalize(t.double(), dim=-1) for t in (q, k))
    ro, rs = naive_recurrent_kda(qn, kn, v.double(), g.double(), beta.double(),
                                 initial_state=pool[slots.long()].double(), output_final_state=True)
    for name, mod in mods.items():
        for bv in (16, 32):
            s = dict(q=q, k=k, v=v, g=g, beta=beta, pool=pool.clone(), slots=slots,
                     o=torch.full((batch, 1, H, V), float("nan"), device=DEVICE))
            s["pool"][0] = float("nan")
            launch(mod, bv, 1, s)()
            assert rel_err(s["o"], ro) < 1e-5, (name, bv)
            assert rel_err(s["pool"][slots.long()], rs) < 1e-5, (name, bv)
            assert s["pool"][0].isnan().all() and torch.equal(s["pool"][3], pool[3]), (name, bv)
