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
