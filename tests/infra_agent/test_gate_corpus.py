"""A corpus of real diffs of the bundled target, each with the decision the gate must reach: the
synchronisation, exposure and numerics changes that use no dtype word are held, so are malformed
and CRLF diffs; harmless edits are clean.  Each diff is made by git from an edit of the real file."""

from __future__ import annotations

import pytest

from feedback.manifest import load_manifest
from infra_agent.gate import assess_text
from tests.support.bundled import bundled_diff, replacing

CACHE = "target_stack/engine/cache.py"
TRANSFER = "target_stack/engine/disagg/transfer.py"
SERVE = "target_stack/serve.py"
LAYERS = "target_stack/model/layers.py"
QUANT = "target_stack/model/quant.py"
SAMPLER = "target_stack/engine/sampler.py"

# name: (file, old, new, decision, category or None)
CORPUS = {
    "a lock's with-block removed": (CACHE, "        with self._lock:\n            if count > len(self._free):",
                                    "        if True:\n            if count > len(self._free):", "held", "concurrency"),
    "a stream wait dropped": (TRANSFER, "                        self.stream.wait_event(item.event)\n", "",
                              "held", "concurrency"),
    "a synchronize dropped": (TRANSFER, "                        self.stream.synchronize()\n", "", "held",
                              "concurrency"),
    "the server binds every interface": (SERVE, 'ThreadingHTTPServer(("127.0.0.1", args.http), handler)',
                                         'ThreadingHTTPServer(("0.0.0.0", args.http), handler)', "held", "production"),
    "a default request limit raised": (SERVE, 'body.get("max_tokens", 16)', 'body.get("max_tokens", 4096)', "held",
                                       "production"),
    "an epsilon without the word eps": (LAYERS, "clamp_min(1e-9), idx", "clamp_min(1e-3), idx", "held", "numerics"),
    "a quantisation clamp range": (QUANT, "clamp_(-127, 127).to(torch.int8), scale",
                                   "clamp_(-128, 127).to(torch.int8), scale", "held", "numerics"),
    "a reduction reordered": (SAMPLER, "before = sorted_p.cumsum(-1) - sorted_p",
                              "before = sorted_p.flip(-1).cumsum(-1).flip(-1) - sorted_p", "held", "numerics"),
    "the cudnn autotuner switched on": (SAMPLER, "import torch\n",
                                        "import torch\n\ntorch.backends.cudnn.benchmark = True\n", "held", "numerics"),
    "tf32 allowed through the environment": ("target_stack/ops/utils.py", "import os\n",
                                             'import os\n\nos.environ.setdefault("NVIDIA_TF32_OVERRIDE", "1")\n',
                                             "held", "numerics"),
    "a comment added to a lock's line": (CACHE, "        with self._lock:\n            if count > len(self._free):",
                                         "        with self._lock:  # one owner at a time\n"
                                         "            if count > len(self._free):",
                                         "clean", None),  # the code of the line is the same: nothing to review
    "a line moved out of a lock's block": (CACHE, "                self._owner[i] = owner\n            return ids\n",
                                           "                self._owner[i] = owner\n        return ids\n", "held",
                                           "concurrency"),
    "a heading of the scenarios' notes": ("target_stack/scenarios/README.md", "# target_stack scenarios",
                                          "# The scenarios of target_stack", "clean", None),
}


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_the_gate_decides_each_real_diff_as_expected(tmp_path, name):
    rel, old, new, decision, category = CORPUS[name]
    diff, root = bundled_diff(tmp_path, {rel: replacing(old, new)})
    result = assess_text(diff, load_manifest(root), tree=root)
    assert result.decision == decision, (name, [f.render() for f in result.findings], result.error)
    if category:
        assert category in result.categories, (name, result.categories)


def test_crlf_and_malformed_diffs_are_never_clean(tmp_path):
    diff, root = bundled_diff(tmp_path, {"target_stack/scenarios/README.md": replacing(
        "# target_stack scenarios", "# The scenarios of target_stack")})
    manifest = load_manifest(root)
    assert assess_text(diff, manifest, tree=root).decision == "clean"  # the same change, LF: clean
    crlf = diff.replace("\n", "\r\n")
    assert assess_text(crlf, manifest, tree=root).decision in ("held", "error", "refused")
    cut = diff[: len(diff) // 2]
    assert assess_text(cut, manifest, tree=root).decision in ("held", "error")
