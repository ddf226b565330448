"""A pytest plugin the runner loads into a ``pytest:`` probe (``-p infra_agent_imports``, from this
folder alone, first on the path, under a name no target uses).  At the end of the session it writes
the tree's source files among the process's modules, with their sha256, to ``FILE.PID`` for
``--infra-agent-imports=FILE`` (one file per process: under pytest-xdist each worker imports its own
share): what a Python probe's worker records (:func:`tree_imports`, which it calls too).  So a pytest probe's
cached result, too, holds only while every file of the tree it imported is unchanged, and a failing
one is judged again when a patch changes one of them (``feedback.select.rechecked``).  Standard
library only: it runs in the target's interpreter."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import sys


def pytest_addoption(parser):
    parser.addoption("--infra-agent-imports", default=None, help="write the tree's imported files here (JSON)")
    parser.addoption("--infra-agent-tree", default=None, help="the tree under test")


def tree_imports(tree: pathlib.Path) -> dict[str, str]:
    """The tree's source files among this process's modules, relative path -> sha256 of the file (a
    Python probe's worker records the same, through this function: ``feedback.worker``)."""
    out = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not path:
            continue
        path = pathlib.Path(path).resolve()
        if tree in path.parents and path.is_file():
            out[str(path.relative_to(tree))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return dict(sorted(out.items()))


def pytest_sessionfinish(session, exitstatus):
    out, tree = session.config.getoption("infra_agent_imports"), session.config.getoption("infra_agent_tree")
    if not out or not tree:
        return
    tmp = f"{out}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(tree_imports(pathlib.Path(tree).resolve()), f)
    os.replace(tmp, f"{out}.{os.getpid()}")
