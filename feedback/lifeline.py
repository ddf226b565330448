"""Probe processes die with the harness, however the harness dies.

The runner kills a probe's process group at its budget and on Ctrl-C.  A harness killed outright
(``kill -9``, the OOM killer, a lost terminal) runs no code at all, so the probe processes must
notice by themselves.  On Linux each one asks the kernel for a signal when its parent dies
(``prctl(PR_SET_PDEATHSIG)``) and answers it by killing its whole process group, the probe's own
children included; a parent already gone before the request (the race between fork and prctl)
is caught by comparing ``getppid()`` with the harness's pid from ``INFRA_AGENT_HARNESS_PID``.

Python probes call :func:`bind` first thing in ``feedback.worker``; command and pytest probes run under
``python -I .../feedback/lifeline.py -- CMD`` (standard library only: it runs isolated from the target's
path), which binds itself and runs ``CMD`` in a shell as its child.
Elsewhere than Linux it does nothing (the runner's own kills still hold while it lives).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

HARNESS_PID = "INFRA_AGENT_HARNESS_PID"
_PR_SET_PDEATHSIG = 1


def _kill_group(*_args) -> None:
    os.killpg(os.getpgrp(), signal.SIGKILL)


def bind() -> bool:
    """Die, with this process group, when the parent (the harness) dies.  Returns whether it could."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    signal.signal(signal.SIGTERM, _kill_group)
    expected = os.environ.get(HARNESS_PID)
    if expected and expected.isdigit() and os.getppid() != int(expected):
        _kill_group()  # the harness died before the request was made
    return True


def main(argv: list[str]) -> int:
    """``python -I lifeline.py -- CMD``: run the shell command ``CMD`` bound to the harness."""
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if len(argv) != 1:
        print("usage: python -I lifeline.py -- 'shell command'", file=sys.stderr)
        return 2
    bind()
    return subprocess.call(argv[0], shell=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
