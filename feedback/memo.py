"""Whole reports remembered: an unchanged re-run of ``infra-agent feedback`` answered in milliseconds.

An unchanged re-run already takes every probe result from the cache (:mod:`feedback.runner`), but it
still imports the harness (typer, pydantic, yaml, the manifest's models), reads the manifest and hashes
every covered file.  A memo is the report such a fully cached run printed, stored with what it was
computed from, and served again only while all of that is as it was:

* **the request**: the target's path, the probes asked for, the change (the ``--changed-from``
  revision, or the text of ``--diff``), ``--all``, ``--baseline``, an outside ``--manifest`` (its
  path and text);
* **the files**: every file under the target tree (but a virtual environment kept in it,
  :data:`feedback.state.ENV_PARTS`), under the harness's own packages and under any probe folder kept
  outside the tree, by path, size, mtime, ctime and inode.  ctime cannot be set back from user space,
  so a rewrite shows even when its size and mtime are restored; a file written within :data:`RACY_NS`
  of an observation is hashed as well (a second write in the same clock tick leaves every time stamp
  as it was);
* **git's answers**: the commit the baseline revision names and the files changed since it;
* **the environment** probes run in, as the cache's key holds it: the interpreter, torch's and
  triton's installed files, the GPU the driver reports, and the variables that switch the
  interpreter and the tf32 emulation;
* **the cache**: its folder's time stamps and entry count (a baseline result cached since may select
  another probe).

A memo is written only from a report in which every result came from the cache, with every input
observed equal before and after that run.  After a run that computed results, the CLI judges the tree
once more from the cache alone (:class:`CacheOnly`: a miss runs nothing) to get that report, so the very
next unchanged run is served.  Anything else (a changed byte, a new file, a moved branch, a cleared
cache, another machine) is a miss, and the full path runs and writes a new memo.

Not memoised: ``--no-cache``, ``--trace-dir`` (the run writes traces), an executor other than the
local one (the cache's key is then the cluster's), a tree with a symbolic link to a folder (a walk
would not see inside) or with more than :data:`MAX_FILES` files.

This module and what it imports use nothing beyond the standard library, so the console script
(:mod:`infra_agent.entry`) can answer from a memo before anything heavy loads.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import pathlib
import sys
import time

from feedback import machine
from feedback.changes import changes_since, commit_of, repo_root
from feedback.state import ENV_PARTS, SKIP_PARTS

VERSION = 1
#: a file whose mtime or ctime lies this close to an observation is hashed too (coarse clocks, and file
#: systems that keep seconds)
RACY_NS = 3_000_000_000
#: a larger tree is not memoised (its walk would cost what it saves)
MAX_FILES = 50_000
#: memos kept per state folder, the most recently written
KEEP = 64
#: the harness's own packages: a new infra-agent judges differently, so its files are inputs too
HARNESS_DIRS = tuple(str(pathlib.Path(__file__).resolve().parents[1] / p) for p in ("feedback", "infra_agent"))
#: the variables that change how probes run (the interpreter, hidden GPUs, the tf32 emulation)
ENV_VARS = ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES", "INFRA_AGENT_EMULATE_DOT")


class Unmemoizable(Exception):
    """This tree or request cannot be observed cheaply and exactly: no memo is read or written."""


class CacheMiss(RuntimeError):
    pass


class CacheOnly:
    """An executor for :class:`feedback.runner.Runner` that runs nothing: a probe the cache cannot answer
    becomes an error result (never cached), so a report judged with it is whole only when every result
    came from the cache."""

    def run(self, runner, spec):
        raise CacheMiss(f"{spec.id}: not in the cache")


class Request:
    """What a ``feedback`` command asked, as far as it decides the report.  ``diff_text``, ``manifest_text``:
    the texts the run itself reads (read once, by the caller); they enter as their hashes."""

    def __init__(self, target: str | os.PathLike, *, probes=None, changed_from: str | None = None,
                 diff_text: str | None = None, run_all: bool = False, baseline: str | None = None,
                 manifest_file: str | os.PathLike | None = None, manifest_text: str | None = None):
        self.target = str(pathlib.Path(target).resolve())
        self.fields = {"target": self.target, "probes": list(probes or ()), "changed_from": changed_from,
                       "diff_sha256": _sha(diff_text.encode()) if diff_text is not None else None,
                       "run_all": bool(run_all), "baseline": baseline,
                       "manifest": str(pathlib.Path(manifest_file).resolve()) if manifest_file else None,
                       "manifest_sha256": _sha(manifest_text.encode()) if manifest_text is not None else None}

    def key(self) -> str:
        return _sha(json.dumps(self.fields, sort_keys=True).encode())


class Memo:
    """A served memo: the report's text, its exit code, where it lies and when it was written."""

    def __init__(self, path: pathlib.Path, report: str, code: int, written: float):
        self.path, self.report, self.code, self.written = path, report, code, written


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _walk(folder: str, now_ns: int, find_racy: bool, racy: set[str]) -> list:
    """[hash of the stat lines of ``folder``'s files, their count]; with ``find_racy``, the paths of those
    written within :data:`RACY_NS` of ``now_ns`` are added to ``racy``."""
    h, n = hashlib.sha256(), 0
    for root, dirs, files in os.walk(folder):
        # a virtual environment in the tree (uv and venv keep ``.venv`` in the project) is not walked: tens of
        # thousands of files that no probe covers, whose packages the key holds by version (torch, Triton)
        dirs[:] = sorted(d for d in dirs if d not in SKIP_PARTS and d not in ENV_PARTS)
        for d in dirs:
            if os.path.islink(os.path.join(root, d)):
                raise Unmemoizable(f"{os.path.join(root, d)} is a symbolic link to a folder")
        for name in sorted(files):
            path = os.path.join(root, name)
            try:
                st = os.stat(path)
            except OSError:  # a dangling link: its own stat
                st = os.lstat(path)
            n += 1
            if n > MAX_FILES:
                raise Unmemoizable(f"{folder} has more than {MAX_FILES} files")
            h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0{st.st_ino}\n".encode())
            if find_racy and max(st.st_mtime_ns, st.st_ctime_ns) >= now_ns - RACY_NS:
                racy.add(path)
    return [h.hexdigest(), n]


def _files(dirs: list[str], racy: list[str] | None) -> tuple[dict, dict]:
    """({folder: [stat hash, count]}, {racy path: sha256}) of ``dirs``.  ``racy``: the paths to hash; None:
    those written within :data:`RACY_NS` of now."""
    now, found = time.time_ns(), set()
    walked = {d: _walk(d, now, racy is None, found) if os.path.isdir(d) else None for d in dirs}
    hashed = {}
    for path in sorted(found if racy is None else racy):
        try:
            hashed[path] = _sha(pathlib.Path(path).read_bytes())
        except OSError:
            hashed[path] = None
    return walked, hashed


def _outside(new: list[str], dirs: list[str]) -> list[str]:
    """The folders of ``new`` (resolved) that no folder of ``dirs`` holds."""
    out: list[str] = []
    for d in (str(pathlib.Path(x).resolve()) for x in new):
        if not any(d == o or d.startswith(o.rstrip(os.sep) + os.sep) for o in [*dirs, *out]):
            out.append(d)
    return out


def _environment() -> dict:
    env = {"python": sys.executable, "version": sys.version, "platform": sys.platform, "machine": os.uname().machine,
           "gpu": machine.gpu_present(), "vars": {k: os.environ.get(k) for k in ENV_VARS}}
    env["device"] = machine.driver_gpu_model() if env["gpu"] else None
    for name in ("torch", "triton"):
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin:
            env[name] = None
            continue
        st = os.stat(spec.origin)
        env[name] = [spec.origin, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
    return env


def _git(request: Request) -> dict:
    out: dict = {}
    asked = request.fields
    if asked["changed_from"]:  # ValueError (no repository, an unknown revision): not memoised
        out["base"], out["changed"] = changes_since(request.target, asked["changed_from"])
    if asked["baseline"]:
        root = repo_root(pathlib.Path(request.target))
        out["base"] = commit_of(root, asked["baseline"]) if root is not None else None
    return out


def _cache(cache_dir: pathlib.Path) -> list:
    try:
        st = os.stat(cache_dir)
        return [st.st_mtime_ns, st.st_ctime_ns, len(os.listdir(cache_dir))]
    except OSError:
        return [None, None, 0]


def observe(request: Request, dirs: list[str], cache_dir: str | os.PathLike,
            racy: list[str] | None = None) -> dict:
    """Everything a fully cached run of ``request`` reads, summarised: two observations are equal only
    if such a run would print the same report.  ``racy``: the paths to hash (a lookup hashes those its
    memo named); without it, the files written within :data:`RACY_NS` of now are hashed."""
    files, hashed = _files(dirs, racy)
    return {"files": files, "racy": hashed, "git": _git(request), "environment": _environment(),
            "cache": _cache(pathlib.Path(cache_dir))}


def _plain(value):
    """``value`` as JSON gives it back (tuples as lists): what a stored observation is compared with."""
    return json.loads(json.dumps(value))


def lookup(memo_dir: str | os.PathLike, request: Request, cache_dir: str | os.PathLike) -> Memo | None:
    """The memo of ``request`` when nothing it was computed from has changed since, else None."""
    path = pathlib.Path(memo_dir) / f"{request.key()}.json"
    try:
        data = json.loads(path.read_text())
        if data.get("version") != VERSION or data.get("request") != request.fields:
            return None
        now = observe(request, data["dirs"], cache_dir, racy=list(data["observed"]["racy"]))
    except Exception:  # noqa: BLE001 - no memo, a damaged one, a repository git refuses: the full path judges
        return None
    if _plain(now) != data["observed"]:
        return None
    return Memo(path=path, report=data["report"], code=int(data["code"]), written=float(data["written"]))


class Recorder:
    """Observes a request's inputs before a run; :meth:`keep` stores the run's report as its memo when
    the inputs are still as observed afterwards."""

    def __init__(self, memo_dir: str | os.PathLike, request: Request, cache_dir: str | os.PathLike,
                 dirs: list[str] | None = None):
        self.memo_dir, self.request, self.cache_dir = pathlib.Path(memo_dir), request, cache_dir
        self.dirs = list(dirs) if dirs is not None else _outside([request.target, *HARNESS_DIRS], [])
        try:
            self.before = observe(request, self.dirs, cache_dir)
        except Exception:  # noqa: BLE001 - not memoisable (Unmemoizable, git's refusal): the run goes on without
            self.before = None

    def renew(self) -> Recorder:
        """The same request and folders, observed now (before another run)."""
        return Recorder(self.memo_dir, self.request, self.cache_dir, self.dirs)

    def extend(self, dirs) -> None:
        """Observe these folders too (a manifest's probe folders, known once it is read), those that no
        observed folder holds already."""
        new = _outside(list(map(str, dirs)), self.dirs)
        if self.before is None or not new:
            return
        try:
            files, hashed = _files(new, None)
        except Exception:  # noqa: BLE001 - as in __init__
            self.before = None
            return
        self.dirs += new
        self.before["files"].update(files)
        self.before["racy"].update(hashed)

    def keep(self, report_text: str, code: int) -> pathlib.Path | None:
        """Store ``report_text`` (printed by a run whose every result came from the cache) and its exit
        code; None, and nothing stored, when an input moved during the run."""
        if self.before is None:
            return None
        try:
            after = observe(self.request, self.dirs, self.cache_dir, racy=list(self.before["racy"]))
        except Exception:  # noqa: BLE001 - as in __init__
            return None
        if _plain(after) != _plain(self.before):
            return None
        self.memo_dir.mkdir(parents=True, exist_ok=True)
        path = self.memo_dir / f"{self.request.key()}.json"
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"version": VERSION, "request": self.request.fields, "dirs": self.dirs,
                                   "observed": _plain(self.before), "report": report_text, "code": code,
                                   "written": time.time()}))
        os.replace(tmp, path)
        _prune(self.memo_dir)
        return path


def _prune(memo_dir: pathlib.Path) -> None:
    memos = sorted(memo_dir.glob("*.json"), key=lambda p: p.stat().st_mtime_ns, reverse=True)
    for old in memos[KEEP:]:
        with contextlib.suppress(OSError):
            old.unlink()


def note(memo: Memo) -> str:
    """The line a served memo prints on stderr."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(memo.written))
    return (f"unchanged since {when}: the report of that run, every result from the cache "
            f"(memo {memo.path.name[:12]}; --no-cache judges again)")
