"""The component probes through the real harness: each one passes on the clean bundled target and
fails, naming the right file and symbol, when a realistic defect is planted in a scratch copy.

Defects are grouped so that one harness call runs several probes, each seeing only the defects
in the files it covers; every probe also runs (and passes) in a tree where its files are clean.
Several defects in one file are told apart by the symbol their findings name.
"""

from __future__ import annotations

import pathlib

import pytest

from feedback.harness import judge
from feedback.models import Status
from feedback.targets import materialize_bundled
from target_stack.probes import reference as ref

LAYERS = "target_stack/model/layers.py"
QUANT = "target_stack/model/quant.py"
MODEL = "target_stack/model/model.py"
IMAGE = "target_stack/model/image.py"
KDA_LAYER = "target_stack/model/kda_layer.py"
SAMPLER = "target_stack/engine/sampler.py"
RUNNER = "target_stack/engine/runner.py"
TP = "target_stack/engine/tp.py"
REPLAY = "target_stack/engine/replay_ssm.py"
DISAGG = "target_stack/engine/disagg/transfer.py"
WORKERS = "target_stack/engine/disagg/workers.py"
NATIVE_C = "target_stack/ops/moe/native/moe_dispatch.c"
CHUNK = "target_stack/ops/kda/chunk.py"
RECURRENT = "target_stack/ops/kda/fused_recurrent.py"
CP = "target_stack/ops/kda/cp.py"
SCHEDULER = "target_stack/engine/scheduler.py"
ENGINE = "target_stack/engine/engine.py"
KV_CACHE = "target_stack/engine/cache.py"
DECODE_INPUTS = "target_stack/ops/kda/decode_inputs.py"
NORM = "target_stack/ops/norm.py"
MESSAGES = "target_stack/engine/disagg/messages.py"
CLUSTER = "target_stack/engine/disagg/cluster.py"
SERVE = "target_stack/serve.py"
NAIVE = "target_stack/ops/kda/naive.py"
PREFIX = "target_stack/engine/prefix.py"
SEQUENCE = "target_stack/engine/sequence.py"

# name: (file, text, replacement)
DEFECTS = {
    "prompt positions without the image patches": (
        SEQUENCE, "extra = 0 if self.prompt_embeds is None else self.prompt_embeds.shape[0]", "extra = 0"),
    "stored values read with the keys' scales": (
        KV_CACHE, "((self.k, self.k_scale), (self.v, self.v_scale)):\n            x = dequantize_kv",
        "((self.k, self.k_scale), (self.v, self.k_scale)):\n            x = dequantize_kv"),
    "rmsnorm eps outside the root": (
        LAYERS, "torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)",
        "1.0 / (xf.pow(2).mean(-1, keepdim=True).sqrt() + self.eps)"),
    "prefill window one token wider": (
        LAYERS, "keep |= (qpos[:, None] - pos[None, :] < window) & causal",
        "keep |= (qpos[:, None] - pos[None, :] <= window) & causal"),
    "softmax routing": (
        LAYERS, "scores = torch.sigmoid(F.linear(x.float(), self.router.float()))",
        "scores = torch.softmax(F.linear(x.float(), self.router.float()), dim=-1)"),
    "top-k weights not renormalised": (
        LAYERS, "return w / w.sum(-1, keepdim=True).clamp_min(1e-9), idx", "return w, idx"),
    "decode window one token shorter": (
        LAYERS, "keep |= (lengths[:, None] - 1 - pos[None, :]) < window",
        "keep |= (lengths[:, None] - pos[None, :]) < window"),
    "int8 KV scale over 128": (
        QUANT, 'if kind == "int8":\n        scale = amax / 127.0', 'if kind == "int8":\n        scale = amax / 128.0'),
    "per-tensor activation scale": (
        QUANT, "amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-8)\n    scale = amax / 127.0",
        "amax = x.abs().amax().float().clamp_min(1e-8).expand(*x.shape[:-1], 1)\n    scale = amax / 127.0"),
    "temperature applied twice": (
        SAMPLER, "torch.softmax(logits[row] / p.temperature, dim=-1)",
        "torch.softmax(logits[row] / p.temperature / p.temperature, dim=-1)"),
    "top-p keeps one token too few": (
        SAMPLER, "sorted_p.masked_fill(before >= top_p, 0.0)", "sorted_p.masked_fill(before + sorted_p > top_p, 0.0)"),
    "top-p not renormalised": (SAMPLER, "return kept / kept.sum(-1, keepdim=True)", "return kept"),
    "prefill hands on the oldest convolution inputs": (
        KDA_LAYER, "conv = full[:, -(CONV - 1):]\n        h0 = state.kda if state else None",
        "conv = full[:, :CONV - 1]\n        h0 = state.kda if state else None"),
    "k not normalised": (KDA_LAYER, "k = F.normalize(k.reshape(B, T, H, K), dim=-1)", "k = k.reshape(B, T, H, K)"),
    "tp dt_bias of rank 0 everywhere": (
        TP, "shard.dt_bias.copy_(layer.dt_bias[q_idx])", "shard.dt_bias.copy_(layer.dt_bias[: h * K])"),
    "ffn reads the first norm": (MODEL, "return h + ffn(norm2(h))", "return h + ffn(norm(h))"),
    "netpbm divided by 255": (
        IMAGE, "img = px.permute(2, 0, 1).float() / maxval", "img = px.permute(2, 0, 1).float() / 255"),
    "native silu sign": (NATIVE_C, "hid[h] = g / (1.f + expf(-g)) * u;", "hid[h] = g / (1.f + expf(g)) * u;"),
    "decode lengths one short": (
        RUNNER, "lengths = torch.tensor([s.length for s in seqs], device=self.device)",
        "lengths = torch.tensor([s.length - 1 for s in seqs], device=self.device)"),
    "in-kernel k normalisation dropped": (
        RECURRENT, "            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)\n", ""),
    "last decay of the first sequence's chunks": (
        CHUNK, "tl.load(glast + ((c0 + i_c) * H + i_h) * K + o_k", "tl.load(glast + (i_c * H + i_h) * K + o_k"),
    "replay decay off by one token": (REPLAY, "G = g.cumsum(0)  # [n, H, K]", "G = g.cumsum(0) - g  # [n, H, K]"),
    "conv tail not transferred": (DISAGG, 'for name in ("kda", "conv"):', 'for name in ("kda",):'),
    "page copy to the source page": (DISAGG, "remote[dst].copy_(t[src])", "remote[src].copy_(t[src])"),
    "merge row of the wrong sequence": (CP, "row = (i_n * P + p) * H + i_h", "row = (i_n + p) * H + i_h"),
    # outputs stay right with these (any victim resumes correctly; a stale slot is overwritten by luck)
    "preempts the oldest": (SCHEDULER, "victim = self.running[-1]", "victim = self.running[0]"),
    "stale slot after release": (
        SCHEDULER, "            self.slots.give([seq.slot], seq.id)\n            seq.slot = 0",
        "            self.slots.give([seq.slot], seq.id)"),
    "cancelled request stays queued": (
        ENGINE, "        self.scheduler.release(seq)\n        self.scheduler.remove_waiting(seq)",
        "        self.scheduler.release(seq)"),
    # preemption and admission: a copy of nothing resumed from, a request that never starts or starts a step late
    "preempted sequence copied after its release": (
        SCHEDULER, "        seq.swapped = self.swap_out(seq)\n        self.release(seq)",
        "        self.release(seq)\n        seq.swapped = self.swap_out(seq)"),
    "a prompt past the prefill budget never admitted": (
        SCHEDULER, "if not resuming and plan.prefill and tokens", "if not resuming and tokens"),
    "a prompt filling the rest of the prefill budget waits a step": (
        SCHEDULER, "- reused > self.max_prefill_tokens", "- reused >= self.max_prefill_tokens"),
    "conv state not swapped back in": (
        RUNNER, "            pool.conv[seq.slot] = conv.to(self.device)\n", ""),
    # the GPU's decode path only, unless a probe turns the layer's fused kernels on
    "decode-input tails shifted twice from the same slot": (
        DECODE_INPUTS, "tl.store(pool + (slot * 3 + 1) * C + ch, t2, mask=live)",
        "tl.store(pool + (slot * 3 + 1) * C + ch, t1, mask=live)"),
    "gate of the fused norm not squashed": (
        NORM, "out = out * tl.sigmoid(tl.load(gate + row * N + offs, mask=m, other=0.0).to(tl.float32))",
        "out = out * tl.load(gate + row * N + offs, mask=m, other=0.0).to(tl.float32)"),
    "sentinel that does not survive pickling": (MESSAGES, "STOP = None", "STOP = object()"),
    "run's transfer flag ignored": (
        CLUSTER, "req = Request(rid, list(prompt), params, timings[rid], transfer, image=image)",
        "req = Request(rid, list(prompt), params, timings[rid], self.transfer, image=image)"),
    "a stop token of 0 ignored": (
        ENGINE, "if seq.params.stop_token is not None and token == seq.params.stop_token:",
        "if seq.params.stop_token and token == seq.params.stop_token:"),
    "swapped-out state kept as views of the pool": (
        RUNNER, 'out["state"][i] = (pool.kda[seq.slot].to("cpu", copy=True), pool.conv[seq.slot].to("cpu", copy=True))',
        'out["state"][i] = (pool.kda[seq.slot], pool.conv[seq.slot])'),
    "prefix hit hands out a page too many": (
        PREFIX, "pages = hit.entry.pages[: hit.length // self.page_size]",
        "pages = hit.entry.pages[: hit.length // self.page_size + 1]"),
    "torch chunk form decays the carried state the wrong way": (
        NAIVE, "((G_last - G).exp() * kc)", "((G - G_last).exp() * kc)"),
    "cached tokens counted as cache hits": (
        SERVE, 'prefix.stats["reused_tokens"] - before if prefix else 0',
        'prefix.stats["hits"] - before if prefix else 0'),
}


def _tree(tmp_path: pathlib.Path, defects: list[str]) -> pathlib.Path:
    tree = materialize_bundled(tmp_path / "ts")
    for name in defects:
        file, text, replacement = DEFECTS[name]
        path = tree / file
        source = path.read_text()
        assert source.count(text) == 1, f"defect {name!r}: the text to replace is not in {file} exactly once"
        path.write_text(source.replace(text, replacement))
    return tree


def _judge(tmp_path: pathlib.Path, defects: list[str], probes: list[str]) -> dict:
    tree = _tree(tmp_path, defects)
    env = {"TARGET_STACK_CACHE": str(tmp_path / "native-cache")}  # a planted C defect builds its own library
    report = judge(tree, probe_ids=probes, run_all=True, use_cache=False, jobs=2, extra_env=env)
    return {r.probe: r for r in report.results}


def _located(result) -> list[tuple[str, str]]:
    """(file, symbol or kernel) of the probe's own findings: threshold violations left out, and a device's fault
    (an out-of-bounds kernel on a GPU: it names where it surfaced, the configuration that ran, not a culprit)
    or its memory running out (a parallel test run shares one GPU)."""
    return [(f.location.file or "", f.location.symbol or f.location.kernel or "") for f in result.findings
            if "violates" not in f.message and not f.message.startswith((ref.DEVICE_FAULT, ref.OUT_OF_MEMORY))]


def assert_passed(results: dict, *probes: str) -> None:
    for pid in probes:
        r = results[pid]
        assert r.status == Status.passed, f"{pid} on a clean copy: {r.status} {r.reason} {_located(r)} " \
                                          f"{[f.message for f in r.findings]}"


def assert_caught(result, *expected: tuple[str, str], only: bool = True) -> None:
    """Failed, with a finding at each (file, symbol part); with ``only``, no finding names another file."""
    located = _located(result)
    assert result.status == Status.failed, f"{result.probe}: {result.status} {result.reason} {located}"
    for file, symbol in expected:
        assert any(f == file and symbol in s for f, s in located), f"{result.probe}: no finding at {file} {symbol}: " \
                                                                  f"{located}"
    if only:
        files = {f for f, _ in expected}
        assert {f for f, _ in located} <= files, f"{result.probe} also blames {located}: " \
                                                 f"{[f.message[:300] for f in result.findings]}"


def test_norm_window_kv_scale_sampler_and_tp_defects_are_caught_and_located(tmp_path):
    r = _judge(tmp_path, ["rmsnorm eps outside the root", "prefill window one token wider", "int8 KV scale over 128",
                          "temperature applied twice", "top-p not renormalised", "tp dt_bias of rank 0 everywhere"],
               ["model.layers", "model.quant", "engine.sampler", "engine.tp", "model.kda_layer",
                "kda.chunk.correctness", "kda.recurrent.correctness"])
    assert_caught(r["model.layers"], (LAYERS, "RMSNorm.forward"), (LAYERS, "sparse_attention"))
    assert {s for _, s in _located(r["model.layers"])} == {"RMSNorm.forward", "sparse_attention"}
    assert_caught(r["model.quant"], (QUANT, "quantize_kv"))
    assert all("int8" in f.location.condition for f in r["model.quant"].findings if f.location.condition)
    # the temperature shows in the draws; the filter's missing renormalisation only in its own output
    # (the draws, normalised by multinomial, still follow the nucleus)
    assert_caught(r["engine.sampler"], (SAMPLER, "sample"), (SAMPLER, "top_p_filter"))
    assert {s for _, s in _located(r["engine.sampler"])} == {"sample", "top_p_filter"}
    assert all("top_p=" in f.location.condition for f in r["engine.sampler"].findings
               if f.location.symbol == "top_p_filter")
    assert_caught(r["engine.tp"], (TP, "shard_kda_layer"))
    assert_passed(r, "model.kda_layer", "kda.chunk.correctness", "kda.recurrent.correctness")


def test_routing_decode_window_w8a8_nucleus_and_kda_layer_defects_are_caught_and_located(tmp_path):
    r = _judge(tmp_path, ["softmax routing", "decode window one token shorter", "per-tensor activation scale",
                          "top-p keeps one token too few", "k not normalised"],
               ["model.layers", "model.quant", "engine.sampler", "model.kda_layer"])
    assert_caught(r["model.layers"], (LAYERS, "MoE.route"), (LAYERS, "sparse_decode_attention"))
    assert all(s.startswith(("MoE", "sparse_decode_attention")) for _, s in _located(r["model.layers"]))
    assert_caught(r["model.quant"], (QUANT, "W8A8Linear"))
    assert_caught(r["engine.sampler"], (SAMPLER, "top_p_filter"), (SAMPLER, "sample"))
    assert_caught(r["model.kda_layer"], (KDA_LAYER, "KDALayer.prefill"), (KDA_LAYER, "KDALayer.decode"))


def test_unnormalised_routing_weights_are_blamed_on_the_router_on_every_path(tmp_path):
    r = _judge(tmp_path, ["top-k weights not renormalised"], ["model.layers", "model.moe.native"])
    assert_caught(r["model.layers"], (LAYERS, "MoE.route"))
    assert_caught(r["model.moe.native"], (LAYERS, "MoE.route"))  # the extension itself computes right


def test_block_wiring_image_native_and_cp_layout_defects_are_caught_and_located(tmp_path):
    r = _judge(tmp_path, ["ffn reads the first norm", "netpbm divided by 255", "native silu sign",
                          "merge row of the wrong sequence"],
               ["model.hybrid", "model.moe.native", "kda.cp.correctness", "engine.sampler", "model.layers",
                "model.quant", "engine.tp"])
    assert_caught(r["model.hybrid"], (MODEL, "Block.forward"), (IMAGE, "decode_netpbm"))
    assert not any(s.startswith(("RMSNorm", "MoE", "SwiGLU", "KDALayer")) for _, s in _located(r["model.hybrid"]))
    assert_caught(r["model.moe.native"], (NATIVE_C, "ts_moe_dispatch_combine"))
    cp = r["kda.cp.correctness"]  # invisible with one sequence: only the case of two shows it
    assert_caught(cp, (CP, "chunk_kda_cp"))
    assert all("B=2" in f.location.condition for f in cp.findings if f.location.condition)
    assert_passed(r, "engine.sampler", "model.layers", "model.quant", "engine.tp")


def test_kernel_condition_defects_are_caught_and_located(tmp_path):
    r = _judge(tmp_path, ["in-kernel k normalisation dropped", "last decay of the first sequence's chunks"],
               ["engine.reference", "kda.recurrent.correctness", "kda.chunk.correctness", "model.hybrid",
                "model.moe.native"])
    rec = r["kda.recurrent.correctness"]
    assert_caught(rec, (RECURRENT, "_kda_fused_recurrent_kernel"))
    assert all("l2norm=True" in f.location.condition for f in rec.findings if f.location.condition)
    chunk = r["kda.chunk.correctness"]  # every sequence after the first of a batch decays with the first one's gates
    assert_caught(chunk, (CHUNK, "_kda_state_kernel"))
    assert all("B=2" in f.location.condition or "seqlens" in f.location.condition
               for f in chunk.findings if f.location.condition)
    # the model and the engine prefill one sequence per call, so neither can see it, on any device (on an H200
    # the engine and the model run the planted kernel: both passed there, 2026-12-04)
    assert_passed(r, "model.hybrid", "model.moe.native", "engine.reference")


def test_a_runner_defect_is_caught_on_every_device(tmp_path):
    # on a GPU decode replays CUDA graphs, which compute the lengths themselves: the eager configuration finds it
    r = _judge(tmp_path, ["decode lengths one short"], ["engine.reference"])
    assert_caught(r["engine.reference"], (RUNNER, "ModelRunner.decode"))


def test_a_defect_in_reading_stored_kv_is_caught_past_the_storage_tie_margin(tmp_path):
    # only quantised storage has scales: the int8 configuration, whose steps from stored KV are judged only
    # where their discrete choices are clear of the storage's tie margin, must still see it
    r = _judge(tmp_path, ["stored values read with the keys' scales"], ["engine.reference"])
    res = r["engine.reference"]
    assert_caught(res, (RUNNER, "ModelRunner.decode"), only=False)
    assert all("kv_dtype=int8" in (f.location.condition or "") for f in res.findings if "violates" not in f.message)
    assert "near_tie_steps_int8_kv" in res.metrics  # the steps left to the margin are counted


def test_a_state_handed_on_wrong_is_blamed_on_the_layer_and_not_on_the_engine(tmp_path):
    # every output of a prefill is right; only the next step, from the handed-on state, is off
    r = _judge(tmp_path, ["prefill hands on the oldest convolution inputs"], ["engine.reference"])
    assert_caught(r["engine.reference"], (KDA_LAYER, "KDALayer.decode"))


def test_the_sequences_position_count_is_blamed_for_an_image_prompt_placed_wrong(tmp_path):
    # the engine places the image request's keys by the sequence's own count: the count is checked where
    # the engine reads it, so the defect is named in the sequence, not in the engine that used it
    r = _judge(tmp_path, ["prompt positions without the image patches"], ["engine.reference"])
    assert_caught(r["engine.reference"], (SEQUENCE, "Sequence.num_prompt"), only=False)


def test_scheduler_defects_that_outputs_hide_break_its_promises(tmp_path):
    r = _judge(tmp_path, ["preempts the oldest", "stale slot after release", "cancelled request stays queued"],
               ["engine.scheduler"])
    res = r["engine.scheduler"]
    assert_caught(res, (SCHEDULER, "Scheduler.schedule"), (SCHEDULER, "Scheduler.release"),
                  (ENGINE, "LLMEngine._finish"))
    victim = [f.message for f in res.findings if f.location.symbol == "Scheduler.schedule"]
    assert any("most recently admitted" in m for m in victim), victim


def test_a_preempted_copy_of_nothing_and_a_request_never_admitted_are_blamed_on_the_scheduler(tmp_path):
    # the copy is taken after the pages and slot are given back; a prompt past max_prefill_tokens waits forever
    r = _judge(tmp_path, ["preempted sequence copied after its release",
                          "a prompt past the prefill budget never admitted"], ["engine.scheduler"])
    res = r["engine.scheduler"]
    assert_caught(res, (SCHEDULER, "Scheduler.preempt"), (SCHEDULER, "Scheduler.schedule"))
    messages = [f.message for f in res.findings]
    assert any("swap_out was given pages []" in m for m in messages), messages
    assert any("made no progress" in m for m in messages), messages  # the step bound, not the probe's budget_s
    assert any("left queued though admissible" in m for m in messages), messages


def test_a_late_admission_at_the_budget_and_a_lost_swap_in_are_told_apart(tmp_path):
    r = _judge(tmp_path, ["a prompt filling the rest of the prefill budget waits a step",
                          "conv state not swapped back in"], ["engine.scheduler"])
    res = r["engine.scheduler"]
    assert_caught(res, (SCHEDULER, "Scheduler.schedule"), (RUNNER, "ModelRunner.swap_in"))
    late = [f.message for f in res.findings if f.location.symbol == "Scheduler.schedule"]
    assert late and all("left queued though admissible" in m for m in late), late


@pytest.mark.slow
def test_replay_defect_is_caught_while_the_disaggregated_cluster_passes(tmp_path):
    r = _judge(tmp_path, ["replay decay off by one token"], ["engine.reference", "engine.disagg.correctness"])
    assert_caught(r["engine.reference"], (REPLAY, "ReplaySSM"), only=False)
    assert_passed(r, "engine.disagg.correctness")


@pytest.mark.slow
def test_transfer_defects_are_caught_while_the_engine_passes(tmp_path):
    r = _judge(tmp_path, ["conv tail not transferred", "page copy to the source page"],
               ["engine.disagg.correctness", "engine.reference"])
    res = r["engine.disagg.correctness"]
    assert_caught(res, (DISAGG, "TransferEngine._copy_stage"), (WORKERS, "decode_worker"))  # the copy, the outputs
    copies = {f.location.symbol: f.message for f in res.findings if "_copy_stage" in (f.location.symbol or "")}
    # the missing conv tail in every mode; the page-by-page mode's pages besides (kv pools listed first)
    assert len(copies) == 3 and "kv." in copies["TransferEngine._copy_stage (copy='page')"]
    assert all("state." in m and "kv." not in m for s, m in copies.items() if "'page'" not in s)
    assert_passed(r, "engine.reference")


def test_the_fused_decode_step_is_judged_on_the_cpu_and_each_kernel_blamed(tmp_path):
    # the engine takes the one-launch decode inputs and the gated norm on a GPU only; the layer probe runs them
    r = _judge(tmp_path, ["decode-input tails shifted twice from the same slot", "gate of the fused norm not squashed"],
               ["model.kda_layer"])
    res = r["model.kda_layer"]
    assert_caught(res, (DECODE_INPUTS, "kda_decode_inputs"), (NORM, "rms_norm (gate)"))
    tails = [f.location.condition for f in res.findings if f.location.file == DECODE_INPUTS]
    assert any("decode step 1" in c for c in tails), tails  # the first shift is wrong already


def test_the_endpoint_and_the_clusters_protocol_are_judged(tmp_path):
    r = _judge(tmp_path, ["cached tokens counted as cache hits", "sentinel that does not survive pickling",
                          "run's transfer flag ignored"], ["engine.http", "engine.disagg.correctness"])
    assert_caught(r["engine.http"], (SERVE, "Server.complete"))
    assert all("cached_tokens" in f.message for f in r["engine.http"].findings if "violates" not in f.message)
    # the protocol's sentinel, then its consequence (workers that never stop); the prefill-only run
    assert_caught(r["engine.disagg.correctness"], (MESSAGES, "wire protocol"), (WORKERS, "shutdown"),
                  (CLUSTER, "DisaggCluster.run(transfer=False)"))


def test_the_endpoint_probe_passes_on_the_clean_target(tmp_path):
    r = _judge(tmp_path, [], ["engine.http"])
    assert_passed(r, "engine.http")
    assert r["engine.http"].metrics["calls"].value == 3


def test_stop_tokens_swap_snapshots_and_prefix_heads_are_judged(tmp_path):
    r = _judge(tmp_path, ["a stop token of 0 ignored", "swapped-out state kept as views of the pool",
                          "prefix hit hands out a page too many"],
               ["engine.correctness", "engine.pool_accounting", "engine.scheduler"])
    res = r["engine.correctness"]  # the runner's logits steered: token 0 comes, and the request runs on past it
    assert_caught(res, (ENGINE, "stop tokens"))
    assert all("stop_token=0 " in f.location.condition for f in res.findings if "violates" not in f.message)
    assert_caught(r["engine.pool_accounting"], (RUNNER, "ModelRunner.swap_out"))
    assert_caught(r["engine.scheduler"], (PREFIX, "PrefixCache.acquire"), only=False)
    # the saved state changes while swapped out: the copy is blamed when it is swapped back in
    assert_caught(r["engine.scheduler"], (RUNNER, "ModelRunner.swap_out"), only=False)


def test_the_torch_chunk_form_is_blamed_for_its_own_defect(tmp_path):
    r = _judge(tmp_path, ["torch chunk form decays the carried state the wrong way"], ["model.kda_layer"])
    assert_caught(r["model.kda_layer"], (NAIVE, "naive_chunk_kda"), only=False)


# -- the native layout wait's deadline, the sampler's exit, the page pool under threads: the probes' checks on the
# real components, with a realistic defect planted where it would sit (lighter than a whole harness run)


def _findings(ctx) -> list[tuple[str, str, str]]:
    return [(f.location.file or "", f.location.symbol or "", f.message) for f in ctx.findings]


def test_the_layout_wait_check_blames_a_timeout_in_the_wrong_unit_on_the_wrapper(monkeypatch):
    """The wrapper's timeout passed in milliseconds to a C function that takes microseconds (a 3 s wait becomes
    3 ms): the C function called directly keeps its deadlines, the wrapper misses a flag published 0.2 s late."""
    from feedback.probe import ProbeContext
    from target_stack.ops.moe import native
    from target_stack.probes.model import NATIVE_PY, _check_layout_wait

    ctx = ProbeContext("model.moe.native", {}, ".")
    _check_layout_wait(ctx, ref.Draw("cpu"))
    assert not ctx.failed, _findings(ctx)

    real = native.library()

    class Milliseconds:  # the library as the wrapper sees it, its timeout argument read a thousand times short
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def ts_moe_layout_wait(flag, expected, timeout, *rest):
            return real.ts_moe_layout_wait(flag, expected, timeout // 1000, *rest)

    monkeypatch.setattr(native, "library", lambda: Milliseconds())
    ctx = ProbeContext("model.moe.native", {}, ".")
    _check_layout_wait(ctx, ref.Draw("cpu"))
    found = _findings(ctx)
    assert ctx.failed and found and {f for f, _, _ in found} == {NATIVE_PY}, found
    assert any("TimeoutError" in m and "published 0.2 s late" in m for _, _, m in found), found


def test_a_sampler_thread_that_keeps_the_process_alive_is_blamed_on_the_events_module(tmp_path, monkeypatch):
    """A process that writes events with the GIL sampler on must exit when its main code ends; with the sampler
    thread started without daemon=True it never does, and the check says so within its grace time."""
    import time

    import target_stack.events as events
    from feedback.probe import ProbeContext
    from target_stack.probes.engine import EVENTS, _check_sampled_process_exits

    ctx = ProbeContext("engine.kv_transfer.events", {}, ".")
    _check_sampled_process_exits(ctx)
    assert not ctx.failed, _findings(ctx)

    src = pathlib.Path(events.__file__).read_text()
    text = 'threading.Thread(target=run, name="gil-sampler", daemon=True).start()'
    assert src.count(text) == 1
    (tmp_path / "target_stack").mkdir()
    (tmp_path / "target_stack" / "__init__.py").write_text("")
    planted = tmp_path / "target_stack" / "events.py"
    planted.write_text(src.replace(text, 'threading.Thread(target=run, name="gil-sampler").start()'))
    monkeypatch.setattr(events, "__file__", str(planted))  # the check runs the child on this module's tree
    ctx = ProbeContext("engine.kv_transfer.events", {"exit_grace_s": 1.0}, ".")
    t0 = time.monotonic()
    _check_sampled_process_exits(ctx)
    assert time.monotonic() - t0 < 20
    found = _findings(ctx)
    assert ctx.failed and [f for f, _, _ in found] == [EVENTS], found
    assert "did not exit" in found[0][2] and "after its main code ended" in found[0][2], found


def test_a_pool_capacity_check_outside_its_lock_is_caught_under_threads(monkeypatch):
    """FreeList.take checking the free count before taking its lock: two threads near exhaustion both pass the
    check and one pops from an empty list (IndexError, pages lost).  The clean pool passes the same run."""
    from feedback.probe import ProbeContext
    from target_stack.engine import cache
    from target_stack.probes.engine import _check_pool_threads

    ctx = ProbeContext("engine.pool_accounting", {}, ".")
    _check_pool_threads(ctx)
    assert not ctx.failed, _findings(ctx)

    def take(self, count, owner):
        if count > len(self._free):
            raise cache.OutOfMemory(f"{self.what}: need {count}, {len(self._free)} free")
        with self._lock:
            ids = [self._free.pop() for _ in range(count)]
            for i in ids:
                self._owner[i] = owner
            return ids

    monkeypatch.setattr(cache.FreeList, "take", take)
    ctx = ProbeContext("engine.pool_accounting", {"pool_threads": {"seconds": 3.0}}, ".")  # ends at the first error
    _check_pool_threads(ctx)
    found = _findings(ctx)
    assert ctx.failed and {f for f, _, _ in found} == {KV_CACHE}, found
    assert any(s == "FreeList.take" and "IndexError" in m for _, s, m in found), found
