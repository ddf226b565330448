"""Whether a process still runs, read from /proc (the tests that kill harnesses and nodes share it)."""

from __future__ import annotations

import pathlib


def alive(pid: int) -> bool:
    """Running: a zombie has exited (only its parent's wait is missing) and counts as dead."""
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")
