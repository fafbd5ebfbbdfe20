"""The job record (`opgraph.parallel.job.JobSpec`): built by the command line, the launch
configs, the case files and `plan --compare` alike, and checked in one place."""

import pytest
from opgraph.models import preset

from opgraph import OpgraphError, hardware
from opgraph.cost.costmodel import CalibratedCostModel
from opgraph.io.cases import read_case
from opgraph.io.launch import Launch
from opgraph.parallel import cluster as clusters
from opgraph.parallel.distributed import profile_parallel
from opgraph.parallel.job import JobSpec
from opgraph.parallel.parallel import Parallel
from opgraph.passes.attach_adamw import AdamW

H100 = hardware.get("h100-sxm")
LAYOUT = Parallel(tp=2, pp=2, gpus=8, micro_batch=1, global_batch=16)


def job(**fields):
    return JobSpec(**({"forward": preset("llama3.2-1b"), "hardware": H100, "layout": LAYOUT}
                      | fields))


def test_a_job_profiles_as_profile_parallel_with_its_options():
    spec = job(seq_len=2048, recompute="selective", fuse="elementwise", adamw="bf16-moments",
               cost=CalibratedCostModel())
    from opgraph.core.pipeline import fusion_passes

    want = profile_parallel(preset("llama3.2-1b"), H100, LAYOUT, values={"S": 2048},
                            cost=CalibratedCostModel(), recompute="selective",
                            extra_passes=fusion_passes("elementwise"),
                            adamw=AdamW.named("bf16-moments"))
    got = spec.profile()
    assert got.parallel.step_time_s == want.parallel.step_time_s
    assert got.parallel.memory.total == want.parallel.memory.total
    assert [r.name for r in got.ops] == [r.name for r in want.ops]


def test_the_defaults_are_the_models_sequence_and_the_parts_cluster():
    spec = job()
    assert spec.seq_len == preset("llama3.2-1b").seq_len
    assert spec.cluster == clusters.for_hardware(H100)
    assert (spec.recompute, spec.precision, spec.fuse, spec.adamw) == \
        ("none", "bf16", None, "mixed")


@pytest.mark.parametrize("fields, says", [
    ({"recompute": "most"}, "job recompute 'most': give one of none"),
    ({"recompute": "selective:moe,moe_act"}, "job recompute 'selective:moe,moe_act': write it "
                                             "'selective:moe_act+moe'"),
    ({"precision": "fp4"}, "job precision 'fp4': give a precision"),
    ({"fuse": "all"}, "job fuse 'all': give a fusion policy"),
    ({"adamw": "adam"}, "job adamw 'adam'"),
    ({"seq_len": 0}, "sequence length"),
    ({"forward": "llama3-8b"}, "job forward is a str; give the model's forward graph"),
    ({"hardware": "h100-sxm"}, "job hardware is a str"),
    ({"layout": {"tp": 2}}, "job layout is a dict; give a Parallel layout"),
    ({"layout": Parallel(tp=3, gpus=3, micro_batch=1, global_batch=1)},
     "H = 32 is not divisible by --tp 3"),
])
def test_a_bad_job_is_one_line(fields, says):
    with pytest.raises(OpgraphError) as e:
        job(**fields)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_sequence_past_the_models_positions_is_refused():
    with pytest.raises(OpgraphError, match="longer than gpt2's 1,024 positions"):
        job(forward=preset("gpt2"), layout=Parallel(gpus=1, micro_batch=1, global_batch=1),
            seq_len=2048)


def test_a_launch_config_and_a_case_file_give_their_jobs():
    launch = Launch(model="llama3.2-1b", seq_len=4096, parallel=LAYOUT, recompute="full",
                    fuse="elementwise")
    spec = launch.job(H100)
    assert (spec.layout, spec.seq_len, spec.recompute, spec.fuse) == \
        (launch.parallel, 4096, "full", "elementwise")
    case = {"id": "mine", "source": "a test", "model": "llama3.2-1b", "gpus": 8,
            "parallel": {"tp": 2, "pp": 2, "dp": 2, "micro_batch": 1, "global_batch": 16},
            "seq_len": 2048, "fuse": "none", "recompute": "selective",
            "measured": {"step_time_s": 1.0}}
    c = read_case(case)
    spec = c.job()
    assert (spec.seq_len, spec.recompute, spec.fuse, spec.layout) == \
        (2048, "selective", None, c.parallel)
    assert spec.hardware == c.part() and spec.cluster == clusters.for_hardware(c.part())
