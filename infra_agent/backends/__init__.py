"""Backends: who decides the next action (a model over the OpenAI protocol, an offline policy, a replay)."""
