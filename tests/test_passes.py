"""The passes on their own: backward, fusion and AdamW invariants, as formulas."""

import pytest
import sympy
from opgraph.models import preset
from opgraph.passes.attach_adamw import AdamW
from opgraph.passes.derive_backward import gradient_of
from opgraph.passes.fuse_attention import rewrite_attention

from opgraph import (GraphBuilder, Phase, attach_adamw, compile_step, derive_backward, evaluate,
                     fuse_attention, hardware, verify)
from opgraph.cost.costmodel import DEFAULT, CostModel
from opgraph.core.symbols import B, D, H, H_kv, L, S, d_h

H100 = hardware.get("h100-sxm")


@pytest.fixture(scope="module")
def llama():
    return preset("llama3-8b")


def total(graph, quantity, phase=None, cost=DEFAULT):
    ops = [op for op in graph.ops() if phase is None or op.phase is phase]
    costs = cost.op_costs(graph)
    return sympy.expand(sympy.Add(*(getattr(costs[op.name], quantity) * op.count for op in ops)))


def flops(graph, op, cost=DEFAULT):
    return cost.op_cost(graph, op).flops


def test_every_pass_leaves_a_valid_graph(llama):
    graph = llama
    for run in (fuse_attention, derive_backward, attach_adamw):
        graph = verify(run(graph))
    verify(attach_adamw(verify(derive_backward(llama))))


def test_passes_do_not_mutate_their_input(llama):
    before = str(llama)
    compile_step(llama)
    assert str(llama) == before


def test_matmul_backward_is_twice_its_forward(llama):
    step = derive_backward(llama)
    fwd = step.op("layers.q_proj")
    bwd = [op for op in step.ops() if op.forward == fwd.name]
    assert sorted(op.kind for op in bwd) == ["matmul", "matmul"]  # dX and dW
    assert sympy.expand(sum(flops(step, op) for op in bwd) - 2 * flops(step, fwd)) == 0
    assert sympy.expand(flops(step, fwd) - 2 * B * S * D * H * d_h) == 0
    # dX = dY W^T and dW = X^T dY each touch tensors as large as the forward's (dW is FP32, so
    # its own tensors are larger: the plate charges the forward's), and each does the
    # forward's FLOPs by its own rule too, plus one add per element where dX accumulates into
    # the partial gradient of the norm's output (read by Q, K and V)
    derived = CostModel(backward="derived")
    for op in bwd:
        assert sympy.expand(DEFAULT.op_cost(step, op).bytes - step.op_bytes(fwd)) == 0
        accumulated = B * S * D if op.param("accumulate") else 0
        assert sympy.expand(flops(step, op, derived) - flops(step, fwd) - accumulated) == 0
    assert [op.param("accumulate") for op in bwd] == [1, None]  # dX, then dW


def test_backward_is_twice_forward_overall(llama):
    step = derive_backward(llama)
    for quantity in ("flops", "bytes"):
        fwd = total(step, quantity, Phase.FORWARD)
        assert sympy.expand(total(step, quantity, Phase.BACKWARD) - 2 * fwd) == 0


def test_every_weight_gradient_reaches_the_optimizer(llama):
    step = compile_step(llama)
    for w in step.weights():
        grad = gradient_of(step, w.name)
        assert grad is not None and grad.shape == w.shape
        assert [op.kind for op in step.consumers(grad.name)] == ["adamw"]


def test_residual_gradient_is_accumulated_not_overwritten(llama):
    step = derive_backward(llama)
    # the residual stream after attention feeds the MLP norm and the MLP residual add
    partials = [t.name for t in step.tensors() if t.grad_of == "layers.attn_residual"]
    assert len(partials) == 2
    second = step.producer(partials[1])
    assert partials[0] in second.inputs


def test_fusion_keeps_flops_and_removes_exactly_the_score_matrix(llama):
    unfused = compile_step(llama, fused_attention=False)
    fused = compile_step(llama)
    assert total(fused, "flops") - total(unfused, "flops") == 0
    # The score matrix is B*H*S*S BF16 values per layer: written and read once forward;
    # the backward (twice the forward) moves it twice as much.
    score_matrix = 2 * B * H * S**2
    assert sympy.expand(total(unfused, "bytes") - total(fused, "bytes")
                        - L * (2 + 4) * score_matrix) == 0


def test_fusing_before_or_after_backward_agrees(llama):
    before = attach_adamw(derive_backward(fuse_attention(llama)))
    after = attach_adamw(fuse_attention(derive_backward(llama)))
    assert total(before, "flops") - total(after, "flops") == 0
    assert evaluate(before, H100).step_time_s == pytest.approx(
        evaluate(after, H100).step_time_s, rel=1e-12)


def test_fusion_reports_what_it_replaced(llama):
    _, report = rewrite_attention(derive_backward(llama))
    assert len(report) == 1  # the stack is held once
    (fused,) = report
    assert fused.op == "layers.attn.flash" and fused.backward == "layers.attn.flash.grad"
    assert {"layers.attn.scores", "layers.attn.pv"} <= set(fused.replaced)


def small_attention_block(extra_reader=False):
    """Not Llama: one multi-head, non-causal block with LayerNorm and a GELU MLP."""
    g = GraphBuilder("tiny", {B: 2, S: 128, D: 256, H: 4, d_h: 64})
    x = g.activation("x", (B, S, D))
    h = g.layernorm(x, g.weight("ln.w", (D,)), g.weight("ln.b", (D,)))
    q = g.matmul(h, g.weight("wq", (D, H * d_h)), name="q")
    k = g.matmul(h, g.weight("wk", (D, H * d_h)), name="k")
    v = g.matmul(h, g.weight("wv", (D, H * d_h)), name="v")
    p = g.attention_scores(q, k, heads=H, kv_heads=H, causal=False, name="core.scores")
    o = g.matmul(p, v, name="core.pv", category="attention", heads=H, kv_heads=H, causal=False)
    if extra_reader:  # someone else reads the score matrix: the core cannot be fused
        g.gelu(p, name="probe")
    y = g.add(x, g.matmul(o, g.weight("wo", (H * d_h, D)), name="o"))
    g.gelu(y)
    return g.build()


def test_a_small_attention_block_is_fused_too():
    block = small_attention_block()
    fused, report = rewrite_attention(derive_backward(block))
    verify(fused)
    assert [r.op for r in report] == ["core.flash"]
    flash = fused.op("core.flash")
    assert flash.inputs == ("q", "k", "v")
    # non-causal: QK^T and P.V each 2*S*S*d_h per head and sequence
    assert sympy.expand(flops(fused, flash) - 2 * 2 * B * H * S * S * d_h) == 0
    assert total(fused, "flops") - total(derive_backward(block), "flops") == 0
    assert not any(op.kind == "attention_scores" for op in fused.ops())


def test_a_match_whose_score_matrix_is_read_elsewhere_is_rejected():
    block = small_attention_block(extra_reader=True)
    fused, report = rewrite_attention(block)
    assert report == []
    assert str(fused) == str(block)


def test_adamw_moves_34_bytes_per_parameter(llama):
    step = compile_step(llama)
    updates = [op for op in step.ops() if op.phase is Phase.OPTIMIZER]
    assert {op.kind for op in updates} == {"adamw"}
    assert len(updates) == len(step.weights())
    moved = sympy.Add(*(step.op_bytes(op) * op.count for op in updates))
    assert sympy.expand(moved - 34 * step.parameters()) == 0
    counted = sympy.Add(*(flops(step, op) * op.count for op in updates))
    assert sympy.expand(counted - 12 * step.parameters()) == 0


def test_adamw_bytes_follow_its_precisions(llama):
    fp32_only = AdamW(master=None, copy=None, zero_grad=False)
    step = attach_adamw(derive_backward(llama), fp32_only)
    moved = sympy.Add(*(step.op_bytes(op) * op.count for op in step.ops()
                        if op.kind == "adamw"))
    # BF16 weight read and written, FP32 gradient read, two FP32 moments read and written
    assert sympy.expand(moved - (2 + 2 + 4 + 4 * 4) * step.parameters()) == 0


def test_real_backward_traffic_is_an_option(llama):
    step = derive_backward(llama)
    op = step.op("layers.attn_residual.grad")  # the add's backward only passes dY along
    real = CostModel(backward="tensors").op_cost(step, op)
    plate = DEFAULT.op_cost(step, op)
    assert sympy.expand(real.bytes - 3 * 2 * B * S * D) == 0
    assert sympy.expand(plate.bytes - 2 * 3 * 2 * B * S * D) == 0
    assert sympy.expand(real.flops - plate.flops) == 0  # FLOPs keep the convention


def test_category_shares_sum_to_one(llama):
    for fused in (True, False):
        p = evaluate(compile_step(llama, fused_attention=fused), H100, {"B": 3})
        assert sum(c.time_share for c in p.categories) == pytest.approx(1, rel=1e-12)
        assert sum(c.flop_share for c in p.categories) == pytest.approx(1, rel=1e-12)
        assert sum(r.time_s for r in p.ops) == pytest.approx(p.step_time_s, rel=1e-12)


def test_roofline_time_per_op(llama):
    p = evaluate(compile_step(llama), H100)
    for r in p.ops:
        assert r.time_s == max(r.flops / H100.peak_flops, r.bytes / H100.bandwidth)
        assert r.bound == ("compute" if r.flops / H100.peak_flops >= r.bytes / H100.bandwidth
                           else "memory")


def test_gqa_kv_heads_shape_the_attention(llama):
    step = compile_step(llama)
    flash = step.op("layers.attn.flash")
    k = step.tensor(flash.inputs[1])
    assert k.shape == (B, S, H_kv * d_h)
    # causal: 2 x (2 S^2 d_h / 2) per head and sequence
    assert sympy.expand(flops(step, flash) - 2 * (2 * S**2 * d_h / 2) * B * H) == 0
