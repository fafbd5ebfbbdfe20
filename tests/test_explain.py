"""The step's parts (`ParallelResult.parts`) add up to it, each measured on its own."""

import pytest

from opgraph import hardware
from opgraph.costmodel import cost_model
from opgraph.distributed import profile_parallel
from opgraph.models import preset
from opgraph.parallel import Parallel
from opgraph.schedule import GROUPS

H100 = hardware.get("h100-sxm")


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
