"""The MoE op's native extension: the dispatch / expert / combine step of the CPU prefill path, and
the host-side dispatch layout of the GPU prefill path (:class:`HostLayout`).

The C source beside this file is compiled at first use with the machine's C compiler into a cache
directory keyed by the source's hash (``$TARGET_STACK_CACHE``, default ``~/.cache/target_stack``),
written atomically so concurrent first uses are safe, and loaded with ctypes.

``ctypes.CDLL`` releases the GIL for the duration of each call, so Python threads (the KV-transfer
thread) keep running while the experts compute; ``ctypes.PyDLL`` would hold it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading

import torch

from target_stack.events import emit

SOURCE = pathlib.Path(__file__).with_name("moe_dispatch.c")
CFLAGS = ["-O3", "-fPIC", "-shared", "-fno-math-errno"]
_lock = threading.Lock()
_lib = None


class NativeBuildError(RuntimeError):
    pass


def cache_dir() -> pathlib.Path:
    root = os.environ.get("TARGET_STACK_CACHE") or pathlib.Path.home() / ".cache" / "target_stack"
    return pathlib.Path(root) / "native"


def build() -> pathlib.Path:
    """Compile the extension if this source has not been built here yet; return the library path."""
    src = SOURCE.read_bytes()
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise NativeBuildError("no C compiler found (set CC, or install cc/gcc/clang) to build "
                               f"target_stack's native MoE dispatch from {SOURCE}")
    key = hashlib.sha256(src + " ".join([cc, *CFLAGS, sys.platform]).encode()).hexdigest()[:16]
    out = cache_dir() / f"libts_moe-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    proc = subprocess.run([cc, *CFLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise NativeBuildError(f"building {SOURCE.name} with {cc} failed:\n{proc.stderr.strip()}")
    os.replace(tmp, out)  # atomic: a concurrent builder either sees nothing or the whole library
    return out


def library() -> ctypes.CDLL:
    global _lib
    with _lock:
        if _lib is None:
            lib = ctypes.CDLL(str(build()))
            fn = lib.ts_moe_dispatch_combine
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_int64] * 5 + [ctypes.c_void_p] * 7
            wait = lib.ts_moe_layout_wait
            wait.restype = ctypes.c_int
            wait.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                             ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
            _lib = lib
    return _lib


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def moe_dispatch_combine(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w_gate: torch.Tensor,
                         w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{experts[t, k]}(x[t]) for x [T, D] fp32 on the CPU.

    w_gate, w_up: [E, H, D]; w_down: [E, D, H] (all fp32, contiguous).
    """
    if x.device.type != "cpu" or x.dtype != torch.float32:
        raise ValueError(f"the native MoE dispatch runs on CPU float32 tensors, got {x.dtype} on {x.device}")
    T, D = x.shape
    E, H, _ = w_gate.shape
    K = experts.shape[1]
    x = x.contiguous()
    experts = experts.to(torch.int64).contiguous()
    weights = weights.to(torch.float32).contiguous()
    out = torch.empty(T, D)
    emit("dispatch.enter", tokens=T)
    rc = library().ts_moe_dispatch_combine(T, D, H, E, K, _ptr(x), _ptr(experts), _ptr(weights),
                                           _ptr(w_gate), _ptr(w_up), _ptr(w_down), _ptr(out))
    emit("dispatch.exit", tokens=T)
    if rc == -1:
        raise ValueError(f"expert ids must be in [0, {E})")
    if rc != 0:
        raise MemoryError("native MoE dispatch could not allocate its buffers")
    return out


def moe_layout_wait(flag: torch.Tensor, expected: int, experts: torch.Tensor, num_experts: int, order: torch.Tensor,
                    ends: torch.Tensor, timeout_s: float = 60.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Wait until ``flag`` (host int32 [1], written by the device after the routing decisions)
    reads ``expected``, then sort the pairs of ``experts`` (host int64 [P]) by expert into
    ``order`` [P] and the group ends ``ends`` [E] (both host int64).  The GPU MoE path's dispatch:
    the wait is for the device, which is where a call that keeps the GIL hurts most."""
    for name, t in (("flag", flag), ("experts", experts), ("order", order), ("ends", ends)):
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous host tensor")
    P = experts.numel()
    emit("dispatch.enter", tokens=P)
    rc = library().ts_moe_layout_wait(_ptr(flag), int(expected), int(timeout_s * 1e6), _ptr(experts), P,
                                      num_experts, _ptr(order), _ptr(ends))
    emit("dispatch.exit", tokens=P)
    if rc == -3:
        raise TimeoutError(f"the device did not publish the routing within {timeout_s:g} s")
    if rc == -1:
        raise ValueError(f"expert ids must be in [0, {num_experts})")
    if rc != 0:
        raise MemoryError("native MoE layout could not allocate its buffer")
    return order[:P], ends


class HostLayout:
    """The GPU prefill MoE's dispatch layout made on the host by the native extension: the routing goes
    to pinned host memory with a sequence number behind it; :func:`moe_layout_wait` waits for the
    number (for the device to get there) and sorts the pairs by expert.  Buffers are reused: the next
    call writes them only after its own flag, which the device publishes after this call's uploads."""

    def __init__(self):
        self._staging: dict | None = None

    def __call__(self, idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(order on ``idx``'s device, group ends as host int64 [E]) for expert ids ``idx`` on a GPU."""
        P, E = idx.numel(), num_experts
        st = self._staging
        if st is None or st["idx"].numel() < P or st["ends"].numel() != E or st["dev_flag"].device != idx.device:
            n = max(P, 1024)
            pinned = dict(device="cpu", pin_memory=True)
            st = self._staging = {"idx": torch.empty(n, dtype=torch.int64, **pinned),
                                  "order": torch.empty(n, dtype=torch.int64, **pinned),
                                  "ends": torch.empty(E, dtype=torch.int64, **pinned),
                                  "flag": torch.zeros(1, dtype=torch.int32, **pinned),
                                  "dev_flag": torch.zeros(1, dtype=torch.int32, device=idx.device), "seq": 0}
        st["seq"] = st["seq"] % (2**30) + 1
        host_idx = st["idx"][:P]
        host_idx.copy_(idx.reshape(-1), non_blocking=True)
        st["dev_flag"].fill_(st["seq"])
        st["flag"].copy_(st["dev_flag"], non_blocking=True)  # stream order: after the routing copy
        order, ends = moe_layout_wait(st["flag"], st["seq"], host_idx, E, st["order"][:P], st["ends"])
        return order.to(idx.device, non_blocking=True), ends

