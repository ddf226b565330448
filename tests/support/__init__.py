"""Fakes the tests share: a scripted OpenAI-protocol server, toy targets."""
