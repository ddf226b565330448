"""``infra-agent init``: look at a repository and write the manifest it can already be judged by.

:func:`inspect` finds the Python packages (plain and ``src/`` layouts), the files with Triton
kernels (``@triton.jit``), the pytest files and the benchmark scripts, reading source only.
:func:`starter_manifest` turns that into probes that need no Python written against the harness:

* the built-in static checks over the kernel files (``dot_precision``, ``kernel_loop_division``)
  and over the packages (``gil_native``, ``argument_order``, ``tf32_switch``); the counts a repository
  already has are held as thresholds (loop divisions, misplaced arguments, tf32 switches: nothing new);
* one ``pytest`` probe per test file that imports a module with kernels (the kernels' own tests,
  covering those modules), up to ``max_tests``; other test files are listed, commented out;
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
from feedback.manifest import MANIFEST_NAME, parse_manifest
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
    kernel_tests: dict[str, list[str]] = field(default_factory=dict)  # test file -> kernel files it imports
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
    mods: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            mods.add(node.module)
            mods.update(f"{node.module}.{a.name}" for a in node.names)
    return mods


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
    for path in _files(root):
        rel = path.relative_to(root).as_posix()
        if _is_test(rel):
            inv.test_files.append(rel)
        elif any(rel.startswith(p + "/") for p in inv.packages):
            source = _read(path)
            if any(n in source for n in NEEDLES["kernel_loop_division"]) and (tree := _parse(source, rel)) \
                    and (names := _kernel_names(tree)):
                inv.kernel_files.append(rel)
                inv.kernels[rel] = names
        if re.search(r"(^|/)(bench|benchmarks?)(/|_|\.py$)", rel) and not _is_test(rel):
            inv.bench_files.append(rel)
        if _REFERENCE.search(pathlib.PurePosixPath(rel).name) and not _is_test(rel):
            inv.references.append(rel)
    modules = {_module(f, inv.import_root): f for f in inv.kernel_files}
    # an import of a kernel module, or of its package, spells the last part of that name
    words = {part.rpartition(".")[2] for mod in modules for part in (mod, mod.rpartition(".")[0]) if part}
    broad = max(4, len(modules) // 4)  # `import pkg` names every kernel: it says nothing about what is tested
    for test in inv.test_files if words else []:
        source = _read(root / test)
        if not any(w in source for w in words) or (tree := _parse(source, test)) is None:
            continue
        hit: set[str] = set()
        for m in _imports(tree):
            # the module itself, a name from it, or its own package (`from pkg.ops.kda import chunk_kda`);
            # not an ancestor further up (`import pkg` names every kernel of the package)
            files = {f for mod, f in modules.items()
                     if m == mod or m.startswith(mod + ".") or mod.rpartition(".")[0] == m}
            if len(files) <= broad:
                hit |= files
        if hit:
            inv.kernel_tests[test] = sorted(hit)
    return inv


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
                       "params": {"paths": kernel_dirs}, "covers": covers, "budget_s": 60})
        probes.append({"id": "static.kernel_loop_division", "kind": "static", "check": "kernel_loop_division",
                       "description": "no division inside a kernel's loop", "params": {"paths": kernel_dirs},
                       "covers": covers, "budget_s": 60,
                       "thresholds": {"loop_divisions": {"max": _count(inv, "kernel_loop_division", kernel_dirs)}}})
    if inv.packages:
        probes.append({"id": "static.gil_native", "kind": "static", "check": "gil_native",
                       "description": "no native library loaded so that its calls hold the GIL",
                       "params": {"paths": inv.packages}, "covers": {"files": pkg_globs}, "budget_s": 60})
        probes.append({"id": "static.argument_order", "kind": "static", "check": "argument_order",
                       "description": "no call passes its arguments in another order than its callee declares",
                       "params": {"paths": inv.packages}, "covers": {"files": pkg_globs}, "budget_s": 120,
                       "thresholds": {"misplaced_arguments": {"max": _count(inv, "argument_order", inv.packages)}}})
        probes.append({"id": "static.tf32_switch", "kind": "static", "check": "tf32_switch",
                       "description": "no new statement puts the process's fp32 matmuls on tf32",
                       "params": {"paths": inv.packages}, "covers": {"files": pkg_globs}, "budget_s": 60,
                       "thresholds": {"tf32_switches": {"max": _count(inv, "tf32_switch", inv.packages)}}})
    # the most focused tests first (fewest kernel files each), one per set of kernel files
    chosen, seen = [], set()
    for t in sorted(inv.kernel_tests, key=lambda t: (len(inv.kernel_tests[t]), t)):
        key = tuple(inv.kernel_tests[t])
        if key not in seen and len(chosen) < max_tests:
            chosen.append(t)
            seen.add(key)
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
    tests_dirs = sorted({pathlib.PurePosixPath(t).parts[0] + "/**" for t in inv.test_files
                         if len(pathlib.PurePosixPath(t).parts) > 1})
    data = {"schema_version": 1, "name": name or inv.root.name,
            "description": f"starter manifest written by `infra-agent init` for {inv.root.name}",
            "python_path": [inv.import_root], "probes": probes,
            "protected": sorted(set(tests_dirs + ["**/conftest.py", MANIFEST_NAME] + inv.references))}
    text = yaml.dump(data, Dumper=_NoAliases, sort_keys=False, width=110)
    parse_manifest(text)  # what init writes always validates
    notes = ["# Starter manifest: edit freely, then `infra-agent manifest check`.",
             f"# found: {len(inv.packages)} package(s), {len(inv.kernel_files)} file(s) with Triton kernels, "
             f"{len(inv.test_files)} test file(s), {len(inv.bench_files)} benchmark script(s)"]
    others = [t for t in inv.test_files if t not in chosen]
    if others:
        notes.append("# other test files (add a pytest probe for those that judge code you change):")
        notes += [f"#   {t}" for t in others[:20]]
        notes += [f"#   ... and {len(others) - 20} more"] if len(others) > 20 else []
    if inv.bench_files:
        notes.append("# benchmark scripts (a `command` probe runs one that prints a JSON object of metrics last):")
        notes += [f"#   {b}" for b in inv.bench_files[:20]]
    return "\n".join(notes) + "\n" + text


def _count(inv: Inventory, check: str, paths: list[str]) -> int:
    """Today's count of a built-in check: the starter holds the line (nothing new), it does not demand a
    rewrite of what the repository already does."""
    from feedback.checks import run_check

    return run_check(check, inv.root, paths)[1]
