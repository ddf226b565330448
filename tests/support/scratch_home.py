"""The tests' state home: a scratch folder, shared by the CLIs the tests start and by xdist's workers (which
inherit it through the environment), removed when the process that made it exits.  Imported first by
``tests/conftest.py``: the import sets it."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile


def ensure() -> None:
    """Point ``INFRA_AGENT_HOME`` at a new scratch folder unless the environment names one already (a caller's,
    or the controller's for an xdist worker): only the process that made it removes it."""
    if "INFRA_AGENT_HOME" not in os.environ:
        home = os.environ["INFRA_AGENT_HOME"] = tempfile.mkdtemp(prefix="infra-agent-home-")
        atexit.register(shutil.rmtree, home, ignore_errors=True)


ensure()
