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
    parser.addoption("--infra-agent-env", default=None, help="write where the tests ran here (JSON)")


def environment() -> dict:
    """Where this process runs (``feedback.models.fingerprint`` of a Python probe is built from it): the
    interpreter, the versions of torch and Triton, the GPU where the process imported torch and it has one (the
    device is read only then, so a static probe stays cheap), interpreter mode."""
    import importlib.metadata as md
    import platform

    env = {"python": platform.python_version(), "platform": f"{platform.system()}-{platform.machine()}",
           "mode": "interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "native"}
    for name in ("torch", "triton"):
        try:
            env[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    torch = sys.modules.get("torch")
    if torch is not None and env["mode"] == "native":
        try:
            if torch.cuda.is_available():
                env["device"] = torch.cuda.get_device_name(0)
        except Exception:  # noqa: BLE001 - a broken driver: the device stays unnamed
            pass
    return env


class _Witness:
    """A finder first on ``sys.meta_path`` that finds nothing itself: it notes where the path finder would load
    each module from.  A module whose import raised (a SyntaxError, a failing top-level statement) is gone from
    ``sys.modules`` by the end of the session, and a cached failure that did not name it would be served again
    after the file was mended (FlagAttention: a stray bracket in flash.py, then a clean tree that still failed)."""

    attempted: set[str] = set()

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        import importlib.machinery

        try:
            spec = importlib.machinery.PathFinder.find_spec(name, path)
        except Exception:  # noqa: BLE001 - a finder that cannot look says nothing; the import goes on as it would
            return None
        if spec is not None and spec.origin and spec.has_location:
            cls.attempted.add(spec.origin)
        return None

    @classmethod
    def invalidate_caches(cls) -> None:
        pass


if _Witness not in sys.meta_path:
    sys.meta_path.insert(0, _Witness)


def tree_imports(tree: pathlib.Path) -> dict[str, str]:
    """The tree's source files among this process's modules, and those an import tried and failed to load,
    relative path -> sha256 of the file (a Python probe's worker records the same, through this function:
    ``feedback.worker``)."""
    out = {}
    paths = [getattr(module, "__file__", None) for module in list(sys.modules.values())]
    for path in [*paths, *_Witness.attempted]:
        if not path:
            continue
        path = pathlib.Path(path).resolve()
        if tree in path.parents and path.is_file():
            out[str(path.relative_to(tree))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return dict(sorted(out.items()))


def pytest_sessionfinish(session, exitstatus):
    # under pytest-xdist the workers ran the tests (and imported torch) and finish first: the controller's own
    # view is written only where no worker wrote one
    where = session.config.getoption("infra_agent_env")
    if where and (os.environ.get("PYTEST_XDIST_WORKER") or not os.path.exists(where)):
        with open(f"{where}.{os.getpid()}.tmp", "w") as f:
            json.dump(environment(), f)
        os.replace(f"{where}.{os.getpid()}.tmp", where)
    out, tree = session.config.getoption("infra_agent_imports"), session.config.getoption("infra_agent_tree")
    if not out or not tree:
        return
    tmp = f"{out}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(tree_imports(pathlib.Path(tree).resolve()), f)
    os.replace(tmp, f"{out}.{os.getpid()}")
