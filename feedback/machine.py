"""What this machine offers probes (its NVIDIA GPUs), read without importing torch or anything heavier
than the standard library: the runner's environment key and the memo's (:mod:`feedback.memo`) both ask."""

from __future__ import annotations

import contextlib
import glob
import os
import pathlib


def gpu_present() -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return False
    return pathlib.Path("/dev/nvidia0").exists() or pathlib.Path("/dev/nvidiactl").exists()


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity: a container's or ``taskset``'s share)."""
    with contextlib.suppress(AttributeError, OSError):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def gpu_count() -> int:
    """NVIDIA GPUs this process may use (``CUDA_VISIBLE_DEVICES`` respected), counted without importing torch."""
    if not gpu_present():
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    return len(glob.glob("/dev/nvidia[0-9]*"))


def driver_gpu_model(root: str = "/proc/driver/nvidia/gpus") -> str | None:
    """The model of this machine's first NVIDIA GPU from the driver's own record (``Model:`` in
    ``<root>/<bus id>/information``), without importing torch; None where the driver keeps none."""
    for info in sorted(glob.glob(os.path.join(glob.escape(root), "*", "information"))):
        with contextlib.suppress(OSError):
            for line in pathlib.Path(info).read_text().splitlines():
                if line.startswith("Model:") and line.split(":", 1)[1].strip():
                    return line.split(":", 1)[1].strip()
    return None
