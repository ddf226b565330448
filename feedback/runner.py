"""Run probes: each in its own subprocess, under a hard timeout, cached by content hash.

* Python probes run ``python -m feedback.worker`` with the tree's import roots first on
  PYTHONPATH; command probes run their shell command in the tree and print one JSON object.
* Without a GPU the probe process gets ``TRITON_INTERPRET=1`` and the dot-precision emulation
  (``INFRA_AGENT_EMULATE_DOT=1``), so tf32 bugs show on a CPU.  A probe declared ``interpret: true``
  (it counts a kernel's work, never times it) gets the interpreter and no GPU on every machine.
* Each probe is its own process group: past ``budget_s`` the whole group is killed, and a harness
  killed outright takes the group with it (``feedback/lifeline.py``).
* The cache key is the content of every covered file and of the probe's own module, the probe
  spec (params, thresholds), the environment and the harness's own source (another infra-agent may judge
  otherwise); a hit is reported with ``cached: true``.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import glob
import hashlib
import importlib.metadata as md
import json
import os
import pathlib
import platform
import re
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from feedback import forkserver, jobserver, machine
from feedback.lifeline import HARNESS_PID
from feedback.manifest import SECRET_VAR, Manifest, ProbeSpec
from feedback.models import Finding, Fingerprint, Location, Metric, ProbeResult, Status
from feedback.needs import absent_package, importable, lacks
from feedback.state import StateDir
from feedback.timing import WITNESS_FD
from feedback.verdict import combine_runs, repeats_for

TAIL = 4000  # characters of stdout/stderr kept in a result
ARMED_KINDS = ("microbench", "e2e")  # their clocks are kept before the tree loads (feedback/timing.py)
HARNESS_ROOT = pathlib.Path(__file__).resolve().parents[1]
#: the lifeline that command and pytest probes run under, started by path in isolated mode (``-I``: no
#: PYTHONPATH, no current folder), so a target's own top-level ``feedback`` package (or a ``signal.py``
#: at its root) cannot stand in for it or for the standard library it imports
LIFELINE = [sys.executable, "-I", str(pathlib.Path(__file__).resolve().parent / "lifeline.py")]
#: the folder of the pytest plugin that records a pytest probe's imports (alone in it, so first on the path)
PYTEST_PLUGIN = str(pathlib.Path(__file__).resolve().parent / "pytest_plugin")


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


@functools.cache
def harness_digest() -> str:
    """sha256 over the harness's own source (``feedback/``, ``infra_agent/``): a new infra-agent may judge
    differently (a check that counts other sites, a probe helper that measures another way), so a result
    cached by one is never served to another.  Read once per process (some sixty files: a few ms)."""
    h = hashlib.sha256()
    for part in ("feedback", "infra_agent"):
        for f in sorted((HARNESS_ROOT / part).rglob("*.py")):
            if "__pycache__" not in f.parts:
                h.update(f.relative_to(HARNESS_ROOT).as_posix().encode())
                h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def environment_key(emulate: bool) -> str:
    """A cheap fingerprint of where probes will run, computed without importing torch: a result cached
    on one GPU model is not served on another (a state folder on a shared file system)."""
    return local_fingerprint(emulate).key()


def local_fingerprint(emulate: bool) -> Fingerprint:
    """This machine's :class:`Fingerprint` as a probe here would record it, read without importing torch."""
    return Fingerprint(python=platform.python_version(), platform=f"{platform.system()}-{platform.machine()}",
                     torch=_version("torch"), triton=_version("triton"),
                     device=(machine.driver_gpu_model() or "gpu") if machine.gpu_present() else "cpu",
                     mode="native" if machine.gpu_present() else "interpreter",
                     emulation="truncate" if emulate and not machine.gpu_present() else None)


def _tail(text: str | bytes | None) -> str:
    if text is None:
        return ""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    return text[-TAIL:]


class _Tail:
    """Reads a pipe to its end on a thread, keeping only the last ``TAIL`` characters' worth of bytes
    (and how many were dropped), so a probe that prints without end neither blocks nor fills memory."""

    def __init__(self, pipe):
        self.pipe, self.kept, self.dropped = pipe, bytearray(), 0
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        keep = 4 * TAIL  # bytes: room for multi-byte characters
        try:
            while chunk := self.pipe.read1(1 << 16) if hasattr(self.pipe, "read1") else self.pipe.read(1 << 16):
                self.kept += chunk
                if len(self.kept) > 2 * keep:
                    self.dropped += len(self.kept) - keep
                    del self.kept[:-keep]
        except (OSError, ValueError):
            pass

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)

    def text(self) -> str:
        body = _tail(bytes(self.kept))
        return f"[{self.dropped} earlier bytes of output not kept]\n{body}" if self.dropped else body


#: the reason of a probe :meth:`Runner.stop` kept from starting
STOPPED = "stopped before it started: the harness no longer wanted its result"


class EnvironmentFailure(RuntimeError):
    """The harness or the machine could not run a probe; reported as an error never blamed on a candidate."""


class Runner:
    def __init__(self, tree: str | pathlib.Path, manifest: Manifest, *, jobs: int = 2, cache_dir: str | None = None,
                 use_cache: bool = True, emulate: bool = True, extra_env: dict[str, str] | None = None,
                 executor=None):
        self.tree = pathlib.Path(tree).resolve()
        self.manifest = manifest
        self.jobs = max(1, jobs)
        self.use_cache = use_cache
        self.emulate = emulate
        self.extra_env = dict(extra_env or {})
        self.cache_dir = pathlib.Path(cache_dir) if cache_dir else StateDir.of(self.tree).cache
        # where the probes run decides which cached results hold: here, or an executor's machines
        self.env_key = (executor.environment_key(emulate) if hasattr(executor, "environment_key")
                        else environment_key(emulate))
        self._live: set[subprocess.Popen] = set()
        self._stopping = threading.Event()  # set by stop(): nothing starts, whatever runs is killed
        # where probes run: None here, as subprocesses; or an executor with run(runner, spec) -> (result,
        # reported), such as feedback.ray_executor.RayExecutor (the cache stays here either way)
        self.executor = executor
        self._digests: dict[str, str | None] = {}
        # the slots of ``jobs``: a probe run here holds one, and may borrow those that idle
        # (feedback/jobserver.py); made on first use, so a runner that runs nothing makes no folder, and
        # removed with the runner
        self._slots: jobserver.Slots | None = None
        self._slots_lock = threading.Lock()

    @property
    def import_roots(self) -> list[pathlib.Path]:
        """Where the tree's modules are imported from (the manifest's ``python_path``, in the tree)."""
        return [self.tree / r for r in self.manifest.python_path]

    # --- cache ------------------------------------------------------------------------------

    def covered_files(self, spec: ProbeSpec) -> list[pathlib.Path]:
        files: set[pathlib.Path] = set()
        for pattern in spec.covers.files:
            for hit in glob.glob(str(self.tree / pattern), recursive=True):
                p = pathlib.Path(hit)
                if p.is_file():
                    files.add(p)
        for node in spec.pytest or []:  # a pytest probe's own test files judge it: their content is in the key
            test = self.tree / node.split("::")[0]
            if test.is_file():
                files.add(test)
        dotted = [spec.entry] if spec.entry else [d for d in (spec.bench.call, spec.bench.make, spec.bench.check,
                                                               spec.bench.bytes) if isinstance(d, str)] \
            if spec.bench else []
        for entry in dotted:  # the modules a probe runs are part of what it covers
            module = entry.split(":")[0].replace(".", "/")
            for root in [*self.manifest.probe_roots(), *self.import_roots]:
                for cand in (root / f"{module}.py", root / module / "__init__.py"):
                    if cand.is_file():
                        files.add(cand)
        return sorted(files)

    def cache_key(self, spec: ProbeSpec) -> str:
        h = hashlib.sha256()
        h.update(spec.model_dump_json().encode())
        h.update(self.env_key.encode())
        h.update(harness_digest().encode())
        h.update(str(self.extra_env).encode())
        root = str(self.tree) + os.sep
        for f in map(str, self.covered_files(spec)):
            if f.startswith(root):  # a tree file is read once per runner, whichever probes cover it
                rel = f[len(root):]
                h.update(rel.encode())
                h.update(bytes.fromhex(self._digest(rel) or ""))
            else:
                h.update(f.encode())
                h.update(hashlib.sha256(pathlib.Path(f).read_bytes()).digest())
        return h.hexdigest()

    def _cache_get(self, key: str) -> ProbeResult | None:
        """The cached result under ``key``, unless a tree file its probe imported has changed since (one its
        covers do not name: the key holds only those)."""
        path = self.cache_dir / f"{key}.json"
        if not path.is_file():
            return None
        try:
            hit = ProbeResult.model_validate_json(path.read_text())
        except Exception:  # noqa: BLE001 - a damaged cache entry is a miss
            return None
        if any(self._digest(rel) != digest for rel, digest in hit.imports.items()):
            return None
        # a package its tests could not import is there now (installed, a submodule checked out): ask again
        if any(importable(name, [self.tree, *self.import_roots]) for name in hit.absent):
            return None
        return hit.model_copy(update={"cached": True})

    def _digest(self, rel: str) -> str | None:
        """sha256 of a tree file (None: it is gone), read once per runner: one judgement of one tree."""
        if rel not in self._digests:
            try:
                self._digests[rel] = hashlib.sha256((self.tree / rel).read_bytes()).hexdigest()
            except OSError:
                self._digests[rel] = None
        return self._digests[rel]

    def _cache_put(self, key: str, result: ProbeResult) -> None:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.cache_dir / f"{key}.{os.getpid()}.tmp"
        tmp.write_text(result.model_dump_json())
        os.replace(tmp, self.cache_dir / f"{key}.json")

    # --- running ----------------------------------------------------------------------------

    @property
    def slots(self) -> jobserver.Slots:
        with self._slots_lock:
            if self._slots is None:
                self._slots = jobserver.Slots(self.jobs)
            return self._slots

    def env(self, spec: ProbeSpec | None = None) -> dict[str, str]:
        # no credentials: a probe (and the candidate code it imports) has no use for them, and whatever
        # it prints ends up in results and records
        env = {k: v for k, v in os.environ.items() if not SECRET_VAR.search(k)}
        if spec is not None:
            env.update(spec.env)  # the manifest's switches; what the harness sets below wins
        roots = [str(r) for r in self.import_roots]
        # probe modules kept outside the tree first (nothing in the tree can stand in for them), then the
        # tree's import roots, then the harness, for feedback.* itself
        probes = [str(r) for r in self.manifest.probe_roots()]
        env["PYTHONPATH"] = os.pathsep.join(probes + roots + [str(HARNESS_ROOT)] +
                                            ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONFAULTHANDLER"] = "1"  # a probe killed by a signal still says where it was (crash_site)
        env[HARNESS_PID] = str(os.getpid())  # the probe dies with the harness (feedback/lifeline.py)
        if "OMP_NUM_THREADS" not in env:
            # the cores shared among the ``jobs`` probes that run at once: torch's OpenMP threads of parallel probes
            # would oversubscribe the machine, and libgomp's spinning barriers then stall (a 2 s probe ran past its
            # 60 s budget on a 2-core machine beside a probe with three worker processes; bench/RESULTS.md,
            # 2026-12-06d).  A value in the environment or the manifest's ``env:`` is kept.
            env["OMP_NUM_THREADS"] = str(max(1, machine.cpu_cores() // self.jobs))
        if self._slots is not None:  # the harness's idle slots, which a probe may borrow (feedback/jobserver.py);
            env[jobserver.SLOTS_VAR] = str(self._slots.path)  # none where no slot is held for it (a Ray worker)
        if self.manifest.preload:  # what the warm probe server imports besides its own (feedback/forkserver.py)
            env[forkserver.PRELOAD_VAR] = ",".join(self.manifest.preload)
        if not machine.gpu_present():
            env["TRITON_INTERPRET"] = "1"
            if self.emulate:
                env.setdefault("INFRA_AGENT_EMULATE_DOT", "1")
        elif spec is not None and spec.interpret:  # a work-counting probe: the interpreter, on the CPU, anywhere
            env["TRITON_INTERPRET"] = "1"
            env["CUDA_VISIBLE_DEVICES"] = ""
        env.update(self.extra_env)
        return env

    def run(self, specs: list[ProbeSpec], on_done: Callable[[ProbeResult], None] | None = None,
            fresh: bool = False) -> list[ProbeResult]:
        """Run probes (up to ``jobs`` at once); results in the order of ``specs``.  ``fresh``: measure
        them again even where the cache holds a result (which is then replaced)."""
        results: dict[str, ProbeResult] = {}
        with cf.ThreadPoolExecutor(max_workers=self.jobs) as pool:
            futures = {pool.submit(self.run_one, s, fresh): s for s in specs}
            try:
                for fut in cf.as_completed(futures):
                    spec = futures[fut]
                    try:
                        res = fut.result()
                    except Exception as exc:  # noqa: BLE001 - the harness never crashes on a probe
                        res = ProbeResult(probe=spec.id, status=Status.error, reason=f"harness: {exc}",
                                          environment_failure=True)
                    results[spec.id] = res
                    if on_done:
                        on_done(res)
            except BaseException:  # Ctrl-C: no probe process outlives the harness
                for f in futures:
                    f.cancel()
                for proc in list(self._live):
                    self._kill_group(proc)
                raise
        return [results[s.id] for s in specs]

    def stop(self) -> None:
        """Stop the probes of this runner's runs in progress: those not started yet are not started (a
        skipped result, :data:`STOPPED`), the running ones are killed with their process groups.  Nothing of a
        stopped probe is cached: it reported nothing.  For a run whose results are no longer wanted (the
        harness's next stage, started beside a static stage that then failed); :meth:`resume` ends it."""
        self._stopping.set()
        for proc in list(self._live):
            self._kill_group(proc)

    def resume(self) -> None:
        """Let probes start again after :meth:`stop` (once the stopped runs have returned)."""
        self._stopping.clear()

    def cached(self, spec: ProbeSpec) -> ProbeResult | None:
        """The cache's result for ``spec``, if it holds one."""
        return self._cache_get(self.cache_key(spec)) if self.use_cache else None

    def run_one(self, spec: ProbeSpec, fresh: bool = False) -> ProbeResult:
        """Run a probe (``repeats`` times for the performance kinds), or serve it from the cache.

        Cached: what the probe itself reported, failures and its own exceptions included (the same
        files in the same environment raise the same way).  Re-run every time: timeouts, crashes
        and failures of the harness or the machine.
        """
        if self._stopping.is_set():
            return ProbeResult(probe=spec.id, status=Status.skipped, reason=STOPPED)
        key = self.cache_key(spec) if self.use_cache else None
        if key and not fresh and (hit := self._cache_get(key)):
            return hit
        if self.executor is not None:
            result, reported = self.executor.run(self, spec)
        else:
            # a slot of ``jobs`` while it runs (a static probe runs beside a stage and takes none)
            held = None if spec.kind == "static" else self.slots.acquire(self._stopping)
            try:
                if self._stopping.is_set():
                    return ProbeResult(probe=spec.id, status=Status.skipped, reason=STOPPED)
                result, reported = self.execute(spec)
            finally:
                if held is not None:
                    held.release()
        result = apply_thresholds(spec, result)
        if key and reported:
            self._cache_put(key, result)
        return result

    def run_once(self, spec: ProbeSpec) -> tuple[ProbeResult, bool]:
        """One run of a probe, here or on the executor: no repeats, no thresholds, no cache.  (result,
        whether the probe itself reported it.)  A paired measurement interleaves these and hands the runs
        to :meth:`settle`."""
        one = spec.model_copy(update={"repeats": 1})
        try:
            return self.executor.run(self, one) if self.executor is not None else self.execute(one)
        except BaseException:  # Ctrl-C: no probe process outlives the harness
            for proc in list(self._live):
                self._kill_group(proc)
            raise

    def settle(self, spec: ProbeSpec, runs: list[ProbeResult], reported: bool) -> ProbeResult:
        """The result :meth:`run_one` would give for these runs of ``spec``: combined, its thresholds
        applied to the medians, cached when every run was the probe's own report."""
        result = apply_thresholds(spec, combine_runs(runs))
        if self.use_cache and reported:
            self._cache_put(self.cache_key(spec), result)
        return result

    def execute(self, spec: ProbeSpec) -> tuple[ProbeResult, bool]:
        """Run the probe here (``repeats`` times for the performance kinds): (result, whether the probe
        itself reported it).  An executor elsewhere (``feedback/ray_executor.py``) calls this on its worker."""
        if (spec.needs_gpu or spec.gpus) and not machine.gpu_present():
            return ProbeResult(probe=spec.id, status=Status.skipped, reason="needs a GPU; none on this machine"), True
        if spec.gpus and (have := machine.gpu_count()) < spec.gpus:
            return ProbeResult(probe=spec.id, status=Status.skipped,
                               reason=f"needs {spec.gpus} GPUs together; this machine has {have}"), True
        runs, reported = [], True
        for _ in range(repeats_for(spec.kind, spec.repeats)):
            run, ok = (self._run_python(spec) if spec.entry or spec.bench else self._run_check(spec) if spec.check
                       else self._run_pytest(spec) if spec.pytest else self._run_command(spec))
            runs.append(run)
            reported &= ok
            if run.status not in (Status.passed, Status.failed):
                break  # an error, a timeout or a skip: repeating would say the same
        return combine_runs(runs), reported

    def _spawn(self, spec: ProbeSpec, argv: list[str] | str, shell: bool,
               stamps: list[tuple[float, str]] | None = None,
               warm: bool = False, path_first: str | None = None) -> tuple[int | None, str, str, float, bool]:
        """Run in a new process group; kill the group at the budget.  (rc, out, err, secs, timed_out)

        With ``stamps``, the probe gets the write end of a pipe (``INFRA_AGENT_WITNESS_FD``) and every
        line it writes there is appended with this process's clock at its arrival.  With ``warm`` (``argv`` is
        ``python -m feedback.worker ARGS``), the probe is forked by a warm server where one can serve it
        (``feedback/forkserver.py``), the same process in every other respect."""
        limit = spec.memory_mb

        def preexec() -> None:
            if limit:
                resource.setrlimit(resource.RLIMIT_AS, (limit * 2**20, limit * 2**20))

        env, fds, reader = self.env(spec), (), None
        if path_first:  # a folder ahead of everything else on the probe's import path
            env["PYTHONPATH"] = os.pathsep.join([path_first, env["PYTHONPATH"]])
        if stamps is not None:
            rfd, wfd = os.pipe()
            env[WITNESS_FD], fds = str(wfd), (wfd,)
            reader = threading.Thread(target=_read_witness, args=(rfd, stamps), daemon=True)
        t0 = time.perf_counter()
        try:
            proc = forkserver.spawn(argv[3:], env, str(self.tree), witness_fd=fds[0] if fds else None) \
                if warm and not limit else None
            if proc is None:
                proc = subprocess.Popen(argv, cwd=self.tree, env=env, shell=shell, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                        preexec_fn=preexec if limit else None, pass_fds=fds)
        except OSError as exc:  # no interpreter, no shell, no such directory: the machine failed, not the probe
            for fd in fds + ((rfd,) if fds else ()):
                os.close(fd)
            raise EnvironmentFailure(f"cannot start the probe process: {exc}") from exc
        if reader is not None:
            os.close(wfd)
            reader.start()
        self._live.add(proc)
        if self._stopping.is_set():  # stop() came between this probe's start and its registration
            self._kill_group(proc)
        out, err = _Tail(proc.stdout), _Tail(proc.stderr)  # bounded: a probe printing gigabytes costs nothing
        try:
            proc.wait(timeout=spec.budget_s)
            self._live.discard(proc)
            out.join(), err.join()
            if reader is not None:
                reader.join(timeout=5)
            return proc.returncode, out.text(), err.text(), time.perf_counter() - t0, False
        except subprocess.TimeoutExpired:
            self._kill_group(proc)
        except BaseException:  # Ctrl-C in the harness: the probe's process group dies with it
            self._kill_group(proc)
            raise
        try:
            proc.wait(timeout=10)
            out.join(timeout=10), err.join(timeout=10)  # pipes held by an escaped grandchild: give up on them
        except subprocess.TimeoutExpired:  # pragma: no cover - a process that survives SIGKILL
            pass
        finally:
            self._live.discard(proc)
        return None, out.text(), err.text(), time.perf_counter() - t0, True

    @staticmethod
    def _kill_group(proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    @staticmethod
    def _exit_reason(rc: int) -> str:
        if rc < 0:
            name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
            hint = " (out of memory?)" if -rc in (signal.SIGKILL, signal.SIGSEGV) else ""
            return f"probe process killed by {name}{hint}"
        return f"probe process exited with status {rc}"

    def _run_python(self, spec: ProbeSpec) -> tuple[ProbeResult, bool]:
        """One run of a Python probe: (result, whether the probe itself reported it)."""
        with tempfile.TemporaryDirectory(prefix="infra-agent-probe-") as tmp:
            req, out = pathlib.Path(tmp) / "request.json", pathlib.Path(tmp) / "result.json"
            armed = spec.kind in ARMED_KINDS
            req.write_text(json.dumps({"probe": spec.id, "entry": spec.entry, "params": spec.params,
                                       "bench": spec.bench.model_dump() if spec.bench else None,
                                       "tree": str(self.tree), "arm": armed,
                                       "probe_roots": [str(r) for r in self.manifest.probe_roots()]}))
            stamps: list[tuple[float, str]] = []
            rc, stdout, stderr, secs, timed_out = self._spawn(
                spec, [sys.executable, "-m", "feedback.worker", str(req), str(out)], shell=False, stamps=stamps,
                warm=True)
            if timed_out:
                return ProbeResult(probe=spec.id, status=Status.timeout, duration_s=secs, stdout=stdout, stderr=stderr,
                                   reason=f"no result within budget_s={spec.budget_s:g}; process group killed"), False
            if out.is_file():
                try:
                    res = ProbeResult.model_validate_json(out.read_text())
                    res = witnessed(res, stamps)
                    return res.model_copy(update={"stdout": stdout, "stderr": stderr, "duration_s": secs}), True
                except Exception as exc:  # noqa: BLE001
                    reason = f"unreadable result: {exc}".splitlines()[0]
            else:
                reason = self._exit_reason(rc) if rc else "probe process wrote no result"
                last = [ln for ln in stderr.strip().splitlines() if ln.strip()]
                if last:
                    reason += f": {last[-1][:300]}"
                site = crash_site(stderr, self.tree)
                if site:
                    reason += f" (at {site})"
            return ProbeResult(probe=spec.id, status=Status.error, duration_s=secs, stdout=stdout, stderr=stderr,
                               reason=reason), False

    def _run_check(self, spec: ProbeSpec) -> tuple[ProbeResult, bool]:
        """A built-in static check (feedback/checks.py), in this process: it only reads the tree's source."""
        from feedback.checks import DigestStore, run_check
        from feedback.sites import TOLERATED, split_tolerated

        t0 = time.perf_counter()
        try:
            options = {"every": True} if spec.check == "dot_precision" and spec.params.get("every") else {}
            metric, count, sites = run_check(spec.check, self.tree, spec.params.get("paths"),
                                             store=DigestStore(self.cache_dir / "digests"), **options)
        except ValueError as exc:
            return ProbeResult(probe=spec.id, status=Status.error, reason=str(exc)), True
        # the sites the manifest tolerates (what the tree had when `init` wrote it) are reported, not counted
        # a file that does not parse is a finding, not a site: it fails the check unless the manifest tolerates it
        # (`init` does, for what did not parse then), whatever the count; a change that breaks a file's syntax
        # leaves the check blind to that file, and had passed every check
        unparsed = {id(s) for s in sites[count:]}
        new, tolerated, stale = split_tolerated(sites, spec.params.get("tolerated", []))
        counted = [s for s in new if id(s) not in unparsed]
        unreadable = [s for s in new if id(s) in unparsed]
        count = len(counted)
        threshold = spec.thresholds.get(metric)
        failed = count > 0 and threshold is None or bool(unreadable)  # a threshold, where given, decides the count
        # the sites are what the count counted: where a threshold on it is violated, they are what failed, each
        # at its line (apply_thresholds adds the bound's own line)
        sites_failed = failed or (threshold is not None and threshold.violated(count))
        findings = [Finding(message=s.message + (TOLERATED if ok else ""),
                            location=Location(file=s.file, symbol=s.symbol, condition=f"line {s.line}"),
                            failed=not ok and (sites_failed or id(s) in unparsed))
                    for s, ok in ([(s, False) for s in counted + unreadable] + [(s, True) for s in tolerated])[:50]]
        if stale:
            findings.append(Finding(message=f"{len(stale)} site(s) the manifest tolerates are no longer found (fixed, "
                                            "or changed): params.tolerated can drop them: " + "; ".join(stale[:5])
                                    + (f"; and {len(stale) - 5} more" if len(stale) > 5 else "")))
        return ProbeResult(probe=spec.id, status=Status.failed if failed else Status.passed,
                           metrics={metric: Metric(value=count, better="lower")}, findings=findings,
                           duration_s=time.perf_counter() - t0), True

    def _stopped(self, spec: ProbeSpec, why: str, output: str, base: dict) -> ProbeResult:
        """A pytest run that stopped before it could write a result (a conftest that raised, a usage error): its
        exception and the tree's frame it came from, not the last line it printed (the second line of a
        message, or pytest's own footer)."""
        from feedback.junit import exception_line, localise

        said = exception_line(output) or next(iter([ln for ln in output.strip().splitlines() if ln.strip()][-1:]), "")
        at = localise(output, self.tree)
        findings = [Finding(message=f"pytest stopped before running a test: {said[:300]}", failed=True,
                            location=Location(file=at[0], symbol=at[2], condition=f"line {at[1]}"))] if at else []
        return ProbeResult(status=Status.error, reason=f"pytest {' '.join(spec.pytest)[:200]}: {why}"
                           + (f": {said[:200]}" if said else "") + (f" (at {at[0]}:{at[1]})" if at else ""),
                           findings=findings, **base)

    def _run_pytest(self, spec: ProbeSpec) -> tuple[ProbeResult, bool]:
        """The tree's own tests (node ids), under the lifeline; JUnit XML says what failed and where."""
        import shlex

        from feedback.junit import read_junit

        with tempfile.TemporaryDirectory(prefix="infra-agent-pytest-") as tmp:
            xml = pathlib.Path(tmp) / "junit.xml"
            imports = pathlib.Path(tmp) / "imports.json"
            where = pathlib.Path(tmp) / "environment.json"
            # a file that fails to import does not stop the others (pytest's default interrupts the whole run)
            cmd = shlex.join([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=native",
                              "--continue-on-collection-errors",
                              f"--junitxml={xml}", "-o", "junit_family=xunit1", "-p", "infra_agent_imports",
                              f"--infra-agent-imports={imports}", f"--infra-agent-tree={self.tree}",
                              f"--infra-agent-env={where}", *spec.pytest])
            rc, stdout, stderr, secs, timed_out = self._spawn(
                spec, [*LIFELINE, "--", cmd], shell=False, path_first=PYTEST_PLUGIN)
            base = dict(probe=spec.id, duration_s=secs, stdout=stdout, stderr=stderr)
            # the tree's files the tests imported (feedback/pytest_plugin/), one file per pytest process:
            # the cache and the selection use them
            for part in imports.parent.glob(imports.name + ".*"):
                try:
                    if not part.name.endswith(".tmp"):
                        base.setdefault("imports", {}).update(json.loads(part.read_text()))
                except (OSError, ValueError):
                    pass
            try:  # where the tests ran (the plugin's, as a Python probe's worker says it)
                base["environment"] = Fingerprint.model_validate(json.loads(where.read_text()))
            except (OSError, ValueError):
                pass
            if timed_out:
                return ProbeResult(status=Status.timeout, reason=f"no result within budget_s={spec.budget_s:g}; "
                                   "process group killed", **base), False
            if not xml.is_file():  # (exit 5 with a file: every test skipped itself, which the file says)
                if rc != 5 and (need := lacks(stdout + "\n" + stderr, self.import_roots)):
                    # pytest stopped before collecting (a conftest's import): no test can run on this machine
                    return self._unstartable(need, base), True
                why = "no tests were collected" if rc == 5 else self._exit_reason(rc or 1)
                return self._stopped(spec, why, stdout + "\n" + stderr, base), False
            try:
                summary = read_junit(xml, self.tree, roots=self.import_roots)
            except ValueError as exc:
                return ProbeResult(status=Status.error, reason=str(exc), **base), False
        if rc == 4 or summary.tests == 0:  # a node id that names nothing: usage error, or nothing ran
            last = [ln for ln in (stdout + stderr).strip().splitlines() if ln.strip() and "ERROR" in ln][-1:]
            return ProbeResult(status=Status.error, reason=f"pytest {' '.join(spec.pytest)[:200]}: no test ran"
                               + (f": {last[0][:200]}" if last else ""), **base), False
        counts = summary.counts()
        metrics = {k: Metric(value=v, better="lower" if k in ("failed", "errors", "unrunnable") else None)
                   for k, v in counts.items()}
        findings = list(summary.findings)
        if summary.failed + summary.errors:
            status, reason = Status.failed, None
        elif not counts["passed"]:
            # no test judged the code: every one needs what the machine lacks (the machine's, not the tree's; a
            # candidate that leaves more tests unable to run than its baseline fails: feedback.verdict), or
            # the tests skipped themselves
            status, reason = Status.skipped, summary.not_run()[:400]
        else:
            status, reason = Status.passed, None
        if summary.unrunnable and status != Status.skipped:
            findings.append(Finding(message=f"not run on this machine: {summary.lacking()}"[:400]))
        absent = sorted({n for need in summary.needs if (n := absent_package(need))})
        return ProbeResult(status=status, reason=reason, metrics=metrics, findings=findings,
                           failing=summary.failing[:2000], absent=absent, **base), True

    @staticmethod
    def _unstartable(need: str, base: dict) -> ProbeResult:
        """A pytest run that stopped before collecting anything because the machine lacks ``need`` (a
        conftest imports a package that is not installed): not run here, one unit unrunnable, so that a
        candidate whose conftest newly needs it fails against a baseline that ran (``feedback.verdict``)."""
        text = f"not run on this machine: pytest stopped before collecting (a conftest needs {need})"
        metrics = {"passed": Metric(value=0), "unrunnable": Metric(value=1, better="lower")}
        return ProbeResult(status=Status.skipped, reason=text[:400], metrics=metrics, findings=[Finding(message=text)],
                           absent=[n] if (n := absent_package(need)) else [], **base)

    def _run_command(self, spec: ProbeSpec) -> tuple[ProbeResult, bool]:
        """One run of a command probe: (result, whether the command itself reported it)."""
        argv = [*LIFELINE, "--", spec.command]  # the shell dies with the harness
        rc, stdout, stderr, secs, timed_out = self._spawn(spec, argv, shell=False)
        base = dict(probe=spec.id, duration_s=secs, stdout=stdout, stderr=stderr)
        if timed_out:
            return ProbeResult(status=Status.timeout, reason=f"no result within budget_s={spec.budget_s:g}; "
                               "process group killed", **base), False
        if rc != 0:
            return ProbeResult(status=Status.error, reason=self._exit_reason(rc), **base), False
        lines = [ln for ln in stdout.strip().splitlines() if ln.strip()]
        try:
            data = json.loads(lines[-1]) if lines else None
            if not isinstance(data, dict):
                raise ValueError("the last line of stdout is not a JSON object")
            metrics = {k: (Metric(value=v) if isinstance(v, (int, float)) else Metric.model_validate(v))
                       for k, v in data.get("metrics", {}).items()}
            status = Status(data.get("status", "pass"))
            return ProbeResult(status=status, metrics=metrics, findings=data.get("findings", []),
                               reason=data.get("reason"), **base), True
        except Exception as exc:  # noqa: BLE001 - garbage output is an error result, not a crash
            return ProbeResult(status=Status.error, reason=f"command printed no JSON result: {exc}".splitlines()[0],
                               **base), False


def _read_witness(fd: int, stamps: list[tuple[float, str]]) -> None:
    """Stamp each line the probe writes to the witness pipe with this process's clock, until EOF."""
    buf = b""
    with os.fdopen(fd, "rb", buffering=0) as pipe:
        while chunk := pipe.read(4096):
            now = time.monotonic()
            buf += chunk
            *lines, buf = buf.split(b"\n")
            stamps.extend((now, ln.decode("utf-8", "replace")) for ln in lines[-64:])
            del stamps[:-4096]  # a probe writing without end keeps only the latest


def witnessed(result: ProbeResult, stamps: list[tuple[float, str]], *, rel: float = 0.5,
              abs_s: float = 0.02) -> ProbeResult:
    """Hold each timed loop's length by the probe's clock against the harness's stamps of it.

    The witness measures the same interval from outside the probe process (plus pipe latency), so
    a probe clock that runs slow, or a loop the harness never saw begin and end, fails the probe:
    its times cannot be trusted."""
    if not result.spans or result.status not in (Status.passed, Status.failed):
        return result
    from feedback.models import Finding

    seen: dict[str, float] = {}
    begun: dict[str, float] = {}
    for t, line in stamps:
        tag, _, edge = line.rpartition(" ")
        if edge == "B":
            begun[tag] = t
        elif edge == "E" and tag in begun:
            seen[tag] = t - begun.pop(tag)
    problems = []
    for tag, inside in result.spans.items():
        outside = seen.get(tag)
        if outside is None:
            problems.append(f"timed loop '{tag}': the harness never saw it begin and end (witness pipe closed "
                            "or written over); its times cannot be trusted")
        elif not outside * (1 - rel) - abs_s <= inside <= outside * (1 + rel) + abs_s:
            problems.append(f"timed loop '{tag}': the probe's clock says {inside:.4f} s, the harness's clock "
                            f"{outside:.4f} s; its times cannot be trusted")
    if not problems:
        return result
    findings = list(result.findings) + [Finding(message=p, failed=True) for p in problems]
    return result.model_copy(update={"findings": findings, "status": Status.failed})


_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+)(?:,)? in (?P<func>\S+)')


def crash_site(stderr: str, tree: pathlib.Path) -> str | None:
    """The innermost frame inside ``tree`` of the last traceback or fault dump in ``stderr``.

    Python's tracebacks list the innermost frame last; faulthandler's dumps (a segfault, an abort,
    a fatal signal) list it first, under "Current thread" / "Thread".  Either way the frame nearest
    the fault that lies in the tree under test is where a person should look."""
    lines = stderr.splitlines()
    dump = max((i for i, ln in enumerate(lines) if ln.startswith(("Fatal Python error", "Current thread",
                                                                   "Thread 0x"))), default=None)
    frames = []
    for ln in lines[dump:] if dump is not None else lines:
        m = _FRAME.match(ln)
        if m:
            frames.append(m)
    if dump is None:
        frames.reverse()  # a traceback: innermost last
    root = str(tree.resolve()) + os.sep
    for m in frames:
        path = m["path"]
        if path.startswith(root) and "/feedback/" not in path[len(root) - 1:]:
            return f"{path[len(root):]}:{m['line']} in {m['func']}"
    return None


def apply_thresholds(spec: ProbeSpec, result: ProbeResult) -> ProbeResult:
    """Manifest thresholds over the probe's metrics: a violated bound fails the probe, localised."""
    if result.status not in (Status.passed, Status.failed) or not spec.thresholds:
        return result

    findings, failed = list(result.findings), result.status == Status.failed
    for name, th in spec.thresholds.items():
        metric = result.metrics.get(name)
        if metric is None:
            findings.append(Finding(message=f"threshold on {name} but the probe reported no such metric",
                                    failed=True))
            failed = True
            continue
        if th.violated(metric.value):
            params = ", ".join(f"{k}={v!r}" for k, v in spec.params.items() if not isinstance(v, (list, dict)))
            findings.append(Finding(
                message=f"{name} = {metric.value:.3g}{metric.unit} violates {th.describe()}",
                location=Location(file=", ".join(spec.covers.files[:2]) or None,
                                  symbol=", ".join(spec.covers.symbols[:2]) or None, param=params or None),
                failed=True))
            failed = True
    return result.model_copy(update={"findings": findings, "status": Status.failed if failed else result.status})
