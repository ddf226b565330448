"""Tensor parallelism: two real processes over gloo split the KDA heads and the vocabulary."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from target_stack.engine.tp import shard_kda_layer
from target_stack.model.kda_layer import KDALayer


def test_two_rank_kda_and_lm_head_equal_the_unsharded_layer():
    proc = subprocess.run([sys.executable, "-m", "target_stack.engine.tp", "--check"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] and len(result["ranks"]) == 2
    for r in result["ranks"]:
        assert r["local_heads"] == 2 and max(r["prefill"], r["decode"], r["lm_head"]) < 1e-5


def test_heads_that_do_not_split_are_refused(gen):
    with pytest.raises(ValueError, match="do not split"):
        shard_kda_layer(KDALayer(32, 3, 8, 8, generator=gen), rank=0, world=2)
