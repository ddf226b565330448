"""ReplaySSM: rebuild a KDA state at any recent position without recomputing the prompt.

A KDA step rewrites the state as a decay plus a rank-one update::

    S_t = Diag(exp(g_t)) S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - (Diag(exp(g_t)) S_{t-1})^T k_t)

Once u_t is known (it needs S_{t-1}, so it is computed when the token is first processed), the
update no longer depends on the state.  ReplaySSM keeps a checkpoint state S_c and a ring of the
last ``capacity`` records (k, u, g); the state at any position p in [c, c + len(ring)] is

    S_p = Diag(exp(G_p - G_c)) S_c + sum_{c < j <= p} Diag(exp(G_p - G_j)) k_j u_j^T

with G the running sum of g: one batched contraction, no token loop, no delta-rule solve.  When
the ring is full the oldest record is folded into the checkpoint.  Uses: restoring a preempted or
swapped-out sequence from a host checkpoint, reusing a cached prefix whose boundary lies inside
the ring, rolling back rejected speculative tokens (``truncate``).  Shapes per sequence: states
[H, K, V] fp32; k, g [H, K]; u [H, V].
"""

from __future__ import annotations

import torch


class ReplaySSM:
    def __init__(self, checkpoint: torch.Tensor, capacity: int, position: int = 0):
        if checkpoint.dim() != 3:
            raise ValueError(f"checkpoint must be a state [H, K, V], got shape {tuple(checkpoint.shape)}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.checkpoint = checkpoint.detach().float().clone()
        self.checkpoint_position = position
        self.capacity = capacity
        H, K, V = self.checkpoint.shape
        dev = self.checkpoint.device
        self._k = torch.zeros(capacity, H, K, device=dev)
        self._u = torch.zeros(capacity, H, V, device=dev)
        self._g = torch.zeros(capacity, H, K, device=dev)
        self._start = 0  # ring index of the oldest record
        self._len = 0

    @property
    def position(self) -> int:
        """Tokens folded into the newest state: checkpoint position plus recorded tokens."""
        return self.checkpoint_position + self._len

    def _records(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        idx = (self._start + torch.arange(n, device=self._k.device)) % self.capacity
        return self._k[idx], self._u[idx], self._g[idx]

    def record(self, k: torch.Tensor, u: torch.Tensor, g: torch.Tensor) -> None:
        if self._len == self.capacity:  # fold the oldest record into the checkpoint
            k0, u0, g0 = self._k[self._start], self._u[self._start], self._g[self._start]
            self.checkpoint = self.checkpoint * g0.exp()[..., None] + k0[..., None] * u0[:, None, :]
            self.checkpoint_position += 1
            self._start = (self._start + 1) % self.capacity
            self._len -= 1
        slot = (self._start + self._len) % self.capacity
        self._k[slot], self._u[slot], self._g[slot] = k.float(), u.float(), g.float()
        self._len += 1

    def state(self, position: int | None = None) -> torch.Tensor:
        """The state after ``position`` tokens (default: the newest)."""
        position = self.position if position is None else position
        n = position - self.checkpoint_position
        if not 0 <= n <= self._len:
            raise ValueError(f"position {position} is outside the replayable range "
                             f"[{self.checkpoint_position}, {self.position}]")
        if n == 0:
            return self.checkpoint.clone()
        k, u, g = self._records(n)
        G = g.cumsum(0)  # [n, H, K]
        total = G[-1]
        out = self.checkpoint * total.exp()[..., None]
        return out + torch.einsum("nhk,nhv->hkv", k * (total[None] - G).exp(), u)

    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             scale: float | None = None) -> torch.Tensor:
        """Process one token from the newest state (the plain recurrence), record it, return o [H, V]."""
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        decayed = self.state() * g.float().exp()[..., None]
        u = beta.float()[:, None] * (v.float() - torch.einsum("hkv,hk->hv", decayed, k.float()))
        self.record(k, u, g)
        new = decayed + k.float()[..., None] * u[:, None, :]
        return torch.einsum("hkv,hk->hv", new, q.float()) * scale

    def truncate(self, position: int) -> None:
        """Forget the tokens after ``position`` (a rejected speculation, a shorter shared prefix)."""
        n = position - self.checkpoint_position
        if not 0 <= n <= self._len:
            raise ValueError(f"cannot truncate to {position}: replayable range is "
                             f"[{self.checkpoint_position}, {self.position}]")
        self._len = n

    @classmethod
    def from_state(cls, state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   capacity: int, position: int = 0) -> ReplaySSM:
        """Checkpoint ``state`` (after ``position`` tokens) and the records of the n <= capacity tokens
        that follow it: k, g [n, H, K], v [n, H, V], beta [n, H].  The effective values u come from the
        chunked (WY) form, one triangular solve per 64 tokens, not a token loop."""
        from target_stack.ops.kda import naive_chunk_kda

        n = k.shape[0]
        if n > capacity:
            raise ValueError(f"{n} tokens do not fit a ring of {capacity}")
        ssm = cls(state, capacity, position=position)
        if n:
            q0 = torch.zeros_like(k[None], dtype=torch.float32)
            _, _, u = naive_chunk_kda(q0, k[None].float(), v[None].float(), g[None].float(), beta[None].float(),
                                      initial_state=ssm.checkpoint[None], return_values=True)
            ssm._k[:n], ssm._u[:n], ssm._g[:n] = k.float(), u[0], g.float()
            ssm._len = n
        return ssm

    @classmethod
    def from_sequence(cls, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, capacity: int,
                      initial_state: torch.Tensor | None = None) -> ReplaySSM:
        """Build from one sequence's inputs k, g [T, H, K], v [T, H, V], beta [T, H]: the prefix before
        the last ``capacity`` tokens folded into the checkpoint, the rest recorded."""
        from target_stack.ops.kda import naive_chunk_kda

        T, H, K = k.shape
        V = v.shape[-1]
        head = max(0, T - capacity)
        state = initial_state.float() if initial_state is not None else torch.zeros(H, K, V, device=k.device)
        if head:
            q0 = torch.zeros(1, head, H, K, device=k.device)
            _, s = naive_chunk_kda(q0, k[None, :head].float(), v[None, :head].float(), g[None, :head].float(),
                                   beta[None, :head].float(), initial_state=state[None], output_final_state=True)
            state = s[0]
        return cls.from_state(state, k[head:], v[head:], g[head:], beta[head:], capacity, position=head)
