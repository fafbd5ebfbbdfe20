"""The lowered step (`opgraph.cost.lowered`): one typed record per step that the interpreters
read. Expected values are written from Llama 3 8B's published shapes and the plate's formulas."""

import pytest
import sympy
from opgraph.models import preset

from opgraph import OpgraphError, compile_step, evaluate, hardware, lower
from opgraph.core.ir import Phase
from opgraph.core.symbols import B, D, H, L, S, d_h
from opgraph.cost.costmodel import CalibratedCostModel, CostModel
from opgraph.parallel.distributed import compile_parallel
from opgraph.parallel.parallel import Parallel
from opgraph.passes.evaluate import resolve
from opgraph.passes.split_stages import split_stages

H100 = hardware.get("h100-sxm")


@pytest.fixture(scope="module")
def step():
    return compile_step(preset("llama3-8b"))


def test_every_op_is_lowered_once_in_the_graphs_order(step):
    low = lower(step)
    assert [o.name for o in low.ops] == [op.name for op in step.ops()]
    assert [o.phase for o in low.ops] == [op.phase for op in step.ops()]
    assert {o.category for o in low.ops} == {op.category for op in step.ops()}
    q = low.op("layers.q_proj")
    # a [B, S, D] x [D, H d_h] projection, once per layer: 2 B S D H d_h FLOPs an instance
    assert q.count == L
    assert sympy.expand(q.cost.flops - 2 * B * S * D * H * d_h) == 0
    assert sympy.expand(q.flops - L * 2 * B * S * D * H * d_h) == 0
    assert q.cost.grid and q.region == "layers" and q.group is None
    with pytest.raises(OpgraphError, match="no op 'nope'"):
        low.op("nope")


def test_the_mfu_parameters_are_llama_3_8bs_published_shapes(step):
    # Llama 3 8B (Meta's config.json): 32 layers of D 4096, 32 query and 8 KV heads of 128,
    # FFN 14336, vocabulary 128256; N of the MFU convention leaves out the input embedding
    layer = 4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336 + 2 * 4096
    n = 32 * layer + 4096 * 128256 + 4096  # the layers, the output head, the final norm
    low = lower(step)
    subs = resolve(step)
    assert int(low.mfu_parameters.xreplace(subs)) == n
    assert int(low.parameters.xreplace(subs)) == n + 4096 * 128256
    assert low.active_parameters is None  # a dense model
    assert int(low.tokens.xreplace(subs)) == int(subs[B] * subs[S])


def test_a_point_gives_evaluates_numbers(step):
    subs = resolve(step, {"B": 2, "S": 4096})
    profile = evaluate(step, H100, {"B": 2, "S": 4096})
    at = lower(step).at(subs)
    assert [(o.name, o.count, o.flops, o.bytes) for o in at] == \
        [(r.name, r.count, r.flops, r.bytes) for r in profile.ops]


def test_a_symbol_without_a_value_is_a_one_line_error_naming_the_op(step):
    low = lower(step)
    first = step.ops()[0].name
    with pytest.raises(OpgraphError, match=f"op {first}'s .* depends on .*S") as e:
        low.at({B: 1})
    assert "\n" not in str(e.value)


def test_the_lowering_is_the_cost_models_own(step):
    """The calibrated model and another backward convention lower the same graph differently
    only where their rules differ: the FLOPs are the roofline's, the backward's bytes follow
    the convention."""
    roofline, calibrated = lower(step), lower(step, CalibratedCostModel())
    assert [o.cost for o in roofline.ops] == [o.cost for o in calibrated.ops]
    tensors = lower(step, CostModel(backward="tensors"))
    assert [o.flops for o in tensors.ops] == [o.flops for o in roofline.ops]
    assert any(a.bytes != b.bytes for a, b in zip(tensors.ops, roofline.ops)
               if a.phase is Phase.BACKWARD)


def test_a_stage_lowered_like_its_step_costs_the_same():
    """A pipeline stage shares its step's op costs (`like`): the same record as lowering it
    alone, its sends and receives costed on their own."""
    forward = preset("llama3.2-1b")
    layout = Parallel(tp=2, pp=2, gpus=8, micro_batch=1, global_batch=16)
    step = compile_parallel(forward, layout)
    whole = lower(step)
    for i in range(layout.pp):
        stage = split_stages(step, layout, i)
        alone, like = lower(stage), lower(stage, like=whole)
        assert alone.ops == like.ops
        sends = [o for o in alone.ops if o.group == "pp"]
        assert sends and all(not whole.has_op(o.name) for o in sends)
        assert {o.group for o in alone.ops} >= {None, "tp", "pp"}
