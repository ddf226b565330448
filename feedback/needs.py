"""What a failed test says this machine lacks: a GPU, or a package the tree imports but does not provide.

A repository's own tests, run on a machine they were not written for (a laptop without CUDA, a CI
runner without the stack's serving dependencies), fail by the dozen before they reach the code under
test.  Those failures say nothing about the tree: they are the machine's.  :func:`lacks` reads a
failure's text (the exception line and its traceback) and names what is missing, or returns None for
a failure that is the code's.

It is deliberately narrow, so that a defect is never excused as the machine's:

* a missing module counts only when the tree does not provide its top-level package (a broken import
  of the tree's own code is a defect), and an installed package without a name the tree imports from it
  is named as a version mismatch;
* a missing GPU counts only on the messages torch, Triton and the CUDA runtime give when there is no
  usable device or driver, never on a CUDA error raised while a kernel runs; a missing native library
  only where the loader says it cannot open it.

The harness still holds a candidate to what its baseline could run: a change that leaves more tests
unable to run here than before (a new third-party import, a CPU path that now asks for CUDA) fails
(``feedback.verdict``).
"""

from __future__ import annotations

import pathlib
import re
from collections.abc import Iterable

from feedback.submodules import not_checked_out

# the exception lines torch, Triton and the CUDA runtime give where no usable GPU or driver exists
_NO_GPU = (
    "Torch not compiled with CUDA enabled",
    "No CUDA GPUs are available",
    "Found no NVIDIA driver on your system",
    "CUDA driver initialization failed",
    "no CUDA-capable device is detected",
    "CUDA driver version is insufficient",
    "no kernel image is available for execution on the device",
    "active drivers ([]). There should only be one",  # Triton without a GPU and without its interpreter
    "libcuda.so",  # Triton looking for the driver library
)
# a test that asserts the GPU is there (torchao: `assert torch.cuda.is_available()`), as the traceback's source line
# or pytest's explanation of the failed assertion shows it
_ASKS_GPU = re.compile(r"^\s*assert\s+(?:torch\.)?cuda\.is_available\(\)\s*(?:,.*)?$|"
                       r"where False = <function is_available\b", re.M)
_NO_MODULE = re.compile(r"(?:ModuleNotFoundError|ImportError): No module named '(?P<name>[\w.]+)'")
_NO_NAME = re.compile(r"ImportError: cannot import name '(?P<attr>\w+)' from '(?P<name>[\w.]+)'")
# a native library the machine does not have (the CUDA runtime of a compiled extension, say)
_NO_LIBRARY = re.compile(r"(?:ImportError|OSError): (?P<lib>lib[\w+-]+\.so[.\d]*): cannot open shared object file")


def provided(name: str, roots: Iterable[pathlib.Path]) -> bool:
    """Whether the tree provides the top-level package or module of ``name`` under one of its import roots."""
    top = name.split(".")[0]
    return any((r / top).is_dir() or (r / f"{top}.py").is_file() or any(r.glob(f"{top}.*.so"))
               for r in roots)


def lacks(text: str, roots: Iterable[pathlib.Path]) -> str | None:
    """What the failure's ``text`` says this machine lacks ("CUDA (Torch not compiled with CUDA enabled)",
    "the package 'tqdm'"), or None when the failure is the code's."""
    roots = list(roots)
    for line in reversed(text.strip().splitlines()):
        line = re.sub(r"^E\s+", "", line.strip())
        if line.startswith("AssertionError") and _ASKS_GPU.search(text):
            return "a CUDA GPU (the test asserts that torch.cuda.is_available())"
        if m := _NO_MODULE.search(line):
            if provided(m["name"], roots):
                return None
            top = m["name"].split(".")[0]
            sub = next((s for r in roots if (s := not_checked_out(r, top))), None)
            return f"the package '{top}'" + (f" (in the git submodule {sub}, not checked out: `git submodule "
                                            f"update --init {sub}`)" if sub else "")
        if m := _NO_NAME.search(line):
            if provided(m["name"], roots):
                return None
            return f"another version of '{m['name'].split('.')[0]}' (this one has no '{m['attr']}')"
        if m := _NO_LIBRARY.search(line):
            return f"the shared library {m['lib']}"
        for phrase in _NO_GPU:
            if phrase in line:
                return f"a CUDA GPU ({phrase.strip(' (')})"
        if re.match(r"^[\w.]+(Error|Exception|Interrupt)\b", line):
            return None  # the innermost exception is another one: the code's
    return None


def absent_package(need: str) -> str | None:
    """The top-level package a need of :func:`lacks` names as missing ("the package 'tqdm'", "another version
    of 'vllm' (...)"), or None for another need (a GPU, a shared library)."""
    m = re.match(r"(?:the package|another version of) '([\w.]+)'", need)
    return m[1] if m else None


def importable(name: str, roots: Iterable[pathlib.Path]) -> bool:
    """Whether ``name`` can be imported now: from the tree's import ``roots`` or this interpreter's path."""
    import importlib.util

    if provided(name, roots):
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
