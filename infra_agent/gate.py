"""The risk gate: a deterministic classifier over the diff itself, never over the model's label.

Categories: **numerics** (dtype casts, precision arguments and tf32 switches, eps and tolerance
constants, scales and quantisation, accumulation or reduction order), **concurrency** (threads,
locks, GIL release or acquire in Python, C or C++, async code, CUDA streams and events,
synchronisation, shared buffers) and **production** (serving defaults, scheduler limits,
timeouts, memory limits, deployment files).  Built-in rules, the target manifest's ``risk``
rules, and Python AST checks on the patched files.  A patch touching a protected path, or
reaching the judges some other way (``infra_agent/tamper.py``: self-loaded files, renames and mode
changes, imports of the harness or the references, monkeypatching, introspection, the probes'
environment), is refused outright; an error inside the classifier counts as high risk.
"""

from __future__ import annotations

import ast
import fnmatch
import pathlib
import re
import subprocess
import tempfile
from dataclasses import dataclass

from pydantic import BaseModel, Field

from feedback.checks import parse
from feedback.manifest import Manifest
from infra_agent import tamper
from infra_agent.patch import Patch, PatchError, PatchRefused


@dataclass(frozen=True)
class Rule:
    id: str
    category: str
    pattern: str | None = None  # regex over added and removed lines
    paths: tuple[str, ...] = ("*",)  # globs the rule applies to (fnmatch on the whole path)
    whole_file: bool = False  # the path alone is the risk (deployment files)


CODE = ("*.py", "*.c", "*.cc", "*.cpp", "*.cu", "*.cuh", "*.h", "*.hpp", "*.pyx")
BUILTIN: tuple[Rule, ...] = (
    # numerics
    Rule("num.dtype-cast", "numerics",
         r"\.to\(\s*(torch\.|tl\.)?(float|half|bfloat16|float16|float32|float64|double|int8|uint8|fp8|float8)"
         r"|\.(float|half|double|bfloat16)\(\)|\bdtype\s*=|\.to\(tl\.", CODE),
    Rule("num.precision", "numerics",
         r"input_precision|allow_tf32|set_float32_matmul_precision|\btf32|\bieee\b|allow_fp16_reduced", CODE),
    Rule("num.eps-tolerance", "numerics", r"\b(eps|epsilon|atol|rtol|tol|tolerance)\b\s*[=:]|\b\d*\.?\d+e-\d+", CODE),
    Rule("num.scale-quant", "numerics", r"\bscale[sd]?\b|quant|\bint8\b|\bfp8\b|e4m3|e5m2|amax|absmax", CODE),
    Rule("num.clamp-range", "numerics",
         r"\bclamp(_min|_max|_)?\(|\bclip\(|tl\.(minimum|maximum|clamp)\(|\bnan_to_num\(|\bfmin\(|\bfmax\(", CODE),
    Rule("num.approximate", "numerics",
         r"\brsqrt\b|\bexp2\b|\blog2\b|\bfast_\w+|\bapprox\b|libdevice|fast_math|-ffast-math", CODE),
    Rule("num.reduction-order", "numerics",
         r"tl\.(sum|cumsum|reduce|associative_scan|dot|atomic_add)|\.(sum|cumsum|mean)\(|accumulat|split_k|splitk",
         CODE),
    Rule("num.backend-flags", "numerics",  # library switches that change every kernel's numbers, no dtype word
         r"torch\.backends\.\w+\.\w+|\bcudnn\.(benchmark|deterministic|enabled|allow_tf32)\b|"
         r"use_deterministic_algorithms|set_flush_denormal|set_default_dtype|NVIDIA_TF32_OVERRIDE|"
         r"TORCH_ALLOW_TF32\w*|CUBLAS_WORKSPACE_CONFIG|TRITON_F32_DEFAULT|\bfast_accum\b", ("*",)),
    # concurrency
    Rule("conc.threads", "concurrency", r"\bthreading\b|Thread\(|ThreadPool|multiprocessing|concurrent\.futures",
         CODE),
    Rule("conc.locks", "concurrency",
         r"\b(R?Lock|Semaphore|BoundedSemaphore|Condition|Barrier)\(|\.acquire\(|\.release\(|std::mutex|"
         r"pthread_mutex|lock_guard|unique_lock", CODE),
    Rule("conc.sync", "concurrency",  # a lock held by a with-block, waits, notifications, barriers, queue bounds
         r"\bwith\s+[\w.]*(lock|mutex|cond|sem|guard)\w*\s*:|\.wait(_for)?\(|\.notify(_all)?\(|\bbarrier\(|"
         r"\bQueue\(|\bmaxsize\b|\bEvent\(\)|\bwait_event\(|\.record\(|\bquery\(\)|\bjoin\(\s*(timeout\s*=\s*[\d.]+)?\s*\)|__sync|\bmemory_order",
         CODE),
    Rule("conc.gil", "concurrency",
         r"Py_(BEGIN|END)_ALLOW_THREADS|PyGILState_|PyEval_(Save|Restore)Thread|\bPyDLL\b|\bCDLL\b|\bnogil\b|"
         r"gil_scoped_(release|acquire)|release_gil", CODE),
    Rule("conc.async", "concurrency", r"\basync\s+def\b|\bawait\b|\basyncio\b|\bcreate_task\(", CODE),
    Rule("conc.cuda-streams", "concurrency",
         r"cuda\.(Stream|Event|stream|synchronize)|wait_stream|record_stream|\.synchronize\(|cudaStream|"
         r"cudaEvent|cudaDeviceSynchronize|__syncthreads|tl\.debug_barrier", CODE),
    Rule("conc.shared-buffers", "concurrency", r"shared_memory|SharedMemory|\bmmap\b|\batomic|share_memory_\(", CODE),
    # production
    Rule("prod.serving-defaults", "production",
         r"\b(max_batch\w*|max_num_seqs|max_tokens|max_model_len|max_num_batched_tokens|port|host|workers?|"
         r"gpu_memory_utilization|mem_fraction\w*|memory_limit\w*|max_queue\w*|max_wait\w*|timeout\w*|"
         r"keep_alive)\b\s*[=:]", ("*",)),
    Rule("prod.exposure", "production",  # what a server binds, accepts and asks for
         r"0\.0\.0\.0|127\.0\.0\.1|localhost|\b(bind|listen|HTTPServer|ThreadingHTTPServer|serve_forever)\b|"
         r"\b(api_key|authenticat\w*|authoriz\w*|Authorization|bearer|allow_origins|cors|ssl_\w+|tls_\w+|"
         r"certfile|keyfile)\b|"
         r"\b(max_request\w*|max_body\w*|max_content_length|rate_limit\w*|max_connections)\b", ("*",)),
    Rule("prod.deployment-files", "production", None,
         ("Dockerfile*", "*/Dockerfile*", "docker-compose*", "*/docker-compose*", "deploy/*", "*/deploy/*",
          "k8s/*", "helm/*", "charts/*", ".github/workflows/*", "*.service", "Procfile"), whole_file=True),
)

# Python AST: calls whose (dotted) name, or keyword arguments whose name, mark a category.
AST_CALLS = {
    "tl.dot": "numerics", "torch.set_float32_matmul_precision": "numerics", "torch.backends.cuda.matmul": "numerics",
    "threading.Thread": "concurrency", "threading.Lock": "concurrency", "threading.RLock": "concurrency",
    "ctypes.PyDLL": "concurrency", "ctypes.CDLL": "concurrency", "asyncio.run": "concurrency",
    "asyncio.create_task": "concurrency", "torch.cuda.Stream": "concurrency", "torch.cuda.Event": "concurrency",
    "torch.cuda.synchronize": "concurrency", "torch.cuda.graph": "concurrency",
}
AST_KWARGS = {"input_precision": "numerics", "dtype": "numerics", "eps": "numerics", "atol": "numerics",
              "rtol": "numerics", "out_dtype": "numerics", "timeout": "production", "max_batch_size": "production",
              "max_num_seqs": "production", "daemon": "concurrency"}


class RiskFinding(BaseModel):
    rule: str
    category: str
    file: str
    line: int
    text: str

    def render(self) -> str:
        return f"{self.category}: {self.rule} at {self.file}:{self.line}: {self.text.strip()[:100]}"


class Assessment(BaseModel):
    schema_version: int = 1
    findings: list[RiskFinding] = Field(default_factory=list)
    refused: str | None = None  # a protected path, with the reason
    error: str | None = None  # an error inside the classifier counts as high risk

    @property
    def held(self) -> bool:
        return bool(self.findings) or self.error is not None

    @property
    def decision(self) -> str:
        return "refused" if self.refused else "error" if self.error else "held" if self.findings else "clean"

    @property
    def categories(self) -> list[str]:
        return sorted({f.category for f in self.findings} | ({"error"} if self.error else set()))


def ast_findings(path: str, source: str, lines: set[int]) -> list[RiskFinding]:
    """Calls and keyword arguments that mark a category, on the given (added) line numbers."""
    out = []
    tree = parse(source, path)
    text = source.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        span = set(range(node.lineno, (node.end_lineno or node.lineno) + 1))
        if not span & lines:
            continue
        name = tamper.dotted(node.func)
        for prefix, cat in AST_CALLS.items():
            if name == prefix or name.startswith(prefix + "."):
                out.append(RiskFinding(rule=f"ast.call:{prefix}", category=cat, file=path, line=node.lineno,
                                       text=text[node.lineno - 1]))
        for kw in node.keywords:
            if kw.arg in AST_KWARGS and kw.value.lineno in lines:
                out.append(RiskFinding(rule=f"ast.kwarg:{kw.arg}", category=AST_KWARGS[kw.arg], file=path,
                                       line=kw.value.lineno, text=text[kw.value.lineno - 1]))
    return out


def _patched_sources(patch: Patch, tree: pathlib.Path) -> dict[str, str]:
    """The post-patch text of every Python file the patch touches, the whole patch applied to a
    scratch copy of the files it touches (a diff that does not apply is an error, whatever the file)."""
    py = [f.path for f in patch.files if f.path.endswith(".py") and f.added]
    touched = [f.path for f in patch.files]
    with tempfile.TemporaryDirectory(prefix="infra-agent-gate-") as tmp:
        for rel in touched:
            src = tree / rel
            dst = pathlib.Path(tmp) / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            if src.is_file():
                dst.write_bytes(src.read_bytes())
        proc = subprocess.run(["git", "apply", "--recount", "--unidiff-zero", "--whitespace=nowarn",
                               *[f"--include={p}" for p in touched], "-"], cwd=tmp, input=patch.diff,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise PatchError("the diff does not apply to the target: " + proc.stderr.strip()[:200])
        return {rel: (pathlib.Path(tmp) / rel).read_text() for rel in py}


def _old_path(header: str) -> str | None:
    path = header[4:].split("\t")[0].strip()
    if path == "/dev/null":
        return None
    return path[2:] if path.startswith(("a/", "b/")) else path


def assess(patch: Patch, manifest: Manifest, tree: str | pathlib.Path | None = None) -> Assessment:
    """Classify a parsed patch.  With ``tree`` (the target before the patch) AST checks run too."""
    for f in patch.files:
        pat = manifest.is_protected(f.path)
        if pat:
            return Assessment(refused=f"{f.path} is protected ({pat}): probes, references, tests and the "
                                      "manifest judge a change and may not be changed by it")
    if "\r" in patch.diff:
        return Assessment(error="the diff has carriage returns (CRLF line endings): it would change line endings, "
                                "not only content; send it with LF endings")
    try:
        sources = _patched_sources(patch, pathlib.Path(tree)) if tree is not None else {}
        added = {f.path: {no for no, _ in f.added} for f in patch.files}
        old_paths = [_old_path(ln) for ln in patch.diff.splitlines() if ln.startswith("--- ")]
        why = tamper.refusal(patch.diff, patch.paths, [p for p in old_paths if p], sources, added, manifest)
        if why:
            return Assessment(refused=f"the patch reaches what judges it: {why}")
        findings: list[RiskFinding] = []
        custom = [Rule(r.id, r.category, r.pattern, tuple(r.paths)) for r in manifest.risk]
        for rule in (*BUILTIN, *custom):
            rx = re.compile(rule.pattern) if rule.pattern else None
            for f in patch.files:
                if not any(fnmatch.fnmatchcase(f.path, g) or fnmatch.fnmatchcase(pathlib.PurePath(f.path).name, g)
                           for g in rule.paths):
                    continue
                if rule.whole_file:
                    first = (f.added or f.removed or [(1, "")])[0]
                    findings.append(RiskFinding(rule=rule.id, category=rule.category, file=f.path, line=first[0],
                                                text=first[1]))
                    continue
                for no, text in [*f.added, *f.removed]:
                    if rx is not None and rx.search(text):
                        findings.append(RiskFinding(rule=rule.id, category=rule.category, file=f.path, line=no,
                                                    text=text))
        for rel, source in sources.items():
            findings += ast_findings(rel, source, added.get(rel, set()))
        seen, unique = set(), []
        for f in findings:
            key = (f.rule, f.file, f.line)
            if key not in seen:
                seen.add(key)
                unique.append(f)
        return Assessment(findings=sorted(unique, key=lambda f: (f.file, f.line, f.category, f.rule)))
    except Exception as exc:  # noqa: BLE001 - a classifier error must hold the patch, never pass it
        return Assessment(error=f"{type(exc).__name__}: {exc}")


def assess_text(diff: str, manifest: Manifest, tree: str | pathlib.Path | None = None) -> Assessment:
    """Parse and classify a diff; a protected path is refused, a malformed diff is an error."""
    try:
        patch = Patch.parse(diff, manifest=None)
    except PatchRefused as exc:  # pragma: no cover - parse without a manifest never refuses
        return Assessment(refused=str(exc))
    except PatchError as exc:
        return Assessment(error=str(exc))
    return assess(patch, manifest, tree)
