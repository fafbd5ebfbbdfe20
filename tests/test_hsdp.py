"""HSDP (`Parallel.replicate`): each replica shards over its own dp x cp / replicate ranks, and a
gradient reduce-scattered within a replica is all-reduced across the replicas holding the same
shard (torchtitan's data_parallel_replicate_degree; Megatron-LM's
--num-distributed-optimizer-instances). Expected figures are written from the model's shapes."""

import pytest

from opgraph import hardware
from opgraph.core.errors import OpgraphError
from opgraph.io.outputs.report import layout_text
from opgraph.models import preset
from opgraph.parallel.distributed import profile_parallel
from opgraph.parallel.parallel import Parallel, parse_layout
from opgraph.parallel.search import Searcher, Space, rows

H100 = hardware.get("h100-sxm")  # the DGX H100 fabric: 8 GPUs a node on NVLink, a NIC each
D, F, LAYERS = 2048, 8192, 16  # Llama 3.2 1B


@pytest.fixture(scope="module")
def runs():
    """Llama 3.2 1B on 16 GPUs (two nodes) under torchtitan's FSDP, two micro-batches a rank:
    over all 16 ranks, and as 2 replicas of 8."""
    f = preset("llama3.2-1b")
    return {rep: profile_parallel(f, H100, Parallel(dp=16, zero=3, replicate=rep, global_batch=32,
                                                    framework="torchtitan")).parallel
            for rep in (1, 2)}


def test_a_replica_holds_what_fsdp_over_its_own_ranks_holds(runs):
    """Weights, gradients and optimizer states are a 1/8 shard with 2 replicas of 8, twice the
    1/16 shard of FSDP over all 16 ranks."""
    fsdp, hsdp = runs[1].memory, runs[2].memory
    for part in ("weights", "gradients", "optimizer"):
        assert getattr(hsdp, part) == 2 * getattr(fsdp, part), part


def test_hsdp_gathers_inside_a_replica_and_all_reduces_the_shard_across_replicas(runs):
    """q_proj (D x D): gathered in BF16 (2 D^2 bytes) and its gradient reduce-scattered in FP32
    (4 D^2) over the replica's 8 ranks, inside one node; then its 1/8 shard, 4 D^2 / 8 bytes,
    all-reduced over the 2 replicas, a NIC apart; each every micro-batch of every layer
    (ZeRO-3's reduction is per micro-batch)."""
    q = {t.collective: t for t in runs[2].communication  # the backward's gather: as the forward's
         if ".q_proj.weight" in t.name and "@backward" not in t.name}
    assert (q["all_gather"].group, q["all_gather"].group_size) == ("dp", 8)
    assert q["all_gather"].bytes == 2 * D * D
    assert (q["reduce_scatter"].group, q["reduce_scatter"].group_size) == ("dp", 8)
    assert q["reduce_scatter"].bytes == 4 * D * D
    assert (q["all_reduce"].group, q["all_reduce"].group_size) == ("dpr", 2)
    assert q["all_reduce"].bytes == 4 * D * D / 8
    assert q["all_reduce"].count == q["reduce_scatter"].count == LAYERS * 2
    assert "NVLink" in q["reduce_scatter"].tier and "NVLink" not in q["all_reduce"].tier
    # FSDP over 16 ranks crosses the nodes for every gather
    fsdp = [t for t in runs[1].communication if t.name == "layers.q_proj.weight@forward.all_gather"]
    assert fsdp[0].group_size == 16 and "NVLink" not in fsdp[0].tier
    assert not any(t.group == "dpr" for t in runs[1].communication)


@pytest.mark.parametrize("fields, words", [
    ({"dp": 16, "replicate": 2}, ("--zero 1, 2 or 3",)),  # ZeRO 0 shards nothing to replicate
    ({"dp": 16, "zero": 3, "replicate": 3}, ("must divide", "16")),
    ({"dp": 16, "zero": 3, "replicate": 16}, ("2 ranks or more",)),
    ({"dp": 16, "zero": 3, "ep": 2, "replicate": 2}, ("--ep 2",)),
    ({"dp": 16, "zero": 1, "replicate": 2, "framework": "deepspeed"}, ("deepspeed",)),
    ({"dp": 16, "zero": 1, "replicate": 2, "framework": "nanotron"}, ("nanotron",)),
    ({"dp": 16, "zero": 3, "replicate": 2, "framework": "megatron"}, ("only at ZeRO-1",)),
    ({"dp": 16, "zero": 1, "replicate": 2, "framework": "torchtitan"}, ("only at ZeRO-3",)),
])
def test_replicas_a_framework_cannot_run_are_one_line_errors(fields, words):
    with pytest.raises(OpgraphError) as e:
        Parallel(**fields)
    assert "\n" not in str(e.value)
    for word in words:
        assert word in str(e.value)


def test_a_layout_with_replicas_reads_back_from_its_text():
    layout = Parallel(tp=2, dp=32, zero=3, replicate=4, framework="torchtitan")
    text = layout_text(layout, "full", "bf16")
    assert " zero3 rep4 " in text
    fields, _ = parse_layout(text)
    assert fields["replicate"] == 4 and fields["zero"] == 3
    assert " rep" not in layout_text(Parallel(dp=32, zero=3), "full", "bf16")


def test_plan_tries_one_replica_per_node_at_zero_3_where_the_framework_runs_hsdp():
    """At ZeRO-3 the search adds the replicas whose shard groups fill one node (8 / tp ranks)
    beside plain FSDP; a framework without HSDP gets none, and --replicate fixes the count."""
    f = preset("llama3.2-1b")
    cluster = Searcher(f, H100, seq_len=4096).cluster

    def replicas(**constraints):
        space = Space(gpus=32, batch=64, precision=("bf16",), recompute=("full",), pp=1, cp=1,
                      **constraints)
        return {(r.tp, r.zero, r.replicate) for r in rows(f, H100, space, 4096, cluster)}

    found = replicas(framework="torchtitan", zero=3)
    assert {(1, 3, 4), (2, 3, 4), (4, 3, 4), (1, 3, 1)} <= found  # 32 / (8 / tp) replicas
    assert (8, 3, 4) not in found  # tp 8 fills the node: its shard group would be 1 rank
    assert all(n == 1 for _, _, n in replicas(framework="deepspeed"))
    assert {n for _, _, n in replicas(framework="torchtitan", zero=3, replicate=2)} == {2}


@pytest.mark.parametrize("framework, constraints", [
    ("torchtitan", {"zero": 3, "replicate": 2, "recompute": ("full",)}),
    ("megatron", {"tp": 2, "zero": 1, "replicate": 2, "recompute": ("none",)}),
])
def test_plan_figures_with_replicas_are_profiles(framework, constraints):
    """A searched layout with replicas scheduled as `profile` schedules it (to 1e-9)."""
    from opgraph.cost.costmodel import cost_model

    forward, cost = preset("llama3.2-1b"), cost_model("calibrated")
    searcher = Searcher(forward, H100, seq_len=4096, cost=cost)
    space = Space(gpus=16, batch=64, framework=framework, precision=("bf16",), micro_batch=1,
                  pp=1, **constraints)
    found = rows(forward, H100, space, 4096, searcher.cluster)
    assert found and all(r.replicate == 2 for r in found)
    for row in found[:2]:
        candidate = row.candidate()
        mine = searcher.one(candidate).result
        theirs = profile_parallel(forward, H100, candidate.layout, values={"S": 4096},
                                  cost=cost, recompute=candidate.recompute,
                                  precision=candidate.precision).parallel
        for name in ("step_time_s", "mfu", "exposed_communication_s"):
            assert getattr(mine, name) == pytest.approx(getattr(theirs, name), rel=1e-9,
                                                        abs=1e-12), (name, candidate)
        assert mine.memory.total == theirs.memory.total


@pytest.mark.parametrize("constraints, words", [
    ({"zero": 0, "replicate": 2}, "contradicts --zero 0"),
    ({"framework": "deepspeed", "replicate": 2}, "deepspeed runs no replicated shards"),
    ({"framework": "megatron", "zero": 3, "replicate": 2}, "(only --zero 1)"),
])
def test_plan_constraints_no_layout_can_meet_say_why(constraints, words):
    """A search for replicas the framework or ZeRO stage cannot hold stops on one line that
    says so, not on 'no layout divides'."""
    with pytest.raises(OpgraphError, match=words.replace("(", r"\(").replace(")", r"\)")):
        Space(gpus=64, batch=256, **constraints)
