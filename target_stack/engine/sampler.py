"""Sampling: greedy, temperature and top-p (nucleus), each request drawing from its own seeded generator."""

from __future__ import annotations

import torch

from target_stack.engine.sequence import Sequence


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p; renormalise."""
    if top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # mass strictly ahead of each token
    sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return kept / kept.sum(-1, keepdim=True)


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """One token per row of ``logits`` [B, vocab] for the matching sequence."""
    if all(seq.params.temperature == 0 for seq in seqs):
        return logits.argmax(-1).tolist()  # the logits' own dtype: the same argmax as an fp32 copy's, one launch less
    logits = logits.float()
    greedy = logits.argmax(-1).tolist()
    out = []
    for row, seq in enumerate(seqs):
        p = seq.params
        if p.temperature == 0:
            out.append(greedy[row])
            continue
        if seq.generator is None:
            seq.generator = torch.Generator(device=logits.device)
            if p.seed is None:
                seq.generator.seed()
            else:
                seq.generator.manual_seed(p.seed)
        probs = top_p_filter(torch.softmax(logits[row] / p.temperature, dim=-1), p.top_p)
        out.append(int(torch.multinomial(probs, 1, generator=seq.generator)))
    return out
