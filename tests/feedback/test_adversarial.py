"""Candidates written to be judged "better" without being better, against the real bundled decode
kernel: each must end incorrect, never unchanged or better (issue 15's corpus; the gate refuses the
ones that reach the judges, tests/infra_agent/test_tamper.py)."""

from __future__ import annotations

import pathlib

import pytest

from feedback.harness import judge
from feedback.targets import materialize_bundled

RECURRENT = "target_stack/ops/kda/fused_recurrent.py"
ENTRY = "    pooled = ssm_state_indices is not None\n    h0 = initial_state\n"
RETURN = "    return o, ht\n"


def _before_return(text: str) -> str:
    return text + RETURN
LAUNCH = "_launch = CachedLaunch(_kda_fused_recurrent_kernel)\n"

CHEATS = {
    # a result cached by pointer and shape: the same tensors refilled with new values get the old answer
    "cached by pointer": [(LAUNCH, LAUNCH + "_memo: dict = {}\n"),
                          (ENTRY, "    _key = (q.data_ptr(), tuple(q.shape), k.data_ptr())\n"
                                  "    if _key in _memo:\n        return _memo[_key]\n" + ENTRY),
                          (RETURN, _before_return("    _memo[_key] = (o, ht)\n"))],
    # the work skipped after the first calls (a warm-up the timer never sees)
    "skipped after warm-up": [(LAUNCH, LAUNCH + "_calls = [0]\n_last: list = []\n"),
                              (ENTRY, "    _calls[0] += 1\n    if _calls[0] > 1 and _last:\n        return _last[0]\n"
                                      + ENTRY),
                              (RETURN, _before_return("    _last[:] = [(o, ht)]\n"))],
    # the output aliases an input of the same shape
    "returns an input": [(RETURN, "    return v, ht\n")],
    # the state quietly kept in bf16 between tokens
    "bf16 state": [("        b_h += b_k[:, None] * b_u[None, :]\n",
                    "        b_h += b_k[:, None] * b_u[None, :]\n        b_h = b_h.to(tl.bfloat16).to(tl.float32)\n")],
    # one token fewer: less work, the last token's output left as it was
    "fewer iterations": [("    for t in range(0, T):\n", "    for t in range(0, T - 1):\n")],
}


def apply_cheat(tree: pathlib.Path, name: str) -> None:
    """Write cheat ``name`` into the decode kernel of the bundled target materialised at ``tree``."""
    path = tree / RECURRENT
    text = path.read_text()
    for old, new in CHEATS[name]:
        assert old in text, (name, old)
        text = text.replace(old, new, 1)
    path.write_text(text)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> pathlib.Path:
    return materialize_bundled(tmp_path_factory.mktemp("base"))


@pytest.mark.parametrize("name", sorted(CHEATS))
def test_a_cheating_decode_kernel_is_incorrect(tmp_path, base, name):
    cand = materialize_bundled(tmp_path / "cand")
    apply_cheat(cand, name)
    report = judge(cand, baseline_tree=base, probe_ids=["kda.recurrent.correctness", "kda.decode.work"],
                   run_all=True, jobs=2, cache_dir=base.parent / "cache", same_judges=True)
    assert report.verdict.name == "incorrect", (name, report.verdict)
    assert "kda.recurrent.correctness" in report.verdict.reason or "kda.decode.work" in report.verdict.reason
