"""The IR, the builder and the verifier."""

import attrs
import pytest
import sympy
from opgraph.models import preset
from opgraph.passes.derive_backward import VJP_RULES

from opgraph import GraphBuilder, Op, Tensor, VerifyError, derive_backward, verify
from opgraph.core import rules
from opgraph.cost.costmodel import BACKWARD_COST, DEFAULT
from opgraph.core.ir import Graph
from opgraph.core.symbols import B, D, F, H, H_kv, L, S, V, d_h


def test_every_forward_kind_has_a_row_in_every_table():
    kinds = set(rules.FORWARD_KINDS)
    assert set(rules.SHAPE_RULES) == set(rules.FLOP_RULES) >= kinds
    assert set(VJP_RULES) == kinds | set(rules.COLLECTIVE_KINDS)
    assert set(BACKWARD_COST) == kinds


def test_llama3_8b_parameter_count():
    # Meta's Llama 3 8B: 8,030,261,248 parameters (model card; sum of the HF checkpoint's tensors)
    graph = preset("llama3-8b")
    assert graph.parameters().xreplace(graph.dims) == 8_030_261_248
    expected = V * D * 2 + D + L * (2 * D + 2 * D * H * d_h + 2 * D * H_kv * d_h + 3 * D * F)
    assert sympy.expand(graph.parameters() - expected) == 0


def test_the_stack_is_held_once_with_its_multiplicity():
    graph = preset("llama3-8b")
    layer_ops = [op for op in graph.ops() if op.name.startswith("layers.")]
    assert len(layer_ops) == 16  # the plate's 15 per layer, the attention core as two ops
    assert {op.count for op in layer_ops} == {L}
    assert len(graph.ops()) == len(layer_ops) + 4  # embedding, final norm, head, loss


def test_plate_granularity_per_layer():
    kinds = [op.kind for op in preset("llama3-8b").ops() if op.name.startswith("layers.")]
    assert kinds == ["rmsnorm", "matmul", "rope", "matmul", "rope", "matmul",
                     "attention_scores", "matmul", "matmul", "add", "rmsnorm", "matmul",
                     "matmul", "swiglu", "matmul", "add"]


def test_bytes_are_derived_from_the_tensors():
    g = GraphBuilder("t", {B: 1, S: 8, D: 16, F: 32})
    x = g.activation("x", (B, S, D))
    y = g.matmul(x, g.weight("w", (D, F)), name="proj")
    graph = g.build()
    op = graph.op("proj")
    cost = DEFAULT.op_cost(graph, op)
    assert sympy.expand(cost.flops - 2 * B * S * D * F) == 0
    assert sympy.expand(cost.bytes - 2 * (B * S * D + D * F + B * S * F)) == 0
    assert sympy.expand(graph.op_bytes(op) - cost.bytes) == 0
    assert y.shape == (B, S, F)


def test_records_are_frozen():
    t = Tensor("x", [B, S])
    assert isinstance(t.shape, tuple)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        t.name = "y"
    op = Op("o", "add", "elementwise", ["x"], ["y"])
    assert op.inputs == ("x",)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        op.count = 3
    assert not hasattr(op, "flops") and not hasattr(op, "traffic")  # costs are derived


def test_matmul_inner_dims_must_agree():
    g = GraphBuilder("bad")
    x = g.activation("x", (B, S, D))
    with pytest.raises(rules.ShapeError, match="inner dims"):
        g.matmul(x, g.weight("w", (F, D)))


def test_verifier_catches_a_tensor_produced_twice_and_bad_shapes():
    graph = Graph("bad")
    for t in (Tensor("x", (B, D)), Tensor("w", (D, F)), Tensor("y", (B, F))):
        graph.add_tensor(t)
    graph.add_op(Op("a", "matmul", "matmul", ["x", "w"], ["y"]))
    verify(graph)
    graph.add_op(Op("b", "add", "elementwise", ["x", "x"], ["y"]))
    with pytest.raises(VerifyError, match="produced 2 times") as e:
        verify(graph)
    assert "outputs" in str(e.value)  # add of [B, D] cannot give [B, F]


def test_verifier_catches_a_cycle():
    graph = Graph("cyclic")
    for t in (Tensor("a", (D,)), Tensor("b", (D,))):
        graph.add_tensor(t)
    graph.add_op(Op("f", "rope", "elementwise", ["a"], ["b"]))
    graph.add_op(Op("g", "rope", "elementwise", ["b"], ["a"]))
    with pytest.raises(VerifyError, match="cycle"):
        verify(graph)


def test_textual_form_is_one_line_per_op():
    graph = preset("llama3-8b")
    text = str(graph)
    op_lines = [line for line in text.splitlines() if " = " in line]
    assert len(op_lines) == len(graph.ops())
    q = next(line for line in op_lines if line.strip().startswith("layers.q_proj ="))
    assert "matmul(layers.attn_norm, layers.q_proj.weight)" in q
    assert "bf16[B, S, H*d_h]" in q and "xL" in q and "flops=2*B*D*H*S*d_h" in q


def test_order_is_deterministic():
    assert str(derive_backward(preset("llama3-8b"))) == str(derive_backward(preset("llama3-8b")))


def test_an_op_added_before_its_reader_runs_there():
    """`add_op(..., before=reader)`: the new op takes its reader's place in the order, ahead
    of an op added earlier that was ready all along; appended, it would run after that one."""
    for before, expected in ((None, ["a", "late", "c", "b"]), ("b", ["a", "c", "b", "late"])):
        g = Graph("g")
        for name in ("x", "y", "z", "w"):
            g.add_tensor(Tensor(name, (D,)))
        g.add_op(Op("a", "add", "elementwise", ("x",), ("y",)))
        g.add_tensor(Tensor("y2", (D,)))
        g.add_op(Op("b", "add", "elementwise", ("y2",), ("z",)))
        g.add_op(Op("late", "add", "elementwise", ("y",), ("w",)))  # ready after a
        g.add_op(Op("c", "add", "elementwise", ("y",), ("y2",)), before=before and "b")
        g.add_tensor(Tensor("unused", (D,)))
        assert [op.name for op in g.ops()] == expected


@pytest.mark.parametrize("mark, words", [
    ({"launches": "E/ep"}, "launches 'E/ep' is not a whole number"),  # text is never parsed
    ({"launches": 0}, "launches 0 is not a whole number from 1"),
    ({"launches": True}, "launches True"),
    ({"efficiency": "fast"}, "efficiency 'fast' is not one of matmul, matmul_fp8, attention"),
])
def test_the_verifier_checks_what_a_pass_leaves_for_the_cost_model(mark, words):
    """`launches` and `efficiency` are read by every interpreter (`costmodel.Cost`): a pass of
    the user's that sets them wrong is named by the verifier, not met later as a KeyError."""
    g = preset("llama3.2-1b")
    op = g.op("layers.q_proj")
    g.replace_op(attrs.evolve(op, params={**dict(op.params), **mark}))
    with pytest.raises(VerifyError, match=words):
        verify(g)
    g.replace_op(attrs.evolve(op, params={**dict(op.params), "launches": L, "efficiency":
                                          "attention_fused"}))
    verify(g)  # an expression of the dimensions and a known efficiency are fine
