"""infra-agent: agent-assisted performance and correctness work on LLM inference stacks."""

__version__ = "0.1.0"
