"""Executable playbook transforms: deterministic source edits at the code matches a playbook found.

Each takes (tree, code matches, knobs) and returns the files it changed.  They edit text at AST
positions, so formatting and comments elsewhere survive, and they never touch a file twice.
"""

from __future__ import annotations

import ast
import pathlib
from typing import Any

from feedback.checks import parse
from feedback.sites import Tolerated
from playbooks.model import CodeMatch


def _files(matches: list[CodeMatch]) -> list[str]:
    return sorted({m.file for m in matches})


def _tolerated(knobs: dict[str, Any]) -> Tolerated:
    """The sites the manifest's static checks tolerate (knob ``tolerated``, as ``init`` lists what the tree had):
    a transform leaves them as they are."""
    return Tolerated(list(knobs.get("tolerated") or []))


PRECISION_CONSTANT = "FP32_DOT_PRECISION"


def _precision_constant(src: str, mod: ast.Module, precision: str, fallback: str) -> tuple[str, int]:
    """``src`` with a module-level constexpr ``FP32_DOT_PRECISION`` after its imports (``precision`` on CUDA
    builds of torch, ``fallback`` on every other build: ROCm, whose Triton has no tf32x3, the Ascend and Intel
    backends, a CPU build under the interpreter), and the number of characters inserted before the first line
    that follows the imports.

    It reads only how torch was built, never the device: importing a kernel module must not initialise
    CUDA (``torch.cuda.get_device_capability`` does; a server that imports its kernels and then forks its
    workers could not use CUDA in them).  Where tf32 tensor cores are missing (before compute capability
    8.0, Triton's interpreter) the three tf32 products of tf32x3 are plain fp32 ones: as exact, only slower."""
    from feedback.checks import import_aliases, language_name

    imports = [n for n in mod.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    has_torch = any(isinstance(n, ast.Import) and any(a.name == "torch" and not a.asname for a in n.names)
                    for n in imports)
    # the module's own name for triton.language (tl, T, triton.language), or one imported here
    lang = language_name(import_aliases(ast.Module(body=imports, type_ignores=[])))
    after = max((n.end_lineno for n in imports), default=0)
    lines = src.splitlines(keepends=True)
    block = ("" if has_torch else "import torch\n") + ("" if lang else "import triton.language as tl\n") + (
        f"\n# fp32 dot chains: {precision} on CUDA builds of torch, {fallback} on others (read from the build: "
        f"the device is not touched at import)\n"
        f"{PRECISION_CONSTANT} = {lang or 'tl'}.constexpr({precision!r} if torch.version.cuda else {fallback!r})\n")
    head = "".join(lines[:after])
    return head + block + "".join(lines[after:]), len(block)


def state_dot_precision(tree: pathlib.Path, matches: list[CodeMatch], knobs: dict[str, Any]) -> list[str]:
    """Give the fp32 ``tl.dot`` calls without ``input_precision`` an explicit one.

    Which dots: those with an fp32 operand (``feedback.checks.implicit_dots``: bf16 and fp16 dots are
    exact in their fp32 accumulation and are left alone); in a file where none is provably fp32, the
    precision-less dots on the matched lines that are not provably of another dtype (operands cast to bf16,
    an integer accumulator).  What precision: inside a kernel that takes a precision
    parameter (a constexpr whose name ends in PRECISION), that parameter, which the host resolves;
    otherwise a module-level constexpr, ``precision`` (tf32x3) where tf32 tensor cores exist and
    ``fallback`` (ieee) elsewhere, never a hard-coded tf32.
    """
    from feedback.checks import dot_site, implicit_dots, import_aliases, kernels

    tolerated = _tolerated(knobs)
    changed = []
    for rel in _files(matches):
        path = tree / rel
        src = path.read_text()
        mod = parse(src, rel)
        pos, aliases = _position(src), import_aliases(mod)
        matched = {m.line for m in matches if m.file == rel}
        found = list(kernels(mod, aliases))
        chosen: list[tuple[ast.FunctionDef, ast.Call]] = [(fn, d) for fn in found
                                                          for d in implicit_dots(fn, aliases=aliases)]
        if not chosen:
            chosen = [(fn, d) for fn in found for d in implicit_dots(fn, aliases=aliases, maybe_fp32=True)
                      if d.lineno in matched]
        chosen = [(fn, d) for fn, d in chosen if not tolerated.take(dot_site(rel, fn, d))]
        edits: list[tuple[int, str]] = []
        constant = False
        for fn, node in chosen:
            params = [a.arg for a in fn.args.args + fn.args.kwonlyargs]
            prec = next((p for p in params if p.upper().endswith("PRECISION")), None)
            constant |= prec is None
            # right after the last argument, not before the closing parenthesis: a call written one argument
            # per line with a trailing comma (`b,\n)`) would otherwise get a second comma, a syntax error
            last = max([*node.args, *node.keywords], key=lambda a: (a.end_lineno, a.end_col_offset))
            edits.append((pos(last.end_lineno, last.end_col_offset), f", input_precision={prec or PRECISION_CONSTANT}"))
        if not edits:
            continue
        for pos, text in sorted(set(edits), reverse=True):
            src = src[:pos] + text + src[pos:]
        if constant and PRECISION_CONSTANT not in {t.id for n in mod.body if isinstance(n, ast.Assign)
                                                   for t in n.targets if isinstance(t, ast.Name)}:
            src, _ = _precision_constant(src, mod, knobs.get("precision", "tf32x3"), knobs.get("fallback", "ieee"))
        path.write_text(src)
        changed.append(rel)
    return changed


#: ctypes' loaders that hold the GIL through each call, and the ones that release it
_RELEASING = {"PyDLL": "CDLL", "pydll": "cdll"}


def pydll_to_cdll(tree: pathlib.Path, matches: list[CodeMatch], knobs: dict[str, Any]) -> list[str]:
    """Load native libraries with ``ctypes.CDLL``, which releases the GIL around every call: every reference
    to ``ctypes.PyDLL`` or ``ctypes.pydll`` in the matched files, however the file imported it (``import
    ctypes as C``, ``from ctypes import PyDLL as Loader``, ``from ctypes import pydll``), is turned into its
    releasing twin.  ``ctypes.pythonapi`` is the interpreter's own C API, which must hold the GIL: left alone."""
    from feedback.checks import import_aliases, resolved_name

    changed = []
    for rel in _files(matches):
        path = tree / rel
        try:
            src = path.read_text()
            mod = parse(src, rel)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        aliases, pos = import_aliases(mod), _position(src)
        edits: list[tuple[int, int, str]] = []
        for node in ast.walk(mod):
            if isinstance(node, ast.ImportFrom) and node.module == "ctypes" and not node.level and any(
                    a.name in _RELEASING for a in node.names):
                names: list[ast.alias] = []
                for a in node.names:  # the twin under the same local name; a twin imported already, once
                    twin = ast.alias(_RELEASING.get(a.name, a.name), a.asname)
                    if all((n.name, n.asname) != (twin.name, twin.asname) for n in names):
                        names.append(twin)
                edits.append((pos(node.lineno, node.col_offset), pos(node.end_lineno, node.end_col_offset),
                              ast.unparse(ast.ImportFrom(module="ctypes", names=names, level=0))))
            elif isinstance(node, ast.Attribute) and node.attr in _RELEASING:
                if resolved_name(node.value, aliases) == "ctypes":  # ctypes however the file imported it
                    end = pos(node.end_lineno, node.end_col_offset)
                    edits.append((end - len(node.attr), end, _RELEASING[node.attr]))
            elif (isinstance(node, ast.Name) and node.id in _RELEASING
                  and aliases.get(node.id) == f"ctypes.{node.id}"):  # imported under its own name: renamed there
                edits.append((pos(node.lineno, node.col_offset), pos(node.end_lineno, node.end_col_offset),
                              _RELEASING[node.id]))
        if edits:
            new = src
            for start, end, text in sorted(set(edits), reverse=True):
                new = new[:start] + text + new[end:]
            path.write_text(new)
            changed.append(rel)
    return changed


def _position(src: str):
    """``pos(line, col)``: the index in ``src`` of an AST position (``col`` counts UTF-8 bytes, as the AST's
    offsets do, so a line with a non-ASCII character before the node still lands on it)."""
    lines = src.splitlines(keepends=True)
    starts = [0]
    for ln in lines:
        starts.append(starts[-1] + len(ln))

    def pos(line: int, col: int) -> int:
        text = lines[line - 1] if line <= len(lines) else ""
        return starts[line - 1] + len(text.encode()[:col].decode(errors="ignore"))
    return pos


def restore_argument_order(tree: pathlib.Path, matches: list[CodeMatch], knobs: dict[str, Any]) -> list[str]:
    """Put each positional argument that the argument-order check (``feedback/argorder.py``) found in another
    parameter's place back into its own: ``kernel[grid](k, q, ...)`` against ``def kernel(q, k, ...)`` becomes
    ``kernel[grid](q, k, ...)``.  Calls in the matched files only, judged against the definitions of the
    whole tree (its virtual environments left out); a declaration that every call disagrees with the same
    way is left alone (the declaration, not the calls, is then what changed: a person decides).

    Only the matched files are kept whole; of every other file the check's digest (its definitions and
    calls) is kept, read from the harness's digest store where it has one (knob ``digest_store``, the folder
    the runner's check keeps them in: a file unchanged since the check ran is not parsed again).  unsloth's
    1 800 files: 52 s and 1.5 GB with every tree kept, before."""
    from feedback.argorder import call_faults, call_site, digest, restored_args
    from feedback.checks import DigestStore, python_files

    files = _files(matches)
    store = DigestStore(pathlib.Path(knobs["digest_store"])) if knobs.get("digest_store") else None
    sources: dict[str, str] = {}
    trees: dict[str, ast.Module] = {}
    digests: list = []
    for path in python_files(tree, None):  # every definition a matched call may reach, as the check's default
        rel = path.relative_to(tree.resolve()).as_posix()
        try:
            src = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        if rel not in files and store is not None and (kept := store.get("argument_order", rel, src)) is not None:
            digests.append(kept)
            continue
        try:
            mod = parse(src, rel)
        except (SyntaxError, ValueError, RecursionError):
            continue  # a file that does not parse has no calls to judge
        digests.append(digest(mod, rel))
        if rel in files:
            trees[rel], sources[rel] = mod, src
        elif store is not None:
            store.put("argument_order", rel, src, digests[-1])
    faults: dict[str, list] = {}
    tolerated = _tolerated(knobs)
    for found in call_faults(digests):
        # a call the manifest tolerates (a starter lists the tree's own calls that trade names on purpose) stays
        if found.file in files and not tolerated.take(call_site(found)):
            faults.setdefault(found.file, []).append(found)
    changed = []
    for rel, found_here in sorted(faults.items()):
        src, pos = sources[rel], _position(sources[rel])
        edits: list[tuple[int, int, str]] = []
        done: set[int] = set()  # calls already put in order: two alike on one line are two findings
        for found in found_here:
            for node in ast.walk(trees[rel]):
                if not (isinstance(node, ast.Call) and node.lineno == found.line) or id(node) in done:
                    continue
                moves = restored_args(node, found)
                if moves is None:
                    continue
                done.add(id(node))
                call = [(pos(node.args[own].lineno, node.args[own].col_offset),
                         pos(node.args[own].end_lineno, node.args[own].end_col_offset),
                         ast.get_source_segment(src, node.args[at])) for at, own in moves.items()]
                # a call's arguments move together or not at all: one nested in another's moved argument waits
                # for the next application
                if not any(a < d and c < b for a, b, _ in call for c, d, _ in edits):
                    edits += call
                break
        if edits:
            for a, b, text in sorted(set(edits), reverse=True):
                src = src[:a] + text + src[b:]
            (tree / rel).write_text(src)
            changed.append(rel)
    return changed


def _tl_call(node: ast.expr, name: str, aliases: dict[str, str], src: str) -> tuple[ast.Call, str] | None:
    """``node`` as a one-argument call of ``triton.language.<name>`` however the module spells it, with the
    prefix that names the language there (``tl.``, ``T.``, ``triton.language.``); None otherwise, or where the
    function was imported bare and the module has no name for the language to write another with."""
    from feedback.checks import language_name, resolved_name

    if not (isinstance(node, ast.Call) and len(node.args) == 1 and resolved_name(node.func, aliases) == f"tl.{name}"):
        return None
    if isinstance(node.func, ast.Attribute):
        return node, ast.get_source_segment(src, node.func.value) + "."
    lang = language_name(aliases)
    return (node, f"{lang}.") if lang else None


def _negated(arg: ast.expr, src: str) -> str:
    if isinstance(arg, ast.UnaryOp) and isinstance(arg.op, ast.USub):
        return ast.get_source_segment(src, arg.operand)
    text = ast.get_source_segment(src, arg)
    return f"-{text}" if isinstance(arg, (ast.Name, ast.Attribute, ast.Call, ast.Subscript)) else f"-({text})"


def rsqrt_multiply(tree: pathlib.Path, matches: list[CodeMatch], knobs: dict[str, Any]) -> list[str]:
    """Divisions by a special function become multiplies: ``x / tl.sqrt(y)`` -> ``x * tl.rsqrt(y)`` and
    ``x / tl.exp(y)`` -> ``x * tl.exp(-y)`` (a subscript or call on the divisor, ``tl.exp(y)[:, None]``,
    is kept); ``1 / tl.sqrt(y)`` is ``tl.rsqrt(y)``.  A full-precision division costs many
    instructions; the multiply one.  The language is named as the module names it (``T.sqrt`` after
    ``import triton.language as T``)."""
    from feedback.checks import import_aliases

    changed = []
    for rel in _files(matches):
        path = tree / rel
        src = path.read_text()
        pos, mod = _position(src), parse(src, rel)
        aliases = import_aliases(mod)
        edits: list[tuple[int, int, str]] = []  # (start, end, replacement) of the operator and divisor
        for node in ast.walk(mod):
            if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)):
                continue
            divisor, suffix = node.right, ""
            if isinstance(divisor, ast.Subscript):  # tl.exp(y)[:, None]
                suffix = src[pos(divisor.value.end_lineno, divisor.value.end_col_offset):
                             pos(divisor.end_lineno, divisor.end_col_offset)]
                divisor = divisor.value
            if (found := _tl_call(divisor, "sqrt", aliases, src)) is not None:
                call, tl = found
                repl = f"* {tl}rsqrt({ast.get_source_segment(src, call.args[0])}){suffix}"
            elif (found := _tl_call(divisor, "exp", aliases, src)) is not None:
                call, tl = found
                repl = f"* {tl}exp({_negated(call.args[0], src)}){suffix}"
            else:
                continue
            # from the operator itself (a parenthesised left operand ends after its own parenthesis)
            start = src.index("/", pos(node.left.end_lineno, node.left.end_col_offset),
                              pos(node.right.lineno, node.right.col_offset))
            if isinstance(node.left, ast.Constant) and node.left.value == 1:  # 1 / tl.sqrt(y): tl.rsqrt(y)
                start, repl = pos(node.left.lineno, node.left.col_offset), repl[2:]
            edits.append((start, pos(node.right.end_lineno, node.right.end_col_offset), repl))
        if edits:
            bound = len(src)
            for a, b, text in sorted(set(edits), reverse=True):
                if b <= bound:  # a division nested in another's divisor waits for the next application
                    src, bound = src[:a] + text + src[b:], a
            path.write_text(src)
            changed.append(rel)
    return changed


_TILE_HELPER = '''

def {name}(dim: int, start: int, other_programs: int, widest: int = {widest}, per_sm: int = {per_sm}) -> int:
    """The widest power-of-two tile of ``dim``, up to ``widest``, that still gives every SM of this GPU
    at least ``per_sm`` programs; ``start`` where even halving down to it does not (a small batch is
    latency-bound and wants the programs).  Without a GPU (the interpreter) the widest: the same
    per-head work done the fewest times.  Written by the fuse-v-tiles playbook."""
    import os

    import torch
    import triton

    tile = max(start, min(widest, triton.next_power_of_2(dim)))
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return tile
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    while tile > start and other_programs * triton.cdiv(dim, tile) < per_sm * sms:
        tile //= 2
    return max(tile, start)
'''


def _is_jit(fn: ast.FunctionDef) -> bool:
    return any((isinstance(d, ast.Attribute) and d.attr == "jit") or (isinstance(d, ast.Name) and d.id == "jit")
               or (isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr == "jit")
               for d in fn.decorator_list)


def _program_tiles(kernel: ast.FunctionDef) -> list[tuple[int, str]]:
    """(grid axis, tile constexpr) pairs of ``kernel``: an index derived from ``tl.program_id(AXIS)``, directly
    (``i_v = tl.program_id(0)``) or through arithmetic on a flattened grid (``i_v = (pid // NK) % NV``),
    scaling a constexpr parameter (``i_v * BV``)."""
    params = {a.arg for a in kernel.args.args}
    axis_of: dict[str, int] = {}
    assigns = [n for n in ast.walk(kernel) if isinstance(n, ast.Assign)]
    for node in assigns:
        value = node.value
        while (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "to"
               and isinstance(value.func.value, ast.Call)):
            value = value.func.value  # tl.program_id(0).to(tl.int64)
        if (len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) and isinstance(value, ast.Call)
                and isinstance(value.func, ast.Attribute) and value.func.attr == "program_id" and value.args
                and isinstance(value.args[0], ast.Constant)):
            axis_of[node.targets[0].id] = int(value.args[0].value)
    grown = True
    while grown:  # indices computed from a program id carry its axis (i_nh = pid // NV; i_n, i_h = i_nh // H, ...)
        grown = False
        for node in assigns:
            axes = {axis_of[n.id] for n in ast.walk(node.value) if isinstance(n, ast.Name) and n.id in axis_of}
            if len(axes) != 1:
                continue
            (axis,) = axes
            for target in node.targets:
                for name in (target.elts if isinstance(target, ast.Tuple) else [target]):
                    if isinstance(name, ast.Name) and name.id not in axis_of:
                        axis_of[name.id] = axis
                        grown = True
    tiles: list[tuple[int, str]] = []
    for node in ast.walk(kernel):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            for idx, tile in ((node.left, node.right), (node.right, node.left)):
                if (isinstance(idx, ast.Name) and idx.id in axis_of and isinstance(tile, ast.Name)
                        and tile.id in params and (axis_of[idx.id], tile.id) not in tiles):
                    tiles.append((axis_of[idx.id], tile.id))
    return tiles


def _factors(e: ast.expr) -> list[ast.expr]:
    """The factors of a product (``a * b * c``), ``[e]`` for anything else."""
    if isinstance(e, ast.BinOp) and isinstance(e.op, ast.Mult):
        return _factors(e.left) + _factors(e.right)
    return [e]


def _grid_with(tile: str, axis: int, fn: ast.FunctionDef) -> tuple[ast.expr, list[ast.expr]] | None:
    """In host function ``fn``: a grid tuple whose ``axis`` entry is ``cdiv(DIM, tile)``, or a flattened grid's
    product of it with other counts (``cdiv(V, BV) * N * H``): (DIM, the other counts and entries)."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Tuple) and len(node.elts) > axis:
            factors = _factors(node.elts[axis])
            for i, e in enumerate(factors):
                if (isinstance(e, ast.Call) and getattr(e.func, "attr", getattr(e.func, "id", None)) == "cdiv"
                        and len(e.args) == 2 and isinstance(e.args[1], ast.Name) and e.args[1].id == tile):
                    return e.args[0], ([f for j, f in enumerate(factors) if j != i]
                                       + [x for j, x in enumerate(node.elts) if j != axis])
    return None


def widen_program_tiles(tree: pathlib.Path, matches: list[CodeMatch], knobs: dict[str, Any]) -> list[str]:
    """Fewer, wider programs along a tiled grid axis, chosen per launch.

    For each Triton kernel in a matched file whose program id along an axis scales a tile constexpr
    (``i_v * BV``), the host function that launches it over ``cdiv(DIM, BV)`` programs on that axis
    gets, after its last assignment of the tile, ``BV = widest_tile(DIM, BV, <the grid's other
    entries>)``: the widest tile up to the ``widest`` knob that still leaves ``per_sm`` programs per
    SM, the original where none does.  Every program along that axis repeats the per-row work
    (loads and normalisation of inputs shared by the row), so a wider tile does it fewer times.
    """
    widest, per_sm = int(knobs.get("widest", 64)), int(knobs.get("per_sm", 2))
    helper = str(knobs.get("helper", "_widest_tile"))
    changed = []
    for rel in _files(matches):
        path = tree / rel
        src = path.read_text()
        mod = parse(src, rel)
        if any(isinstance(n, ast.FunctionDef) and n.name == helper for n in mod.body):
            continue  # already widened: never touch a file twice
        kernels = [n for n in mod.body if isinstance(n, ast.FunctionDef) and _is_jit(n)]
        hosts = [n for n in mod.body if isinstance(n, ast.FunctionDef) and not _is_jit(n)]
        lines = src.splitlines(keepends=True)
        inserts: list[tuple[int, str]] = []  # (after line number, text)
        for kernel in kernels:
            for axis, tile in _program_tiles(kernel):
                for fn in hosts:
                    found = _grid_with(tile, axis, fn)
                    if found is None:
                        continue
                    dim, others = found
                    assigns = [n for n in ast.walk(fn) if isinstance(n, ast.Assign) and len(n.targets) == 1
                               and isinstance(n.targets[0], ast.Name) and n.targets[0].id == tile]
                    if not assigns:
                        continue
                    last = max(assigns, key=lambda n: n.end_lineno)
                    indent = lines[last.lineno - 1][:last.col_offset]
                    other = " * ".join(ast.unparse(x) if isinstance(x, (ast.Name, ast.Constant, ast.Attribute))
                                        else f"({ast.unparse(x)})" for x in others) or "1"
                    inserts.append((last.end_lineno, f"{indent}{tile} = {helper}({ast.unparse(dim)}, {tile}, "
                                                     f"{other})\n"))
        if not inserts:
            continue
        for after, text in sorted(set(inserts), reverse=True):
            lines.insert(after, text)
        first_host = min(fn.lineno - len(fn.decorator_list) for fn in hosts)
        at = first_host - 1
        while at > 0 and lines[at - 1].strip() == "":
            at -= 1
        lines.insert(at, _TILE_HELPER.format(name=helper, widest=widest, per_sm=per_sm).rstrip("\n") + "\n")
        path.write_text("".join(lines))
        changed.append(rel)
    return changed
