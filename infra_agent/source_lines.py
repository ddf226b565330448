"""What a changed line of a source file is, for the risk gate: its code without comments, whether it is
documentation, whether it lies inside a GPU kernel, a kernel's launch or a critical section.

The gate's rules read code, not prose: a comment that mentions an accumulation or an epsilon changes no
number, while any edit inside a kernel's body does, whatever words it uses.  Comment syntax is known per
file type (``#`` for Python, shell, YAML and TOML; ``//`` and one-line ``/* */`` for the C family and
CUDA); files of other types (Markdown, where ``#`` is a heading) are read whole.
"""

from __future__ import annotations

import ast
import pathlib
import re
from dataclasses import dataclass

from feedback.checks import parse
from infra_agent.tamper import dotted

HASH_COMMENTS = (".py", ".pyx", ".pyi", ".sh", ".bash", ".yaml", ".yml", ".toml", ".cfg", ".ini", ".cmake", ".txt")
SLASH_COMMENTS = (".c", ".cc", ".cpp", ".cxx", ".cu", ".cuh", ".h", ".hh", ".hpp", ".hxx", ".inl", ".metal", ".mlir",
                  ".go", ".rs", ".java", ".js", ".ts", ".proto", ".swift", ".kt")
# decorators that make a Python function device code: triton.jit, triton.autotune / heuristics stacked on
# it, numba.cuda.jit, tilelang.jit, cute.kernel / cute.jit, T.prim_func, torch.jit.script
KERNEL_DECORATOR = re.compile(r"(^|\.)(jit|autotune|heuristics|kernel|prim_func|script)$")
# what a with-statement holds when it takes a lock (self._lock, cond, mutex, sem, guard, a FileLock(...)) or
# puts work on a device stream (torch.cuda.stream(s), self.stream)
LOCK_NAME = re.compile(r"(?i)(lock|mutex|cond|sema|guard|stream)\w*$")


def _cut(text: str, marker: str) -> str:
    """``text`` up to the first ``marker`` that is not inside a string literal."""
    quote = None
    i = 0
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 2
                continue
            if c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif text.startswith(marker, i):
            return text[:i]
        i += 1
    return text


def code_part(path: str, text: str) -> str:
    """The code of one line of ``path`` with its comment removed ('' for a comment-only line)."""
    suffix = pathlib.PurePath(path).suffix.lower()
    if suffix in HASH_COMMENTS or pathlib.PurePath(path).name in ("Makefile", "CMakeLists.txt"):
        return _cut(text, "#").rstrip()
    if suffix in SLASH_COMMENTS:
        stripped = text.lstrip()
        if stripped.startswith(("*", "/*")) and ("*/" not in stripped or stripped.endswith("*/")):
            return ""  # a block comment's line
        text = re.sub(r"/\*.*?\*/", " ", text)
        if re.match(r"\s*#\s*pragma\s+once\s*$", text):
            return ""  # an include guard computes nothing
        return _cut(text, "//").rstrip()
    return text


def module(source: str | None, path: str = "<src>") -> ast.Module | None:
    """The parsed ``source`` (None for no source, or one that does not parse: every line is then read as
    plain code).  Parsed once per side of a patch, for :func:`python_regions` and :func:`defaults` both."""
    if source is None:
        return None
    try:
        return parse(source, path)
    except (SyntaxError, ValueError):
        return None


def _called_name(node: ast.expr) -> str:
    """``a.b.c`` for a decorator or a with-item, called (``@triton.jit(...)``, ``with FileLock(p)``) or not."""
    return dotted(node.func if isinstance(node, ast.Call) else node)


@dataclass(frozen=True)
class Regions:
    """Line numbers of a Python source by what they are part of."""

    docs: frozenset[int] = frozenset()  # docstrings and other bare string statements
    kernels: frozenset[int] = frozenset()  # bodies of functions decorated as device code (KERNEL_DECORATOR)
    locked: frozenset[int] = frozenset()  # bodies of with-blocks that hold a lock or a stream (LOCK_NAME)
    launches: frozenset[int] = frozenset()  # kernel launches, ``kernel[grid](...)`` (:func:`python_regions`)


def _span(node: ast.AST) -> range:
    return range(node.lineno, (node.end_lineno or node.lineno) + 1)


def _launched(value: ast.expr) -> ast.expr:
    """What a subscripted launch launches: ``k`` of ``k[grid]``, and of ``wrap_triton(k)[grid]`` (torch.library's
    wrapper of a Triton kernel, or any call that takes the kernel first)."""
    while isinstance(value, ast.Call) and value.args:
        value = value.args[0]
    return value


def python_regions(tree: ast.Module | None) -> Regions:
    """The :class:`Regions` of a parsed Python source (none without one), from one walk of its tree.

    A kernel launch is a call ``k[grid](args)`` of a subscripted name that is a kernel this source defines
    (KERNEL_DECORATOR) or a name it imports (a kernel of another module, ``from .kernels import k``, or
    reached through an imported module, ``ops.k[grid](...)``): its grid, its arguments' order and its
    compile-time constants decide what the kernel computes.  A subscripted local (``handlers[name](x)``) is
    not one.  The names are known only once the whole tree is seen, so the subscripted calls wait for them.
    """
    if tree is None:
        return Regions()
    docs: set[int] = set()
    kernels: set[int] = set()
    locked: set[int] = set()
    names: set[str] = set()  # kernels defined here and names imported: what a launch's subscript may start from
    subscripted: list[tuple[str, ast.Call]] = []  # (the name the subscripted callee starts from, the call)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            docs.update(_span(node))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                KERNEL_DECORATOR.search(_called_name(d)) for d in node.decorator_list):
            kernels.update(range(node.body[0].lineno, (node.end_lineno or node.lineno) + 1))
            names.add(node.name)
        elif isinstance(node, (ast.With, ast.AsyncWith)) and any(
                LOCK_NAME.search(_called_name(item.context_expr)) for item in node.items):
            locked.update(_span(node))
        elif isinstance(node, ast.ImportFrom):
            names.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.asname or a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) and (
                root := dotted(_launched(node.func.value)).split(".")[0]):
            subscripted.append((root, node))
    launches = {line for root, call in subscripted if root in names for line in _span(call)}
    return Regions(frozenset(docs), frozenset(kernels), frozenset(locked), frozenset(launches))


def defaults(tree: ast.Module | None) -> dict[tuple[str, ...], tuple[str, int]]:
    """The settings a parsed Python source declares, each with its value (as ``ast.dump``) and line: every
    parameter default of a function (``("def", qualname, param)``), every class-level assignment
    (``("field", class, name)``: config classes, dataclasses, pydantic models) and every module-level
    UPPER_CASE constant (``("const", name)``).  Empty without a source."""
    if tree is None:
        return {}
    out: dict[tuple[str, ...], tuple[str, int]] = {}

    def assigned(node: ast.stmt) -> list[tuple[str, ast.expr]]:
        if isinstance(node, ast.Assign):
            return [(t.id, node.value) for t in node.targets if isinstance(t, ast.Name)]
        if isinstance(node, ast.AnnAssign) and node.value is not None and isinstance(node.target, ast.Name):
            return [(node.target.id, node.value)]
        return []

    def walk(body: list[ast.stmt], prefix: str, in_class: bool) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                positional = [*a.posonlyargs, *a.args]
                pairs = [*zip(positional[len(positional) - len(a.defaults):], a.defaults),
                         *((arg, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None)]
                for arg, d in pairs:
                    out[("def", prefix + node.name, arg.arg)] = (ast.dump(d), d.lineno)
                walk(node.body, f"{prefix}{node.name}.", False)
            elif isinstance(node, ast.ClassDef):
                walk(node.body, f"{prefix}{node.name}.", True)
            else:
                for name, value in assigned(node):
                    if in_class:
                        out[("field", prefix.rstrip("."), name)] = (ast.dump(value), value.lineno)
                    elif not prefix and name.isupper() and not name.startswith("__"):
                        out[("const", name)] = (ast.dump(value), value.lineno)

    walk(tree.body, "", False)
    return out
