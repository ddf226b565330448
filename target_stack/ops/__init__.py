"""Triton kernels of target_stack, each beside its plain torch reference.

Triton chooses between compiling and interpreting when a kernel is decorated, and its own
standard library is decorated when ``triton`` is first imported.  So the choice is made here,
before anything below imports triton: without a CUDA device the kernels run in Triton's
interpreter (NumPy on the CPU).  An explicit ``TRITON_INTERPRET`` always wins.
"""

import os
import sys

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    if "triton" in sys.modules:
        raise ImportError(
            "target_stack.ops: triton was imported before target_stack on a machine without a GPU; "
            "set TRITON_INTERPRET=1 in the environment, or import target_stack.ops first"
        )
    os.environ["TRITON_INTERPRET"] = "1"

if os.environ.get("TRITON_INTERPRET") == "1":
    from target_stack.ops.interpreter import patch as _patch_interpreter

    _patch_interpreter()
