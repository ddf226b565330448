"""ReplaySSM against the plain token-loop recurrence (float64 reference), on fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from target_stack.engine.replay_ssm import ReplaySSM
from target_stack.ops.kda import naive_recurrent_kda
from target_stack.ops.kda.testing import make_inputs, rel_err


def _states(q, k, v, g, beta, h0, upto):
    """Float64 reference state after each of the first ``upto`` tokens."""
    out = []
    for t in range(1, upto + 1):
        _, s = naive_recurrent_kda(*(x[:, :t].double() for x in (q, k, v, g, beta)),
                                   initial_state=h0[None].double(), output_final_state=True)
        out.append(s[0])
    return out


def test_replay_rebuilds_every_recent_state_and_folds_the_ring(gen):
    T, H, K, V, R = 40, 2, 16, 8, 12
    q, k, v, g, beta = make_inputs(1, T, H, K, V, generator=gen)
    h0 = torch.randn(H, K, V, generator=gen)
    ref = _states(q, k, v, g, beta, h0, T)
    ssm = ReplaySSM(h0, capacity=R)
    outs = [ssm.step(q[0, t], k[0, t], v[0, t], g[0, t], beta[0, t]) for t in range(T)]
    o_ref, _ = naive_recurrent_kda(*(x.double() for x in (q, k, v, g, beta)), initial_state=h0[None].double())
    assert rel_err(torch.stack(outs), o_ref[0]) < 1e-5
    assert (ssm.checkpoint_position, ssm.position) == (T - R, T)  # the ring kept the last R tokens
    for p in range(T - R, T + 1):
        assert rel_err(ssm.state(p), ref[p - 1]) < 1e-5, p
    with pytest.raises(ValueError, match="replayable range"):
        ssm.state(T - R - 1)


def test_from_sequence_and_truncate_for_prefix_reuse(gen):
    T, H, K, V, R = 90, 2, 16, 16, 16
    q, k, v, g, beta = make_inputs(1, T, H, K, V, generator=gen)
    ssm = ReplaySSM.from_sequence(k[0], v[0], g[0], beta[0], capacity=R)
    ref = _states(q, k, v, g, beta, torch.zeros(H, K, V), T)
    assert ssm.position == T and rel_err(ssm.state(), ref[-1]) < 1e-5
    # a request sharing the first 80 tokens resumes from there without recomputing them
    ssm.truncate(80)
    assert rel_err(ssm.state(), ref[79]) < 1e-5
    # ... and continues with its own tokens exactly like the plain recurrence
    q2, k2, v2, g2, beta2 = make_inputs(1, 5, H, K, V, generator=gen)
    for t in range(5):
        ssm.step(q2[0, t], k2[0, t], v2[0, t], g2[0, t], beta2[0, t])
    _, s = naive_recurrent_kda(*(x.double() for x in (q2, k2, v2, g2, beta2)), initial_state=ref[79][None],
                               output_final_state=True)
    assert rel_err(ssm.state(), s[0]) < 1e-5
    with pytest.raises(ValueError, match="cannot truncate"):
        ssm.truncate(10)


def test_from_state_gets_the_recorded_values_without_a_token_loop(gen):
    # 100 tokens: two 64-token chunks of the WY solve, from a non-zero checkpoint
    T, H, K, V, R = 100, 2, 16, 8, 128
    q, k, v, g, beta = make_inputs(1, T, H, K, V, generator=gen)
    h0 = torch.randn(H, K, V, generator=gen)
    batched = ReplaySSM.from_state(h0, k[0], v[0], g[0], beta[0], capacity=R, position=7)
    ref = _states(q, k, v, g, beta, h0, T)
    assert (batched.checkpoint_position, batched.position) == (7, 7 + T)
    for p in (7, 8, 40, 71, 72, 7 + T):
        want = h0.double() if p == 7 else ref[p - 8]
        assert rel_err(batched.state(p), want) < 1e-5, p
    with pytest.raises(ValueError, match="do not fit"):
        ReplaySSM.from_state(h0, k[0], v[0], g[0], beta[0], capacity=T - 1)
