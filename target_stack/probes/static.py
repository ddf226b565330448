"""Static probes of target_stack: source checks that need no kernel run (protected)."""

from __future__ import annotations

import ast
import pathlib

from feedback.probe import ProbeContext, probe


@probe(kind="static")
def dot_precision_stated(ctx: ProbeContext) -> None:
    """Every ``tl.dot`` in the kernels names its ``input_precision``: precision is a decision.

    Triton's default for fp32 operands is tf32; a dot that leaves it implicit is exactly the
    accident behind the context-parallel merge case.
    """
    root = pathlib.Path(ctx.tree)
    dots = missing = 0
    for path in sorted((root / ctx.params.get("root", "target_stack/ops")).rglob("*.py")):
        rel = str(path.relative_to(root))
        try:
            tree = ast.parse(path.read_text(), filename=rel)
        except SyntaxError as exc:
            ctx.fail(f"does not parse: {exc.msg}", file=f"{rel}:{exc.lineno}")
            continue
        func_at = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                for sub in ast.walk(node):
                    func_at.setdefault(id(sub), node.name)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "dot"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "tl"):
                dots += 1
                if not any(kw.arg == "input_precision" for kw in node.keywords):
                    missing += 1
                    ctx.fail("tl.dot without input_precision: fp32 operands default to tf32",
                             file=f"{rel}:{node.lineno}", kernel=func_at.get(id(node)))
    ctx.metric("tl_dot_calls", dots)
    ctx.metric("implicit_precision", missing, better="lower")
