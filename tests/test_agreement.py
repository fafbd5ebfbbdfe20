"""One step, five interpreters: `evaluate`, `formula` evaluated at the point, `sweep` at the
point, the many-GPU profile with every degree 1 and `plan`'s search path for that layout give
the same step time, MFU and HFU (relative 1e-9), under both cost models, in BF16 and FP8, on
random step options and points (issue 21: a figure computed twice will disagree some day)."""

import random

import numpy as np
import pytest
from opgraph.models import preset

from opgraph import compile_step, evaluate, hardware
from opgraph.costmodel import cost_model
from opgraph.distributed import profile_parallel
from opgraph.formula import formula, value
from opgraph.parallel import Parallel
from opgraph.passes.evaluate import resolve
from opgraph.search import Candidate, Searcher
from opgraph.sweep import compile_sweep

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
