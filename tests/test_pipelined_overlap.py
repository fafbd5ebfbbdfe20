"""Collectives that run beside the op that reads or writes them move their data in blocks, one
per rank of their group, each beside the compute of another (`schedule.Streams._fill`): a
gather's reader computes its last block after that block arrives, a scatter's writer computes its
first block before any is sent. And PyTorch's async TP sums a matmul's exchanged partial
products in a kernel of its own (`passes.sum_tp_partials`). Expected times are written from the
ops' durations; expected bytes from the model's shapes."""

import pytest
from opgraph.models import preset

from opgraph import hardware
from opgraph.core.ir import Graph, Op, Tensor
from opgraph.parallel.distributed import compile_parallel, profile_parallel
from opgraph.parallel.parallel import Parallel
from opgraph.parallel.schedule import plan, simulate

H100 = hardware.get("h100-sxm")


def _chain(kind: str, group: str = "tp") -> Graph:
    """x -> (a gather of x -> matmul) or (matmul -> a scatter -> add): one collective beside
    the matmul that reads or writes it."""
    g = Graph("chain", {})
    for name in ("x", "y", "z", "w"):
        g.add_tensor(Tensor(name, (8,)))
    if kind == "all_gather":
        g.add_op(Op("gather", "all_gather", "communication", ("x",), ("y",),
                    params={"group": group, "axis": 0, "size": 1}))
        g.add_op(Op("mm", "matmul", "matmul", ("y",), ("z",)))
    else:
        g.add_op(Op("mm", "matmul", "matmul", ("x",), ("y",)))
        g.add_op(Op(kind, kind, "communication", ("y",), ("z",),
                    params={"group": group, "axis": 0, "size": 1}))
        g.add_op(Op("add", "add", "elementwise", ("z",), ("w",)))
    return g


def _span(kind: str, comm_s: float, mm_s: float, blocks: int, group: str = "tp") -> float:
    g = _chain(kind, group)
    seconds = {"gather": comm_s, kind: comm_s, "mm": mm_s, "add": 0.0}
    return simulate(plan(g, g.ops(), {}), seconds, async_tp=True,
                    chunks=((group, blocks),)).time_s


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_to_all"])
@pytest.mark.parametrize("comm_s, mm_s", [(1.0, 4.0), (3.0, 4.0), (6.0, 4.0)])
def test_a_pipelined_collective_hides_all_but_one_block_of_its_matmul(kind, comm_s, mm_s):
    """With n blocks the pair takes max(matmul, collective + matmul / n): the matmul's last
    block after the gather's last, or its first block before the scatter's first; one
    block (no pipelining) is the plain overlap, max(matmul, collective)."""
    for n in (1, 2, 8):
        assert _span(kind, comm_s, mm_s, n) == pytest.approx(
            max(mm_s, comm_s + (mm_s / n if n > 1 else 0.0)), rel=1e-12)


def test_only_overlapped_groups_are_pipelined():
    """A data-parallel gather is not run beside its reader: the reader waits for it whole,
    whatever `chunks` says."""
    assert _span("all_gather", 3.0, 4.0, 8, group="dp") == pytest.approx(7.0, rel=1e-12)


# --- PyTorch's matmul reduce-scatter -----------------------------------------------------------

D, T, LAYERS, S = 4096, 8, 32, 8192  # Llama 3 8B at TP 8, one sequence of 8,192 tokens


def _torchtitan(async_tp: bool, framework: str = "torchtitan") -> Parallel:
    return Parallel(tp=T, sequence_parallel=True, async_tp=async_tp, framework=framework)


def test_torch_async_tp_exchanges_partial_products_and_sums_them_apart():
    """Each reduce-scatter of a matmul's output becomes an all-to-all of the partial products
    and a sum of the tp blocks of the GPU's shard: per layer, forward, after the attention's
    output projection and the MLP's down projection; backward, after the input gradients of
    the column-parallel projections (the attention's and the MLP's inputs, through their
    norms). Each sum reads tp shards of S/tp x D in BF16 and writes one."""
    g = compile_parallel(preset("llama3-8b"), _torchtitan(True))
    sums = [op for op in g.ops() if op.kind == "sum_partials"]
    in_layer = [op for op in sums if op.region is not None]
    assert len(in_layer) == 4
    assert not any(op.kind == "reduce_scatter" and op.param("group") == "tp"
                   and g.producer(op.inputs[0]).kind == "matmul" for op in g.ops())
    subs = {**g.dims, "B": 1, "S": S}
    for op in in_layer:
        read, wrote = (g.tensor(op.inputs[0]), g.tensor(op.outputs[0]))
        assert int(read.nbytes.xreplace(subs)) == S * D * 2
        assert int(wrote.nbytes.xreplace(subs)) == S // T * D * 2
        exchanged = g.producer(op.inputs[0])
        assert (exchanged.kind, exchanged.param("group")) == ("all_to_all", "tp")


@pytest.mark.parametrize("layout", [_torchtitan(False), Parallel(tp=T, sequence_parallel=True,
                                                                 async_tp=True,
                                                                 framework="megatron")])
def test_nccl_and_transformer_engine_reduce_inside_the_collective(layout):
    """Without async TP, or under Megatron-LM's TP overlap (Transformer Engine reduces on its
    communication kernels' SMs), the reduce-scatters stay and no sum is added."""
    g = compile_parallel(preset("llama3-8b"), layout)
    assert not any(op.kind == "sum_partials" for op in g.ops())


def test_the_sums_move_their_bytes_on_the_compute_stream():
    """The sums are compute-stream kernels of the step's profile: in the layers, 4 a layer,
    each reading tp shards and writing one (S x D + S/tp x D in BF16), each no faster than
    its bytes at the part's HBM bandwidth."""
    run = profile_parallel(preset("llama3-8b"), H100, _torchtitan(True), values={"S": S})
    summed = [r for r in run.ops if r.kind == "sum_partials"]
    assert summed and all(r.time_s >= r.bytes / H100.bandwidth for r in summed)
    in_layers = [r for r in summed if r.count == LAYERS]
    assert len(in_layers) == 4
    assert sum(r.bytes for r in in_layers) == 4 * LAYERS * (S * D * 2 + S // T * D * 2)
