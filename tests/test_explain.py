"""A layout as `plan` prints it reads back (`parallel.parse_layout`); the step's parts
(`ParallelResult.parts`) add up to it, each measured on its own."""

import pytest

from opgraph import hardware, search
from opgraph.costmodel import cost_model
from opgraph.distributed import profile_parallel
from opgraph.errors import OpgraphError
from opgraph.models import preset
from opgraph.outputs.report import layout_text
from opgraph.parallel import Parallel, parse_layout
from opgraph.schedule import GROUPS
from opgraph.search import Space, rows

H100 = hardware.get("h100-sxm")
SMALL = ("llama3.2-1b", 2048)  # 16 layers: pipelines of 2, 4, 8 and uneven ones of 3 (5/6/5)


# --- the compact layout ------------------------------------------------------------------------

def test_every_layout_the_plan_prints_reads_back_to_itself():
    """Each layout of a space (uneven pipelines and sequence parallelism among them), printed
    as the plan's table prints it, is read back by `parse_layout` to the same layout and
    options."""
    model, seq = SMALL
    forward = preset(model)
    found = rows(forward, H100, Space(gpus=24, batch=48, max_micro_batch=2), seq,
                 search.clusters.for_hardware(H100))
    assert any(r.first is not None for r in found) and any(r.sequence_parallel for r in found)
    for r in found:
        fields, options = parse_layout(layout_text(r.layout(), r.recompute, r.precision))
        assert Parallel(global_batch=r.batch, **fields) == r.layout()
        assert options == {"recompute": r.recompute, "precision": r.precision}


@pytest.mark.parametrize("text, words", [
    ("tq8", "'tq8' is not a layout word"),
    ("tp8,tp4", "tp twice"),
    ("full selective", "recompute twice"),
    ("zero1(1/.../2)", "not a layout word"),
    ("", "write it as plan prints one"),
    ("tp" + "9" * 40, "not a layout word"),
])
def test_a_text_that_is_no_layout_is_one_line(text, words):
    with pytest.raises(OpgraphError, match=words.replace("(", r"\(").replace(")", r"\)")):
        parse_layout(text)


# --- the step's parts --------------------------------------------------------------------------

@pytest.mark.parametrize("model, seq, layout, cost", [
    ("llama3.2-1b", 2048, Parallel(tp=2, pp=4, gpus=16, global_batch=32, zero=1,
                                   sequence_parallel=True), "calibrated"),
    ("llama3.2-1b", 2048, Parallel(tp=2, pp=4, gpus=16, global_batch=32, zero=3,
                                   virtual_stages=2), "roofline"),
    ("llama3.2-1b", 4096, Parallel(tp=2, cp=2, pp=2, gpus=16, global_batch=32, micro_batch=2,
                                   zero=2, overlap_grad_reduce=False), "calibrated"),
    ("mixtral-8x7b", 4096, Parallel(tp=2, ep=4, pp=2, gpus=32, global_batch=64, zero=1),
     "calibrated"),
])
def test_the_parts_add_up_to_the_step(model, seq, layout, cost):
    """The identity the schedule guarantees: rank 0's compute stream only runs or waits, so a
    micro-batch's span is its compute plus its waits (`schedule.simulate`); the pipeline's span
    is m of rank 0's micro-batches plus the bubble; the step adds the longest tail (rank 0's own,
    in its last micro-batch, and a later stage's excess) and the overlap slowdown. So

        step = compute + bubble + sum over groups of the wait + later stage's tail + slowdown.

    Each part is measured on its own: compute is the sum of rank 0's compute ops' times over the
    step (the profile's rows), the waits are the exposed communication less the tail."""
    profile = profile_parallel(preset(model), H100, layout, values={"S": seq},
                               cost=cost_model(cost))
    r = profile.parallel
    parts = r.parts()
    assert sum(parts.values()) == pytest.approx(r.step_time_s, rel=1e-12)
    assert all(value >= 0 for value in parts.values())
    compute = sum(row.time_s for row in profile.ops if row.bound != "network")
    assert r.compute_s == pytest.approx(compute, rel=1e-9)
    waits = dict(r.waited_by_group)
    assert sum(waits.values()) == pytest.approx(
        r.exposed_communication_s - r.later_stage_tail_s, rel=1e-12, abs=1e-15)
    assert list(waits) == [g for g in GROUPS if g in waits]  # the schedule's order
    assert {"tp", "dp", "pp"} <= set(waits)
    assert (r.overlap_slowdown_s > 0) == (cost == "calibrated")
