"""Positional arguments in another parameter's place: calls checked against the definitions they reach.

``Prefilled(rid, first, timing)`` against a record that declares ``first`` before ``rid`` runs, type-checks
when both are ints, and files every result under the wrong key; a Triton launch ``kernel[grid](k, q, ...)``
against ``def kernel(q, k, ...)`` computes the transpose of the intended product.  Neither fails where it
happens.  The evidence is in the names: arguments named (``rid``, ``msg.rid``, ``self._rid``) after parameters
of the callee that trade places with each other, each in the place of another's namesake.

Definitions are indexed across every module checked, by their last name: functions, methods (``self`` and
``cls`` dropped; ``@staticmethod`` keeps its first parameter), classes through their ``__init__``, and
dataclasses and ``NamedTuple`` records through their fields in order (a dataclass base's fields first; a
base that is not indexed makes the class unknown, so it is skipped).  A call is judged against every
definition of its name, and flagged only if it is misplaced against each of them.

Where a finding points: the call and the definition disagree, and either may be what changed.  If every
call of a definition that passes names disagrees with it the same way (at least two of them), the
declaration is the odd one out and the finding is at the definition, naming the calls; if some calls
agree, each disagreeing call is a finding of its own; one call alone names both places.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from feedback.checks import Site


@dataclass(frozen=True)
class Signature:
    """The positional parameters of a callable as its source declares them."""

    name: str
    file: str
    line: int
    params: tuple[str, ...]


@dataclass(frozen=True)
class Misplaced:
    """One call's arguments found in other parameters' places (``(argument, place, its own place)``)."""

    file: str
    line: int
    caller: str | None
    callee: Signature
    moves: tuple[tuple[str, int, int], ...]  # by the names as compared (:func:`_bare`)
    written: tuple[str, ...] = ()  # the moved arguments as the call writes them, in the order of ``moves``
    at_line: int = 0  # the line of the first moved argument (a launch written one argument a line): 0, the call's

    @property
    def where(self) -> int:
        return self.at_line or self.line

    def describe(self) -> str:
        p, written = self.callee.params, self.written or tuple(arg for arg, _, _ in self.moves)
        return ", ".join(f"`{arg}` as parameter {at + 1} ({p[at]}; `{arg}` is parameter {own + 1})"
                         for arg, (_, at, own) in zip(written, self.moves, strict=True))


def _last(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Call):
        return _last(node.func)
    return ""


def _bare(name: str) -> str:
    """A name as the check compares it: without leading underscores, case or a pointer suffix, so that a
    launch's ``q`` is the kernel's ``Q`` or ``q_ptr`` (Triton's conventions for a tensor's pointer)."""
    bare = name.lstrip("_").lower()
    for suffix in ("_pointer", "_ptr"):
        if bare.endswith(suffix) and len(bare) > len(suffix):
            return bare[: -len(suffix)]
    return bare


def _function_params(fn: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> tuple[str, ...] | None:
    """Positional parameter names; ``None`` where they are not what a call fills (``*args`` first, say)."""
    names = [a.arg for a in [*fn.args.posonlyargs, *fn.args.args]]
    decorators = {_last(d) for d in fn.decorator_list}
    if method and "staticmethod" not in decorators:
        if not names:
            return None
        names = names[1:]
    return tuple(names)


def _is_classvar(annotation: ast.AST) -> bool:
    """``ClassVar[...]``: not a field.  (An ``InitVar`` is: ``__init__`` takes it in its place.)"""
    return _last(annotation.value if isinstance(annotation, ast.Subscript) else annotation) == "ClassVar"


def _field_init_false(value: ast.AST | None) -> bool:
    return (isinstance(value, ast.Call) and _last(value.func) == "field"
            and any(k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False
                    for k in value.keywords))


def _kw_only(decorators: list[ast.expr]) -> bool:
    return any(isinstance(d, ast.Call) and any(k.arg == "kw_only" and isinstance(k.value, ast.Constant)
                                                and k.value.value is True for k in d.keywords)
               for d in decorators)


def _own_fields(cls: ast.ClassDef) -> tuple[str, ...]:
    fields = []
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            if _last(stmt.annotation) == "KW_ONLY":
                break  # the fields after `_: KW_ONLY` are keyword-only
            if not _is_classvar(stmt.annotation) and not _field_init_false(stmt.value):
                fields.append(stmt.target.id)
    return tuple(fields)


@dataclass
class Digest:
    """What the check keeps of one module, so that a large tree is never held whole: its definitions, the
    dataclasses whose fields may come from a base (resolved across modules), the calls that pass at least
    two names positionally (with the function around each), and its imports."""

    rel: str
    definitions: list[Signature]
    records: list[ast.ClassDef]
    calls: list[tuple[ast.Call, str | None]]
    imports: list[ast.Import | ast.ImportFrom]


def digest(tree: ast.Module, rel: str) -> Digest:
    """One walk of a module (``rel``: its path in the tree)."""
    out = Digest(rel, [], [], [], [])
    classes: list[ast.ClassDef] = []
    stack: list[tuple[ast.AST, str | None]] = [(tree, None)]
    while stack:
        node, fn = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            fn = node.name
        elif isinstance(node, ast.ClassDef):
            classes.append(node)
        elif isinstance(node, ast.Call):
            if sum(_arg_name(a) is not None for a in node.args) >= 2:  # fewer cannot say which order it believes
                out.calls.append((node, fn))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.imports.append(node)
        stack.extend((child, fn) for child in ast.iter_child_nodes(node))
    out.calls.sort(key=lambda c: (c[0].lineno, c[0].col_offset))

    def add_functions(body: list[ast.stmt], method: bool) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                params = _function_params(node, method)
                if params is not None and node.name != "__init__":
                    out.definitions.append(Signature(node.name, rel, node.lineno, params))

    add_functions(tree.body, method=False)
    for cls in classes:
        add_functions(cls.body, method=True)
        init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
        decorators = {_last(d) for d in cls.decorator_list}
        if init is not None:
            params = _function_params(init, method=True)
            if params is not None:
                out.definitions.append(Signature(cls.name, rel, cls.lineno, params))
        elif "dataclass" in decorators and not _kw_only(cls.decorator_list):
            out.records.append(cls)
        elif any(_last(b) == "NamedTuple" for b in cls.bases):
            out.definitions.append(Signature(cls.name, rel, cls.lineno, _own_fields(cls)))
    return out


def _digests(modules: Iterable[tuple[ast.Module, str] | Digest]) -> list[Digest]:
    return [m if isinstance(m, Digest) else digest(*m) for m in modules]


def signatures(digests: list[Digest]) -> dict[str, list[Signature]]:
    """Every definition of the modules, by its last name."""
    index: dict[str, list[Signature]] = defaultdict(list)
    records: dict[str, list[tuple[ast.ClassDef, str]]] = defaultdict(list)  # dataclass name -> (class, file)
    for d in digests:
        for sig in d.definitions:
            index[sig.name].append(sig)
        for cls in d.records:
            records[cls.name].append((cls, d.rel))

    def fields(cls: ast.ClassDef, seen: frozenset[str]) -> tuple[str, ...] | None:
        inherited: tuple[str, ...] = ()
        for base in cls.bases:
            name = _last(base)
            found = records.get(name, [])
            if name in seen or len(found) != 1:
                return None  # a base we cannot read (or read two ways): the order is unknown
            more = fields(found[0][0], seen | {name})
            if more is None:
                return None
            inherited += tuple(f for f in more if f not in inherited)
        own = _own_fields(cls)
        return tuple(f for f in inherited if f not in own) + own

    for name, found in records.items():
        for cls, rel in found:
            params = fields(cls, frozenset({name}))
            if params is not None:
                index[name].append(Signature(name, rel, cls.lineno, params))
    return index


def _arg_name(node: ast.AST) -> str | None:
    if isinstance(node, (ast.Name, ast.Attribute)):
        return _bare(_last(node))
    return None


def _moves(args: list[ast.expr], sig: Signature) -> tuple[tuple[str, int, int], ...]:
    """The arguments named after another parameter, kept only where they trade places among themselves
    (``(k, q)`` for ``(q, k)``; a cycle of three): ``(A_in, A)`` for ``(A, A2)`` is a coincidence of names
    (``A`` is not displaced by another parameter's namesake), ``(x, x)`` for ``(x, y)`` passes one value twice."""
    params = [_bare(p) for p in sig.params]
    place = {p: i for i, p in enumerate(params) if params.count(p) == 1}  # two alike (x and X_ptr): neither
    to: dict[int, tuple[str, int]] = {}
    for at, arg in enumerate(args[:len(params)]):
        if isinstance(arg, ast.Starred):
            break  # positions after a *spread are unknown
        name = _arg_name(arg)
        if name and name != params[at] and name in place and place[name] != at:
            to[at] = (name, place[name])
    moves = []
    for start, (name, own) in to.items():
        seen, at = {start}, own
        while at in to and at not in seen:
            seen.add(at)
            at = to[at][1]
        if at == start:
            moves.append((name, start, own))
    return tuple(moves)


def _names_passed(args: list[ast.expr], sig: Signature) -> bool:
    """Whether a call passes at least two of the callee's parameter names positionally: enough to say which
    order it believes in."""
    params = {_bare(p) for p in sig.params}
    return sum(_arg_name(a) in params for a in args) >= 2


def _dotted(rel: str) -> str:
    parts = rel.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _foreign(imports: list[ast.Import | ast.ImportFrom], ours: set[str]) -> set[str]:
    """The names a module binds to other code than the modules checked (``torch``, ``tl``, ``randint`` of
    ``from torch import randint``): a call through them never reaches an indexed definition."""
    def mine(module: str) -> bool:
        return any(m == module or m.startswith(module + ".") for m in ours)

    out: set[str] = set()
    for node in imports:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not mine(alias.name):
                    out.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and not node.level and not mine(node.module or ""):
            out.update(alias.asname or alias.name for alias in node.names)
    return out


Found = tuple[Misplaced | None, Signature, str, int]


def _imported_from(imports: list[ast.Import | ast.ImportFrom], rel: str) -> dict[str, str]:
    """The names a module binds with ``from X import name`` -> the module X they come from (relative imports
    resolved against the module's own path)."""
    here = _dotted(rel).split(".")
    package = here if rel.endswith("__init__.py") else here[:-1]
    out: dict[str, str] = {}
    for node in imports:
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            if node.level - 1 > len(package):
                continue
            base = package[:len(package) - (node.level - 1)]
            module = ".".join([*base, node.module] if node.module else base)
        else:
            module = node.module or ""
        for alias in node.names:
            out[alias.asname or alias.name] = module
    return out


def _within(candidates: list[Signature], module: str) -> list[Signature]:
    """The definitions in ``module`` or a module under it (a path under a source root read as its import)."""
    dotted = "." + module
    return [s for s in candidates if ("." + _dotted(s.file)).endswith(dotted) or dotted + "." in "." + _dotted(s.file)]


def _nearest(candidates: list[Signature], rel: str, origin: str | None) -> list[Signature]:
    """Of the definitions a call's name may mean, the one it means where that is known: the calling module's
    own, else the one in the module the name was imported from.  Triton repositories define `_fwd_kernel` in
    many files; another file's `_fwd_kernel`, which the call never reaches, had vetoed a swap at FlagAttention's
    launch of its own."""
    if len(candidates) < 2:
        return candidates
    if local := [s for s in candidates if s.file == rel]:
        return local
    if origin and (found := _within(candidates, origin)):
        return found
    return candidates


def misplaced(modules: Iterable[tuple[ast.Module, str] | Digest]) -> Iterator[Found]:
    """(finding or ``None`` for a call that agrees, the definition, call file, call line) for every call that
    passes names of its callee's parameters positionally (``modules``: (tree, path) pairs, or their digests)."""
    digests = _digests(modules)
    index = signatures(digests)
    # a module's name as its file's path spells it and as an import under a source root does (`src/flag_attn/x.py`
    # is imported as `flag_attn.x`: a kernel imported from it is ours, not a third party's)
    ours = {".".join(parts[i:]) for d in digests if (parts := _dotted(d.rel).split(".")) for i in range(len(parts))}
    for d in digests:
        rel = d.rel
        foreign = _foreign(d.imports, ours)
        origins = _imported_from(d.imports, rel)
        for node, caller in d.calls:
            func = node.func.value if isinstance(node.func, ast.Subscript) else node.func  # kernel[grid](...)
            while isinstance(node.func, ast.Subscript) and isinstance(func, ast.Call) and func.args:
                func = func.args[0]  # wrap_triton(kernel)[grid](...): torch.library's launch of `kernel`
            root = func
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in foreign:
                continue  # torch.randint(...), tl.load(...): not ours, whatever our own names are
            candidates = [s for s in index.get(_last(func), []) if _names_passed(node.args, s)]
            if isinstance(root, ast.Name) and root is not func and root.id in origins:
                # `module.function(...)`: a definition of that module; `Class.method(...)` on an imported class: a
                # method whose class this index does not keep (Liger's `LigerCrossEntropyFunction.apply(...)` is
                # torch's Function.apply, not some other file's `apply`), so not judged
                candidates = [] if root.id[:1].isupper() else _within(candidates, origins[root.id])
            else:
                candidates = _nearest(candidates, rel, origins.get(func.id) if isinstance(func, ast.Name) else None)
            if not candidates:
                continue
            judged = [(s, _moves(node.args, s)) for s in candidates]
            if all(moves for _, moves in judged):
                sig, moves = judged[0]
                written = tuple(_last(node.args[at]) for _, at, _ in moves)
                first = min(node.args[at].lineno for _, at, _ in moves)
                yield Misplaced(rel, node.lineno, caller, sig, moves, written, first), sig, rel, node.lineno
            else:
                sig = next(s for s, moves in judged if not moves)
                yield None, sig, rel, node.lineno


def _by_definition(modules: Iterable[tuple[ast.Module, str] | Digest]
                   ) -> Iterator[tuple[Signature, list[Misplaced], int, bool]]:
    """(definition, its misplaced calls, how many calls pass it names, whether the declaration is the odd one
    out) for every definition with a misplaced call."""
    by_def: dict[Signature, list[Misplaced | None]] = defaultdict(list)
    for found, sig, _, _ in misplaced(modules):
        by_def[sig].append(found)
    for sig, calls in by_def.items():
        bad = [f for f in calls if f is not None]
        if bad:
            yield sig, bad, len(calls), len(bad) == len(calls) and len({f.moves for f in bad}) == 1 and len(bad) >= 2


def call_faults(modules: Iterable[tuple[ast.Module, str] | Digest]) -> list[Misplaced]:
    """The misplaced calls that are the call's fault: those of a definition that some calls agree with, or
    that has one naming call alone (either side may be wrong; the call is the smaller edit)."""
    return [f for _, bad, _, odd in _by_definition(modules) if not odd for f in bad]


def restored_args(call: ast.Call, found: Misplaced) -> dict[int, int] | None:
    """For ``call`` (the node of ``found``): which positional argument goes where (``{from: to}``) to put
    each in its own parameter's place; None where the node is not the call ``found`` describes."""
    if _moves(call.args, found.callee) != found.moves:
        return None
    return {at: own for _, at, own in found.moves}


def _declared(sig: Signature) -> str:
    return f"`{sig.name}` ({sig.file}:{sig.line}) declares ({', '.join(sig.params)})"


def call_site(found: Misplaced) -> Site:
    """The check's site of a misplaced call that is the call's fault (at its first moved argument)."""
    return Site(found.file, found.where, found.caller or found.callee.name,
                f"call of {_declared(found.callee)} passes {found.describe()}")


def argument_order(modules: Iterable[tuple[ast.Module, str] | Digest]) -> Iterator[Site]:
    """The built-in check: a site per call in another order than its callee (or per definition that every
    naming call disagrees with; see the module's text)."""
    for sig, bad, calls, odd in _by_definition(modules):
        declared = _declared(sig)
        if odd:
            where = ", ".join(f"{f.file}:{f.where}" for f in bad)
            yield Site(sig.file, sig.line, sig.name, f"{declared}, but all {len(bad)} calls that pass names "
                       f"pass {bad[0].describe()} ({where}): the declaration's order is the odd one out")
            continue
        for f in bad:
            yield call_site(f)
            if calls == 1:
                yield Site(sig.file, sig.line, sig.name, f"{declared}; its one call that passes names "
                           f"({f.file}:{f.where}) passes {f.describe()}")
