"""Built-in static checks: probes a manifest names (``check: NAME``) instead of writing one.

Each reads Python source under ``params.paths`` (files or folders of the tree, default the whole
tree) with the ``ast`` module, imports nothing of the target and runs no code of it, and reports
a count as a metric (``better: lower``) with one finding per site, bound to its file, line and the
kernel or function around it.  Names are read through the file's imports (:func:`import_aliases`):
``T.dot`` after ``import triton.language as T`` is ``tl.dot``, ``Loader`` after ``from ctypes import
PyDLL as Loader`` is ``ctypes.PyDLL``.

* ``dot_precision``: ``tl.dot`` calls inside ``@triton.jit`` kernels with an fp32 operand (as the
  kernel's text shows it: an fp32 accumulator from ``tl.zeros(..., dtype=tl.float32)``, a ``.to(tl.float32)``,
  another dot's result, arithmetic on those) that state no ``input_precision`` (nor the older
  ``allow_tf32``): they get the device's default, tf32 on NVIDIA tensor cores, ~1e-3 relative
  error per product that chained dots accumulate.  bf16 and fp16 dots are exact in fp32
  accumulation and are not counted (``params.every: true`` counts every dot without a precision).
  Metric ``implicit_precision``.
* ``gil_native``: native libraries loaded so that their calls hold the GIL for their whole
  duration (``ctypes.PyDLL``, ``ctypes.pydll``): every other Python thread of the process (a
  KV-transfer thread, a scheduler) stops while they run.  Not ``ctypes.pythonapi``: the interpreter's
  own C API (``PyCapsule_GetPointer``) must hold the GIL, and CDLL is no cure for it (flash-attention's
  capsule idiom).  Metric ``gil_holding_loads``.
* ``tf32_switch``: a statement that puts every later fp32 matmul of the process on tf32 tensor cores
  (``torch.backends.cuda.matmul.allow_tf32 = True``, ``torch.set_float32_matmul_precision("high")``,
  ``fp32_precision = "tf32"``): a torch-level state merge or reference then loses the precision a kernel's
  ``input_precision`` would have kept.  Metric ``tf32_switches``.
* ``tf32_dot``: an fp32 ``tl.dot`` whose precision is stated as tf32 (``input_precision="tf32"``,
  ``allow_tf32=True``): the same ~1e-3 relative error per product as the default, chosen in writing.
  ``init`` tolerates those a tree has (a choice made before), so a new one, or an ``ieee`` dot turned
  tf32, fails.  Metric ``tf32_dots``.
* ``kernel_loop_division``: a division (``/``, ``tl.fdiv``, ``tl.div_rn``) inside a loop of a
  ``@triton.jit`` kernel: a reciprocal hoisted out of the loop, or an ``rsqrt`` multiply, does the
  same work with a cheaper instruction per element.  Metric ``loop_divisions``.
* ``argument_order``: calls whose positional arguments are named after *other* parameters of the callee
  than the ones their places fill (``Prefilled(rid, first, ...)`` against a record that declares ``first``
  first, ``kernel[grid](k, q, ...)`` against ``def kernel(q, k, ...)``), callees found across every file
  checked (``feedback/argorder.py``).  Metric ``misplaced_arguments``.

The runner calls :func:`run_check` in its own process (a static check needs no isolation); a
file that does not parse is a finding, never a crash.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import os
import pathlib
import pickle
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from feedback.state import ENV_PARTS, SKIP_PARTS


@dataclass
class Site:
    file: str
    line: int
    symbol: str | None
    message: str


def dotted_name(node: ast.AST) -> str:
    """``a.b.c`` for a name, an attribute chain or the callee of a call (through calls: ``f().g`` is ``f.g``)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{dotted_name(node.value)}.{node.attr}"
    if isinstance(node, ast.Call):
        return dotted_name(node.func)
    return ""


def _is_kernel(fn: ast.AST, aliases: dict[str, str]) -> bool:
    """A function decorated ``@triton.jit`` (or ``@jit``, ``@triton.autotune(...)`` over it, ...).  Through
    the module's imports (``aliases``): a ``jit`` of another DSL (``cute.jit`` after ``import cutlass.cute
    as cute``, ``numba.jit``, ``torch.jit.script``) is not Triton's; a bare ``jit`` whose origin the file
    does not say (a relative import, a re-export) is taken for Triton's."""
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    for d in fn.decorator_list:
        full = resolved_name(d, aliases)
        if full.split(".")[-1] in ("jit", "autotune", "heuristics") and (full.startswith("triton.") or "." not in full):
            return True
    return False


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def _enclosing(tree: ast.AST) -> dict[int, str]:
    """The name of the outermost function around each node (by ``id``), for a site's symbol."""
    out: dict[int, str] = {}
    stack: list[tuple[ast.AST, str | None]] = [(tree, None)]  # not recursion: generated files nest deeply
    while stack:
        node, name = stack.pop()
        for child in ast.iter_child_nodes(node):
            inner = name or (child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else None)
            if inner is not None:
                out[id(child)] = inner
            stack.append((child, inner))
    return out


_FP32 = ("tl.float32", "tl.fp32")  # as resolved_name spells them
_ELEMENTWISE = {"exp", "exp2", "log", "log2", "sqrt", "rsqrt", "sigmoid", "abs", "maximum", "minimum", "where",
                "sum", "cumsum", "max", "min", "trans", "reshape", "broadcast_to", "expand_dims", "permute", "view"}


def resolved_name(node: ast.AST, aliases: dict[str, str]) -> str:
    """The dotted name of ``node`` through the module's import aliases (:func:`import_aliases`): ``Loader``
    after ``from ctypes import PyDLL as Loader`` is ``ctypes.PyDLL``.  Triton's language reads as ``tl``:
    ``T.dot`` after ``import triton.language as T``, or ``dot`` after ``from triton.language import dot``,
    is ``tl.dot``.  A project that re-exports Triton (``from vllm.triton_utils import tl, triton``) is
    read through: what follows its ``triton`` is Triton's, and ``tl`` stands for the language, as
    everywhere."""
    name = dotted_name(node)
    root, _, rest = name.partition(".")
    origin = aliases.get(root, root)
    parts = ".".join(filter(None, (origin, rest))).split(".")
    if "triton" in parts[:-1]:  # vllm.triton_utils.triton.jit: triton.jit
        parts = parts[parts.index("triton"):]
    if root == "tl" or origin.rsplit(".", 1)[-1] == "tl":  # the language's conventional name, re-exported or not
        parts = ["tl", *rest.split(".")] if rest else ["tl"]
    full = ".".join(parts)
    return "tl." + full.removeprefix("triton.language.") if full.startswith("triton.language.") else full


def language_name(aliases: dict[str, str]) -> str | None:
    """What a module with these imports calls ``triton.language`` (``tl``, ``T``, ``triton.language``), or
    None where it names it nothing."""
    for name, origin in sorted(aliases.items()):
        if origin == "triton.language" or origin.endswith((".tl", ".triton.language")) or name == "tl":
            return name
    for name, origin in sorted(aliases.items()):
        if origin == "triton" or origin.endswith(".triton"):
            return f"{name}.language"
    return None


def _fp32_expr(node: ast.AST, fp32: set[str], aliases: dict[str, str]) -> bool:
    """Whether ``node`` is, as far as the kernel's own text says, an fp32 tensor."""
    def is32(n: ast.AST) -> bool:
        return _fp32_expr(n, fp32, aliases)

    if isinstance(node, ast.Name):
        return node.id in fp32
    if isinstance(node, ast.Call):
        fn = resolved_name(node.func, aliases)
        last = fn.split(".")[-1]
        if last == "to" and node.args:  # x.to(tl.float32): fp32; x.to(anything else): not
            return resolved_name(node.args[0], aliases) in _FP32
        if last in ("zeros", "full", "zeros_like", "full_like") and fn.startswith("tl."):
            dtype = next((k.value for k in node.keywords if k.arg == "dtype"), node.args[-1] if len(node.args) > 1
                         else None)
            return dtype is not None and resolved_name(dtype, aliases) in _FP32
        if fn == "tl.dot":  # accumulates in fp32 unless told otherwise
            out = next((k.value for k in node.keywords if k.arg == "out_dtype"), None)
            return out is None or resolved_name(out, aliases) in _FP32
        if last in _ELEMENTWISE:
            operand = node.func.value if isinstance(node.func, ast.Attribute) and not fn.startswith("tl.") else None
            return any(map(is32, [*node.args, *([operand] if operand is not None else [])]))
        return False
    if isinstance(node, ast.BinOp):
        return is32(node.left) or is32(node.right)
    if isinstance(node, ast.UnaryOp):
        return is32(node.operand)
    if isinstance(node, ast.Subscript):
        return is32(node.value)
    if isinstance(node, ast.Attribute) and node.attr == "T":
        return is32(node.value)
    if isinstance(node, ast.IfExp):
        return is32(node.body) or is32(node.orelse)
    return False


_SHAPE_ONLY = {"trans", "reshape", "broadcast_to", "expand_dims", "permute", "view"}


def _narrow_expr(node: ast.AST, narrow: set[str], aliases: dict[str, str]) -> bool:
    """Whether ``node`` is, as far as the kernel's own text says, a tensor of another dtype than fp32 (cast to
    bf16, fp16, fp8 or an integer type): a dot of such operands never runs on tf32."""
    if isinstance(node, ast.Name):
        return node.id in narrow
    if isinstance(node, ast.Call):
        fn = resolved_name(node.func, aliases)
        last = fn.split(".")[-1]
        if last == "to" and node.args:
            dtype = resolved_name(node.args[0], aliases)
            return dtype.startswith("tl.") and dtype not in _FP32
        if last in _SHAPE_ONLY:
            operand = node.func.value if isinstance(node.func, ast.Attribute) and not fn.startswith("tl.") else None
            first = node.args[0] if node.args else operand
            return first is not None and _narrow_expr(first, narrow, aliases)
        return False
    if isinstance(node, (ast.Subscript, ast.Attribute)) and (not isinstance(node, ast.Attribute) or node.attr == "T"):
        return _narrow_expr(node.value, narrow, aliases)
    return False


def _not_fp32_dot(node: ast.Call, narrow: set[str], aliases: dict[str, str]) -> bool:
    """A ``tl.dot`` that provably is no fp32 product: an operand cast to a narrower type, or an integer or
    16-bit accumulator (``out_dtype=tl.int32``: an int8 product)."""
    out = next((resolved_name(k.value, aliases) for k in node.keywords if k.arg == "out_dtype"), None)
    if out is not None and out.startswith("tl.") and out not in _FP32:
        return True
    return any(_narrow_expr(a, narrow, aliases) for a in node.args[:2])


def _stated_tf32(call: ast.Call) -> bool:
    """Whether a dot states tf32 itself: ``input_precision="tf32"`` or ``allow_tf32=True`` written as constants."""
    for k in call.keywords:
        if isinstance(k.value, ast.Constant) and (k.arg == "input_precision" and str(k.value.value).lower() == "tf32"
                                                   or k.arg == "allow_tf32" and k.value.value is True):
            return True
    return False


def implicit_dots(fn: ast.FunctionDef, every: bool = False,
                  aliases: dict[str, str] | None = None, maybe_fp32: bool = False,
                  stated_tf32: bool = False) -> Iterator[ast.Call]:
    """The ``tl.dot`` calls of kernel ``fn`` with an fp32 operand and no stated precision (``every``: any
    dot without one; ``maybe_fp32``: any without one that is not provably a product of another dtype,
    :func:`_not_fp32_dot`; ``stated_tf32``: instead the dots that state tf32 themselves and are not provably
    of another dtype; ``aliases``: its
    module's imports, :func:`import_aliases`, however it names ``tl``).
    Which local names hold fp32 is followed through the kernel in source order: each dot is judged by the
    assignments before it (a name loaded as bf16 after an fp32 use is bf16 again)."""
    aliases = aliases or {}
    events = []
    for node in ast.walk(fn):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and node.value is not None:
            events.append(((node.end_lineno, node.end_col_offset, 1), node))
        elif isinstance(node, ast.Call) and resolved_name(node.func, aliases) == "tl.dot":
            events.append(((node.lineno, node.col_offset, 0), node))
    fp32: set[str] = set()
    narrow: set[str] = set()
    for _, node in sorted(events, key=lambda e: e[0]):
        if isinstance(node, ast.Call):
            if stated_tf32:  # tf32 is only ever a precision of fp32 operands: any dot not provably narrower
                if _stated_tf32(node) and not _not_fp32_dot(node, narrow, aliases):
                    yield node
            elif not {k.arg for k in node.keywords} & {"input_precision", "allow_tf32"} and \
                    (every or any(_fp32_expr(a, fp32, aliases) for a in node.args[:2])
                     or maybe_fp32 and not _not_fp32_dot(node, narrow, aliases)):
                yield node
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        is32 = _fp32_expr(node.value, fp32, aliases) or (
            isinstance(node, ast.AugAssign) and _fp32_expr(node.target, fp32, aliases))
        is_narrow = not is32 and not isinstance(node, ast.AugAssign) and _narrow_expr(node.value, narrow, aliases)
        for t in targets:
            if isinstance(t, ast.Name):
                (fp32.add if is32 else fp32.discard)(t.id)
                (narrow.add if is_narrow else narrow.discard)(t.id)


def kernels(tree: ast.AST, aliases: dict[str, str] | None = None) -> Iterator[ast.FunctionDef]:
    """The ``@triton.jit`` (or autotuned, heuristics-wrapped) functions of a module (:func:`_is_kernel`);
    ``aliases``: its :func:`import_aliases`, where the caller has them already."""
    aliases = import_aliases(tree) if aliases is None else aliases
    return (fn for fn in _functions(tree) if _is_kernel(fn, aliases))


def dot_precision(tree: ast.AST, rel: str, every: bool = False) -> Iterator[Site]:
    """fp32 ``tl.dot`` calls without an explicit ``input_precision`` (:func:`implicit_dots`)."""
    aliases = import_aliases(tree)
    for fn in kernels(tree, aliases):
        for node in implicit_dots(fn, every, aliases):
            yield dot_site(rel, fn, node)


def tf32_dot(tree: ast.AST, rel: str) -> Iterator[Site]:
    """fp32 ``tl.dot`` calls that state tf32 themselves (:func:`implicit_dots` with ``stated_tf32``)."""
    aliases = import_aliases(tree)
    for fn in kernels(tree, aliases):
        for node in implicit_dots(fn, aliases=aliases, stated_tf32=True):
            yield Site(rel, node.lineno, fn.name, f"{ast.unparse(node)[:80]}: fp32 operands on tf32 tensor cores, as "
                       "stated (~1e-3 relative error per product; tf32x3 or ieee keep fp32's)")


def dot_site(rel: str, fn: ast.FunctionDef, node: ast.Call) -> Site:
    """The dot-precision check's site of the dot ``node`` in kernel ``fn``."""
    return Site(rel, node.lineno, fn.name, f"{ast.unparse(node)[:80]}: fp32 operands and no input_precision, so "
                "the device's default (tf32 on NVIDIA tensor cores)")


def import_aliases(tree: ast.AST) -> dict[str, str]:
    """What each name a module binds by import stands for: ``{"C": "ctypes", "pydll": "ctypes.pydll"}``."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names if a.name != "*"})
    return out


#: the ctypes loaders whose functions run with the GIL held, and its handle on the interpreter's own C API
GIL_HOLDING = ("ctypes.PyDLL", "ctypes.pydll")


def gil_native(tree: ast.AST, rel: str) -> Iterator[Site]:
    enclosing: dict[int, str] = {}  # filled at the first site (most files have none)
    imported = import_aliases(tree)
    inner: set[int] = set()  # a chain's inner names, already reported with the chain they start
    sites = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Name, ast.Attribute)) or id(node) in inner:
            continue
        name, full = dotted_name(node), resolved_name(node, imported)  # the latter through the file's imports
        hit = next((g for g in GIL_HOLDING if full == g or full.startswith(g + ".")), None)
        if hit is None and full.rsplit(".", 1)[-1] == "PyDLL":
            hit = "PyDLL"  # a PyDLL reached through another module (a re-export, a vendored ctypes)
        if hit is not None:
            inner.update(id(n) for n in ast.walk(node))
            enclosing = enclosing or _enclosing(tree)
            sites.append(Site(rel, node.lineno, enclosing.get(id(node)),
                              f"{name}: its calls hold the GIL for their whole duration (CDLL releases it)"))
    yield from sorted(sites, key=lambda s: s.line)


#: switches that put every later fp32 matmul of the process on tf32 tensor cores: name -> the values that do not
TF32_SWITCHES = {"torch.backends.cuda.matmul.allow_tf32": (False,),
                 "torch.backends.cuda.matmul.fp32_precision": ("ieee", "none"),
                 "torch.backends.fp32_precision": ("ieee", "none"),
                 "torch.set_float32_matmul_precision": ("highest",)}


def tf32_switch(tree: ast.AST, rel: str) -> Iterator[Site]:
    """Statements that turn tf32 on for the process's fp32 matmuls (``TF32_SWITCHES``): an assignment to the
    flag, or the call, with a value other than the ones that keep fp32 (a value the source does not state
    counts: it may be tf32).  Read through the file's imports (``from torch.backends.cuda import matmul``)."""
    aliases, enclosing = import_aliases(tree), {}  # the latter filled at the first site

    def switched(target: ast.AST, value: ast.AST | None) -> str | None:
        name = resolved_name(target, aliases)
        if name not in TF32_SWITCHES:
            return None
        if isinstance(value, ast.Constant) and (value.value in TF32_SWITCHES[name] or (
                isinstance(value.value, str) and value.value.lower() in TF32_SWITCHES[name])):
            return None
        return name

    for node in ast.walk(tree):
        found = []
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found = [(n, f"{n} = {ast.unparse(node.value)[:40]}") for t in targets
                     if (n := switched(t, node.value)) is not None]
        elif isinstance(node, ast.Call) and node.args and (n := switched(node.func, node.args[0])) is not None:
            found = [(n, f"{n}({ast.unparse(node.args[0])[:40]})")]
        enclosing = enclosing or (_enclosing(tree) if found else {})
        for _, text in found:
            yield Site(rel, node.lineno, enclosing.get(id(node)),
                       f"{text}: every later fp32 matmul of the process runs on tf32 tensor cores (about 1e-3 "
                       "relative error per product, which a chain of them, a state merge, accumulates)")


def kernel_loop_division(tree: ast.AST, rel: str) -> Iterator[Site]:
    """Divisions inside a kernel's loops, each counted once however many loops hold it."""
    for fn in kernels(tree):
        seen: set[int] = set()
        for loop in ast.walk(fn):
            if not isinstance(loop, (ast.For, ast.While)):
                continue
            for node in ast.walk(loop):
                div = isinstance(node, (ast.BinOp, ast.AugAssign)) and isinstance(node.op, ast.Div) or \
                    isinstance(node, ast.Call) and dotted_name(node.func).split(".")[-1] in ("fdiv", "div_rn")
                if div and id(node) not in seen:
                    seen.add(id(node))
                    yield Site(rel, node.lineno, fn.name, f"division in the kernel's loop: {ast.unparse(node)[:80]}")


def argument_order(modules: list) -> Iterator[Site]:
    """(tree, relative path) pairs or their digests (``feedback.argorder.digest``) -> sites."""
    from feedback.argorder import argument_order as check  # it imports Site from here

    return check(modules)


#: name -> (metric, check): a check of one file, (tree, relative path) -> sites, or of them all (WHOLE_TREE)
CHECKS: dict[str, tuple[str, Callable[..., Iterator[Site]]]] = {
    "dot_precision": ("implicit_precision", dot_precision),
    "gil_native": ("gil_holding_loads", gil_native),
    "kernel_loop_division": ("loop_divisions", kernel_loop_division),
    "argument_order": ("misplaced_arguments", argument_order),
    "tf32_switch": ("tf32_switches", tf32_switch),
    "tf32_dot": ("tf32_dots", tf32_dot),
}
#: the checks that read every file together: [digest of each (tree, relative path), ...] -> sites
WHOLE_TREE = {"argument_order"}


def _digest(name: str) -> Callable[[ast.Module, str], object]:
    """What a whole-tree check keeps of one module (a large tree is never held whole in memory)."""
    from feedback.argorder import digest

    return {"argument_order": digest}[name]


@functools.cache
def _digest_code(name: str) -> str:
    """The hash of the code that makes a check's digests: a change to it makes every stored digest stale."""
    import feedback.argorder

    code = {"argument_order": feedback.argorder}[name]
    return hashlib.sha256(pathlib.Path(code.__file__).read_bytes() + sys.version.encode()).hexdigest()


class DigestStore:
    """A whole-tree check's digest of each file, kept by the file's path and content (and the check's own
    code) in a folder of the harness's state: a change to one file of a large tree parses that file, not
    the tree (``argument_order`` over unsloth's 60 MB: 30 s each time before).  A digest that cannot be
    read back is made again; one that cannot be written is only not kept."""

    def __init__(self, folder: pathlib.Path) -> None:
        self.folder = pathlib.Path(folder)

    def _path(self, name: str, rel: str, source: str) -> pathlib.Path:
        key = hashlib.sha256(f"{name}\0{_digest_code(name)}\0{rel}\0{source}".encode("utf-8", "replace")).hexdigest()
        return self.folder / name / key[:2] / f"{key}.pickle"

    def get(self, name: str, rel: str, source: str) -> object | None:
        try:
            return pickle.loads(self._path(name, rel, source).read_bytes())
        except Exception:  # noqa: BLE001 - absent, truncated by a kill, from another version: made again
            return None

    def put(self, name: str, rel: str, source: str, digest: object) -> None:
        path = self._path(name, rel, source)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_bytes(pickle.dumps(digest, protocol=pickle.HIGHEST_PROTOCOL))
            os.replace(tmp, path)
        except (OSError, pickle.PicklingError, RecursionError):
            pass

#: words without one of which a file cannot hold a site of the check, so it is not parsed for it: each check
#: matches a name whose last part the source spells out (in the use itself, or in the import that aliases it)
NEEDLES = {"dot_precision": ("dot",), "kernel_loop_division": ("jit", "autotune", "heuristics"),
           "gil_native": ("PyDLL", "pydll"),
           "tf32_switch": ("allow_tf32", "fp32_precision", "float32_matmul_precision"),
           "tf32_dot": ("tf32", "TF32")}


def python_files(root: pathlib.Path, paths: list[str] | None) -> list[pathlib.Path]:
    """The ``.py`` files under ``paths`` (relative to ``root``; default everything), state and VCS left out,
    and a virtual environment kept in the tree (ENV_PARTS) unless a path names it or a file in it."""
    out: set[pathlib.Path] = set()
    for p in paths or ["."]:
        base = (root / p).resolve()
        if not base.is_relative_to(root.resolve()):
            raise ValueError(f"path {p!r} leaves the tree")
        found = [base] if base.is_file() else sorted(base.rglob("*.py")) if base.is_dir() else []
        out.update(f for f in found if SKIP_PARTS.isdisjoint(f.relative_to(root.resolve()).parts)
                   and ENV_PARTS.isdisjoint(f.relative_to(base).parts[:-1] if f != base else ()))
    return sorted(out)


# CPython 3.11's AST constructor keeps its recursion depth per interpreter, not per thread: two threads
# parsing at once fail at random ("SystemError: AST constructor recursion depth mismatch"), and the runner
# runs static checks in its own threads.  One parse at a time.
_PARSE = threading.Lock()


def parse(source: str, filename: str) -> ast.Module:
    """``ast.parse``, safe to call from several threads at once."""
    with _PARSE:
        return ast.parse(source, filename=filename)


def run_check(name: str, root: str | pathlib.Path, paths: list[str] | None = None,
              store: DigestStore | None = None, **options) -> tuple[str, int, list[Site]]:
    """(metric name, count, sites) of the built-in check ``name`` over ``paths`` of the tree ``root``
    (``store``: where a whole-tree check keeps its digest of each file between runs)."""
    metric, check = CHECKS[name]
    fn = (lambda tree, rel: check(tree, rel, **options)) if options else check
    root = pathlib.Path(root).resolve()
    sites: list[Site] = []
    unreadable: list[Site] = []
    modules: list = []
    for f in python_files(root, paths):
        rel = f.relative_to(root).as_posix()
        source = f.read_text(encoding="utf-8", errors="replace")
        if name in NEEDLES and not any(n in source for n in NEEDLES[name]):
            continue
        if name in WHOLE_TREE and store is not None and (kept := store.get(name, rel, source)) is not None:
            modules.append(kept)
            continue
        try:
            tree = parse(source, rel)
        except SyntaxError as exc:
            unreadable.append(Site(rel, exc.lineno or 0, None, f"does not parse: {exc.msg}"))
            continue
        except RecursionError:  # an expression nested past the parser's depth (a generated file)
            unreadable.append(Site(rel, 0, None, "does not parse: nested too deeply for Python's parser"))
            continue
        if name in WHOLE_TREE:
            modules.append(_digest(name)(tree, rel))  # what the check keeps of it: the tree itself is let go
            if store is not None:
                store.put(name, rel, source, modules[-1])
        else:
            sites.extend(sorted(fn(tree, rel), key=lambda site: site.line))
    if name in WHOLE_TREE:
        sites = sorted(check(modules, **options), key=lambda site: (site.file, site.line))
    return metric, len(sites), sites + unreadable
