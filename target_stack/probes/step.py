"""What one engine decode step launches, counted on any machine (protected from patches).

A graph-captured decode step at batch 1 is bound by its launches (bench/RESULTS.md: hundreds of small
kernels and dtype conversions), and a captured step must never wait for the host.  This probe runs
``ModelRunner.decode_step(static=True)`` (the form a CUDA graph captures) once in the forms a GPU runs (Triton
KDA kernels, the fused norms, router, decode inputs and decode attention, the small-batch experts) under
Triton's interpreter, and counts with ``feedback.launchcount`` every aten op that launches, every Triton
launch and every host sync, per target_stack function: counted metrics the verdict judges against the base
exactly, so a patch that adds a conversion, unfuses a kernel or splits a launch is ``worse`` on a CPU and
names the function.  A host sync in the step fails the probe: a CUDA graph cannot capture it.

The step's logits are held to the float64 model recomputed from each sequence's tokens (a step that skips
work must not count less and pass).  Prompts are fresh random tokens on every run; what the counts depend
on (the preset, the lengths, the forms) is fixed.  Prefill runs in the CPU's torch forms (it is not counted),
then one uncounted step builds what later steps reuse (stacked expert weights) and the state is put back.
"""

from __future__ import annotations

import torch

import target_stack.ops  # noqa: F401  (runtime choice before triton loads)
from feedback.correctness import fresh_generator, rel_err
from feedback.probe import ProbeContext, probe
from target_stack.probes import reference as ref
from target_stack.probes.reference import finite

RUNNER = "target_stack/engine/runner.py"
WITHIN = ["target_stack/"]
PLUMBING = ["target_stack/ops/utils.py"]  # a kernel's launch belongs to the op that asked for it

torch.set_num_threads(1)  # small tensors


def gpu_forms(model, fused: bool = True, small_batch: bool = True) -> None:
    """The forms a GPU runs, on any device: Triton KDA kernels, and the fused kernels
    (``ModelConfig.fused_kernels``) and small-batch experts forced on or off (not left to the device)."""
    from target_stack.model.kda_layer import KDALayer
    from target_stack.model.layers import MoE, RMSNorm
    from target_stack.model.model import SparseAttentionLayer

    for block in model.blocks:
        if not block.is_attn:
            block.mixer.backend = "triton"
    for module in model.modules():
        if isinstance(module, RMSNorm | KDALayer | MoE | SparseAttentionLayer):
            module.fused = fused
        if isinstance(module, MoE):
            module.small_batch = small_batch


def cpu_forms(model) -> None:
    """The torch forms of a CPU (fast for a prefill that is not counted)."""
    for block in model.blocks:
        if not block.is_attn:
            block.mixer.backend = "torch"
    model.set_fused_kernels(False)


def static_step_inputs(engine) -> tuple:
    """(tokens, lengths, slots, block table) of the next decode step of every sequence ``engine`` holds, for
    ``engine.runner.decode_step(*inputs, static=True)``: the form a CUDA graph captures."""
    runner = engine.runner
    seqs = list(engine.seqs.values())
    dev = runner.model.embed.device
    return (torch.tensor([s.output[-1] for s in seqs], device=dev), torch.tensor([s.length for s in seqs], device=dev),
            torch.tensor([s.slot for s in seqs], device=dev),
            runner.block_table(seqs, max(-(-s.length // runner.page_size) for s in seqs)))


def prefilled(model, prompts: list[list[int]]):
    """An engine holding ``prompts``, each prefilled to its first token (in the model's current forms)."""
    from target_stack.engine import LLMEngine, SamplingParams

    engine = LLMEngine(model)
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=4))
    while any(not s.output for s in engine.seqs.values()):
        engine.step()
    return engine


def state_of(runner) -> list[torch.Tensor]:
    """Every tensor a decode step writes: the KV pages and the recurrent state pools."""
    out = [t for cache in runner.kv.values() for t in cache.tensors().values()]
    return out + [t for pool in runner.states.values() for t in (pool.conv, pool.kda)]


def warmed_step(runner, args: tuple) -> torch.Tensor:
    """One uncounted step (what later steps reuse is built: stacked expert weights, the interpreter's
    rewritten kernels) with every buffer a kernel wrapper allocates poisoned, then the state as it was
    before it; its logits."""
    from target_stack.ops.utils import poisoning

    saved = [t.clone() for t in state_of(runner)]
    with torch.no_grad(), poisoning(True):
        logits = runner.decode_step(*args, static=True)
    for t, s in zip(state_of(runner), saved, strict=True):
        t.copy_(s)
    return logits


@probe(kind="trace")
def decode_step_launches(ctx: ProbeContext) -> None:
    from feedback.launchcount import LaunchCount, report
    from target_stack.model.model import HybridModel
    from target_stack.ops.utils import poisoning

    c = ctx.params
    lengths = [int(n) for n in c["lengths"]]
    tol = float(c.get("tolerance", 1e-4))
    gen = fresh_generator()
    model = HybridModel(c.get("preset", "tiny")).eval().to(ctx.device)
    vocab = model.cfg.vocab
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
    cond = f"preset {c.get('preset', 'tiny')}, batch {len(lengths)}, prompt lengths {lengths}, fp32, static step"
    with torch.no_grad():
        cpu_forms(model)
        engine = prefilled(model, prompts)
        gpu_forms(model, fused=bool(c.get("fused", True)), small_batch=bool(c.get("small_batch", True)))
        runner = engine.runner
        args = static_step_inputs(engine)
        poisoned = warmed_step(runner, args)
        with poisoning(False), LaunchCount(root=ctx.tree, within=WITHIN, plumbing=PLUMBING) as lc:
            logits = runner.decode_step(*args, static=True)  # what a server launches: no poison fills
    for op, site, n in lc.syncs():
        ctx.fail(f"the static decode step reads a tensor on the host ({op}, {n}x in {site.function}): on a GPU "
                 f"it waits for the device, and a CUDA graph cannot capture it", file=site.file,
                 symbol=site.function, condition=cond)
    worst, margin = 0.0, float("inf")
    for i, seq in enumerate(engine.seqs.values()):
        want, m = ref.hybrid_logits(model, seq.prompt + seq.output)
        margin = min(margin, m)
        # the poisoned step shows an output a kernel leaves unwritten; the counted one is the one counted
        worst = max(worst, rel_err(poisoned[i], want[-1]), rel_err(logits[i], want[-1]))
    ctx.metric("max_rel_err", finite(worst), better="lower")
    if margin < float(c.get("min_margin", 1e-4)):  # a routing decision within rounding of a tie: not comparable
        ctx.finding(f"a routing decision of the float64 model is within {margin:.1e} of a tie: the logits are "
                    f"not held to it this run", file=RUNNER, condition=cond)
    else:
        ctx.check(worst < tol, f"the counted decode step's logits are wrong (rel. error {worst:.1e} against the "
                  f"float64 model)", file=RUNNER, symbol="ModelRunner.decode_step", condition=cond)
    # every function a part (one that newly launches must show), after the failures: they come first
    report(ctx, lc, per=1, unit="step", top=c.get("top_sites"))
