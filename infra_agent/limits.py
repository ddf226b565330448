"""A session's budgets: steps, wall time, cost, tokens, malformed actions, candidates judged at once."""

from __future__ import annotations

import dataclasses

from infra_agent.exceptions import LimitsExceeded


@dataclasses.dataclass
class Limits:
    max_steps: int = 20
    time_limit_s: float = 1800.0
    max_cost_usd: float = 5.0
    max_tokens: int = 2_000_000
    max_format_errors: int = 3
    parallel: int = 1  # candidates judged ahead together (infra_agent/prefetch.py)

    def check(self, step: int, elapsed_s: float, usage: dict) -> None:
        """``LimitsExceeded`` once a budget is spent."""
        if step >= self.max_steps:
            raise LimitsExceeded(f"step limit {self.max_steps} reached")
        if elapsed_s > self.time_limit_s:
            raise LimitsExceeded(f"time limit {self.time_limit_s:g}s reached")
        if usage["cost_usd"] > self.max_cost_usd:
            raise LimitsExceeded(f"cost limit ${self.max_cost_usd:g} reached")
        if usage["prompt_tokens"] + usage["completion_tokens"] > self.max_tokens:
            raise LimitsExceeded(f"token limit {self.max_tokens} reached")
