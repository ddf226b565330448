"""fla, imported from the tree under test: the probes beside this file judge the checkout the harness
hands them, never an fla installed in the environment (CI's has fla-core 0.6.0 for its own tests)."""

from __future__ import annotations

import importlib
import inspect
import os
import types


def lenient_autotune() -> None:
    """fla 0.5.x names an autotune key (``BT``) its merge kernel does not take; newer Triton refuses that
    at import.  The keys a kernel does not have are dropped (they never distinguished a config)."""
    import triton

    if getattr(triton.autotune, "__infra_agent__", False):
        return
    original = triton.autotune

    def autotune(configs, key, *args, **kwargs):
        def decorate(fn):
            names = set(getattr(fn, "arg_names", None) or inspect.signature(getattr(fn, "fn", fn)).parameters)
            return original(configs, [k for k in key if k in names], *args, **kwargs)(fn)
        return decorate

    autotune.__infra_agent__ = True
    triton.autotune = autotune


def from_tree(name: str, tree: str) -> types.ModuleType:
    """``import name`` (an fla module), refused unless it was imported from ``tree``."""
    lenient_autotune()
    mod = importlib.import_module(name)
    if not os.path.realpath(mod.__file__).startswith(os.path.realpath(tree) + os.sep):
        raise ImportError(f"{mod.__name__} was imported from {mod.__file__}, outside the tree under test {tree}")
    return mod
