"""Block-sparse decode attention in two launches against the float64 definition (interpreter on CPU, fp32)."""

from __future__ import annotations

import pytest
import torch

from target_stack.model.layers import sparse_decode_attention
from target_stack.ops.kda.testing import DEVICE, rel_err
from target_stack.ops.sparse_decode import sparse_decode_attention_kernel
from target_stack.probes import reference as ref

MARGIN = 1e-4  # block choices closer than this may go either way in fp32: those queries are not compared


def _batch(gen, lengths, L, H, D, Di, block, window):
    k, v = torch.randn(len(lengths), L, H, D, generator=gen), torch.randn(len(lengths), L, H, D, generator=gen)
    ik = torch.randn(len(lengths), L, Di, generator=gen)
    q, iq = torch.randn(len(lengths), H, D, generator=gen), torch.randn(len(lengths), Di, generator=gen)
    for b, n in enumerate(lengths):
        k[b, n:], v[b, n:], ik[b, n:] = 1e4, -1e4, 1e4  # padding past the length: never read into the result
        edge = n - window  # the window's oldest key in a block the indexer never picks
        if edge >= 0 and edge // block != (n - 1) // block:
            lo = (edge // block) * block
            ik[b, lo:lo + block] = -iq[b] * 10
    return q, k, v, iq, ik


@pytest.mark.parametrize("lengths,L,H,D,Di,block,top_k,window", [
    ([1, 9, 28, 40, 64], 64, 2, 16, 8, 8, 3, 5),  # blocks dropped; the window reaching into one (by 1 key at 28)
    ([30, 17], 40, 3, 32, 16, 16, 2, 16),         # L not a multiple of the block
    ([100, 3, 77], 100, 1, 8, 4, 12, 4, 10),      # a block size that is no power of two
    ([5, 6], 8, 2, 16, 8, 4, 8, 2),               # top_k above the block count: every valid block kept
])
def test_the_kernel_is_sparse_decode_attention(lengths, L, H, D, Di, block, top_k, window, gen):
    q, k, v, iq, ik = _batch(gen, lengths, L, H, D, Di, block, window)
    lens = torch.tensor(lengths)
    out = sparse_decode_attention_kernel(*(t.to(DEVICE) for t in (q, k, v, iq, ik)), lens.to(DEVICE), block, top_k,
                                         window)
    assert out.shape == q.shape and out.dtype == q.dtype and torch.isfinite(out).all()
    torch_form = sparse_decode_attention(q, k, v, iq, ik, lens, block, top_k, window)
    compared = 0
    for b, n in enumerate(lengths):
        o_ref, margin, _ = ref.sparse_attention(*(t.double() for t in (q[b:b + 1], k[b, :n], v[b, :n], iq[b:b + 1],
                                                                        ik[b, :n])), torch.tensor([n - 1]), block,
                                                top_k, window)
        if margin.item() > MARGIN:
            assert rel_err(out[b:b + 1].cpu(), o_ref) < 1e-5, b
            assert rel_err(torch_form[b:b + 1], o_ref) < 1e-5, b
            compared += 1
    assert compared >= len(lengths) - 1


def test_the_layer_function_takes_the_kernel_when_asked_and_refuses_bad_shapes(gen):
    q, k, v, iq, ik = _batch(gen, [20, 7], 24, 2, 16, 8, 8, 6)
    lens = torch.tensor([20, 7])
    a = sparse_decode_attention(*(t.to(DEVICE) for t in (q, k, v, iq, ik)), lens.to(DEVICE), 8, 2, 6, fused=True)
    b = sparse_decode_attention(q, k, v, iq, ik, lens, 8, 2, 6, fused=False)
    assert rel_err(a.cpu(), b) < 1e-5
    with pytest.raises(ValueError, match="shapes"):
        sparse_decode_attention_kernel(q[:, :1], k, v, iq, ik, lens, 8, 2, 6)
    with pytest.raises(ValueError, match="lengths must be"):
        sparse_decode_attention_kernel(q, k, v, iq, ik, lens[:1], 8, 2, 6)


def test_queries_sliced_from_one_projection_are_read_in_place(gen):
    """The decode step's q and indexer query are slices of one product ([q | k | v | iq | ik] per token): the
    kernel reads them where they lie and gives what their contiguous copies give."""
    lengths, L, H, D, Di, block, top_k, window = [9, 33, 20], 40, 2, 16, 8, 8, 2, 4
    _, k, v, _, ik = _batch(gen, lengths, L, H, D, Di, block, window)
    proj = torch.randn(len(lengths), 3 * H * D + 2 * Di, generator=gen).to(DEVICE)
    q, iq = proj[:, 5:5 + H * D].reshape(-1, H, D), proj[:, 3 * H * D:3 * H * D + Di]
    assert not q.is_contiguous() and not iq.is_contiguous()
    args = (k.to(DEVICE), v.to(DEVICE))
    lens = torch.tensor(lengths, device=DEVICE)
    got = sparse_decode_attention_kernel(q, *args, iq, ik.to(DEVICE), lens, block, top_k, window)
    want = sparse_decode_attention_kernel(q.contiguous(), *args, iq.contiguous(), ik.to(DEVICE), lens, block, top_k,
                                          window)
    assert torch.equal(got, want)
