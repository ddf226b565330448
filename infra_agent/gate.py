"""The risk gate: a deterministic classifier over the diff itself, never over the model's label.

Categories: **numerics** (dtype casts, precision arguments and tf32 switches, eps and tolerance
constants, masking sentinels and non-finite values, scales and quantisation, accumulation or reduction
order), **concurrency** (threads, locks, GIL release or acquire in Python, C or C++, async code, CUDA
streams and events, synchronisation, shared buffers) and **production** (serving defaults, scheduler limits,
timeouts, memory limits, environment switches, deployment files).  Built-in rules over the changed
lines' code (comments, docstrings and layout-only edits are not read: ``source_lines.py``), the
target manifest's ``risk`` rules, and checks of where a line lies, whatever its words: inside a GPU
kernel (numerics; its stores concurrency), in a kernel's launch (numerics), inside a with-block holding
a lock or a stream (concurrency), or the value of a setting (a parameter default, a class field, a module constant:
production).  Measured on real upstream commits: ``bench/gate_upstream.py``.

A patch touching a protected path, or reaching the judges some other way (``infra_agent/tamper.py``:
self-loaded files, renames and mode changes, imports of the harness or the references,
monkeypatching, introspection, the probes' environment), is refused outright; an error inside the
classifier counts as high risk.
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import tempfile
from dataclasses import dataclass

from pydantic import BaseModel, Field

from feedback.checks import import_aliases, parse, resolved_name
from feedback.manifest import Manifest, path_matches
from infra_agent import tamper
from infra_agent.patch import Patch, PatchError, PatchRefused
from infra_agent.source_lines import Regions, code_part, defaults, module, python_regions


@dataclass(frozen=True)
class Rule:
    id: str
    category: str
    pattern: str | None = None  # regex over added and removed lines
    paths: tuple[str, ...] = ("*",)  # globs the rule applies to (the whole path or its name: path_matches)
    whole_file: bool = False  # the path alone is the risk (deployment files)


C_FAMILY = ("*.c", "*.cc", "*.cpp", "*.cxx", "*.cu", "*.cuh", "*.h", "*.hh", "*.hpp", "*.hxx", "*.inl")
CODE = ("*.py", "*.pyx", *C_FAMILY)
BUILTIN: tuple[Rule, ...] = (
    # numerics
    Rule("num.dtype-cast", "numerics",
         r"\.to\(\s*(torch\.|tl\.)?(float|half|bfloat16|float16|float32|float64|double|int8|uint8|fp8|float8)"
         r"|\.(float|half|double|bfloat16)\(\)|\bdtype\s*=|\.to\(tl\.", CODE),
    Rule("num.precision", "numerics",
         r"input_precision|allow_tf32|set_float32_matmul_precision|\btf32|\bieee\b|allow_fp16_reduced", CODE),
    Rule("num.eps-tolerance", "numerics", r"\b(eps|epsilon|atol|rtol|tol|tolerance)\b\s*[=:]|\b\d*\.?\d+e-\d+", CODE),
    Rule("num.scale-quant", "numerics",  # sm_scale, qk_scale, softmax_scale: the word ends the name
         r"\b(\w+_)?(re)?scal(e|es|ed|ing)\b|quant|\bint8\b|\bfp8\b|e4m3|e5m2|amax|absmax", CODE),
    Rule("num.clamp-range", "numerics",
         r"\bclamp(_min|_max|_)?\(|\bclip\(|tl\.(minimum|maximum|clamp)\(|\bnan_to_num\(|\bfmin\(|\bfmax\(", CODE),
    Rule("num.special-values", "numerics",  # masking sentinels and non-finite handling: -inf, NaN, finfo().min, -1e30
         r"\b(inf|nan|NaN|Inf|INFINITY|NAN)\b|\b(finfo|iinfo)\(|\bmasked_fill_?\(|\bis(nan|inf|finite|neginf|posinf)\(|"
         r"-\s*\d+(\.\d*)?[eE]\+?\d+\b|\b(HUGE_VALF?|FLT_MAX|DBL_MAX|__int_as_float)\b", CODE),
    Rule("num.approximate", "numerics",
         r"\brsqrt\b|\bexp2\b|\blog2\b|\bfast_\w+|\bapprox\b|libdevice|fast_math|-ffast-math", CODE),
    Rule("num.reduction-order", "numerics",
         r"tl\.(sum|cumsum|reduce|associative_scan|dot|atomic_add)|\.(sum|cumsum|mean)\(|accumulat|split_k|splitk",
         CODE),
    Rule("num.launch-config", "numerics",  # tiles, warps and stages decide a kernel's reduction order
         r"(?i:\bnum_warps\b|\bnum_stages\b|\bnum_ctas\b|\bmaxnreg\b)|\btriton\.(Config|autotune|heuristics)\b|"
         r"\bBLOCK_[A-Z0-9_]+\b|\bB[KTVMNCHD]\s*[=:]", CODE),
    Rule("num.attention-metadata", "numerics",  # what each query attends to, and at which position
         r"\b(positions?|position_ids|seq_?lens?\w*|seqlens?_\w+|cu_seqlens\w*|max_seqlen\w*|context_lens?\w*|"
         r"slot_mapping|block_tables?|query_start_loc\w*|rotary\w*|rope\w*|sliding_window|is_causal|causal)\b", CODE),
    Rule("num.sampling", "numerics",  # what turns logits into tokens
         r"\b(temperatures?|top_[pk]s?|min_ps?|logits?|logprobs?|log_probs?|softmax|log_softmax|logsumexp|argmax|"
         r"multinomial|gumbel\w*|repetition_penalty|presence_penalty|frequency_penalty|sampler\w*|sampling_\w+|sample_\w+|"
         r"\w+_sampling|do_sample)\b", CODE),
    Rule("num.path-switch", "numerics",  # flags and names that pick another kernel, backend or algorithm
         r"\buse_\w+\s*(=(?!=)|:\s*(bool|Optional|int|str)\b)|\b\w*backend\w*\s*[=:]|"
         r"\b(algo\w*|impl|kernel_\w+|\w+_impl)\s*[=:]", CODE),
    Rule("num.kv-layout", "numerics",  # which key/value elements a cache stores and where
         r"\b(kv_\w+|\w+_kv|k_cache\w*|v_cache\w*|key_caches?|value_caches?|past_key_values?)\b", CODE),
    Rule("num.cuda-source", "numerics", r"\S", ("*.cu", "*.cuh")),  # device code: any code line is the numbers
    Rule("num.backend-flags", "numerics",  # library switches that change every kernel's numbers, no dtype word
         r"torch\.backends\.\w+\.\w+|\bcudnn\.(benchmark|deterministic|enabled|allow_tf32)\b|"
         r"use_deterministic_algorithms|set_flush_denormal|set_default_dtype|NVIDIA_TF32_OVERRIDE|"
         r"TORCH_ALLOW_TF32\w*|CUBLAS_WORKSPACE_CONFIG|TRITON_F32_DEFAULT|\bfast_accum\b", ("*",)),
    # concurrency
    Rule("conc.threads", "concurrency",  # threads, pools and how many; yielding the interpreter or the CPU
         r"\bthreading\b|Thread\(|ThreadPool|multiprocessing|concurrent\.futures|\b(\w+_)?threads?\b|\b\w+Threads?\b|"
         r"\bnum_workers\b|\btime\.sleep\(|\bsched_yield\b|this_thread::(yield|sleep_for)", CODE),
    Rule("conc.locks", "concurrency",
         r"\b(R?Lock|Semaphore|BoundedSemaphore|Condition|Barrier)\(|\.acquire\(|\.release\(|std::mutex|"
         r"pthread_mutex|lock_guard|unique_lock|scoped_lock|\bflock\(|\bfcntl\.(flock|lockf)\(|\bLOCK_(EX|SH|NB|UN)\b|"
         r"\bFileLock\b|\bfilelock\b|\bportalocker\b", CODE),
    Rule("conc.sync", "concurrency",  # a lock held by a with-block, waits, notifications, barriers, queue bounds
         r"\bwith\s+[\w.]*(lock|mutex|cond|sem|guard)\w*\s*:|\b\w*[wW]ait\w*\s*(<[^<>()]*>)?\s*\(|\.notify(_all)?\(|"
         r"\bbarrier\(|\b\w+_ready\b|\bis_ready\b|\bready_\w+|\bin_?flight\w*|"
         r"\bQueue\(|\bmaxsize\b|\bEvent\(\)|\.record\(|\bquery\(\)|\bjoin\(\s*(timeout\s*=\s*[\d.]+)?\s*\)|__sync|\bmemory_order",
         CODE),
    Rule("conc.gil", "concurrency",
         r"Py_(BEGIN|END)_ALLOW_THREADS|PyGILState_|PyEval_(Save|Restore)Thread|\bPyDLL\b|\bCDLL\b|\bnogil\b|"
         r"gil_scoped_(release|acquire)|release_gil", CODE),
    Rule("conc.async", "concurrency", r"\basync\s+def\b|\bawait\b|\basyncio\b|\bcreate_task\(", CODE),
    Rule("conc.cuda-streams", "concurrency",
         r"cuda\.(Stream|Event|stream|synchronize)|wait_stream|record_stream|\.synchronize\(|cudaStream|"
         r"cudaEvent|cudaDeviceSynchronize|__syncthreads|tl\.debug_barrier", CODE),
    Rule("conc.host-sync", "concurrency",  # a copy or read that waits for the device, or one that no longer does
         r"\.item\s*(<[^<>()]*>)?\s*\(|\.cpu\(\)|\.tolist\(\)|\.numpy\(\)|\bnon_blocking\b|\bpin_memory\b|"
         r"\bcudaMemcpy\w*|\bcuMemcpy\w*", CODE),
    Rule("conc.collectives", "concurrency",  # process groups: every rank must take part, in the same order
         r"\b(all_reduce|all_gather\w*|reduce_scatter\w*|all_to_all\w*|broadcast_object\w*|isend|irecv|"
         r"batch_isend_irecv|send_object\w*|recv_object\w*)\b|\bdist\.\w+\(|torch\.distributed|\bnccl\w*|"
         r"\bNCCL\w*|ProcessGroup|\bray\.(get|wait|put)\(", CODE),
    Rule("conc.parallel-layout", "concurrency",  # ranks, groups and shards: who takes part in what
         r"\b(tp|dp|ep|pp|cp|sp|attn_tp|moe_tp)_(size|rank|group|world_size)\b|\bworld_size\b|\b(local_|global_)?rank\b|"
         r"\bnew_\w*group\w*|\b\w*dist_group\w*|\bprocess_group\w*|\bdevice_mesh\b|\bget_\w*_group\(", CODE),
    Rule("conc.device-sync", "concurrency",  # inside CUDA / C++ kernels: fences, barriers, clusters, async copies
         r"__syncwarp|__threadfence\w*|\bfence\w*|\bmbarrier\w*|\barrive\w*|\bnamed_barrier\w*|"
         r"\bcluster_\w+|\w*[mM]ulticast\w*|\b\w*_cta\w*|\bcta_\w+|\bCTA\w*|cp\.async|"
         r"\bcommit_group|\bwait_group|\bwarpgroup_\w+|\btma_store_\w+", C_FAMILY),
    Rule("conc.shared-buffers", "concurrency",
         r"shared_memory|SharedMemory|\bmmap\b|\batomic|share_memory_\(|(?i:\bshm\w*|/dev/shm)", ("*",)),
    # production
    Rule("prod.serving-defaults", "production",
         r"\b(max_batch\w*|max_num_seqs|max_tokens|max_model_len|max_num_batched_tokens|port|host|workers?|"
         r"gpu_memory_utilization|mem_fraction\w*|memory_limit\w*|max_queue\w*|max_wait\w*|timeout\w*|"
         r"keep_alive)\b\s*[=:]", ("*",)),
    Rule("prod.env-defaults", "production",  # runtime switches read from the environment, and their defaults
         r"\bos\.getenv\(|\bos\.environ\.get\(|\bos\.environ\[|\benviron\.setdefault\(|\bgetenv\s*\(|"
         r"\bget_env\w*\s*(<[^<>()]*>)?\s*\(|\bdefault_\w+\s*(:[^=\n]*)?=(?!=)|\bEnv[A-Z]\w*\(|\benv_(bool|int|float|str)\(|"
         r"\bENVS?\.[A-Z_]+|\benvs\.[A-Z_]+", ("*",)),
    Rule("prod.limits", "production",  # bounds on queues, budgets and capacities
         r"\bmaxsize\b|\bcapacity\b|\b\w+_budget\b|\bbudget_\w+|\b\w+_limits?\b|\blimits?_\w+|\b\w+_quota\b", CODE),
    Rule("prod.exposure", "production",  # what a server binds, accepts and asks for
         r"0\.0\.0\.0|127\.0\.0\.1|localhost|\b(bind|listen|HTTPServer|ThreadingHTTPServer|serve_forever)\b|"
         r"\b(api_key|authenticat\w*|authoriz\w*|Authorization|bearer|allow_origins|cors|ssl_\w+|tls_\w+|"
         r"certfile|keyfile)\b|"
         r"\b(max_request\w*|max_body\w*|max_content_length|rate_limit\w*|max_connections)\b", ("*",)),
    Rule("prod.deployment-files", "production", None,
         ("Dockerfile*", "*/Dockerfile*", "docker-compose*", "*/docker-compose*", "deploy/*", "*/deploy/*",
          "k8s/*", "helm/*", "charts/*", ".github/workflows/*", "*.service", "Procfile", "*/crd/*", "*/crds/*",
          "kustomization.y*ml", "*/kustomization.y*ml"), whole_file=True),
    Rule("prod.dependencies", "production",  # a pinned or bounded dependency: what the deployed stack runs
         r"^\s*[\"']?[A-Za-z0-9_.\-]+(\[[\w,.\-]+\])?\s*(==|>=|<=|~=|!=|<|>)\s*v?\d",
         ("requirements*.txt", "*/requirements*.txt", "*.requirements", "pyproject.toml", "*/pyproject.toml",
          "setup.py", "setup.cfg", "environment*.y*ml", "Pipfile", "constraints*.txt", "*/constraints*.txt")),
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
    line: int  # in the file after the patch; before it where ``removed``
    text: str
    removed: bool = False  # a line the patch removes (numbered as the file was)

    def where(self) -> str:
        return f"{self.file}:{self.line}" + (" (removed)" if self.removed else "")

    def render(self) -> str:
        return f"{self.category}: {self.rule} at {self.where()}: {self.text.strip()[:100]}"


def by_line(findings: list[RiskFinding] | list[dict]) -> list[str]:
    """Findings one line of code each, in file and line order: ``file:line categories (rules): text``, and a run
    of consecutive lines alike as ``file:first-last ...: its first line (and N more line(s))``.  A changed line
    inside a kernel that calls ``tl.dot`` with a precision matches five rules; a reviewer (or the model) reads
    the line once."""
    lines: dict[tuple[str, int, bool], tuple[list[str], list[str], str]] = {}
    for f in findings:
        f = f.model_dump() if isinstance(f, RiskFinding) else f
        key = (f["file"], f["line"], bool(f.get("removed")))
        cats, rules, _ = lines.setdefault(key, ([], [], f["text"].strip()[:100]))
        cats += [f["category"]] if f["category"] not in cats else []
        rules += [f["rule"]] if f["rule"] not in rules else []
    # a run of consecutive lines with the same categories and rules reads as one range (a rewritten kernel body is
    # one entry, not a hundred); a removed line is numbered as the file was before the patch, and says so
    runs: list[list] = []  # [file, first, last, removed, cats, rules, text]
    for (file, no, gone), (cats, rules, text) in sorted(lines.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])):
        last = runs[-1] if runs else None
        if last and (last[0], last[3], last[4], last[5]) == (file, gone, cats, rules) and no == last[2] + 1:
            last[2] = no
        else:
            runs.append([file, no, no, gone, cats, rules, text])
    runs.sort(key=lambda r: (r[0], r[1], r[3]))
    return [f"{file}:{a}{f'-{b}' if b > a else ''}{' (removed)' if gone else ''} {'/'.join(cats)} "
            f"({', '.join(rules)}): {text}{f' (and {b - a} more line(s))' if b > a else ''}"
            for file, a, b, gone, cats, rules, text in runs]


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


def ast_findings(path: str, source: str, lines: set[int], tree: ast.Module | None = None) -> list[RiskFinding]:
    """Calls and keyword arguments that mark a category, on the given (added) line numbers (``tree``: the
    source already parsed; a source that does not parse raises)."""
    out = []
    tree = parse(source, path) if tree is None else tree
    text = source.splitlines()
    aliases = import_aliases(tree)  # `from threading import Thread`, `import ctypes as C`: the names they stand for
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        span = set(range(node.lineno, (node.end_lineno or node.lineno) + 1))
        if not span & lines:
            continue
        name = resolved_name(node.func, aliases)
        for prefix, cat in AST_CALLS.items():
            if name == prefix or name.startswith(prefix + "."):
                out.append(RiskFinding(rule=f"ast.call:{prefix}", category=cat, file=path, line=node.lineno,
                                       text=text[node.lineno - 1]))
        for kw in node.keywords:
            if kw.arg in AST_KWARGS and kw.value.lineno in lines:
                out.append(RiskFinding(rule=f"ast.kwarg:{kw.arg}", category=AST_KWARGS[kw.arg], file=path,
                                       line=kw.value.lineno, text=text[kw.value.lineno - 1]))
    return out


# a kernel body's writes, however the file names the language (tl.store, T.atomic_add, a bare imported store)
KERNEL_WRITES = re.compile(r"(?<![\w])(?:[A-Za-z_][\w.]*\.)?(store|atomic_\w+|debug_barrier)\s*\(")


def region_findings(path: str, lines: list[tuple[int, str, str, Regions, bool]]) -> list[RiskFinding]:
    """Findings from where a changed code line lies, whatever its words.  Inside a Python GPU kernel's body
    (``source_lines.KERNEL_DECORATOR``): numerics, as a kernel's every line is the numbers it computes, and
    its stores, atomics and barriers concurrency too (which program writes where, and when).  In a kernel's
    launch (``kernel[grid](...)``): numerics, as its grid, arguments and compile-time constants are the
    kernel's inputs.  Inside a
    with-block that holds a lock or a stream, on either side of the patch: concurrency (what the critical
    section covers, what runs on the stream)."""
    out = []
    for no, text, code, regions, gone in lines:
        at = dict(file=path, line=no, text=text, removed=gone)
        if no in regions.kernels:
            out.append(RiskFinding(rule="ast.kernel-body", category="numerics", **at))
            if KERNEL_WRITES.search(code):
                out.append(RiskFinding(rule="ast.kernel-writes", category="concurrency", **at))
        if no in regions.launches:
            out.append(RiskFinding(rule="ast.kernel-launch", category="numerics", **at))
        if no in regions.locked:
            out.append(RiskFinding(rule="ast.locked-region", category="concurrency", **at))
    return out


def default_findings(f, new_tree: ast.Module | None, old_tree: ast.Module | None) -> list[RiskFinding]:
    """A setting whose value the patch changes (``source_lines.defaults``: a parameter's default, a class
    field, a module constant), whatever its name: every caller that relied on it now gets another
    behaviour.  Production; the finding is on the added line that holds the new value."""
    old, new = defaults(old_tree), defaults(new_tree)
    added = dict(f.added)
    out = []
    for key, (value, line) in new.items():
        if key in old and old[key][0] != value and line in added:
            out.append(RiskFinding(rule="ast.default-changed", category="production", file=f.path, line=line,
                                   text=added[line]))
    return out


def _old_source(tree: str | pathlib.Path | None, rel: str) -> str | None:
    """The text of ``rel`` before the patch (a Python file of the tree), if there is one."""
    if tree is None or not rel.endswith((".py", ".pyx")):
        return None
    path = pathlib.Path(tree) / rel
    return path.read_text(errors="replace") if path.is_file() else None


def _code_lines(f, new_tree: ast.Module | None,
                old_tree: ast.Module | None) -> list[tuple[int, str, str, Regions, bool]]:
    """(line, text, code, the regions of its side, whether it is a removed line) for each changed line of ``f``
    that carries code (a removed line numbered as the file was before the patch): comments
    are cut off, lines of docstrings are dropped where the file's source (after the patch for added lines,
    before it for removed ones) is known, and so is a run of changed lines whose code is the same on both
    sides but for layout (``same_code``)."""
    regions = {"+": python_regions(new_tree), "-": python_regions(old_tree)}

    def code_of(side: str, changed) -> list[tuple[int, str, str, Regions, bool]]:
        r = regions[side]
        return [(no, text, code, r, side == "-") for no, text in changed
                if (code := code_part(f.path, text)).strip() and no not in r.docs]

    out = []
    for removed, added in f.blocks:
        old, new = code_of("-", removed), code_of("+", added)
        if not same_code(f.path, [c for _, _, c, _, _ in old], [c for _, _, c, _, _ in new]):
            out += new + old
    return out


def same_code(path: str, old: list[str], new: list[str]) -> bool:
    """Whether two runs of code lines differ only in layout: whitespace in the C family and other
    free-form files; trailing whitespace only in Python, where indentation is meaning."""
    if path.endswith((".py", ".pyx", ".pyi")):
        norm = str.rstrip
    else:
        def norm(c: str) -> str:
            return "".join(c.split())
    return len(old) == len(new) and all(norm(a) == norm(b) for a, b in zip(old, new))


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
    # a protected path refuses the patch; the rest is still classified, so that a person reading an upstream
    # commit that also changes tests learns what else it would need a reviewer for
    protected = [(f.path, pat) for f in patch.files if (pat := manifest.is_protected(f.path))]
    refused = ("; ".join(f"{path} is protected ({pat})" for path, pat in protected[:4])
               + (f" and {len(protected) - 4} more" if len(protected) > 4 else "")
               + ": probes, references, tests and the manifest judge a change and may not be changed by it"
               if protected else None)
    guarded = {path for path, _ in protected}  # their own lines are not classified
    if "\r" in patch.diff:
        return Assessment(refused=refused, error="the diff has carriage returns (CRLF line endings): it would change "
                                                 "line endings, not only content; send it with LF endings")
    try:
        added = {f.path: {no for no, _ in f.added} for f in patch.files}
        old_paths = [p for ln in patch.diff.splitlines() if ln.startswith("--- ") and (p := _old_path(ln))]
        # what the paths and headers alone refuse (a protected file moved away, a rename) is said before the
        # patched sources are built, which a rename would stop with an error about a missing file
        for sources in ({}, None):
            if sources is None:
                sources = _patched_sources(patch, pathlib.Path(tree)) if tree is not None else {}
            why = None if refused else tamper.refusal(patch.diff, patch.paths, old_paths, sources, added, manifest)
            if why:
                return Assessment(refused=f"the patch reaches what judges it: {why}")
        findings: list[RiskFinding] = []
        # each Python file parsed once a side: after the patch (added lines), before it (removed lines)
        trees = {f.path: (module(sources.get(f.path), f.path), module(_old_source(tree, f.path), f.path))
                 for f in patch.files}
        lines = {f.path: _code_lines(f, *trees[f.path]) for f in patch.files}
        custom = [Rule(r.id, r.category, r.pattern, tuple(r.paths)) for r in manifest.risk]
        for rule in (*BUILTIN, *custom):
            rx = re.compile(rule.pattern) if rule.pattern else None
            for f in patch.files:
                if not any(path_matches(f.path, g) or path_matches(pathlib.PurePath(f.path).name, g)
                           for g in rule.paths):
                    continue
                if rule.whole_file:
                    first = (f.added or f.removed or [(1, "")])[0]
                    findings.append(RiskFinding(rule=rule.id, category=rule.category, file=f.path, line=first[0],
                                                text=first[1]))
                    continue
                for no, text, code, _, gone in lines[f.path]:
                    if rx is not None and rx.search(code):
                        findings.append(RiskFinding(rule=rule.id, category=rule.category, file=f.path, line=no,
                                                    text=text, removed=gone))
        for f in patch.files:
            findings += region_findings(f.path, lines[f.path])
            findings += default_findings(f, *trees[f.path])
        for rel, source in sources.items():
            findings += ast_findings(rel, source, added.get(rel, set()), trees[rel][0])
        seen, unique = set(), []
        for f in findings:
            key = (f.rule, f.file, f.line, f.removed)
            if key not in seen and f.file not in guarded:
                seen.add(key)
                unique.append(f)
        return Assessment(findings=sorted(unique, key=lambda f: (f.file, f.line, f.removed, f.category, f.rule)),
                          refused=refused)
    except Exception as exc:  # noqa: BLE001 - a classifier error must hold the patch, never pass it
        return Assessment(refused=refused, error=f"{type(exc).__name__}: {exc}")


def assess_text(diff: str, manifest: Manifest, tree: str | pathlib.Path | None = None) -> Assessment:
    """Parse and classify a diff; a protected path is refused, a malformed diff is an error."""
    try:
        patch = Patch.parse(diff, manifest=None)
    except PatchRefused as exc:  # pragma: no cover - parse without a manifest never refuses
        return Assessment(refused=str(exc))
    except PatchError as exc:
        if why := tamper.not_content(diff):  # a rename or mode change alone has no hunk to parse
            return Assessment(refused=f"the patch reaches what judges it: {why}")
        return Assessment(error=str(exc))
    return assess(patch, manifest, tree)
