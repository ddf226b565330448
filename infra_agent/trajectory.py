"""The session's trajectory: every message and observation as JSONL, secrets redacted, synced per line."""

from __future__ import annotations

import json
import os
import pathlib
import re

KEY_VARS = ("ZAI_API_KEY", "OPENAI_API_KEY")
_SECRET = re.compile(r"(sk-[A-Za-z0-9_\-]{12,}|(?i:bearer)\s+[A-Za-z0-9._\-]{12,})")


def redact(text: str) -> str:
    """The API keys of this environment, and anything shaped like a key or a bearer token, replaced."""
    for var in KEY_VARS:
        val = os.environ.get(var)
        if val and len(val) >= 8:
            text = text.replace(val, "[redacted]")
    return _SECRET.sub("[redacted]", text)


class Trajectory:
    def __init__(self, path: pathlib.Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict) -> None:
        """One line, on disk before this returns: a killed session keeps every step it took."""
        line = redact(json.dumps(record, default=str))
        with open(self.path, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
