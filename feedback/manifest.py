"""The target manifest, ``infra-agent.yaml`` at a target's root, validated by pydantic.

Errors name the file, the line and the field::

    infra-agent.yaml:14: probes[2].budget_s: Input should be greater than 0
"""

from __future__ import annotations

import functools
import operator
import pathlib
import re
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

MANIFEST_NAME = "infra-agent.yaml"
KINDS = ("static", "correctness", "microbench", "trace", "events", "e2e")
# The cascade order of change-impact selection: cheap and decisive first.
STAGE_ORDER = {kind: i for i, kind in enumerate(KINDS)}
RISK_CATEGORIES = ("numerics", "concurrency", "production")


@functools.lru_cache(maxsize=1024)
def _glob_regex(pattern: str) -> re.Pattern[str]:
    """fnmatch's rules (``*`` and ``?`` cross ``/``, ``[...]`` a class, ``[!...]`` its complement), and
    ``**/`` also standing for no folder at all."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        c = pattern[i]
        if c == "*":
            out.append(".*")
        elif c == "?":
            out.append(".")
        elif c == "[" and (end := pattern.find("]", i + 2 if pattern[i + 1:i + 2] in "!]" else i + 1)) > i:
            body = pattern[i + 1:end].replace("\\", "\\\\")
            body = "^" + body[1:] if body.startswith("!") else "\\" + body if body.startswith("^") else body
            out.append("[" + body + "]")
            i = end
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out), re.S)


def path_matches(path: str, pattern: str) -> bool:
    """Whether a tree-relative ``path`` matches a manifest glob: fnmatch's rules, with ``**/`` also standing for
    no folder, as in every path glob (``pkg/**/*.py`` holds ``pkg/core.py``, and ``**/conftest.py`` the root's
    ``conftest.py``), the way ``pathlib``'s glob collects a probe's covered files."""
    return path == pattern or _glob_regex(pattern).fullmatch(path) is not None


class ManifestError(Exception):
    """A manifest that cannot be used; the message is one line naming file, line and field."""


class Covers(BaseModel):
    model_config = ConfigDict(extra="forbid")

    files: list[str] = Field(default_factory=list, description="path globs, relative to the target root")
    symbols: list[str] = Field(default_factory=list, description="functions, classes or kernels the probe is bound to")

    def matches(self, path: str) -> bool:
        return any(path_matches(path, pat) for pat in self.files)


class Threshold(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max: float | None = None
    min: float | None = None

    @model_validator(mode="after")
    def _one_bound(self) -> Threshold:
        if self.max is None and self.min is None:
            raise ValueError("a threshold needs max or min")
        return self

    def violated(self, value: float) -> bool:
        """Whether ``value`` lies outside the bounds (a NaN always does)."""
        return (self.max is not None and not value <= self.max) or (self.min is not None and not value >= self.min)

    def describe(self) -> str:
        """The bounds as a reader writes them: ``<= 0``, ``>= 0.9`` or both."""
        return " and ".join(f"{op} {b:g}" for op, b in (("<=", self.max), (">=", self.min)) if b is not None)


_DOTTED = r"[A-Za-z_][\w.]*:[A-Za-z_]\w*"


class BenchSpec(BaseModel):
    """A callable of the tree timed by the harness (``feedback/timing.py``), no probe code written."""

    model_config = ConfigDict(extra="forbid")

    call: str = Field(pattern=_DOTTED, description="module:function of the tree: the call timed")
    make: str = Field(pattern=_DOTTED, description="module:function(i, **params) -> a tuple of fresh inputs for "
                      "call i, made on the device named by params['device'] (set by the harness)")
    check: str | None = Field(None, pattern=_DOTTED, description="module:function(before, after, outputs) -> "
                              "relative error against a reference, run on timed calls after timing")
    bytes: float | str = Field(0.0, description="bytes a call must move (a number, or module:function(*inputs)): "
                               "bandwidth against the device's copy, and a roofline floor")
    tol: float = Field(1e-3, gt=0)
    reps: int = Field(20, ge=3, le=1000)


#: variables the harness sets itself for every probe (the import path, the interpreter switch, its own
#: channels): a manifest may not set them
_HARNESS_VARS = frozenset({"PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED", "PYTHONFAULTHANDLER",
                           "TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES"})
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: names of credentials: never passed to a probe, never set by a manifest
SECRET_VAR = re.compile(r"(API_KEY|_TOKEN|_SECRET|PASSWORD|_CREDENTIALS)$", re.IGNORECASE)


def _env_strings(value: Any) -> dict[str, str]:
    """A manifest's ``env``: names a shell would take, scalar values (as strings), nothing the harness owns
    and no credential (the manifest is written into every record)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"a mapping of variable names to values, not a {type(value).__name__}")
    out = {}
    for name, val in value.items():
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            raise ValueError(f"{name!r} is not a variable name")
        if name in _HARNESS_VARS or name.startswith("INFRA_AGENT_"):
            hint = " (use interpret: true)" if name in ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES") else ""
            raise ValueError(f"{name} is set by the harness for every probe{hint}")
        if SECRET_VAR.search(name):
            raise ValueError(f"{name} looks like a credential; probes get none, and the manifest is recorded")
        if isinstance(val, bool):
            val = "1" if val else "0"
        if not isinstance(val, str | int | float):
            raise ValueError(f"{name} must be a string or a number, got {type(val).__name__}")
        out[name] = str(val)
    return out


#: an ``env:`` mapping, checked and stringified as it is read
EnvVars = Annotated[dict[str, str], BeforeValidator(_env_strings)]


class ProbeSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
    kind: Literal["static", "correctness", "microbench", "trace", "events", "e2e"]
    entry: str | None = Field(None, description="module:function imported from the tree under test")
    command: str | None = Field(None, description="shell command run in the tree; prints one JSON result")
    pytest: list[str] | None = Field(None, description="pytest node ids (or files) of the tree's own tests; a "
                                     "failure is localised to the innermost frame of its traceback in the tree")
    check: str | None = Field(None, description="a built-in static check (feedback/checks.py) over params.paths")
    bench: BenchSpec | None = Field(None, description="a callable of the tree timed by the harness (microbench)")
    description: str = ""
    covers: Covers = Field(default_factory=Covers)
    params: dict[str, Any] = Field(default_factory=dict, description="launch parameters and input conditions")
    budget_s: float = Field(60.0, gt=0, description="hard timeout: the probe's process group is killed after it")
    memory_mb: int | None = Field(None, gt=0, description="address-space limit of the probe process")
    thresholds: dict[str, Threshold] = Field(default_factory=dict)
    needs_gpu: bool = False
    gpus: int | None = Field(None, ge=1, le=64, description="GPUs of one node the probe needs together (context "
                             "parallelism over ranks, a disaggregated cluster): reserved as one placement group, "
                             "strict pack, on a Ray cluster; locally, skipped where this machine has fewer")
    interpret: bool = Field(False, description="run under Triton's interpreter on the CPU even where a GPU is "
                            "present: for probes that count a kernel's work (feedback/workcount.py), never time it")
    repeats: int | None = Field(None, ge=1, le=100, description="runs of the probe per judgement (default: 3 for "
                                "microbench and e2e, whose verdicts need an interval and a noise floor; 1 otherwise)")
    env: EnvVars = Field(default_factory=dict, description="environment variables the probe runs with (a "
                         "library's switches, e.g. TRITON_CACHE_AUTOTUNING); over the manifest's env; part of "
                         "the probe's cache key")

    @model_validator(mode="after")
    def _one_way_to_run(self) -> ProbeSpec:
        ways = [w for w in ("entry", "command", "pytest", "check", "bench") if getattr(self, w) is not None]
        if len(ways) != 1:
            raise ValueError("a probe needs exactly one of entry (module:function), command, pytest (node ids), "
                             f"check (a built-in static check) or bench, got {', '.join(ways) or 'none'}")
        if self.bench is not None and self.kind != "microbench":
            raise ValueError(f"a bench probe is kind microbench, not {self.kind}")
        if self.entry is not None and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", self.entry):
            raise ValueError(f"entry must look like module.path:function, got {self.entry!r}")
        if self.pytest is not None and not self.pytest:
            raise ValueError("pytest needs at least one node id, e.g. tests/test_ops.py::test_merge")
        if self.check is not None:
            from feedback.checks import CHECKS

            if self.check not in CHECKS:
                raise ValueError(f"unknown check {self.check!r}; built in: {', '.join(sorted(CHECKS))}")
            tolerated = self.params.get("tolerated", [])
            if not isinstance(tolerated, list) or not all(isinstance(t, str) for t in tolerated):
                raise ValueError("params.tolerated must be a list of sites, each 'file: symbol: message' "
                                 "(as `infra-agent init` writes them)")
        return self


_OPS = {"<=": operator.le, "<": operator.lt, ">=": operator.ge, ">": operator.gt, "==": operator.eq}
_CRITERION = re.compile(r"^\s*(?P<metric>[A-Za-z0-9_.:\-]+)\s*(?P<op><=|>=|==|<|>)\s*(?P<value>[-+0-9.eE]+)\s*$")


class Criterion(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    expr: str = Field(description="'<probe>.<metric> <op> <number>', e.g. 'kda.cp.error_growth <= 3'")
    description: str = ""

    @field_validator("expr")
    @classmethod
    def _parse(cls, v: str) -> str:
        m = _CRITERION.match(v)
        if not m:
            raise ValueError(f"expected '<probe>.<metric> <op> <number>' with op one of {list(_OPS)}, got {v!r}")
        float(m["value"])
        return v

    def parts(self) -> tuple[str, str, float]:
        m = _CRITERION.match(self.expr)
        assert m is not None
        return m["metric"], m["op"], float(m["value"])

    @staticmethod
    def compare(value: float, op: str, bound: float) -> bool:
        return _OPS[op](value, bound)


class RiskRule(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    category: Literal["numerics", "concurrency", "production"]
    paths: list[str] = Field(default_factory=lambda: ["**"], description="path globs the rule applies to")
    pattern: str | None = Field(None, description="regex over added and removed lines")
    ast: str | None = Field(None, description="Python AST check: a call or attribute name, e.g. 'tl.dot'")
    description: str = ""

    @field_validator("pattern")
    @classmethod
    def _regex(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as exc:
                raise ValueError(f"invalid regex {v!r}: {exc}") from exc
        return v


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = 1
    name: str
    description: str = ""
    python_path: list[str] = Field(default_factory=lambda: ["."], description="tree-relative import roots")
    probes: list[ProbeSpec]
    acceptance: list[Criterion] = Field(default_factory=list)
    risk: list[RiskRule] = Field(default_factory=list)
    protected: list[str] = Field(default_factory=list, description="path globs no patch may touch")
    probe_path: list[str] = Field(default_factory=list, description="folders, relative to the manifest file, of "
                                  "probe modules kept outside the target (first on the probes' import path, so no "
                                  "file of the tree can stand in for them)")
    env: EnvVars = Field(default_factory=dict, description="environment variables every probe runs with "
                         "(a probe's own env overrides them)")
    preload: list[str] = Field(default_factory=list, description="third-party modules the warm probe server imports "
                               "once, before it forks each probe (the heavy imports every probe of the tree pays, "
                               "e.g. torch._dynamo for a library that compiles with it); never one the tree provides, "
                               "and a server that imported anything the tree provides is not used for it")
    _source: str | None = PrivateAttr(default=None)
    _text: str | None = PrivateAttr(default=None)  # what it was parsed from (a baseline with the same text reuses it)

    @property
    def source(self) -> pathlib.Path | None:
        """The file this manifest was read from, when it was read from one."""
        return pathlib.Path(self._source) if self._source else None

    def probe_roots(self) -> list[pathlib.Path]:
        """``probe_path`` as absolute folders (relative to the manifest's own folder)."""
        base = self.source.parent if self.source else pathlib.Path.cwd()
        return [(base / p).resolve() for p in self.probe_path]

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        for name in self.preload:
            if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", name):
                raise ValueError(f"preload: {name!r} is not a module name (dotted identifiers, e.g. torch._dynamo)")
        seen: set[str] = set()
        for p in self.probes:
            if p.id in seen:
                raise ValueError(f"duplicate probe id {p.id!r}")
            seen.add(p.id)
            if self.env:  # each probe carries the environment it runs with (and its cache key with it)
                p.env = {**self.env, **p.env}
        for c in self.acceptance:
            metric = c.parts()[0]
            if self.split_metric(metric) is None:
                raise ValueError(f"acceptance {c.name!r} names {metric!r}, which is no '<probe>.<metric>' "
                                 f"of a declared probe")
        return self

    def probe(self, probe_id: str) -> ProbeSpec:
        for p in self.probes:
            if p.id == probe_id:
                return p
        raise KeyError(probe_id)

    def split_metric(self, name: str) -> tuple[str, str] | None:
        """'kda.cp.error_growth' -> ('kda.cp', 'error_growth'): the longest probe id that prefixes it."""
        if ":" in name:
            pid, metric = name.split(":", 1)
            return (pid, metric) if any(p.id == pid for p in self.probes) else None
        best = None
        for p in self.probes:
            if name.startswith(p.id + ".") and (best is None or len(p.id) > len(best)):
                best = p.id
        return (best, name[len(best) + 1:]) if best else None

    def is_protected(self, path: str) -> str | None:
        """The protecting glob if ``path`` may not be patched (the manifest itself always is)."""
        if path == MANIFEST_NAME:
            return MANIFEST_NAME
        for pat in self.protected:
            if path_matches(path, pat) or path.startswith(pat.rstrip("/") + "/"):
                return pat
        return None


def _line_map(text: str) -> dict[tuple, int]:
    """YAML path -> 1-based line, for naming the line of a validation error."""
    lines: dict[tuple, int] = {}

    def walk(node: yaml.Node, path: tuple) -> None:
        lines[path] = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                k = key.value
                lines[path + (k,)] = key.start_mark.line + 1
                walk(value, path + (k,))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, path + (i,))

    root = yaml.compose(text, Loader=_SAFE_LOADER)
    if root is not None:
        walk(root, ())
    return lines


def _fmt_loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


#: libyaml's loader where PyYAML was built with it (ten times the pure-Python one: a manifest is read on every
#: command), the same safe subset of YAML either way
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_yaml(text: str):
    """``yaml.safe_load``, through libyaml where available."""
    return yaml.load(text, Loader=_SAFE_LOADER)


def parse_manifest(text: str, source: str = MANIFEST_NAME) -> Manifest:
    try:
        data = load_yaml(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        raise ManifestError(f"{where}: not valid YAML: {getattr(exc, 'problem', exc)}") from exc
    if not isinstance(data, dict):
        raise ManifestError(f"{source}:1: the manifest must be a mapping with name and probes")
    try:
        manifest = Manifest.model_validate(data)
        manifest._text = text
        if source != MANIFEST_NAME or pathlib.Path(source).is_file():
            manifest._source = str(pathlib.Path(source).resolve())
        return manifest
    except ValidationError as exc:
        lines = _line_map(text)
        msgs = []
        for err in exc.errors():
            loc = tuple(x for x in err["loc"] if not (isinstance(x, str) and x.startswith("function-")))
            line = next((lines[loc[:n]] for n in range(len(loc), -1, -1) if loc[:n] in lines), 1)
            msg = err["msg"].removeprefix("Value error, ")
            msgs.append(f"{source}:{line}: {_fmt_loc(loc)}: {msg}")
        raise ManifestError("; ".join(msgs)) from None


def load_manifest(root: str | pathlib.Path, file: str | pathlib.Path | None = None) -> Manifest:
    """Load and validate ``<root>/infra-agent.yaml``, or ``file`` (a manifest kept outside the tree)."""
    if file is not None:
        path = pathlib.Path(file)
        if not path.is_file():
            raise ManifestError(f"{path}: no such manifest file")
        return parse_manifest(path.read_text(), str(path))
    path = pathlib.Path(root) / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(f"{path}: no manifest (a target declares its probes in {MANIFEST_NAME} at its root)")
    return parse_manifest(path.read_text(), str(path))


def schema() -> dict:
    return Manifest.model_json_schema()


def dangling(manifest: Manifest, root: str | pathlib.Path) -> list[str]:
    """What the manifest names that the tree at ``root`` does not have (a valid manifest can still point
    at nothing): covers globs that match no file, pytest files, entry modules and check paths that are
    not there.  One line each, naming the probe."""
    import glob

    root = pathlib.Path(root)
    out = []
    for p in manifest.probes:
        for pattern in p.covers.files:
            if not glob.glob(str(root / pattern), recursive=True):
                out.append(f"{p.id}: covers.files {pattern!r} matches no file")
        for node in p.pytest or []:
            if not (root / node.split("::")[0]).exists():
                out.append(f"{p.id}: pytest {node!r}: no such file")
        if p.entry:
            mod = p.entry.split(":")[0].replace(".", "/")
            homes = [*(root / r for r in manifest.python_path), *manifest.probe_roots()]
            if not any((home / f"{mod}.py").is_file() or (home / mod / "__init__.py").is_file() for home in homes):
                out.append(f"{p.id}: entry module {p.entry.split(':')[0]!r} is neither in the tree (python_path "
                           f"{manifest.python_path}) nor in the manifest's probe_path")
        for path in p.params.get("paths", []) if p.check else []:
            if not (root / path).exists():
                out.append(f"{p.id}: check path {path!r} does not exist")
    return out
