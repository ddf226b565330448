"""bench/prefill_sweep.py's variants: each one's knobs exist in today's chunk.py and each gives a right
prefill (the interpreter here, compiled kernels on a GPU), so a sweep on a GPU times real launches; the
launch is restored afterwards, also when the prefill fails."""

from __future__ import annotations

import pytest
import torch

import target_stack.ops.kda.chunk as C
from bench.prefill_sweep import VARIANTS, WIDE, applied
from target_stack.ops.kda import chunk_kda, naive_recurrent_kda
from target_stack.ops.kda.testing import DEVICE, make_inputs, rel_err

ALL = {**VARIANTS, **WIDE}
#: knobs the interpreter sees (it ignores warps, and output_bv is the 16-bit inputs' alone); on a GPU every variant
SHAPES = {"state_bv", "state_stages", "diag_heads", "solve_keys"}
RUN = [n for n, over in ALL.items() if DEVICE != "cpu" or SHAPES & set(over)]


def test_every_variant_s_knobs_exist_in_today_s_launch():
    for name, over in ALL.items():
        with applied(over):
            assert all(C.LAUNCH[k] == v for k, v in over.items() if k in C.LAUNCH), name


@pytest.mark.parametrize("name", RUN)
def test_every_variant_gives_the_reference_prefill(name, gen, monkeypatch):
    monkeypatch.setattr(C, "DIAG_BY_TOKEN", True)  # the diagonal kernel whose launch the knobs shape
    before = (dict(C.LAUNCH), C.state_tile, C.state_stages)
    x = make_inputs(1, 70, 2, 32, 48, generator=gen, device=DEVICE)
    with applied(ALL[name]):
        o, s = chunk_kda(*x, output_final_state=True)
    ro, rs = naive_recurrent_kda(*(t.double() for t in x), output_final_state=True)
    assert rel_err(o, ro) < 1e-5 and rel_err(s, rs) < 1e-5, name
    assert (dict(C.LAUNCH), C.state_tile, C.state_stages) == before


def test_a_fixed_state_tile_reaches_the_launch_and_is_undone_after_an_error():
    saved = dict(C.LAUNCH)
    with pytest.raises(RuntimeError, match="boom"), applied({"state_bv": 64, "state_stages": 1, "output_warps": 2}):
        assert C.state_tile(16, 128, 1, torch.device("cuda")) == 64 and C.state_stages(64, 128, 64, None) == 1
        assert C.LAUNCH["output_warps"] == 2
        raise RuntimeError("boom")
    assert saved == C.LAUNCH and C.state_tile(32, 128, 1, torch.device("cpu")) == 32


def test_an_unknown_knob_is_refused_by_name():
    with pytest.raises(KeyError, match="state_warpz"), applied({"state_warpz": 2}):
        pass
