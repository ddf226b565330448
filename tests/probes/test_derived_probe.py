"""model.hybrid's check of derived weights (target_stack/model/derived.py): every path that reads one is held to
the float64 definition on the new weights after in-place updates, and rebuilds nothing while no weight changes.
It passes on the clean component and, with a defect planted (monkeypatched in the test, or written into a scratch
copy of the target), names DerivedWeight, or the path whose parts are keyed wrong."""

from __future__ import annotations

import torch

from feedback.harness import judge
from feedback.models import Status
from feedback.probe import ProbeContext
from feedback.targets import materialize_bundled
from target_stack.model import derived
from target_stack.probes import model as probes
from target_stack.probes.reference import Checker, Draw

DERIVED = "target_stack/model/derived.py"
LAYERS = "target_stack/model/layers.py"
VERSIONED = "key = (extra, tuple((w._version, w.data_ptr(), w.dtype, w.device) for w in parts))"
UNVERSIONED = "key = (extra, tuple((w.data_ptr(), w.dtype, w.device) for w in parts))"


def _run() -> list[tuple[str, str, str, str]]:
    ctx = ProbeContext("model.hybrid", {"tolerance": 1e-4}, ".")
    probes._check_derived_weights(ctx, Checker(ctx, 1e-4), Draw(ctx.device))  # inputs on the device it finds
    return [(f.location.file or "", f.location.symbol or "", f.location.condition or "", f.message)
            for f in ctx.findings]


def _keyed_without_version(self, parts, *extra):
    """DerivedWeight.__call__ with the parts' version counters left out of its key (the blind defect)."""
    key = (extra, tuple((w.data_ptr(), w.dtype, w.device) for w in parts))
    if self._entry is None or self._entry[0] != key:
        self._entry = None
        with torch.no_grad():
            self._entry = (key, self.build(parts, *extra))
    return self._entry[1]


def _rebuilt_every_call(self, parts, *extra):
    with torch.no_grad():
        return self.build(parts, *extra)


def test_the_derived_weight_check_passes_on_the_clean_component():
    assert _run() == []


def test_a_cache_blind_to_in_place_updates_is_blamed_on_derived_weight_for_every_path_and_update(monkeypatch):
    monkeypatch.setattr(derived.DerivedWeight, "__call__", _keyed_without_version)
    found = _run()
    assert found and {(f, s) for f, s, _, _ in found} == {(DERIVED, "DerivedWeight.__call__")}, found
    stale = [c for _, _, c, _ in found if " after " in c and "T=" in c]
    # the native backend is the CPU's path; a GPU runs the grouped GEMMs instead, where torch has them
    device_path = "backend='native'" if not torch.cuda.is_available() else \
        "grouped GEMMs" if hasattr(torch, "_grouped_mm") else "small_batch_experts"
    for path in ("SparseAttentionLayer.project", "KDALayer.input_weight", "masked_dense", "small_batch_experts",
                 device_path):
        for kind in probes.DERIVED_UPDATES:
            assert any(path in c and kind in c for c in stale), (path, kind, stale)
    assert any("alone" in c and "copy_ into the second part only" in c for _, _, c, _ in found), found


def test_a_cache_that_rebuilds_when_nothing_changed_is_blamed_on_derived_weight(monkeypatch):
    monkeypatch.setattr(derived.DerivedWeight, "__call__", _rebuilt_every_call)
    found = _run()
    assert found and {(f, s) for f, s, _, _ in found} == {(DERIVED, "DerivedWeight.__call__")}, found
    assert all("no weight changed" in c or "nothing changed" in c or "unchanged" in c for _, _, c, _ in found), found


def test_a_path_that_memoises_its_derived_weight_is_blamed_on_the_path_not_the_cache(monkeypatch):
    from target_stack.model.layers import MoE

    real = MoE._small_weights

    def small_weights(self, dtype):  # a memo of its own over the cache: kept after an in-place update
        memo = self.__dict__.setdefault("_memo", {})
        if dtype not in memo:
            memo[dtype] = real(self, dtype)
        return memo[dtype]

    monkeypatch.setattr(MoE, "_small_weights", small_weights)
    found = _run()
    path = "MoE.forward_static (small_batch_experts, form='expert', over MoE._small_weights)"
    assert found and {(f, s) for f, s, _, _ in found} == {(LAYERS, path)}, found
    assert {c.split(" after ")[1] for _, _, c, _ in found} == {f"{k} (in place: same storage, version counter bumped)"
                                                                for k in probes.DERIVED_UPDATES}, found


def test_the_hybrid_probe_catches_the_unversioned_key_in_a_scratch_target(tmp_path):
    tree = materialize_bundled(tmp_path / "ts")
    path = tree / DERIVED
    source = path.read_text()
    assert source.count(VERSIONED) == 1
    path.write_text(source.replace(VERSIONED, UNVERSIONED))
    report = judge(tree, probe_ids=["model.hybrid"], run_all=True, use_cache=False, jobs=1,
                   extra_env={"TARGET_STACK_CACHE": str(tmp_path / "native-cache")})
    (result,) = report.results
    located = {(f.location.file, f.location.symbol) for f in result.findings if "violates" not in f.message}
    assert result.status == Status.failed and located == {(DERIVED, "DerivedWeight.__call__")}, located


def test_a_wrong_stacking_is_blamed_on_stack_rows_for_the_projections_that_read_it(monkeypatch):
    from target_stack.model import kda_layer, model

    def reversed_rows(parts):  # the parts stacked last first
        return torch.cat(list(parts)[::-1])

    for module in (derived, model, kda_layer):
        monkeypatch.setattr(module, "stack_rows", reversed_rows)
    found = _run()
    assert found and {(f, s) for f, s, _, _ in found} == {(DERIVED, "stack_rows")}, found
    conditions = " ".join(c for _, _, c, _ in found)
    assert "SparseAttentionLayer.project" in conditions and "KDALayer.input_weight" in conditions, found
