"""One step, five interpreters: `evaluate`, `formula` evaluated at the point, `sweep` at the
point, the many-GPU profile with every degree 1 and `plan`'s search path for that layout give
the same step time, MFU and HFU (relative 1e-9), under both cost models, in BF16 and FP8, on
random step options and points (issue 21: a figure computed twice will disagree some day)."""

import random

import attrs
import numpy as np
import pytest
from opgraph.models import preset

from opgraph import compile_step, evaluate, hardware
from opgraph.cost.costmodel import cost_model
from opgraph.parallel.distributed import profile_parallel
from opgraph.cost.formula import formula, value
from opgraph.parallel.parallel import Parallel
from opgraph.passes.evaluate import resolve
from opgraph.parallel.search import Candidate, Searcher
from opgraph.analysis.sweep import compile_sweep

H100 = hardware.get("h100-sxm")


@pytest.mark.parametrize("cost", ["roofline", "calibrated"])
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_every_interpreter_of_a_step_agrees(cost, precision):
    rng = random.Random(f"{cost}-{precision}")  # a different draw per case, the same each run
    model = rng.choice(["gpt2", "llama3.2-1b", "gemma2-2b", "mixtral-8x7b"])
    recompute = rng.choice(["none", "selective", "selective-op", "full"])
    seq, batch = rng.choice([256, 512, 1024]), rng.choice([1, 2, 4])
    case = (model, recompute, seq, batch)
    c, forward = cost_model(cost), preset(model)
    step = compile_step(forward, recompute=recompute, precision=precision)
    point = {"B": batch, "S": seq}

    one = evaluate(step, H100, point, cost=c)
    time = float(value(formula(step, "time", hardware=H100, cost=c), resolve(step, point)))
    efficiencies = c.figures(H100) if cost == "calibrated" else None  # with clock, SMs
    swept = compile_sweep(step, cost=c).run(
        {"B": np.array([float(batch)]), "S": np.array([float(seq)])}, H100.peak_flops,
        H100.bandwidth, H100.fp8_flops, efficiencies)
    layout = Parallel(gpus=1, micro_batch=batch, global_batch=batch)
    many = profile_parallel(forward, H100, layout, values={"S": seq}, cost=c,
                            recompute=recompute, precision=precision)
    planned = Searcher(forward, H100, seq_len=seq, cost=c).one(
        Candidate(layout, recompute, precision)).result

    def same(*figures):
        assert figures == pytest.approx([figures[0]] * len(figures), rel=1e-9), case

    same(one.step_time_s, time, swept["step_time_s"][0], many.step_time_s,
         many.parallel.step_time_s, planned.step_time_s)
    same(one.mfu_ceiling, swept["mfu_ceiling"][0], many.mfu_ceiling, planned.mfu)
    same(one.hfu_ceiling, swept["hfu_ceiling"][0], many.hfu_ceiling, planned.hfu)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_a_gemm_per_expert_reaches_every_interpreter(precision):
    """Megatron-LM issues an expert layer's grouped GEMM as one cuBLAS GEMM per local expert
    (`passes/unroll_expert_gemms.py`): at one sequence of 128 tokens each of DeepSeek-V2-Lite's
    64 expert GEMMs (128 x 6 / 64 = 12 token rows of 2,048 by 1,408) is far shorter than the
    host's time to issue it, so each instance of an expert op takes 64 x host_s, and every
    interpreter says the same step."""
    c, forward, seq = cost_model("calibrated"), preset("deepseek-v2-lite"), 128
    layout = Parallel(gpus=1, micro_batch=1, global_batch=1, framework="megatron")
    step = compile_step(forward, layout=layout, precision=precision)
    point = {"B": 1, "S": seq}
    host_s = c.efficiencies(H100).host_s

    one = evaluate(step, H100, point, cost=c)
    experts = [r for r in one.ops if r.kind == "expert_matmul"]
    assert len(experts) == 9  # gate, up and down: forward, dA and dB
    for r in experts:
        assert r.time_s == pytest.approx(r.count * 64 * host_s, rel=1e-12), r.name

    time = float(value(formula(step, "time", hardware=H100, cost=c), resolve(step, point)))
    swept = compile_sweep(step, cost=c).run(
        {"B": np.array([1.0]), "S": np.array([float(seq)])}, H100.peak_flops, H100.bandwidth,
        H100.fp8_flops, c.figures(H100))
    many = profile_parallel(forward, H100, layout, values={"S": seq}, cost=c,
                            precision=precision)
    planned = Searcher(forward, H100, seq_len=seq, cost=c).one(
        Candidate(layout, "none", precision)).result
    figures = [one.step_time_s, time, swept["step_time_s"][0], many.step_time_s,
               many.parallel.step_time_s, planned.step_time_s]
    assert figures == pytest.approx([figures[0]] * len(figures), rel=1e-9)


def test_megatron_runs_attention_at_the_fused_librarys_efficiency():
    """Transformer Engine runs cuDNN's attention on Hopper (`passes/pick_attention_kernel.py`):
    at 8,192 tokens FlashAttention's kernels are compute-bound, so under Megatron-LM each runs
    `attention / attention_fused` of its generic time (Hopper's 0.35 and 0.525), less the
    kernel's launch, which does not scale; every other op is as it was."""
    c, forward, point = cost_model("calibrated"), preset("llama3.2-1b"), {"B": 1, "S": 8192}
    e = c.efficiencies(H100)
    layout = Parallel(gpus=1, micro_batch=1, global_batch=1)
    generic, megatron = (
        {r.name: r for r in evaluate(compile_step(forward, layout=layout_, precision="bf16"),
                                     H100, point, cost=c).ops}
        for layout_ in (layout, attrs.evolve(layout, framework="megatron")))
    flash = [n for n, r in generic.items() if r.kind.startswith("flash_attention")]
    assert len(flash) == 2
    for name in flash:
        a, b = generic[name], megatron[name]
        launches = a.count * e.launch_s
        assert (b.time_s - launches) == pytest.approx(
            (a.time_s - launches) * e.attention / e.attention_fused, rel=1e-9)
    assert all(megatron[n].time_s == r.time_s for n, r in generic.items()
               if n not in flash and r.kind in ("matmul", "rmsnorm"))


def test_expert_launches_over_expert_parallel_agree_in_profile_and_plan():
    """With experts split over ep, each GPU issues E / ep GEMMs per expert op (a formula of the
    degree in `plan`'s arrays, a number in `profile`'s): the two say the same step."""
    c, forward = cost_model("calibrated"), preset("deepseek-v2-lite")
    for tp, ep in ((1, 8), (2, 4)):
        layout = Parallel(gpus=8, tp=tp, ep=ep, micro_batch=1, global_batch=16,
                          framework="megatron", zero=1, sequence_parallel=tp > 1)
        many = profile_parallel(forward, H100, layout, values={"S": 1024}, cost=c)
        planned = Searcher(forward, H100, seq_len=1024, cost=c).one(
            Candidate(layout, "none", "bf16")).result
        assert planned.step_time_s == pytest.approx(many.parallel.step_time_s, rel=1e-9)


@pytest.mark.parametrize("part", ["a100-sxm-80gb", "h100-sxm"])
@pytest.mark.parametrize("library, slower_forward, slower_backward", [("triton", 1.4, 2.0),
                                                                      ("flash1", 2.0, 2.0)])
def test_earlier_attention_kernels_run_as_dao_2023_measured_them(part, library, slower_forward,
                                                                 slower_backward):
    """flash-attn's Triton FlashAttention and FlashAttention 1 (`attention_library`):
    FlashAttention-2 is "around 1.3-1.5x faster than FlashAttention in Triton in the forward
    pass and around 2x faster in the backward pass", and "around 2x faster than FlashAttention"
    (Dao 2023, section 4.1). At 8,192 tokens the kernels are compute-bound, so each runs that
    many times its FlashAttention-2 time less the launch, which does not scale; nothing else
    moves, and profile and plan agree on it."""
    c, forward, point = cost_model("calibrated"), preset("llama3.2-1b"), {"B": 1, "S": 8192}
    gpu = hardware.get(part)
    e = c.efficiencies(gpu)
    layout = Parallel(gpus=1, micro_batch=1, global_batch=1)
    triton_layout = attrs.evolve(layout, attention_library=library)
    flash, triton = (
        {r.name: r for r in evaluate(compile_step(forward, layout=layout_), gpu, point,
                                     cost=c).ops}
        for layout_ in (layout, triton_layout))
    slower = {"flash_attention": slower_forward, "flash_attention_backward": slower_backward}
    for name, a in flash.items():
        b = triton[name]
        if a.kind in slower:
            launches = a.count * e.launch_s
            assert (b.time_s - launches) == pytest.approx(
                (a.time_s - launches) * slower[a.kind], rel=1e-9), name
        else:
            assert b.time_s == a.time_s, name
    many = profile_parallel(forward, gpu, triton_layout, values={"S": 8192}, cost=c)
    planned = Searcher(forward, gpu, seq_len=8192, cost=c).one(
        Candidate(triton_layout, "none", "bf16")).result
    assert many.parallel.step_time_s == pytest.approx(planned.step_time_s, rel=1e-9)
    assert many.parallel.step_time_s == pytest.approx(
        sum(r.time_s for r in triton.values()), rel=1e-9)
