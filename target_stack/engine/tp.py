"""Tensor parallelism over torch.distributed: KDA layers split by heads, the LM head by vocabulary.

A KDA layer's heads are independent until its output projection, so rank r of w takes heads
[r H/w, (r+1) H/w): the q/k/v/gate/beta projections and the short convolution keep the rows of
its heads (column parallel), the recurrent state and the gated norm stay local, and the output
projection keeps the matching columns (row parallel) followed by one all-reduce.  The LM head
keeps a contiguous slice of the vocabulary per rank and all-gathers the logits.

gloo on the CPU, NCCL on GPUs.  ``python -m target_stack.engine.tp --check`` starts two processes
and compares every sharded result with the unsharded layer (used by the tests).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from target_stack.model.kda_layer import KDALayer, KDAState


def _rank_world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def shard_kda_layer(layer: KDALayer, rank: int, world: int) -> KDALayer:
    """The heads of ``rank`` as a KDALayer of H / world heads holding copies of their weights."""
    H, K, V = layer.H, layer.K, layer.V
    if H % world:
        raise ValueError(f"{H} KDA heads do not split over {world} ranks")
    h = H // world
    dim = layer.w_qkv.shape[1]
    q_idx = torch.arange(rank * h * K, (rank + 1) * h * K)
    v_idx = torch.arange(rank * h * V, (rank + 1) * h * V)
    channels = torch.cat([q_idx, H * K + q_idx, 2 * H * K + v_idx])
    shard = KDALayer(dim, h, K, V, backend=layer.backend).to(layer.w_qkv.device, layer.w_qkv.dtype)
    heads = slice(rank * h, (rank + 1) * h)
    with torch.no_grad():
        shard.w_qkv.copy_(layer.w_qkv[channels])
        shard.conv.copy_(layer.conv[channels])
        shard.w_f.copy_(layer.w_f[q_idx])
        shard.dt_bias.copy_(layer.dt_bias[q_idx])
        shard.A_log.copy_(layer.A_log[heads])
        shard.w_b.copy_(layer.w_b[heads])
        shard.w_g.copy_(layer.w_g[v_idx])
        shard.norm_w.copy_(layer.norm_w)
        shard.w_o.copy_(layer.w_o[:, v_idx])
    return shard


class TensorParallelKDA(torch.nn.Module):
    """One rank's part of a KDA layer; ``prefill`` / ``decode`` return the full (reduced) output and
    the rank's local state."""

    def __init__(self, layer: KDALayer):
        super().__init__()
        rank, world = _rank_world()
        self.shard = shard_kda_layer(layer, rank, world)

    def prefill(self, x: torch.Tensor, state: KDAState | None = None) -> tuple[torch.Tensor, KDAState]:
        y, state = self.shard.prefill(x, state)
        dist.all_reduce(y)
        return y, state

    def decode(self, x: torch.Tensor, state: KDAState) -> tuple[torch.Tensor, KDAState]:
        y, state = self.shard.decode(x, state)
        dist.all_reduce(y)
        return y, state


class VocabParallelHead(torch.nn.Module):
    def __init__(self, lm_head: torch.Tensor):
        super().__init__()
        rank, world = _rank_world()
        vocab = lm_head.shape[0]
        per = -(-vocab // world)
        self.vocab, self.per = vocab, per
        part = lm_head[rank * per:(rank + 1) * per]
        pad = per - part.shape[0]  # the last rank may hold fewer rows: pad so all_gather sizes match
        self.weight = torch.nn.Parameter(F.pad(part.detach(), (0, 0, 0, pad)), requires_grad=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        local = F.linear(h, self.weight).contiguous()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local)
        return torch.cat(parts, dim=-1)[..., : self.vocab]


# -- the two-process check ---------------------------------------------------------------------------
def _check(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        gen = torch.Generator().manual_seed(1234)  # every rank builds the same full layer and inputs
        layer = KDALayer(dim=48, heads=4, head_k=16, head_v=8, generator=gen, backend="torch")
        x = torch.randn(2, 21, 48, generator=gen)
        lm_head = torch.randn(37, 48, generator=gen)  # 37 rows: not a multiple of the world size
        with torch.no_grad():
            full, state = layer.prefill(x[:, :20])
            full_step, _ = layer.decode(x[:, 20:], state)
            tp = TensorParallelKDA(layer)
            part, pstate = tp.prefill(x[:, :20])
            part_step, _ = tp.decode(x[:, 20:], pstate)
            logits = VocabParallelHead(lm_head)(x)
        err = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
        result = {"rank": rank, "prefill": err(part, full), "decode": err(part_step, full_step),
                  "lm_head": err(logits, F.linear(x, lm_head)), "local_heads": tp.shard.H}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m target_stack.engine.tp")
    parser.add_argument("--check", action="store_true", help="compare the 2-rank split with the full layer")
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args(argv)
    if not args.check:
        parser.error("nothing to do (use --check)")
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_check, args=(args.world, free_port(), out_dir), nprocs=args.world, join=True)
        results = [json.loads(pathlib.Path(out_dir, f"rank{r}.json").read_text()) for r in range(args.world)]
    ok = all(r[k] < 1e-5 for r in results for k in ("prefill", "decode", "lm_head"))
    print(json.dumps({"ok": ok, "ranks": results}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
