"""The replay backend: the model replies of a recorded trajectory, in order (for CI and debugging)."""

from __future__ import annotations

import json
import pathlib

from infra_agent.agent import AgentState
from infra_agent.exceptions import FormatError
from infra_agent.tools import Action


class ReplayBackend:
    name = "replay"

    def __init__(self, trajectory: str | pathlib.Path):
        path = pathlib.Path(trajectory)
        if not path.is_file():
            raise ValueError(f"no trajectory {path}")
        self.model = f"replay of {path.name}"
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0, "cost_usd": 0.0}
        self.replies: list[dict] = []
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line of a killed session
            if rec.get("role") == "assistant" and rec.get("tool_calls"):
                self.replies.append(rec)
        if not self.replies:
            raise ValueError(f"{path} holds no model replies to replay")
        self._next = 0

    def next_action(self, state: AgentState) -> Action:
        if self._next >= len(self.replies):
            return Action("finish", {"summary": "the recorded trajectory ends here"})
        rec = self.replies[self._next]
        self._next += 1
        call = rec["tool_calls"][0]
        try:
            args = json.loads(call["function"]["arguments"] or "{}")
        except json.JSONDecodeError as exc:
            raise FormatError(f"recorded arguments are not valid JSON: {exc}") from exc
        message = {k: v for k, v in rec.items() if k in ("role", "content", "tool_calls")}
        return Action(call["function"]["name"], args, message=message, call_id=call["id"])
