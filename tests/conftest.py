import os
import pathlib

# The state of users' repositories (sessions, caches, review queues) lives in the state home, never
# inside them; the tests' own home is a scratch folder, made and later removed by this import.
import tests.support.scratch_home  # noqa: F401

# Kernels run in Triton's interpreter on machines without a GPU; outputs are poisoned (NaN)
# before every kernel run so a kernel that skips work cannot pass on stale memory.
os.environ.setdefault("TARGET_STACK_POISON", "1")
# Probes are forked by warm servers in that home (feedback/forkserver.py); they retire soon after the last
# test that uses them, and all of them when the session ends.
os.environ.setdefault("INFRA_AGENT_FORKSERVER_IDLE_S", "120")

import git
import pytest
import torch

import target_stack.ops  # noqa: F401  (decides TRITON_INTERPRET before triton is imported)
from tests.support.toy_harness import TOY_MANIFEST, TOY_PROBES


@pytest.fixture
def gen() -> torch.Generator:
    """A generator seeded from the OS: fresh random inputs on every run, reported on failure."""
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    print(f"input seed: {seed}")
    return g


@pytest.fixture
def toy(tmp_path) -> pathlib.Path:
    """A git repository of the harness's toy target (tests/support/toy_harness.py)."""
    root = tmp_path / "toy_target"
    (root / "toy").mkdir(parents=True)
    (root / "toy" / "__init__.py").write_text("")
    (root / "toy" / "probes.py").write_text(TOY_PROBES)
    (root / "toy" / "value.txt").write_text("1")
    (root / "toy" / "core.py").write_text("def core():\n    return 1\n")
    (root / "infra-agent.yaml").write_text(TOY_MANIFEST)
    repo = git.Repo.init(root)
    repo.index.add(["toy/__init__.py", "toy/probes.py", "toy/value.txt", "toy/core.py", "infra-agent.yaml"])
    repo.index.commit("toy target", author=git.Actor("t", "t@t"), committer=git.Actor("t", "t@t"))
    return root


def pytest_sessionfinish(session, exitstatus):
    if not hasattr(session.config, "workerinput"):  # the controller, once every worker is done
        from feedback import forkserver

        forkserver.shutdown(pathlib.Path(os.environ["INFRA_AGENT_HOME"]))
