"""The engine's events go through infra-agent's event API when it is importable (a no-op otherwise),
so a probe that sets ``INFRA_AGENT_EVENTS`` sees prefill, dispatch and KV-transfer spans."""

from __future__ import annotations

try:
    from feedback.events import emit
except ImportError:  # target_stack used on its own
    def emit(name: str, **fields) -> None:  # noqa: ARG001
        return None

__all__ = ["emit"]
