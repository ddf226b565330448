"""Executable playbook transforms: deterministic source edits at the code matches a playbook found.

Each takes (tree, code matches, knobs) and returns the files it changed.  They edit text at AST
positions, so formatting and comments elsewhere survive, and they never touch a file twice.
"""

from __future__ import annotations

import ast
import pathlib
import re
from typing import Any

from playbooks.model import CodeMatch


def _files(matches: list[CodeMatch]) -> list[str]:
    return sorted({m.file for m in matches})


def state_dot_precision(tree: pathlib.Path, matches: list[CodeMatch], knobs: dict[str, Any]) -> list[str]:
    """Give every ``tl.dot`` without ``input_precision`` an explicit one.

    Inside a kernel that already takes a precision parameter (a constexpr whose name ends in
    PRECISION), that parameter is used: the host resolves it (tf32x3 where tf32 exists, ieee
    elsewhere).  Otherwise the ``precision`` knob is written literally.
    """
    changed = []
    for rel in _files(matches):
        path = tree / rel
        src = path.read_text()
        mod = ast.parse(src)
        lines = src.splitlines(keepends=True)
        offsets = [0]
        for ln in lines:
            offsets.append(offsets[-1] + len(ln))
        edits: list[tuple[int, str]] = []
        for fn in [n for n in ast.walk(mod) if isinstance(n, ast.FunctionDef)]:
            params = [a.arg for a in fn.args.args + fn.args.kwonlyargs]
            prec = next((p for p in params if p.upper().endswith("PRECISION")), None)
            value = prec if prec else repr(knobs.get("precision", "tf32x3"))
            for node in ast.walk(fn):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "dot"
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "tl"
                        and not any(kw.arg == "input_precision" for kw in node.keywords)):
                    end = offsets[node.end_lineno - 1] + node.end_col_offset - 1  # the closing parenthesis
                    edits.append((end, f", input_precision={value}"))
        if edits:
            for pos, text in sorted(set(edits), reverse=True):
                src = src[:pos] + text + src[pos:]
            path.write_text(src)
            changed.append(rel)
    return changed


def pydll_to_cdll(tree: pathlib.Path, matches: list[CodeMatch], knobs: dict[str, Any]) -> list[str]:
    """Load native libraries with ``ctypes.CDLL``, which releases the GIL around every call."""
    changed = []
    for rel in _files(matches):
        path = tree / rel
        src = path.read_text()
        new = re.sub(r"\bctypes\.PyDLL\(", "ctypes.CDLL(", src)
        new = re.sub(r"\bctypes\.pydll\.LoadLibrary\(", "ctypes.cdll.LoadLibrary(", new)
        if new != src:
            path.write_text(new)
            changed.append(rel)
    return changed


_DIV_SQRT = re.compile(r"/\s*tl\.sqrt\(")


def rsqrt_multiply(tree: pathlib.Path, matches: list[CodeMatch], knobs: dict[str, Any]) -> list[str]:
    """``x / tl.sqrt(y)`` becomes ``x * tl.rsqrt(y)``: one multiply instead of a sqrt and a divide."""
    changed = []
    for rel in _files(matches):
        path = tree / rel
        src = path.read_text()
        new = _DIV_SQRT.sub("* tl.rsqrt(", src)
        if new != src:
            path.write_text(new)
            changed.append(rel)
    return changed
