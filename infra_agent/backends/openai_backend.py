"""The openai backend: the real ``openai`` SDK, chat completions with tool calling.

Defaults aim at GLM through Z.ai's OpenAI-compatible endpoint (``ZAI_API_KEY``); ``OPENAI_API_KEY``
and ``OPENAI_BASE_URL`` (or ``--model`` / ``--base-url``) reach any compatible server: vLLM,
SGLang, a local proxy.  The SDK retries 429/5xx and timeouts with exponential backoff; usage is
counted per call; the conversation is trimmed when it outgrows the context budget.
"""

from __future__ import annotations

import json
import os

import openai

from infra_agent.agent import AgentState
from infra_agent.exceptions import FormatError
from infra_agent.tools import Action, openai_tools

ZAI_BASE_URL = "https://api.z.ai/api/paas/v4"
DEFAULT_GLM_MODEL = "glm-5"
# USD per million tokens (input, output); unknown models cost 0 here and are still token-limited.
PRICES = {"glm-5": (1.0, 3.2), "glm-5.1": (1.0, 3.2), "glm-4.7-flash": (0.0, 0.0)}
MAX_REPLY_CHARS = 200_000
#: tool calls taken from one reply; the loop runs them one per step (each against its step budget)
MAX_CALLS_PER_REPLY = 8


class OpenAIBackend:
    name = "openai"

    def __init__(self, model: str | None = None, base_url: str | None = None, api_key: str | None = None,
                 context_chars: int = 240_000, max_retries: int = 4, timeout_s: float = 120.0,
                 thinking: bool | None = None):
        zai = os.environ.get("ZAI_API_KEY")
        key = api_key or (zai if zai and not os.environ.get("OPENAI_API_KEY") else os.environ.get("OPENAI_API_KEY"))
        key = key or zai
        if not key:
            raise ValueError("the openai backend needs ZAI_API_KEY or OPENAI_API_KEY (or use --backend offline)")
        if base_url is None:
            base_url = os.environ.get("OPENAI_BASE_URL") or (ZAI_BASE_URL if key == zai else None)
        self.model = model or os.environ.get("INFRA_AGENT_MODEL") or DEFAULT_GLM_MODEL
        self.base_url = base_url
        self.client = openai.OpenAI(api_key=key, base_url=base_url, max_retries=max_retries, timeout=timeout_s)
        self.context_chars = context_chars
        self.thinking = thinking if thinking is not None else (base_url or "").startswith(("https://api.z.ai",
                                                                                           "https://open.bigmodel"))
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0, "cost_usd": 0.0, "calls": 0}
        self._queued: list = []  # the tool calls of the last reply after the one handed out

    def trim(self, messages: list[dict]) -> list[dict]:
        """Keep the system and first user message, and as many recent messages as fit; never split a
        tool call from its result."""
        def size(m):
            return len(json.dumps(m, default=str))

        head, rest = messages[:2], messages[2:]
        budget = self.context_chars - sum(size(m) for m in head)
        kept: list[dict] = []
        for m in reversed(rest):
            budget -= size(m)
            if budget < 0:
                break
            kept.append(m)
        kept.reverse()
        while kept and kept[0].get("role") == "tool":  # a result whose call was trimmed away
            kept.pop(0)
        if len(kept) < len(rest):
            kept.insert(0, {"role": "user", "content": f"[{len(rest) - len(kept)} earlier messages trimmed]"})
        return head + kept

    def next_action(self, state: AgentState) -> Action:
        """The next tool call: one the last reply queued (several in one reply are taken one per step, each
        its own assistant message answered by its own tool message), else a new request."""
        if self._queued:
            return self._action(self._queued.pop(0), None)
        extra = {"thinking": {"type": "enabled"}} if self.thinking else None
        try:
            resp = self.client.chat.completions.create(model=self.model, messages=self.trim(state.messages),
                                                       tools=openai_tools(), tool_choice="auto",
                                                       extra_body=extra)
        except openai.APIStatusError as exc:
            raise RuntimeError(f"the model endpoint answered {exc.status_code}: {exc.message}") from exc
        except openai.APIConnectionError as exc:
            raise RuntimeError(f"cannot reach the model endpoint {self.base_url or 'api.openai.com'}: {exc}") from exc
        self.usage["calls"] += 1
        if resp.usage:
            self.usage["prompt_tokens"] += resp.usage.prompt_tokens or 0
            self.usage["completion_tokens"] += resp.usage.completion_tokens or 0
            pin, pout = PRICES.get(self.model, (0.0, 0.0))
            self.usage["cost_usd"] += ((resp.usage.prompt_tokens or 0) * pin
                                       + (resp.usage.completion_tokens or 0) * pout) / 1e6
        if not resp.choices:
            raise FormatError("the model returned no choices")
        msg = resp.choices[0].message
        content = msg.content or ""
        if len(content) > MAX_REPLY_CHARS:
            raise FormatError(f"the reply is {len(content)} characters; answer with one tool call instead")
        calls = msg.tool_calls or []
        if not calls:
            raise FormatError("no tool call in the reply: answer with exactly one tool call (finish to stop)")
        self._queued = list(calls[1:MAX_CALLS_PER_REPLY])
        return self._action(calls[0], content)

    def queued(self) -> list[Action]:
        """The well-formed tool calls the last reply made beyond the one handed out (``--parallel`` judges
        their patches together with it)."""
        out = []
        for call in self._queued:
            try:
                out.append(self._action(call, None))
            except FormatError:
                continue
        return out

    @staticmethod
    def _action(call, content: str | None) -> Action:
        fn = getattr(call, "function", None)
        if fn is None:
            raise FormatError("a tool call without a function: answer with function tool calls")
        try:
            args = json.loads(fn.arguments or "{}")
        except json.JSONDecodeError as exc:
            raise FormatError(f"the arguments of {fn.name} are not valid JSON: {exc}") from exc
        if not isinstance(args, dict):
            raise FormatError(f"the arguments of {fn.name} must be a JSON object")
        message = {"role": "assistant", "content": content or None,
                   "tool_calls": [{"id": call.id, "type": "function",
                                   "function": {"name": fn.name, "arguments": fn.arguments}}]}
        return Action(fn.name, args, message=message, call_id=call.id)
