"""Prepare a flash-linear-attention release as a target: ``python targets/fla/prepare.py 0.5.2 DEST``.

The release's wheel comes from the package registry (``pip download fla-core==VERSION``) and is
unpacked into ``DEST`` as a git repository with one commit, the way a user's checkout of it would
be.  Nothing of fla is kept in this project; the judges (``infra-agent.yaml``, ``fla_cp_probes.py``)
stay beside this file, outside the tree they judge::

    infra-agent feedback --target DEST --manifest targets/fla/infra-agent.yaml
    infra-agent run --target DEST --manifest targets/fla/infra-agent.yaml
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys
import tempfile
import zipfile

MANIFEST = pathlib.Path(__file__).resolve().parent / "infra-agent.yaml"


def prepare(version: str, dest: str | pathlib.Path) -> pathlib.Path:
    """``fla-core==version`` unpacked into ``dest`` and committed (``RuntimeError``: the registry has none)."""
    dest = pathlib.Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise RuntimeError(f"{dest} exists and is not empty")
    with tempfile.TemporaryDirectory(prefix="fla-wheel-") as tmp:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"fla-core=={version}",
                               "-d", tmp], capture_output=True, text=True, timeout=600)
        wheels = sorted(pathlib.Path(tmp).glob("fla_core-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(f"no fla-core=={version} wheel from the registry: {proc.stderr.strip()[-300:]}")
        dest.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheels[0]) as whl:
            whl.extractall(dest, [n for n in whl.namelist() if n.startswith("fla/")])
    (dest / ".gitignore").write_text(".infra-agent/\n__pycache__/\n")
    env = {"GIT_AUTHOR_NAME": "fla", "GIT_AUTHOR_EMAIL": "fla@localhost", "GIT_COMMITTER_NAME": "fla",
           "GIT_COMMITTER_EMAIL": "fla@localhost", "PATH": "/usr/bin:/bin:/usr/local/bin"}
    for cmd in (["git", "init", "-q", "-b", "main"], ["git", "add", "-A"],
                ["git", "commit", "-q", "-m", f"flash-linear-attention {version} (fla-core wheel)"]):
        subprocess.run(cmd, cwd=dest, check=True, env=env, capture_output=True)
    return dest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("version", help="an fla-core release, e.g. 0.5.2")
    ap.add_argument("dest", help="an empty or missing folder")
    args = ap.parse_args()
    try:
        root = prepare(args.version, args.dest)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{root}: fla-core {args.version}; judge it with --target {root} --manifest {MANIFEST}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
