"""The agent loop's control flow: each way a session ends or a step is refused is one exception."""

from __future__ import annotations


class AgentException(Exception):
    """Base of the loop's control flow."""


class Submitted(AgentException):
    """The backend called ``finish``; the message is its summary."""


class LimitsExceeded(AgentException):
    """Steps, wall time, tokens, cost, or too many malformed actions in a row."""


class FormatError(AgentException):
    """A malformed action; the message goes back to the model, which may retry."""
