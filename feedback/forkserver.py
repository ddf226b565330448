"""Warm probe processes: a server that has imported torch, Triton and NumPy once forks every Python probe.

A cold Python probe spends ~2.5 s importing torch and Triton before it does any work.  The fork
server pays that once: it imports the heavy libraries and the harness's own probe modules, and
nothing of any tree under test, then forks a fresh process for each probe.  Each probe still gets
a process of its own, in a session and process group of its own, with the environment, working
directory, import path and output pipes that a cold ``python -m feedback.worker``
gets, so nothing changes for a verdict:

* nothing of one tree reaches the next: every probe is a fork of the same clean server, which never
  imported a tree; a library that the tree under test itself provides (a tree that *is* a Triton
  fork) is not preloaded, and a server that imported any module the tree provides (an installed copy
  of it, pulled in by a preloaded library) is not used for that tree;
* a manifest's ``preload`` names more third-party modules for the server to import (fla's probes pay
  ~3 s of ``torch._dynamo`` and ``torch._inductor`` imports each on a CPU): one server per such list;
  a module whose import opens the GPU driver (CUDA initialised: no fork could use the GPU) is found
  by the server itself, which checks after each import and refuses to serve, naming it; the harness
  then starts a server without that module (said once on stderr), so the rest stay warm;
* the environment at import time is the probe's own: there is one server per environment (less
  the variables that differ from probe to probe: the import path, the probe id, the harness pid and
  the timing witness; and those read only where they are used, ``TRITON_CACHE_DIR``), so a variable
  read at import time (``TRITON_INTERPRET``) reads the same;
* a probe with an address-space limit (``memory_mb``) runs cold: the limit is meant for a process image
  of the probe's own imports, and a fork carries the server's;
* budgets, Ctrl-C and a harness killed outright kill the probe as before: the probe leads its own
  process group (the runner's ``os.killpg``), and the monitor process between server and probe
  kills that group the moment the harness's connection closes.

One request::

    harness ──unix socket──▶ server ──fork──▶ monitor ──fork──▶ probe (feedback.worker.main)

The harness sends the request (worker arguments, environment, working directory) and
the write ends of its pipes (stdout, stderr, the timing witness) with ``SCM_RIGHTS``; the monitor
answers with the probe's pid, and with its exit status when it ends.

A server lives in the state home (``forkserver/KEY.sock``), started by the first probe that needs
it and shared by every harness process with the same key (the interpreter, the harness's source,
the environment, the preloaded modules).  It exits after ``INFRA_AGENT_FORKSERVER_IDLE_S`` seconds
(default 600) without a request, or as soon as its socket is removed or replaced.
``INFRA_AGENT_FORKSERVER=0`` turns it off.  A server that cannot start or answer is never an error:
the probe runs cold, as it always did.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib
import json
import os
import pathlib
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

from feedback.jobserver import SLOTS_VAR
from feedback.lifeline import HARNESS_PID
from feedback.state import state_home
from feedback.timing import WITNESS_FD

#: environment variables that differ from probe to probe; a server is shared across them
PER_PROBE = frozenset({"PYTHONPATH", WITNESS_FD, HARNESS_PID, "INFRA_AGENT_PROBE_ID", SLOTS_VAR})
#: variables a shell changes between commands, which no library reads at import time
VOLATILE = frozenset({"PWD", "OLDPWD", "_", "SHLVL"})
#: read where they are used, never at import (Triton looks its cache folder up when it compiles): a
#: server is shared across them, and each probe still runs with its own value (the Ray executor gives
#: every worker a Triton cache of its own, and its workers on a node then share one warm server)
READ_AT_USE = frozenset({"TRITON_CACHE_DIR"})
#: device files a process holds open once it has initialised a GPU's runtime (NVIDIA's, AMD's KFD); more,
#: comma-separated, in ``INFRA_AGENT_FORKSERVER_DRIVERS``
DRIVER_FILES = ("/dev/nvidia", "/dev/kfd")
#: the heavy imports every probe of this project pays for; a tree's own copy of one is never preloaded
PRELOAD = ("numpy", "torch", "triton", "triton.language")
#: a manifest's ``preload``: more third-party modules for the server to import (comma-separated)
PRELOAD_VAR = "INFRA_AGENT_PRELOAD"
#: the harness's side of a probe process
HARNESS_MODULES = ("feedback.worker", "feedback.probe", "feedback.models", "feedback.timing", "feedback.emulation",
                   "feedback.lifeline", "feedback.jobserver")
HARNESS_ROOT = pathlib.Path(__file__).resolve().parents[1]
_MAX_MESSAGE = 1 << 20
_START_TIMEOUT_S = 120.0


def enabled() -> bool:
    return (os.environ.get("INFRA_AGENT_FORKSERVER", "1").lower() not in ("0", "off", "false", "no")
            and sys.platform.startswith("linux") and hasattr(socket, "send_fds") and hasattr(os, "pidfd_open"))


def idle_s() -> float:
    try:
        return max(1.0, float(os.environ.get("INFRA_AGENT_FORKSERVER_IDLE_S", "600")))
    except ValueError:
        return 600.0


# --- the harness's side -----------------------------------------------------------------------------------


@functools.cache
def _harness_digest() -> str:
    """The harness's own source: a server started before an edit of ``feedback/`` is never used after it."""
    h = hashlib.sha256()
    for path in sorted((HARNESS_ROOT / "feedback").glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def split_path(pythonpath: str) -> tuple[list[str], list[str]]:
    """The probe's import path as (the tree's and the probes' own roots, what every probe shares: the harness
    and the user's ``PYTHONPATH``)."""
    entries = [p for p in pythonpath.split(os.pathsep) if p]
    harness = str(HARNESS_ROOT)
    if harness in entries:
        at = entries.index(harness)
        return entries[:at], entries[at:]
    return entries, [harness]


def provided_by(tree_roots: list[str]) -> frozenset[str]:
    """The top-level modules and packages the tree (or its probe roots) provides itself."""
    tops: set[str] = set()
    for root in tree_roots:
        with contextlib.suppress(OSError):
            for entry in os.scandir(root):
                if entry.name.endswith(".py") and entry.is_file():
                    tops.add(entry.name[:-3])
                elif entry.is_dir() and entry.name.isidentifier():
                    tops.add(entry.name)
    return frozenset(tops)


def preload_for(tops: frozenset[str], extra: str = "") -> tuple[str, ...]:
    """The heavy imports to preload for a tree (this project's, and ``extra``: a manifest's ``preload``,
    comma-separated): none that the tree (or its probe roots) provides itself (``tops``: ``provided_by``)."""
    names = dict.fromkeys([*PRELOAD, *(n.strip() for n in extra.split(",") if n.strip())])
    return tuple(n for n in names if n.split(".")[0] not in tops)


def server_key(env: dict[str, str], shared_path: list[str], preload: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    kept = sorted((k, v) for k, v in env.items() if k not in PER_PROBE | VOLATILE | READ_AT_USE)
    h.update(json.dumps([sys.executable, _harness_digest(), shared_path, list(preload), kept]).encode())
    return h.hexdigest()[:20]


class Forked:
    """A probe process forked by the server: what the runner uses of ``subprocess.Popen``."""

    def __init__(self, pid: int, conn: socket.socket, stdout, stderr):
        self.pid, self.stdout, self.stderr = pid, stdout, stderr
        self.returncode: int | None = None
        self._conn = conn

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is not None:
            return self.returncode
        self._conn.settimeout(timeout)
        try:
            data = self._conn.recv(4096)
        except TimeoutError:
            raise subprocess.TimeoutExpired("probe", timeout) from None
        except OSError:
            data = b""
        try:
            self.returncode = int(json.loads(data)["rc"])
        except (ValueError, KeyError, TypeError):  # the monitor died: its probe died with it
            self.returncode = -signal.SIGKILL
        self._conn.close()
        return self.returncode


_lock = threading.Lock()
_cold: dict[str, str] = {}  # servers that could not start: key -> why (their probes run cold in this process)
_opens_driver: dict[str, str] = {}  # preloaded modules whose import opened a GPU driver -> the file (never preloaded)
#: the line a server that refuses to serve for this reason writes last: the module and the file
_DRIVER_MARK = "opened-gpu-driver:"
_modules: dict[str, frozenset[str]] = {}  # key -> the top-level modules its server imported
_clashes: dict[tuple[str, frozenset[str]], str] = {}  # (key, modules a tree provides) already reported
_started: list[subprocess.Popen] = []  # the servers this process started: a running child's Popen must not be
#                                        collected (it would warn and lose track of the process)


def _socket_dir(home: pathlib.Path | None = None) -> pathlib.Path:
    return (home or state_home()) / "forkserver"


def socket_path(key: str) -> pathlib.Path | None:
    """Where the server of ``key`` listens: in the state home, or (a home too deep for a unix socket's
    108-byte path) in a private folder of this user under the temporary directory.  None: neither is usable."""
    path = _socket_dir() / f"{key}.sock"
    if len(str(path)) <= 100:
        return path
    short = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / f"infra-agent-{os.getuid()}"
    try:
        short.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(short)
    except OSError:
        return None
    if st.st_uid != os.getuid() or (st.st_mode & 0o077) or not os.path.isdir(short) or os.path.islink(short):
        return None  # a folder someone else made, or opened to others: never listen there
    path = short / (hashlib.sha256(str(path).encode()).hexdigest()[:20] + ".sock")
    return path if len(str(path)) <= 100 else None


def _connect(path: pathlib.Path) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(str(path))
        return sock
    except OSError:
        sock.close()
        return None


class DriverOpened(Exception):
    """A preloaded module's import opened a GPU driver in the server (which then refused to serve)."""

    def __init__(self, module: str, file: str):
        super().__init__(f"importing {module} opened the GPU driver ({file})")
        self.module, self.file = module, file


def _start(key: str, path: pathlib.Path, env: dict[str, str], shared_path: list[str],
           preload: tuple[str, ...]) -> str | None:
    """Start the server of ``key`` (listening on ``path``) unless one answers there already (one starter at a
    time).  The reason it could not, or None."""
    files = _socket_dir()
    files.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(files / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (sock := _connect(path)) is not None:
            sock.close()
            return None
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a server that died without removing its socket
        server_env = {k: v for k, v in env.items() if k not in PER_PROBE}
        server_env["PYTHONPATH"] = os.pathsep.join(shared_path)
        try:
            with open(files / f"{key}.log", "ab") as log:
                proc = subprocess.Popen([sys.executable, "-m", "feedback.forkserver", str(path),
                                         str(files / f"{key}.pid"), *preload],
                                        env=server_env, cwd=str(HARNESS_ROOT), stdin=subprocess.DEVNULL, stdout=log,
                                        stderr=log, start_new_session=True, close_fds=True)
        except OSError as exc:
            return f"cannot start the fork server: {exc}"
        _started.append(proc)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if path.exists():
                return None
            if proc.poll() is not None:
                tail = (files / f"{key}.log").read_text(errors="replace").strip().splitlines()[-3:]
                if tail and tail[-1].startswith(_DRIVER_MARK) and len(mark := tail[-1].split(maxsplit=2)) == 3:
                    raise DriverOpened(mark[1], mark[2])
                return f"the fork server exited with status {proc.returncode}: " + " | ".join(tail)
            time.sleep(0.02)
        proc.kill()
        return f"the fork server did not come up within {_START_TIMEOUT_S:g} s"


def _imported(key: str) -> frozenset[str]:
    """The top-level modules the server of ``key`` imported (written before it listens), read once."""
    if key not in _modules:
        try:
            _modules[key] = frozenset((_socket_dir() / f"{key}.modules").read_text().split())
        except OSError:
            return frozenset()
    return _modules[key]


def spawn(worker_args: list[str], env: dict[str, str], cwd: str, witness_fd: int | None = None) -> Forked | None:
    """``python -m feedback.worker *worker_args`` as a fork of a warm server; None where none can serve it
    (the caller runs it cold)."""
    if not enabled():
        return None
    tree_roots, shared_path = split_path(env.get("PYTHONPATH", ""))
    tops = provided_by(tree_roots)
    wanted = preload_for(tops, env.get(PRELOAD_VAR, ""))
    while True:  # at most once more per module that turns out to open a GPU driver
        preload = tuple(n for n in wanted if n not in _opens_driver)
        key = server_key(env, shared_path, preload)
        if key in _cold:
            return None
        path = socket_path(key)
        if path is None:
            _cold[key] = f"no folder for a unix socket (the state home {state_home()} is too deep, /tmp unusable)"
            return None
        conn = _connect(path)
        if conn is not None:
            break
        try:
            with _lock:
                why = _start(key, path, env, shared_path, preload)
        except DriverOpened as exc:
            if exc.module not in preload:  # the harness's own modules: nothing to leave out
                _cold[key] = str(exc)
                print(f"infra-agent: probes run cold: {exc}", file=sys.stderr)
                return None
            _opens_driver[exc.module] = exc.file
            print(f"infra-agent: the warm probe server leaves out {exc.module}: {exc} there, and a forked "
                  "probe could not use the GPU (its probes import it themselves)", file=sys.stderr)
            continue
        if why is not None:
            _cold[key] = why
            print(f"infra-agent: probes run cold: {why}", file=sys.stderr)
            return None
        conn = _connect(path)
        if conn is None:
            return None
        break
    if clash := _imported(key) & tops:
        conn.close()  # the server imported (an installed copy of) what this tree provides: this tree runs cold
        why = f"the warm server has imported {', '.join(sorted(clash))}, which the tree under test provides"
        if _clashes.setdefault((key, clash), why) is why:
            print(f"infra-agent: probes of this tree run cold: {why}", file=sys.stderr)
        return None
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    request = json.dumps({"argv": worker_args, "env": env, "cwd": cwd}).encode()
    try:
        if len(request) > _MAX_MESSAGE:
            raise OSError("request too large")
        socket.send_fds(conn, [request], [out_w, err_w] + ([witness_fd] if witness_fd is not None else []))
        conn.settimeout(_START_TIMEOUT_S)
        pid = int(json.loads(conn.recv(4096))["pid"])
        conn.settimeout(None)
    except (OSError, ValueError, KeyError, TypeError):  # a server exiting as we came: run this probe cold
        for fd in (out_r, err_r):
            os.close(fd)
        conn.close()
        return None
    finally:
        os.close(out_w)
        os.close(err_w)
    return Forked(pid, conn, os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"))


def servers(home: pathlib.Path | None = None) -> list[int]:
    """The pids of the fork servers of a state home (from their pid files)."""
    out = []
    for pidfile in _socket_dir(home).glob("*.pid"):
        with contextlib.suppress(ValueError, OSError):
            out.append(int(pidfile.read_text()))
    return out


def shutdown(home: pathlib.Path | None = None) -> int:
    """Stop every fork server of a state home (each removes its socket first, so none is used again)."""
    n = 0
    for pid in servers(home):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
            n += 1
    return n


# --- the server's side ------------------------------------------------------------------------------------


def _probe_path(cwd: str, pythonpath: str, rest: list[str]) -> list[str]:
    """The import path a cold ``python -m feedback.worker`` started in ``cwd`` with ``pythonpath`` has."""
    out: list[str] = []
    for p in [cwd, *(p for p in pythonpath.split(os.pathsep) if p), *rest]:
        if p not in out:
            out.append(p)
    return out


def _become_probe(request: dict, fds: list[int], rest: list[str]) -> None:
    """In the forked probe process: take the request's pipes, environment, directory and limits, and run the
    worker exactly as ``python -m feedback.worker`` would.  Never returns."""
    code = 1
    try:
        os.setsid()  # a session and process group of its own: the runner kills the group
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in (devnull, fds[0], fds[1]):
            if fd > 2:
                os.close(fd)
        env = dict(request["env"])
        if len(fds) > 2:
            os.set_inheritable(fds[2], True)
            env[WITNESS_FD] = str(fds[2])
        env[HARNESS_PID] = str(os.getppid())  # the monitor, which kills this group when the harness goes
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(env)
        sys.path[:] = _probe_path(request["cwd"], env.get("PYTHONPATH", ""), rest)
        sys.path_importer_cache.clear()
        importlib.invalidate_caches()
        sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
        if env.get("PYTHONFAULTHANDLER"):
            import faulthandler

            faulthandler.enable()
        import random

        random.seed()  # a fork shares its parent's random state; a cold process would have drawn its own
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        from feedback import worker

        sys.argv = [worker.__file__, *request["argv"]]
        code = worker.main(request["argv"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - whatever happens, this process ends here
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _monitor(conn: socket.socket, rest: list[str]) -> None:
    """Between server and probe: fork the probe, answer its pid, then its exit status; kill its process group
    if the harness's connection closes first."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # this process waits for its child
    message, fds, _flags, _addr = socket.recv_fds(conn, _MAX_MESSAGE, 3)
    if not message:
        return
    request = json.loads(message)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        conn.close()
        _become_probe(request, fds, rest)
    for fd in fds:
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps({"pid": pid}).encode())
    while True:
        ready, _, _ = select.select([conn, pidfd], [], [])
        if pidfd in ready:
            break
        with contextlib.suppress(OSError):
            if conn.recv(64):
                continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # the harness is gone (or gave up): its probe goes too
        break
    _, status = os.waitpid(pid, 0)
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps({"rc": os.waitstatus_to_exitcode(status)}).encode())


def _same_user(conn: socket.socket) -> bool:
    try:
        _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                              struct.calcsize("3i")))
    except (OSError, AttributeError):
        return False
    return uid == os.getuid()


def opened_files(prefix: str) -> list[str]:
    """The files this process holds open whose path starts with ``prefix`` (Linux; none elsewhere)."""
    found = []
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if (target := os.readlink(f"/proc/self/fd/{fd}")).startswith(prefix):
                    found.append(target)
    return found


def serve(path: str, pidfile: str, preload: list[str]) -> int:
    """Import, listen on ``path``, fork a monitor per connection, until idle or displaced."""
    shared = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    rest = [p for p in sys.path[1:] if p not in shared]  # the interpreter's own path (stdlib, site-packages)
    drivers = (*DRIVER_FILES, *filter(None, os.environ.get("INFRA_AGENT_FORKSERVER_DRIVERS", "").split(",")))
    for name in [*preload, *HARNESS_MODULES]:
        importlib.import_module(name)
        # a process that initialised a GPU runtime cannot hand it to a fork: name the import that did it
        if opened := [f for prefix in drivers for f in opened_files(prefix)]:
            print(f"importing {name} opened the GPU driver ({opened[0]}): a forked probe could not use the GPU",
                  file=sys.stderr)
            print(f"{_DRIVER_MARK} {name} {opened[0]}", file=sys.stderr)
            return 3
    # every top-level module the server holds, which no probe's tree may provide (spawn checks it)
    tops = sorted({name.split(".")[0] for name in sys.modules})
    modules = pathlib.Path(pidfile).with_suffix(".modules")
    modules.write_text("\n".join(tops))
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # monitors are reaped by the kernel
    stop = threading.Event()
    tmp = f"{path}.{os.getpid()}.tmp"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.bind(tmp)
    os.chmod(tmp, 0o600)
    sock.listen(64)
    os.replace(tmp, path)  # visible only once it can serve
    ino = os.stat(path).st_ino
    pathlib.Path(pidfile).write_text(str(os.getpid()))

    def ours() -> bool:  # the socket at ``path`` is still this server's (not removed, not another's)
        try:
            return os.stat(path).st_ino == ino
        except FileNotFoundError:
            return False

    def retire(*_args) -> None:  # SIGTERM: no new connection from here on, then out of the loop
        if ours():
            os.unlink(path)
        stop.set()

    signal.signal(signal.SIGTERM, retire)
    idle, last = idle_s(), time.monotonic()
    sock.settimeout(min(idle, 2.0))
    try:
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                if not ours() or time.monotonic() - last > idle:
                    break
                continue
            except InterruptedError:
                continue
            if not _same_user(conn):  # the socket is private; refuse anyone else all the same
                conn.close()
                continue
            last = time.monotonic()
            sys.stdout.flush()
            sys.stderr.flush()
            if os.fork() == 0:
                sock.close()
                try:
                    _monitor(conn, rest)
                finally:
                    os._exit(0)
            conn.close()
    finally:
        if ours():
            os.unlink(path)
        with contextlib.suppress(FileNotFoundError):
            if pathlib.Path(pidfile).read_text() == str(os.getpid()):
                os.unlink(pidfile)
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1], sys.argv[2], sys.argv[3:]))
