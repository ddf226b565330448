"""Reaching the judges: what a candidate patch may never do, whatever its verdict would be.

The probes, the references and the harness judge a change from outside it; a patch written to be
judged "better" can instead try to reach them.  These checks read the diff alone (and the
patched text of its Python files) and refuse such a patch with the reason:

* files that Python or pytest load by themselves, before any probe code runs: ``conftest.py``,
  ``sitecustomize.py``, ``usercustomize.py``, ``*.pth``;
* anything but a content edit: renames and copies (a protected file moved out of the way, or a
  file moved onto a protected path), mode changes, symbolic links, binary patches, and an old path
  (``--- a/...``) that is protected;
* in added Python lines: importing the harness (``feedback``, ``infra_agent``, ``playbooks``) or a
  module whose file is protected (a kernel that calls the float64 reference, a probe's helpers);
  rebinding an attribute of an imported module or of a name ``from M import`` binds, to a function or
  another object, however the module is reached (``time.perf_counter = ...``, ``setattr(torch.cuda.Event,
  ...)``, ``sys.modules['time'].perf_counter = ...``, ``importlib.import_module(...).x = ...``,
  ``vars(time)['perf_counter'] = ...``: timer patching and monkeypatching; a flag set to a constant is
  left to the risk rules); introspection that reaches other frames or every live
  object (``gc.get_objects``, ``inspect.currentframe``, ``sys._getframe``, ``sys.settrace``, writes to
  ``sys.modules`` or ``builtins``); writing an environment variable the harness sets for probes.
"""

from __future__ import annotations

import ast
import pathlib
import re

from feedback.checks import parse
from feedback.manifest import Manifest

HARNESS_PACKAGES = ("feedback", "infra_agent", "playbooks")
SELF_LOADED = ("conftest.py", "sitecustomize.py", "usercustomize.py")
INTROSPECTION = ("gc.get_objects", "gc.get_referrers", "gc.get_referents", "inspect.currentframe", "inspect.stack",
                 "inspect.getouterframes", "inspect.getinnerframes", "inspect.trace", "sys._getframe",
                 "sys._current_frames", "sys.settrace", "sys.setprofile", "threading.settrace",
                 "threading.setprofile")
#: variables the harness sets in a probe's environment (feedback/runner.py), by prefix
HARNESS_ENV = ("INFRA_AGENT_", "TRITON_", "PYTHON", "CUDA_VISIBLE_DEVICES", "TARGET_STACK_")
_HEADERS = re.compile(r"^(rename from|rename to|copy from|copy to|old mode|new mode|new file mode 120000|"
                      r"GIT binary patch|Binary files )", re.MULTILINE)


def refusal(diff: str, paths: list[str], old_paths: list[str], sources: dict[str, str],
            added: dict[str, set[int]], manifest: Manifest) -> str | None:
    """Why the patch reaches the judges, or None.  ``sources``: the patched text of its Python files;
    ``added``: their added line numbers."""
    for rel in paths:
        name = pathlib.PurePosixPath(rel).name
        if name in SELF_LOADED or name.endswith(".pth"):
            return f"{rel}: a file the interpreter or pytest loads by itself, before the probes' code"
    for rel in old_paths:
        if (pat := manifest.is_protected(rel)) is not None:
            return f"{rel} is protected ({pat}) and the patch removes or moves it"
    if why := not_content(diff):
        return why
    for rel, source in sources.items():
        if why := _python(rel, source, added.get(rel, set()), manifest):
            return why
    return None


def not_content(diff: str) -> str | None:
    """Why a diff is more than a content edit (a rename, copy, mode change, symbolic link, binary patch), or None."""
    if m := _HEADERS.search(diff):
        return (f"'{m.group(0).strip()}': only content edits are judged (no renames, copies, mode changes, "
                "symbolic links or binary patches)")
    return None


def dotted(node: ast.AST) -> str:
    """``a.b.c`` for an attribute chain on a name (what a call or an assignment target names); else ''."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _namespace(node: ast.AST) -> bool:
    """Whether ``node`` is a namespace's dictionary: ``X.__dict__`` or ``vars(X)``."""
    return (isinstance(node, ast.Attribute) and node.attr == "__dict__") or \
        (isinstance(node, ast.Call) and dotted(node.func) == "vars")


def root_name(node: ast.AST) -> str:
    """The name an expression starts from, through attributes, subscripts and calls: ``sys`` for
    ``sys.modules['time'].perf_counter``, ``importlib`` for ``importlib.import_module('time').sleep``,
    ``time`` for ``vars(time)``; '' when it starts from a literal."""
    while True:
        if isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.args[0] if dotted(node.func) == "vars" and node.args else node.func
        else:
            return node.id if isinstance(node, ast.Name) else ""


def _module_file(module: str) -> list[str]:
    base = module.replace(".", "/")
    return [f"{base}.py", f"{base}/__init__.py"]


def _python(rel: str, source: str, lines: set[int], manifest: Manifest) -> str | None:
    tree = parse(source, rel)
    # names bound by imports anywhere in the file: modules, and what ``from M import x`` binds (a module, a
    # class or a function of another module: rebinding its attributes patches that module's objects)
    modules: set[str] = {"sys", "builtins", "importlib"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {(a.asname or a.name.split(".")[0]) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            modules |= {(a.asname or a.name) for a in node.names if a.name != "*"}
    text = source.splitlines()

    def at(node: ast.AST, why: str) -> str:
        return f"{rel}:{node.lineno}: {why}: {text[node.lineno - 1].strip()[:100]}"

    for node in ast.walk(tree):
        if not hasattr(node, "lineno") or node.lineno not in lines:
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif node.level:  # relative: from the patched file's package
                package = list(pathlib.PurePosixPath(rel).parent.parts)
                package = package[:len(package) - (node.level - 1)] if node.level > 1 else package
                names = [".".join([*package, *(node.module.split(".") if node.module else [])])]
                names += [f"{names[0]}.{a.name}" for a in node.names]  # from . import naive
            else:
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            probe_modules = {f.stem for r in manifest.probe_roots() for f in r.glob("*.py")} | \
                {d.name for r in manifest.probe_roots() for d in r.iterdir() if (d / "__init__.py").is_file()} \
                if manifest.probe_path else set()
            for name in names:
                if name.split(".")[0] in HARNESS_PACKAGES:
                    return at(node, f"imports the harness ({name})")
                if name.split(".")[0] in probe_modules:
                    return at(node, f"imports {name}, a probe module of the manifest's probe_path (the judges)")
                for candidate in _module_file(name):
                    if (pat := manifest.is_protected(candidate)) is not None:
                        return at(node, f"imports {name}, a protected module ({pat}): the judges' own code")
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else \
            node.targets if isinstance(node, ast.Delete) else []
        for t in targets:
            root = root_name(t)
            value = getattr(node, "value", None)
            callable_value = isinstance(value, (ast.Lambda, ast.Name, ast.Attribute, ast.Call)) or value is None
            if root in ("builtins", "__builtins__"):
                return at(node, "rebinds a builtin")
            if isinstance(t, ast.Subscript) and dotted(t.value) in ("sys.modules", "os.environ"):
                key = t.slice.value if isinstance(t.slice, ast.Constant) else None
                if dotted(t.value) == "sys.modules" or not isinstance(key, str) or key.startswith(HARNESS_ENV):
                    return at(node, f"writes {dotted(t.value)}[{key!r}]")
            if isinstance(t, ast.Attribute) and root in modules and callable_value:  # a flag set to a constant
                return at(node, f"rebinds {ast.unparse(t)}, an attribute of an imported module or object "
                                "(monkeypatching)")
            if isinstance(t, ast.Subscript) and root in modules and _namespace(t.value):
                return at(node, f"writes {ast.unparse(t)}, into an imported module's namespace (monkeypatching)")
        if isinstance(node, ast.Call):
            name = dotted(node.func)
            if name in INTROSPECTION:
                return at(node, f"calls {name} (introspection that reaches the harness's objects or frames)")
            if name in ("setattr", "delattr") and node.args and root_name(node.args[0]) in modules:
                return at(node, f"{name} on {ast.unparse(node.args[0])}, an imported module or object "
                                "(monkeypatching)")
            if name in ("os.putenv", "os.unsetenv", "os.environ.update", "os.environ.setdefault", "os.environ.pop"):
                key = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else None
                if not isinstance(key, str) or key.startswith(HARNESS_ENV):
                    return at(node, f"{name}({key!r}): an environment variable the harness sets for probes")
    return None
