"""``infra-agent init``: look at a repository and write the manifest it can already be judged by.

:func:`inspect` finds the Python packages (plain and ``src/`` layouts), the files with Triton
kernels (``@triton.jit``), the pytest files and the benchmark scripts, reading source only.
:func:`starter_manifest` turns that into probes that need no Python written against the harness:

* the built-in static checks over the kernel files (``dot_precision``, ``kernel_loop_division``)
  and over the packages (``gil_native``, ``argument_order``, ``tf32_switch``); the counts a repository
  already has are held as thresholds (loop divisions, misplaced arguments, tf32 switches: nothing new);
* one ``pytest`` probe per test file that reaches a module with kernels, covering the kernel files it reaches
  (:class:`_Reach`), up to ``max_tests``: the kernels' own tests first (they import a kernel module
  themselves), then tests of modules that import kernels; other test files are listed, commented out;
* benchmark scripts listed as comments: a ``command`` probe needs one JSON object on its last line;
* the tests, conftest files, reference-looking modules and the manifest protected.

The result is validated with the manifest schema before it is written; the user edits it from there.
"""

from __future__ import annotations

import ast
import pathlib
import re
from dataclasses import dataclass, field

import yaml

from feedback.checks import parse
from feedback.manifest import MANIFEST_NAME, parse_manifest, path_matches
from feedback.needs import importable
from feedback.state import ENV_PARTS, SKIP_PARTS

_SKIP = SKIP_PARTS | ENV_PARTS | {"build", "dist", ".eggs"}
_REFERENCE = re.compile(r"(^|_)(ref|reference|naive|torch_ref)(_|\.py$)")


@dataclass
class Inventory:
    root: pathlib.Path
    import_root: str = "."  # ".", "src", or the folder the packaging names (SGLang's "python")
    packages: list[str] = field(default_factory=list)  # top-level package folders, relative to root
    kernel_files: list[str] = field(default_factory=list)
    kernels: dict[str, list[str]] = field(default_factory=dict)  # file -> kernel names
    test_files: list[str] = field(default_factory=list)
    kernel_tests: dict[str, list[str]] = field(default_factory=dict)  # test file -> kernel files it reaches
    direct_tests: dict[str, list[str]] = field(default_factory=dict)  # test file -> kernel files it imports itself
    test_needs: dict[str, list[str]] = field(default_factory=dict)  # test file -> packages it imports, absent here
    conftest_needs: dict[str, list[str]] = field(default_factory=dict)  # conftest.py -> absent packages it imports
    # test files that reach kernels and assert nothing: timing loops named test_* (FlagGems' benchmark/*_perf.py),
    # which pass whatever the kernel computes; never chosen as a correctness probe
    assert_nothing: list[str] = field(default_factory=list)
    bench_files: list[str] = field(default_factory=list)
    references: list[str] = field(default_factory=list)


def _files(root: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in root.rglob("*.py") if _SKIP.isdisjoint(p.relative_to(root).parts[:-1]))


def _read(path: pathlib.Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _parse(source: str, name: str) -> ast.Module | None:
    try:
        return parse(source, name)
    except (SyntaxError, ValueError, RecursionError):
        return None


def _kernel_names(tree: ast.Module) -> list[str]:
    from feedback.checks import kernels

    return [fn.name for fn in kernels(tree)]


def _imports(tree: ast.Module) -> set[str]:
    """The dotted names a test imports: ``from a.b import c`` names ``a.b`` and ``a.b.c``; ``import a`` names
    what the file uses of it (``a.paged_attention(...)``: ``a.paged_attention``, as ``from a import
    paged_attention`` would), or ``a`` itself where it uses nothing by attribute."""
    mods: set[str] = set()
    bound: dict[str, str] = {}  # the name `import a.b as x` / `import a` binds -> the module it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                mods.add(a.name)
                bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            mods.add(node.module)
            mods.update(f"{node.module}.{a.name}" for a in node.names)
    if bound:
        used: dict[str, set[str]] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
                used.setdefault(bound[node.value.id], set()).add(f"{bound[node.value.id]}.{node.attr}")
        for module, names in used.items():
            mods.discard(module)
            mods |= names
    return mods


_FROM = re.compile(r"^[ \t]*from[ \t]+(\.*)([\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[^\n#;]*)", re.M)
_IMPORT = re.compile(r"^[ \t]*import[ \t]+([\w. \t,]+)", re.M)


def _source_imports(source: str, module: str, is_package: bool, renamed: dict[str, str] | None = None) -> set[str]:
    """The dotted names ``source`` imports (``from a.b import c`` names ``a.b`` and ``a.b.c``; relative imports
    resolved against ``module``), read with two regular expressions: no file is parsed for its imports.
    ``renamed`` is filled with the names it binds under another name (``from .flash import attention as
    flash_attention``: ``flash_attention`` -> ``pkg.flash.attention``)."""
    out: set[str] = set()
    if "import" not in source:
        return out
    for m in _IMPORT.finditer(source):
        out.update(part.split()[0] for part in m.group(1).split(",") if part.split())
    base = module.split(".") if is_package else module.split(".")[:-1]
    for m in _FROM.finditer(source):
        dots, name = len(m.group(1)), m.group(2)
        if dots:
            if dots - 1 > len(base):
                continue
            parent = base[:len(base) - (dots - 1)]
            name = ".".join([*parent, name] if name else parent)
        if not name:
            continue
        out.add(name)
        for item in m.group(3).strip("()").split(","):
            if (word := item.split()[0] if item.split() else "") and word.isidentifier():
                out.add(f"{name}.{word}")
                parts = item.split()
                if renamed is not None and len(parts) == 3 and parts[1] == "as" and parts[2].isidentifier():
                    renamed[parts[2]] = f"{name}.{word}"
    return out


def _module(rel: str, import_root: str) -> str:
    p = pathlib.PurePosixPath(rel)
    if import_root != ".":
        p = p.relative_to(import_root)
    parts = list(p.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package_dirs(folder: pathlib.Path, namespace: bool = False) -> list[pathlib.Path]:
    """The Python packages ``folder`` holds directly: folders with an ``__init__.py`` or, with ``namespace``
    (a folder the packaging names as the packages' root), any folder with a Python file in it (PEP 420)."""
    try:
        dirs = [d for d in folder.iterdir() if d.is_dir() and not d.name.startswith(".")
                and d.name not in ("tests", "test") and d.name not in _SKIP]
    except OSError:
        return []
    return sorted(d for d in dirs if (d / "__init__.py").is_file() or (namespace and any(d.glob("*.py"))))


def _declared_root(root: pathlib.Path) -> str | None:
    """The folder the packaging metadata names as the packages' root (``package-dir = {"" = "python"}`` or
    ``packages.find.where`` in pyproject.toml, ``package_dir={"": "python"}`` in setup.py), if any."""
    try:
        import tomllib

        tool = tomllib.loads((root / "pyproject.toml").read_text()).get("tool", {}).get("setuptools", {})
        named = [(tool.get("package-dir") or {}).get(""), *((tool.get("packages") or {}).get("find", {})
                                                           .get("where", []) if isinstance(tool.get("packages"), dict)
                                                           else [])]
    except (OSError, ValueError, ImportError, AttributeError):
        named = []
    try:
        setup = (root / "setup.py").read_text(errors="replace")
        named += re.findall(r"package_dir\s*=\s*\{\s*[\"']{2}\s*:\s*[\"']([^\"']+)[\"']", setup)
    except OSError:
        pass
    for folder in named:
        if isinstance(folder, str) and folder.strip("./") and _package_dirs(root / folder, namespace=True):
            return folder.strip("/").removeprefix("./")
    return None


def _import_root(root: pathlib.Path) -> tuple[str, bool]:
    """Where the repository's packages are imported from, and whether its packaging says so (where namespace
    packages count too): what the packaging declares, else ``src`` (the src layout), else the root itself,
    else the one folder that holds the most packages (SGLang keeps its package in ``python/``)."""
    if declared := _declared_root(root):
        return declared, True
    if _package_dirs(root / "src"):
        return "src", False
    if _package_dirs(root):
        return ".", False
    folders = [d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")
               and d.name not in _SKIP and not (d / "__init__.py").is_file()]
    counts = sorted(((len(_package_dirs(d)), d.name) for d in folders), key=lambda c: (-c[0], c[1]))
    return (counts[0][1] if counts and counts[0][0] else "."), False


# what a test that judges something does: an assert statement or an assert-like helper (assert_close,
# gems_assert_close, assertEqual), a comparison helper, an expected exception
_ASSERTS = re.compile(r"assert|allclose|isclose|\braises\b|\btesting\.|\bcheck_\w+\(|\bcompare\w*\(")


def _is_test(rel: str) -> bool:
    p = pathlib.PurePosixPath(rel)
    return p.name.startswith("test_") or p.stem.endswith("_test")


def inspect(root: str | pathlib.Path) -> Inventory:
    """What the repository at ``root`` holds that probes can use (source only; nothing is imported).

    A file is parsed only where its text can hold what is looked for (a kernel's decorator in the packages,
    a kernel module's name in a test), so a tree of large generated or vendored files is read once, not
    compiled: unsloth's 1 800 files (60 MB, 1 100 of them tests) took 85 s and 1.4 GB for `init` when every
    file was parsed here and each module was kept whole by the argument-order count, 32 s and 164 MB now."""
    from feedback.checks import NEEDLES

    root = pathlib.Path(root).resolve()
    inv = Inventory(root=root)
    inv.import_root, declared = _import_root(root)
    inv.packages = [d.relative_to(root).as_posix() for d in _package_dirs(root / inv.import_root, declared)]
    graph: dict[str, set[str]] = {}  # package module -> the names it imports
    renames: dict[str, dict[str, str]] = {}  # package module -> a name it binds by `import x as y` -> x's full name
    for path in _files(root):
        rel = path.relative_to(root).as_posix()
        if _is_test(rel):
            inv.test_files.append(rel)
        elif path.name == "conftest.py" and (needs := _unconditional_needs(root, inv.import_root, path)):
            inv.conftest_needs[rel] = needs
        elif any(rel.startswith(p + "/") for p in inv.packages):
            source = _read(path)
            name = _module(rel, inv.import_root)
            graph[name] = _source_imports(source, name, path.name == "__init__.py", renames.setdefault(name, {}))
            if any(n in source for n in NEEDLES["kernel_loop_division"]) and (tree := _parse(source, rel)) \
                    and (names := _kernel_names(tree)):
                inv.kernel_files.append(rel)
                inv.kernels[rel] = names
        if re.search(r"(^|/)(bench|benchmarks?)(/|_|\.py$)", rel) and not _is_test(rel) \
                and path.name not in ("__init__.py", "conftest.py") \
                and (not any(rel.startswith(p + "/") for p in inv.packages) or "__main__" in _read(path)):
            # a package's marker runs nothing, and a package's module without a main (flash_attn/utils/benchmark.py:
            # timing helpers) is a library, not a script to run
            inv.bench_files.append(rel)
        if _REFERENCE.search(pathlib.PurePosixPath(rel).name) and not _is_test(rel):
            inv.references.append(rel)
    modules = {_module(f, inv.import_root): f for f in inv.kernel_files}
    broad = max(4, len(modules) // 4)  # `import pkg` names every kernel: it says nothing about what is tested
    reach = _Reach(graph, modules, broad, renames)
    # an import of a module that reaches a kernel module, or of its package, spells the last part of that name
    words = {part.rpartition(".")[2] for mod in reach.relevant() for part in (mod, mod.rpartition(".")[0]) if part}
    for test in inv.test_files if words else []:
        source = _read(root / test)
        if not any(w in source for w in words) or (tree := _parse(source, test)) is None:
            continue
        hit: set[str] = set()
        direct: set[str] = set()
        imported = _imports(tree)
        for m in imported:
            hit |= reach.files(m)
            direct |= reach.files(m, hops=0)
        if hit and not _ASSERTS.search(source):
            inv.assert_nothing.append(test)
        if hit:
            inv.kernel_tests[test] = sorted(hit)
            roots = [root / inv.import_root, root]
            inv.test_needs[test] = sorted({top for m in imported if (top := m.split(".")[0])
                                           and not importable(top, roots)})
        if direct:
            inv.direct_tests[test] = sorted(direct)
    inv.references = _used_references(inv)
    return inv


def _unconditional_needs(root: pathlib.Path, import_root: str, path: pathlib.Path, hops: int = 3) -> list[str]:
    """The packages a ``conftest.py`` imports at its top level (not under ``try`` or ``if``), itself or through the
    tree's modules it so imports (up to ``hops`` away), that this machine cannot import: pytest stops before
    collecting any test under it (Liger-Kernel's `test/conftest.py` imports `test.utils`, which imports
    `transformers`), so every probe of those tests is skipped here until they are installed."""
    # pytest's default import mode puts the first folder up from the conftest that is no package on the path
    top_folder = path.parent
    while (top_folder / "__init__.py").is_file() and top_folder != root:
        top_folder = top_folder.parent
    roots = list(dict.fromkeys([root / import_root, root, top_folder]))
    missing: set[str] = set()
    seen, frontier = {path}, [path]
    for _ in range(hops + 1):
        nxt = []
        for file in frontier:
            tree = _parse(_read(file), str(file))
            if tree is None:
                continue
            names = {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names} | {
                n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.module and not n.level}
            for name in names:
                top = name.split(".")[0]
                own = next((f for r in roots for f in (r.joinpath(*name.split(".")).with_suffix(".py"),
                                                       r.joinpath(*name.split("."), "__init__.py")) if f.is_file()),
                           None)
                if own is not None:
                    if own not in seen:
                        seen.add(own)
                        nxt.append(own)
                elif not importable(top, roots):
                    missing.add(top)
        frontier = nxt
    return sorted(missing)


def _test_helpers(inv: Inventory, tests: list[str]) -> list[str]:
    """The modules outside the packages that ``tests`` import (a ``benchmark/performance_utils.py`` beside a test,
    a ``utils.py`` at the root), and those of a package's ``testing`` subpackage: they judge with the tests, so
    a patch may not change them.  Those under a folder already protected whole, and the package's other
    modules, are left out."""
    packages = tuple(f"{p}/" for p in inv.packages)
    out: set[str] = set()
    for test in tests:
        tree = _parse(_read(inv.root / test), test)
        if tree is None:
            continue
        here = pathlib.PurePosixPath(test).parent
        for name in _imports(tree):
            parts = name.split(".")
            # pytest puts the test's folder (rootdir) on the path; a package's own `testing` subpackage (the
            # references and checks its tests compare with: FlagAttention's flag_attn.testing) judges too
            bases = {here, pathlib.PurePosixPath("."), pathlib.PurePosixPath(inv.import_root)}
            for base in bases:
                for rel in (base.joinpath(*parts).with_suffix(".py"), base.joinpath(*parts, "__init__.py")):
                    path = rel.as_posix().removeprefix("./")
                    where = pathlib.PurePosixPath(path)
                    if path != test and (inv.root / path).is_file() and (
                            not path.startswith(packages) or "testing" in where.parts[:-1]):
                        # a package's `testing` package whole: what its __init__ gathers judges too
                        out.add(f"{where.parent}/**" if where.name == "__init__.py" and where.parent.name == "testing"
                                else path)
    return sorted(out)


def _used_references(inv: Inventory) -> list[str]:
    """The files named like a reference (``naive.py``, ``ref_attention.py``) that the kernels or their tests use as
    one: beside a kernel file, or imported by their module's name by a test that imports a kernel itself; never
    one with a test file of its own (``test_<its name>.py``: code under test).  A production module that happens
    to be called ``naive_memory_cache`` (lightllm) or ``reference_representation_rewrite`` (torchao) is no
    reference, and protecting it would refuse every patch to it."""
    kernel_dirs = {str(pathlib.PurePosixPath(f).parent) for f in inv.kernel_files}
    tested = {pathlib.PurePosixPath(t).stem.removeprefix("test_").removesuffix("_test") for t in inv.test_files}
    # a file with tests of its own (test_<its name>.py) is code under test, wherever it lies
    refs = [r for r in inv.references if pathlib.PurePosixPath(r).stem not in tested]
    unsure = {r for r in refs if str(pathlib.PurePosixPath(r).parent) not in kernel_dirs}
    if not unsure:
        return refs
    texts = [_read(inv.root / t) for t in inv.direct_tests]  # the tests that import a kernel module themselves

    def named(rel: str) -> bool:
        try:
            name = _module(rel, inv.import_root)
        except ValueError:  # outside the import root: its file name is all a test can spell
            name = pathlib.PurePosixPath(rel).stem
        return any(name in text for text in texts)

    return [r for r in refs if r not in unsure or named(r)]


class _Reach:
    """The kernel files an imported name reaches: the kernel module itself, a name from it (for a name a
    package re-exports, its origin: ``from pkg.ops.kda import chunk_kda``), or the kernel modules its own
    package's ``__init__`` imports, then, hop by hop, the kernel modules that the package modules reached so
    far import (a test of ``mamba3_siso_combined``, which has no kernel, tests the forward and backward kernel
    files it imports), for as long as the files stay few: an import that reaches more than
    ``broad`` kernel files names the package's kernels, not what the test tests (``import pkg``), and keeps
    only the hops before it went broad."""

    HOPS = 3

    def __init__(self, graph: dict[str, set[str]], kernel_modules: dict[str, str], broad: int,
                 renames: dict[str, dict[str, str]] | None = None) -> None:
        self.graph, self.kernel_modules, self.broad = graph, kernel_modules, broad
        self.renames = renames or {}
        self._memo: dict[tuple[str, int], set[str]] = {}

    def _direct(self, name: str) -> set[str]:
        # the kernel module itself, a name in it, or a kernel module of the package ``name`` that the package's
        # __init__ imports (`from fla.ops.based import fused_chunk_based`: the package is the kernels' front);
        # not every kernel module beside it: `from pkg import x` names `pkg` too, and flash-attention's tests of
        # `flash_attn`'s interface had become tests of two Triton files in that package that nothing imports
        front = self.graph.get(name, ())
        return {mod for mod in self.kernel_modules if name == mod or name.startswith(mod + ".")
                or mod.rpartition(".")[0] == name and any(i == mod or i.startswith(mod + ".") for i in front)}

    def _module_of(self, name: str) -> str | None:
        while name and name not in self.graph:
            name = name.rpartition(".")[0]
        return name or None

    def files(self, name: str, hops: int = HOPS) -> set[str]:
        if (name, hops) not in self._memo:
            self._memo[name, hops] = {self.kernel_modules[m] for origin in self._origins(name)
                                      for m in self._walk(origin, hops)}
        return self._memo[name, hops]

    def _origins(self, name: str) -> set[str]:
        """Where ``name`` is defined: itself, or, for a name a package re-exports, the module its ``__init__``
        imports it from (``from liger_kernel.ops import LigerRMSNormFunction`` is ``...ops.rms_norm``'s, not
        the whole package's), followed through a few packages that re-export a re-export, and under another name
        (FlagAttention's ``from flag_attn.flash import attention as flash_attention``)."""
        out: set[str] = set()
        frontier = {name}
        for _ in range(self.HOPS):
            nxt: set[str] = set()
            for n in frontier:
                parent, _, attr = n.rpartition(".")
                via = set() if n in self.graph or parent not in self.graph else \
                    {i for i in self.graph[parent] if i.rpartition(".")[2] == attr and i != n} | \
                    ({self.renames[parent][attr]} if attr in self.renames.get(parent, {}) else set())
                (nxt.update(via) if via else out.add(n))
            frontier = nxt - out
            if not frontier:
                break
        return out | frontier

    def _walk(self, name: str, hops: int) -> set[str]:
        found = self._direct(name)
        if len(found) > self.broad or (start := self._module_of(name)) is None:
            return found if len(found) <= self.broad else set()
        seen, frontier = {start}, {start}
        for _ in range(hops):
            nxt = {mod for m in frontier for n in self.graph.get(m, ())
                   if (mod := self._module_of(n)) is not None and mod not in seen}
            more = found | {m for m in nxt if m in self.kernel_modules}
            if not nxt or len(more) > self.broad:
                break
            found, seen, frontier = more, seen | nxt, nxt
        return found

    def relevant(self) -> set[str]:
        """The package modules from which some kernel module is at most :attr:`HOPS` imports away."""
        importers: dict[str, set[str]] = {}
        for m, names in self.graph.items():
            for n in names:
                if (mod := self._module_of(n)) is not None:
                    importers.setdefault(mod, set()).add(m)
        out = frontier = set(self.kernel_modules)
        for _ in range(self.HOPS):
            frontier = {i for m in frontier for i in importers.get(m, ())} - out
            out = out | frontier
        return out


class _NoAliases(yaml.SafeDumper):
    def ignore_aliases(self, data) -> bool:  # a person reads this file: every list written out
        return True


def _dirs(files: list[str]) -> list[str]:
    return sorted({str(pathlib.PurePosixPath(f).parent) for f in files})


def starter_manifest(inv: Inventory, name: str | None = None, max_tests: int = 12) -> str:
    """The starter manifest's YAML text (validated), with comments for what it could not decide."""
    probes: list[dict] = []
    pkg_globs = [f"{p}/**/*.py" for p in inv.packages] or ["**/*.py"]
    if inv.kernel_files:
        kernel_dirs = _dirs(inv.kernel_files)
        covers = {"files": [f"{d}/*.py" for d in kernel_dirs]}
        probes.append({"id": "static.dot_precision", "kind": "static", "check": "dot_precision",
                       "description": "every tl.dot in the kernels states its input_precision",
                       "covers": covers, "budget_s": 60, **_today(inv, "dot_precision", kernel_dirs, sites_too=False)})
        probes.append({"id": "static.tf32_dot", "kind": "static", "check": "tf32_dot",
                       "description": "no new fp32 tl.dot stated as tf32", "covers": covers, "budget_s": 60,
                       **_today(inv, "tf32_dot", kernel_dirs)})
        probes.append({"id": "static.kernel_loop_division", "kind": "static", "check": "kernel_loop_division",
                       "description": "no new division inside a kernel's loop", "covers": covers, "budget_s": 60,
                       **_today(inv, "kernel_loop_division", kernel_dirs)})
    if inv.packages:
        probes.append({"id": "static.gil_native", "kind": "static", "check": "gil_native",
                       "description": "no native library loaded so that its calls hold the GIL",
                       "covers": {"files": pkg_globs}, "budget_s": 60,
                       **_today(inv, "gil_native", inv.packages, sites_too=False)})
        probes.append({"id": "static.argument_order", "kind": "static", "check": "argument_order",
                       "description": "no new call passes its arguments in another order than its callee declares",
                       "covers": {"files": pkg_globs}, "budget_s": 120,
                       **_today(inv, "argument_order", inv.packages)})
        probes.append({"id": "static.tf32_switch", "kind": "static", "check": "tf32_switch",
                       "description": "no new statement puts the process's fp32 matmuls on tf32",
                       "covers": {"files": pkg_globs}, "budget_s": 60, **_today(inv, "tf32_switch", inv.packages)})
    chosen = _choose_tests(inv, max_tests)
    for test in sorted(chosen):
        stem = pathlib.PurePosixPath(test).stem.removeprefix("test_").removesuffix("_test")
        kernels = inv.kernel_tests[test]
        probes.append({"id": f"tests.{re.sub(r'[^A-Za-z0-9_]', '_', stem)}", "kind": "correctness", "pytest": [test],
                       "description": f"the repository's own tests of {', '.join(kernels[:3])}",
                       "covers": {"files": kernels, "symbols": sorted({k for f in kernels for k in inv.kernels[f]})},
                       "budget_s": 900})
    ids = [p["id"] for p in probes]
    for i, pid in enumerate(ids):  # two test files with one stem: keep ids unique
        if ids.count(pid) > 1:
            probes[i]["id"] = f"{pid}_{i}"
    tests_dirs = _test_globs(inv)
    helpers = [h for h in _test_helpers(inv, chosen) if not any(path_matches(h, g) for g in tests_dirs)]
    data = {"schema_version": 1, "name": name or inv.root.name,
            "description": f"starter manifest written by `infra-agent init` for {inv.root.name}",
            "python_path": [inv.import_root], "probes": probes,
            "protected": sorted(set(tests_dirs + ["**/conftest.py", MANIFEST_NAME] + inv.references + helpers))}
    text = yaml.dump(data, Dumper=_NoAliases, sort_keys=False, width=110)
    parse_manifest(text)  # what init writes always validates
    notes = ["# Starter manifest: edit freely, then `infra-agent manifest check`.",
             f"# found: {len(inv.packages)} package(s), {len(inv.kernel_files)} file(s) with Triton kernels, "
             f"{len(inv.test_files)} test file(s), {len(inv.bench_files)} benchmark script(s)"]
    for conftest, needs in sorted(inv.conftest_needs.items()):
        notes.append(f"# not installed here: {', '.join(needs)}, which {conftest} needs: pytest stops before "
                     f"collecting the tests under {pathlib.PurePosixPath(conftest).parent}/ (skipped, not failed)")
    lacking = {t: inv.test_needs[t] for t in sorted(chosen) if inv.test_needs.get(t)}
    if lacking:
        notes.append(f"# not importable here ({len(lacking)} of the {len(chosen)} test probes skip on this machine "
                     "until installed):")
        notes += [f"#   {t} imports {', '.join(needs)}" for t, needs in list(lacking.items())[:12]]
    if inv.assert_nothing:
        notes.append("# test files that reach kernels but assert nothing (timing loops?), not written as probes: "
                     + ", ".join(inv.assert_nothing[:8]) + (" ..." if len(inv.assert_nothing) > 8 else ""))
    others = [t for t in inv.test_files if t not in chosen and t not in inv.assert_nothing]
    if others:
        notes.append("# other test files (add a pytest probe for those that judge code you change):")
        notes += [f"#   {t}" for t in others[:20]]
        notes += [f"#   ... and {len(others) - 20} more"] if len(others) > 20 else []
    if inv.bench_files:
        notes.append("# benchmark scripts (a `command` probe runs one that prints a JSON object of metrics last):")
        notes += [f"#   {b}" for b in inv.bench_files[:20]]
    return "\n".join(notes) + "\n" + text


def _choose_tests(inv: Inventory, max_tests: int) -> list[str]:
    """The test files the starter writes as pytest probes, at most ``max_tests``.

    Ranked: a kernel's own tests first (those that import a kernel module themselves, the most focused first:
    fewest kernel files each), then tests that reach kernels through other modules; between equals, one that
    this machine can import (not a test of an optional backend whose package is absent), then one named after
    its kernel's file (test_rms_norm.py for rms_norm.py), then one of the folder that holds the most kernel tests
    (the main suite, not a backend's parity test against the kernel).  Chosen for breadth: each next one is the
    kernel's own test that covers the most kernel files no chosen test covers yet (those it reaches: a probe
    covers them all; torchao's five tests of mx_formats/kernels.py had left fifteen kernel files without one,
    and on flash-linear-attention 115 of its kernel files are covered, 81 where only a test's own imports
    counted), then the others alike; then, while slots are left, one per set of kernel files not chosen yet."""
    direct = inv.direct_tests
    per_folder: dict[str, int] = {}
    for t in inv.kernel_tests:
        folder = str(pathlib.PurePosixPath(t).parent)
        per_folder[folder] = per_folder.get(folder, 0) + 1

    def named_after(t: str) -> bool:
        stem = pathlib.PurePosixPath(t).stem.removeprefix("test_").removesuffix("_test")
        return any(pathlib.PurePosixPath(k).stem == stem for k in inv.kernel_tests[t])

    judging = [t for t in inv.kernel_tests if t not in inv.assert_nothing]
    ranked = sorted(judging, key=lambda t: (t not in direct, len(direct.get(t, ())), len(inv.kernel_tests[t]),
                                            bool(inv.test_needs.get(t)), not named_after(t),
                                            -per_folder[str(pathlib.PurePosixPath(t).parent)], t))
    rank = {t: i for i, t in enumerate(ranked)}
    chosen: list[str] = []
    covered: set[str] = set()
    while len(chosen) < max_tests:
        best = max((t for t in ranked if t not in chosen), default=None,
                   key=lambda t: (t in direct, len(set(inv.kernel_tests[t]) - covered), -rank[t]))
        if best is None or not set(inv.kernel_tests[best]) - covered:
            break
        chosen.append(best)
        covered |= set(inv.kernel_tests[best])
    seen = {tuple(inv.kernel_tests[t]) for t in chosen}
    for t in ranked:
        key = tuple(inv.kernel_tests[t])
        if t not in chosen and key not in seen and len(chosen) < max_tests:
            chosen.append(t)
            seen.add(key)
    return chosen


def _test_globs(inv: Inventory) -> list[str]:
    """What protects the tests: a top folder of tests whole (``tests/**``: its helpers judge too), and elsewhere
    the test files alone, by their names' pattern under that folder.  torchao keeps a few ``*_test.py`` files
    inside its package: protecting the package's folder would refuse every patch to the code under test."""
    out: set[str] = set()
    package_tops = {pathlib.PurePosixPath(p).parts[0] for p in inv.packages}
    for t in inv.test_files:
        parts = pathlib.PurePosixPath(t).parts
        if len(parts) == 1:
            out.add(t)
        elif "test" in parts[0].lower() and parts[0] not in package_tops:
            out.add(f"{parts[0]}/**")
        else:
            out.add(f"{parts[0]}/**/test_*.py" if parts[-1].startswith("test_") else f"{parts[0]}/**/*_test.py")
    return sorted(out)


#: past this many sites today, a starter holds a check at its count instead of listing each site it tolerates
MAX_TOLERATED = 300


def _today(inv: Inventory, check: str, paths: list[str], sites_too: bool = True) -> dict:
    """A built-in check's ``params`` (and ``thresholds``) that hold the line at what the tree has today: nothing
    new, no rewrite of what the repository already does.  Each site found today is listed in
    ``params.tolerated`` (``file: symbol: message``), so that a new one is told apart from them by name, and a
    playbook's transform never rewrites one (torchao's six backward-GEMM calls that pass M, N, K in another
    order on purpose).  Past :data:`MAX_TOLERATED` sites, the count bounds it instead.  A file that does not
    parse today (under this Python) is tolerated too, and with ``sites_too=False`` (a check whose every site is
    a defect to report from the first run) only such files."""
    from feedback.checks import CHECKS, run_check
    from feedback.sites import tolerated_key

    metric = CHECKS[check][0]
    _, count, sites = run_check(check, inv.root, paths)
    unparsed = [tolerated_key(s.file, s.symbol, s.message) for s in sites[count:]]
    if not sites_too:
        return {"params": {"paths": paths, **({"tolerated": unparsed} if unparsed else {})}}
    if count > MAX_TOLERATED:
        return {"params": {"paths": paths, **({"tolerated": unparsed} if unparsed else {})},
                "thresholds": {metric: {"max": count}}}
    keys = [tolerated_key(s.file, s.symbol, s.message) for s in sites[:count]] + unparsed
    return {"params": {"paths": paths, **({"tolerated": keys} if keys else {})}}
