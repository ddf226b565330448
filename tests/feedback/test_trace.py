"""Trace capture: a Chrome/Perfetto JSON and the ops ranked by time."""

from __future__ import annotations

import json

import torch

from feedback.trace import capture


def test_trace_capture_exports_a_chrome_trace_and_ranks_ops(tmp_path):
    x = torch.rand(128, 128)

    def work():
        for _ in range(20):
            torch.matmul(x, x)
        torch.sigmoid(x)

    summary = capture(work, "unit", out_dir=tmp_path)
    data = json.loads((tmp_path / "unit.trace.json").read_text())
    assert "traceEvents" in data and any("matmul" in e.get("name", "") or "mm" in e.get("name", "")
                                         for e in data["traceEvents"])
    names = [op.name for op in summary.top]
    assert any("mm" in n or "matmul" in n for n in names[:3])
    assert summary.total_cpu_us > 0 and abs(sum(o.share for o in summary.top if o.device == "cpu") - 1) < 0.5
