"""Cores a probe may borrow: the harness's idle slots, lent while they idle (a make-style jobserver).

The harness runs ``--jobs`` probes at a time.  When one ends and nothing waits for its slot (the stage's
last probes), a core sits idle while a probe beside it works through its cases one after another.  A probe
whose cases are independent may borrow such a slot (:func:`lend`), run one more case at once, and give it
back (:meth:`Lent.release`) when its cases run out.  Probes that never ask are unaffected.

Each slot is a file that is held under an exclusive ``flock``: the harness holds one for every probe it runs
(:class:`Slots`), a borrowing probe one for every case it adds.  The kernel releases a lock when its process
dies, so a probe killed at its budget, or one that crashes, returns what it borrowed without any
bookkeeping; a borrowed slot never outlives its holder.  The slots folder reaches a probe through
``INFRA_AGENT_SLOTS``; without it (a probe run by hand, on another machine) :func:`lend` lends nothing and
the probe runs its cases one at a time, as before.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile
import threading
import time

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: nothing is ever lent
    fcntl = None

#: the slots folder a probe may borrow from (set by the harness for the probes it runs here)
SLOTS_VAR = "INFRA_AGENT_SLOTS"
#: how often a waiting harness thread, or a probe with cases left, looks for a free slot
POLL_S = 0.02


class Lent:
    """One held slot: an open file under an exclusive lock; :meth:`release` (or the holder's death) frees it."""

    def __init__(self, fd: int, index: int):
        self.fd, self.index = fd, index

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the only descriptor of the open file drops its lock
            self.fd = -1


def _take(folder: pathlib.Path, n: int) -> Lent | None:
    """One free slot of ``folder``'s ``n``, locked without waiting; None when all are held."""
    for i in range(n):
        try:
            fd = os.open(folder / f"slot-{i}", os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return None  # the folder is gone (the harness finished) or not this machine's
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return Lent(fd, i)
        except OSError:
            os.close(fd)
    return None


def lend(folder: str | os.PathLike | None = None) -> Lent | None:
    """A slot the harness has idle, for one more case of this probe at once; None when none is idle, or when
    this process was not started by a harness that lends (``INFRA_AGENT_SLOTS`` unset)."""
    folder = folder if folder is not None else os.environ.get(SLOTS_VAR)
    if not folder or fcntl is None:
        return None
    folder = pathlib.Path(folder)
    try:
        n = int((folder / "count").read_text())
    except (OSError, ValueError):
        return None
    return _take(folder, n)


class Slots:
    """The harness's side: ``n`` slot files in a folder of their own (removed by :meth:`close`).  A probe
    holds one while it runs (:meth:`acquire`, which waits while probes have borrowed them all)."""

    def __init__(self, n: int):
        self.n = max(1, n)
        self.path = pathlib.Path(tempfile.mkdtemp(prefix="infra-agent-slots-"))
        for i in range(self.n):
            (self.path / f"slot-{i}").touch()
        (self.path / "count").write_text(str(self.n))  # written last: a reader sees every slot file or none

    def acquire(self, stopping: threading.Event | None = None) -> Lent | None:
        """A slot for a probe of the harness, waiting while every one is held (by probes, or lent to their
        cases); None once ``stopping`` is set, or where locks do not exist (nothing is lent then either)."""
        if fcntl is None:
            return None
        while not (stopping is not None and stopping.is_set()):
            got = _take(self.path, self.n)
            if got is not None:
                return got
            time.sleep(POLL_S)
        return None

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def __del__(self) -> None:  # a runner dropped without close(): its folder goes with it
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
