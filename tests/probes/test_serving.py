"""The serving probes' own parts: the disaggregated cluster's second opinion on a token."""

from __future__ import annotations

import dataclasses

import torch

from target_stack.engine import SamplingParams
from target_stack.engine.disagg import DisaggCluster
from target_stack.model.model import PRESETS
from target_stack.probes.serving import _colocated_tokens


def test_the_colocated_engine_gives_the_clusters_tokens_on_a_clean_tree():
    # the disagg probe's decode second opinion (used on a GPU, where bf16 can flip a near tie): on a clean
    # tree, with no transfer in between, one engine in this process gives every token the cluster gives
    seed = int(torch.randint(2**31 - 1, (1,)))
    cfg = dataclasses.replace(PRESETS["tiny"], seed=seed)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(cfg.vocab, (n,), generator=g).tolist() for n in (5, 23, 40)]
    image = torch.rand(3, 2 * cfg.patch, 2 * cfg.patch, generator=g)
    requests = [(q, SamplingParams(max_tokens=4), img) for q, img in zip(prompts + prompts[:1], [None] * 3 + [image])]
    sizes = dict(stages=2, page_size=16, num_pages=64, max_model_len=256)
    with DisaggCluster({"preset": "tiny", "seed": seed, "device": "cpu"}, **sizes) as workers:
        result = workers.run(requests, timeout_s=60)
    mine = _colocated_tokens(seed, "cpu", requests, sizes)
    assert [len(t) for t in mine] == [4] * len(requests)
    assert mine == [out.tokens for out in result.outputs]
