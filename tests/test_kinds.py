"""Op kinds: a user's kind defined here, outside the package, goes through every pass, the
verifier, `formula`, `sweep` and `solve`; the built-in kinds' costs as formulas."""

import re

import attrs
import numpy as np
import pytest
import sympy
from opgraph.passes.derive_backward import VJP_RULES
from opgraph.passes.fuse_attention import fuse_attention

from opgraph import GraphBuilder, Phase, compile_step, evaluate, hardware
from opgraph.core import kinds, rules
from opgraph.cost.costmodel import DEFAULT, CostModel
from opgraph.core.errors import OpgraphError
from opgraph.cost.formula import formula
from opgraph.analysis.solve import max_share
from opgraph.analysis.sweep import compile_sweep, make_grid, run_grid
from opgraph.core.symbols import B, D, F, H, H_kv, L, S, V, d_h, dim

H100 = hardware.get("h100-sxm")
DERIVED = CostModel(backward="derived")
W = dim("W")
BF16 = 2


# --- a user's kind: squared ReLU (Primer), relu(x)^2 ----------------------------------------------

def squared_relu_flops(ins, outs, params):
    """max(x, 0), then its square: 2 per element."""
    return 2 * outs[0].numel


def squared_relu_backward_flops(ins, outs, params):
    """dY * 2 * relu(x): the relu again, times 2, times dY: 3 per element."""
    return 3 * ins[0].numel


@pytest.fixture(scope="module")
def squared_relu():
    kind = kinds.define_kind("squared_relu", shape=kinds.same_shape, flops=squared_relu_flops,
                             vjp="inputs", backward_flops=squared_relu_backward_flops)
    yield kind
    kinds.remove_kind("squared_relu")


def user_model(kind) -> "opgraph.Graph":  # noqa: F821
    """A Primer-style stack: each layer's MLP activation is the user's kind."""
    g = GraphBuilder("primer-tiny", {B: 2, S: 512, D: 256, F: 1024, L: 4, V: 1000})
    tokens, targets = g.input("tokens", (B, S)), g.input("targets", (B, S))
    table = g.weight("embed.weight", (V, D))
    x = g.embedding(tokens, table)
    with g.repeat(L, "layers"):
        h = g.rmsnorm(x, g.weight("norm.weight", (D,)), name="norm")
        up = g.matmul(h, g.weight("up.weight", (D, F)), name="up")
        a = kind.op(g, [up], name="act")
        x = g.add(x, g.matmul(a, g.weight("down.weight", (F, D)), name="down"), name="residual")
    g.output_head(x, table, targets, tied=True)
    graph = g.build()
    graph.seq_len = 512
    return graph


@pytest.fixture(scope="module")
def user_step(squared_relu):
    """The user's model compiled by the standard pipeline (verified). Fusion passes (issue 9,
    part B) extend the tests below by compiling `user_model(squared_relu)` with them."""
    return compile_step(user_model(squared_relu))


def test_a_user_kind_is_in_every_table(squared_relu):
    for table in (rules.SHAPE_RULES, rules.FLOP_RULES, VJP_RULES):
        assert "squared_relu" in table
    assert "squared_relu" in rules.FORWARD_KINDS
    assert "squared_relu_backward" in rules.BACKWARD_KINDS
    assert kinds.kind("squared_relu") is squared_relu
    assert "squared_relu" not in kinds.builtin_kinds()


def test_a_user_matmul_kind_gets_waves_from_its_grid():
    """A kind that says its GEMM grid (`grid=`) is tiled like the built-in matmul: its
    calibrated time carries the same wave quantisation; without it, none."""
    from opgraph.cost.calibration import Efficiencies
    from opgraph.cost.costmodel import CalibratedCostModel, wave_quantum

    def outer_shape(ins, params):  # a[M] x b[N] -> [M, N]
        return [(ins[0].shape[0], ins[1].shape[0])]

    def outer_flops(ins, outs, params):  # as a product over K = 4,096: compute-bound
        return 2 * outs[0].numel * 4096

    def outer_grid(ins, outs, params):
        return (1, *outs[0].shape)

    model = CalibratedCostModel(table={"hopper": Efficiencies(
        "hopper", matmul=0.5, matmul_tile_m=128, matmul_tile_n=256)})
    times = {}
    for grid in (outer_grid, None):
        k = kinds.define_kind("outer", shape=outer_shape, flops=outer_flops, vjp=None, grid=grid)
        assert kinds.kind("outer").grid is grid
        g = GraphBuilder("outer", {B: 1, S: 300, D: 300})
        k.op(g, [g.activation("a", (S,)), g.activation("b", (D,))], name="ab")
        graph = g.build()
        (row,) = evaluate(graph, H100, cost=model).ops
        times[grid] = row.time_s
        kinds.remove_kind("outer")
        assert "outer" not in rules.GEMM_GRIDS
    # 300 x 300: 3 x 2 tiles, K split in floor(132 / 6) = 22 to fill one wave of 132 SMs
    assert times[outer_grid] / times[None] == pytest.approx(
        wave_quantum(1, 300, 300, 132, 128, 256, split=22))


def test_a_user_kind_goes_through_the_backward(user_step):
    act = user_step.op("layers.act")
    (grad,) = [op for op in user_step.ops() if op.forward == "layers.act"]
    assert grad.kind == "squared_relu_backward" and grad.phase is Phase.BACKWARD
    assert grad.count == L
    # its own rule under "derived"; twice the forward under the plate's convention
    assert sympy.expand(DERIVED.op_cost(user_step, grad).flops - 3 * B * S * F) == 0
    assert sympy.expand(DEFAULT.op_cost(user_step, grad).flops
                        - 2 * DEFAULT.op_cost(user_step, act).flops) == 0


def test_a_user_kind_in_formula(user_step):
    assert sympy.expand(formula(user_step, "flops", op="layers.act") - 2 * B * S * F * L) == 0
    # bytes: reads up, writes act (bf16), L times
    assert sympy.expand(formula(user_step, "bytes", op="layers.act")
                        - 2 * BF16 * B * S * F * L) == 0


def test_a_user_kind_in_sweep_and_solve(user_step):
    sweep = compile_sweep(user_step, free=("B", "S"))
    grid = make_grid({"seq_len": np.array([256, 2048]), "batch": np.array([1, 8])}, [H100], 512)
    rows = run_grid(sweep, grid)
    for i in range(len(rows["tokens"])):
        p = evaluate(user_step, H100, {"B": int(rows["batch"][i]), "S": int(rows["seq_len"][i])})
        assert float(rows["step_time_s"][i]) == pytest.approx(p.step_time_s, rel=1e-9)
        assert float(rows["flops"][i]) == pytest.approx(p.flops, rel=1e-9)
    answer = max_share(user_step, H100, "elementwise", share=0.5)
    assert answer is not None


def test_defining_a_kind_twice_or_over_a_builtin_is_an_error(squared_relu):
    with pytest.raises(OpgraphError, match="exists already"):
        kinds.define_kind("squared_relu", shape=kinds.same_shape, flops=squared_relu_flops)
    with pytest.raises(OpgraphError, match="built in"):
        kinds.define_kind("matmul", shape=kinds.same_shape, flops=squared_relu_flops,
                          replace=True)
    with pytest.raises(OpgraphError, match="vjp="):
        kinds.define_kind("bad_vjp", shape=kinds.same_shape, flops=squared_relu_flops,
                          vjp="outputs")
    with pytest.raises(OpgraphError, match="unknown op kind"):
        kinds.kind("no_such_kind")


def test_a_user_view_costs_no_bytes_and_its_default_backward_is_twice_the_forward():
    def transpose_shape(ins, params):
        (x,) = ins
        return [(*x.shape[:-2], x.shape[-1], x.shape[-2])]

    def no_flops(ins, outs, params):
        return sympy.Integer(0)

    def cube_flops(ins, outs, params):
        return 2 * outs[0].numel

    kinds.define_kind("lazy_transpose", shape=transpose_shape, flops=no_flops, view=True,
                      category="elementwise")
    kinds.define_kind("cube", shape=kinds.same_shape, flops=cube_flops, vjp="none")
    try:
        g = GraphBuilder("t", {B: 1, S: 8, D: 4})
        x = g.activation("x", (B, S, D))
        t = kinds.kind("lazy_transpose").op(g, [x])
        y = kinds.kind("cube").op(g, [t])
        step = compile_step(g.build())
        assert DEFAULT.op_cost(step, step.op(t.name)).bytes == 0
        assert DEFAULT.op_cost(step, step.op(t.name, )).flops == 0
        (grad,) = [op for op in step.ops() if op.forward == y.name]
        assert sympy.expand(DERIVED.op_cost(step, grad).flops - 4 * B * S * D) == 0
    finally:
        kinds.remove_kind("lazy_transpose")
        kinds.remove_kind("cube")
    assert "cube" not in rules.SHAPE_RULES and "cube_backward" not in rules.FLOP_RULES


# --- the built-in kinds' costs, as formulas -------------------------------------------------------

def _one_op(kind_method, *shapes, **params):
    g = GraphBuilder("t")
    ins = [g.activation(f"x{i}", s) for i, s in enumerate(shapes)]
    out = getattr(g, kind_method)(*ins, **params)
    graph = g.build()
    return graph, graph.producer(out.name)


@pytest.mark.parametrize("method, args, per_element, backward", [
    ("gelu", {}, 8, 16),  # tanh approximation
    ("gelu", {"approximate": "none"}, 5, 10),  # exact, erf
    ("geglu", {}, 9, 18),
    ("softcap", {"cap": 30}, 3, 5),
    ("scale", {"factor": 8}, 1, 1),
    ("mul", {}, 1, 2),
    ("relu", {}, 1, 1),  # max(x, 0); backward dY where x > 0
    ("dropout", {"p": 0.1}, 0, 0),  # a select by an RNG's integer mask: bytes, no FLOPs
])
def test_elementwise_flops(method, args, per_element, backward):
    n_in = 2 if method in ("geglu", "mul") else 1
    graph, op = _one_op(method, *[(B, S, F)] * n_in, **args)
    assert sympy.expand(DEFAULT.op_cost(graph, op).flops - per_element * B * S * F) == 0
    step = compile_step(graph)
    bwd = sum(DERIVED.op_cost(step, o).flops for o in step.ops() if o.forward == op.name)
    assert sympy.expand(bwd - backward * B * S * F) == 0


def test_gelu_takes_only_its_two_forms():
    with pytest.raises(rules.ShapeError, match="approximate"):
        _one_op("gelu", (B, S, F), approximate="sigmoid")


def _attention(window=None, softcap=None, d_v=d_h, fused=False, causal=True, alibi=False):
    g = GraphBuilder("t")
    q = g.activation("q", (B, S, H * d_h))
    k = g.activation("k", (B, S, H_kv * d_h))
    v = g.activation("v", (B, S, H_kv * d_v))
    make = g.flash_attention if fused else g.attention
    make(q, k, v, heads=H, kv_heads=H_kv, causal=causal, window=window, softcap=softcap,
         alibi=alibi)
    return g.build()


def _flops(graph, cost=DEFAULT):
    costs = cost.op_costs(graph)
    return sympy.Add(*(costs[op.name].flops * op.count for op in graph.ops()))


def test_sliding_window_flops_follow_the_window():
    """Each query sees min(S, W) keys; causal, the band under the diagonal: S w - w^2 / 2."""
    w = sympy.Min(S, W)
    pairs = S * w - w**2 / 2
    flash = _attention(window=W, fused=True)
    assert sympy.expand(_flops(flash) - 2 * B * H * pairs * 2 * d_h) == 0
    # the unfused pair counts the same, and fusing keeps them (and the window)
    unfused = _attention(window=W)
    assert sympy.expand(_flops(unfused) - _flops(flash)) == 0
    fused = fuse_attention(unfused)
    (op,) = fused.ops()
    assert op.kind == "flash_attention" and op.param("window") == W
    # a window that covers the sequence is full causal attention
    full = _flops(_attention(fused=True)).xreplace({S: 4096})
    assert sympy.simplify(_flops(flash).xreplace({S: 4096, W: 8192}) - full) == 0
    assert sympy.simplify(_flops(flash).xreplace({S: 8192, W: 4096})
                          - 2 * B * H * (8192 * 4096 - 4096**2 / 2) * 2 * d_h) == 0
    # not causal: S x w pairs
    both_ways = _attention(window=W, fused=True, causal=False)
    assert sympy.expand(_flops(both_ways) - 2 * B * H * S * w * 2 * d_h) == 0


def test_windowed_backward_follows_the_window():
    w = sympy.Min(S, W)
    step = compile_step(_attention(window=W))  # fused by compile_step
    (grad,) = [op for op in step.ops() if op.kind == "flash_attention_backward"]
    assert sympy.expand(DERIVED.op_cost(step, grad).flops
                        - 2 * B * H * (S * w - w**2 / 2) * 5 * d_h) == 0


def test_soft_capped_logits_add_their_flops_per_score():
    capped, plain = _attention(softcap=50, fused=True), _attention(fused=True)
    scores = B * H * S**2 / 2
    assert sympy.expand(_flops(capped) - _flops(plain) - 3 * scores) == 0
    unfused = _attention(softcap=50)
    assert sympy.expand(_flops(unfused) - _flops(capped)) == 0
    assert sympy.expand(_flops(fuse_attention(unfused)) - _flops(capped)) == 0


def test_alibi_adds_one_flop_per_score_and_fuses():
    """ALiBi's bias is one add per score, forward; the gradient passes through it; a fused
    backward recomputes the scores, so adds it again."""
    biased, plain = _attention(alibi=True, fused=True), _attention(fused=True)
    scores = B * H * S**2 / 2
    assert sympy.expand(_flops(biased) - _flops(plain) - scores) == 0
    unfused = _attention(alibi=True)
    assert sympy.expand(_flops(unfused) - _flops(biased)) == 0
    (op,) = fuse_attention(unfused).ops()
    assert op.kind == "flash_attention" and op.param("alibi") is True

    def backward(graph):
        step = compile_step(graph, fused_attention=False)
        return sympy.Add(*(DERIVED.op_cost(step, o).flops * o.count for o in step.ops()
                           if o.phase is Phase.BACKWARD))
    assert sympy.expand(backward(unfused) - backward(_attention())) == 0
    assert sympy.expand(backward(biased) - backward(plain) - scores) == 0


def test_partial_rope_rotates_its_share_of_each_head():
    R = dim("R")
    graph, op = _one_op("rope", (B, S, H * d_h), rotary=R, heads=H)
    assert sympy.expand(DEFAULT.op_cost(graph, op).flops - 3 * B * S * H * R) == 0
    assert sympy.expand(DEFAULT.op_cost(graph, op).bytes
                        - DEFAULT.op_cost(*_one_op("rope", (B, S, H * d_h))).bytes) == 0
    step = compile_step(graph)
    (bwd,) = [o for o in step.ops() if o.forward == op.name]
    assert sympy.expand(DERIVED.op_cost(step, bwd).flops - 3 * B * S * H * R) == 0
    with pytest.raises(rules.ShapeError, match="heads"):
        _one_op("rope", (B, S, H * d_h), rotary=R)


def test_values_may_have_another_head_size():
    d_v = dim("d_v")
    graph = _attention(d_v=d_v)
    o = graph.tensor("attn.pv")
    assert o.shape == (B, S, H * d_v)
    expected = 2 * B * H * S**2 / 2 * (d_h + d_v)
    assert sympy.expand(_flops(graph) - expected) == 0
    assert sympy.expand(_flops(fuse_attention(graph)) - expected) == 0


# --- views -------------------------------------------------------------------------------------

def _bytes(graph, name, cost=DEFAULT):
    return cost.op_cost(graph, graph.producer(name)).bytes


def test_reshape_and_broadcast_are_views():
    g = GraphBuilder("t")
    x = g.activation("x", (B, S, H * d_h))
    r = g.reshape(x, (B, S, H, d_h))
    z = g.activation("z", (B, S, 1, d_h))
    b = g.broadcast(z, (B, S, H, d_h))
    graph = g.build()
    assert _bytes(graph, r.name) == 0 and _bytes(graph, b.name) == 0
    forced = GraphBuilder("t")
    y = forced.op("reshape", [forced.activation("x", (B, S, D))], category="elementwise",
                  shape=(B * S, D), copy=True)
    assert sympy.expand(_bytes(forced.build(), y.name) - 2 * BF16 * B * S * D) == 0


def test_a_slice_is_a_view_when_contiguous_and_a_copy_when_strided():
    g = GraphBuilder("t")
    x = g.activation("x", (B, S, H, 192))
    strided = g.slice(x, 64, start=128)  # each head's last 64 of 192: strided
    whole = g.activation("w", (1, 1, 4096))
    rows = g.slice(whole, 1024)  # the leading dims are 1: one contiguous run
    parts = g.split(x, [128, 64])
    graph = g.build()
    assert sympy.expand(_bytes(graph, strided.name) - BF16 * B * S * H * (192 + 64)) == 0
    assert _bytes(graph, rows.name) == 0
    assert sympy.expand(_bytes(graph, parts[0].name) - 2 * BF16 * B * S * H * 192) == 0


def test_a_concatenation_is_a_copy_unless_in_place():
    g = GraphBuilder("t")
    a, b = g.activation("a", (B, S, H, 128)), g.activation("b", (B, S, H, 64))
    c = g.concat([a, b])
    d = g.concat([a, b], in_place=True, name="joined")
    graph = g.build()
    assert graph.tensor(c.name).shape == (B, S, H, 192)
    assert sympy.expand(_bytes(graph, c.name) - 2 * BF16 * B * S * H * 192) == 0
    assert _bytes(graph, d.name) == 0


def test_a_views_backward_moves_its_own_tensors():
    """By the plate's convention too: a reshape's backward is a view again (nothing), a
    broadcast's sums dY over the broadcast dim (reads dY, writes the small gradient)."""
    g = GraphBuilder("t")
    x = g.activation("x", (B, S, H * d_h))
    z = g.activation("z", (B, S, 1, d_h))
    y = g.add(g.rope(g.reshape(x, (B, S, H, d_h))), g.broadcast(z, (B, S, H, d_h)))
    step = compile_step(g.build())
    assert step.tensor(y.name).shape == (B, S, H, d_h)
    (grad,) = [op for op in step.ops() if op.kind == "reshape_backward"]
    assert DEFAULT.op_cost(step, grad).bytes == 0 and DEFAULT.op_cost(step, grad).flops == 0
    (grad,) = [op for op in step.ops() if op.kind == "broadcast_backward"]
    dy, saved, dz = B * S * H * d_h, B * S * d_h, B * S * d_h
    assert sympy.expand(DEFAULT.op_cost(step, grad).bytes - BF16 * (dy + saved + dz)) == 0


def test_split_backward_joins_the_pieces_gradients():
    g = GraphBuilder("t")
    x = g.activation("x", (B, S, 3 * D))
    first, second, third = g.split(x, [D, D, D])
    g.add(g.add(first, third), second)
    step = compile_step(g.build())
    (grad,) = [op for op in step.ops() if op.kind == "split_backward"]
    assert grad.param("present") == (0, 1, 2) and grad.param("dys") == 3
    assert step.tensor(grad.outputs[0]).shape == (B, S, 3 * D)
    # a piece without a gradient is left out of the join (zeros), by `present`
    pieces = [step.tensor(n) for n in (grad.inputs[0], grad.inputs[3])]
    assert rules.SHAPE_RULES["split_backward"](pieces, {**dict(grad.params), "dys": 1,
                                                        "present": (0,)}) == [(B, S, 3 * D)]


def test_gather_and_its_scatter_add():
    M = dim("M")
    g = GraphBuilder("t")
    x = g.activation("x", (B, S, D))
    y = g.gather(x, g.input("positions", (B, M)))
    step = compile_step(g.build())
    assert step.tensor(y.name).shape == (B, M, D)
    (grad,) = [op for op in step.ops() if op.kind == "gather_backward"]
    assert sympy.expand(DERIVED.op_cost(step, grad).flops - B * M * D) == 0
    with pytest.raises(rules.ShapeError, match="leading dims"):
        g2 = GraphBuilder("t")
        g2.gather(g2.activation("x", (B, S, D)), g2.input("i", (S, M)))


def test_bad_view_shapes_say_what_is_wrong():
    g = GraphBuilder("t")
    x = g.activation("x", (B, S, D))
    with pytest.raises(rules.ShapeError, match="element counts differ"):
        g.reshape(x, (B, S, H, d_h))
    with pytest.raises(rules.ShapeError, match="do not add up"):
        g.split(x, [D, 1])
    with pytest.raises(rules.ShapeError, match="cannot broadcast"):
        g.broadcast(x, (B, S, 2 * D))
    with pytest.raises(rules.ShapeError, match="ends past"):
        g.slice(g.activation("y", (B, S, 64)), 32, start=48)


def test_every_builtin_kind_has_a_reference_example():
    assert set(kinds.builtin_kinds()) <= set(kinds.EXAMPLES)
    table = kinds.kind_table()
    for name in kinds.builtin_kinds():
        assert f"| `{name}` |" in table
    assert "| `matmul` | `matmul(x[B, S, D], w[D, F])` | `2*B*D*F*S` | `4*B*D*F*S` |" in table


def test_solve_walks_a_windows_min():
    """solve's pieces split where Min(S, W) changes branch, so windowed attention solves exactly
    over the sequence length as well as over tokens."""
    from opgraph.models import preset

    from opgraph.analysis.solve import ridge, smallest

    x = sympy.Symbol("x", positive=True)
    assert smallest(2 - sympy.Min(x, 3), x, 0) == 2
    assert smallest(sympy.Max(4 - sympy.Min(x, 3), x - 10), x, 0) is None
    assert smallest(sympy.Max(4 - sympy.Min(x, 3), x / 2 - 10), x, 0) is None
    step = compile_step(preset("gemma2-2b"))
    answer = max_share(step, H100, "attention", 0.1, dim="seq_len")  # checked by evaluate
    assert answer.holds == "up_to" and answer.seq_len > 4096  # past the window: the band
    local = ridge(step, H100, "layers.local.attn.flash", dim="seq_len")
    assert local.smallest_whole is not None


def test_a_tensor_read_twice_differentiates():
    """mul(x, x) (a square) and concat([y, y]): the backward kernel lists the tensor twice, as
    its layout counts it, and writes its gradient once."""
    g = GraphBuilder("t")
    x = g.activation("x", (B, S, D))
    y = g.mul(x, x)
    g.concat([y, y])
    step = compile_step(g.build())  # verified
    (square,) = [op for op in step.ops() if op.kind == "mul_backward"]
    assert square.inputs[1:] == ("x", "x") and len(square.outputs) == 1
    assert sympy.expand(step.op_bytes(square) - 3 * BF16 * B * S * D) == 0  # dY, x once, dX


def test_a_user_kind_goes_through_fusion(squared_relu):
    """Declared pointwise in a fusion policy, the user's activation joins its matmul's epilogue
    (or the next one's prologue): FLOPs kept exactly, its [B, S, F] round trip gone."""
    from opgraph.passes.fuse_elementwise import fuse_elementwise

    from opgraph.core.fusion import ELEMENTWISE_MATMUL

    policy = ELEMENTWISE_MATMUL.with_kinds(squared_relu="pointwise")
    plain = compile_step(user_model(squared_relu))
    fused = compile_step(user_model(squared_relu),
                         extra_passes=[lambda g: fuse_elementwise(g, policy)])
    (kernel,) = [op for op in fused.ops() if op.kind == "fused" and op.phase is Phase.FORWARD
                 and "layers.act" in {m.name for m in op.param("body")}]
    assert kernel.count == L
    assert sympy.expand(formula(fused, "flops") - formula(plain, "flops")) == 0
    # the forward no longer writes act and reads it back: 2 x BF16 x B*S*F per layer at least
    saved = formula(plain, "bytes") - formula(fused, "bytes")
    assert (saved - 2 * BF16 * B * S * F * L).subs({B: 2, S: 512, D: 256, F: 1024, L: 4}) >= 0


def test_a_user_kind_declares_its_eager_kernels(monkeypatch):
    """`eager=` and `eager_backward=` give a kind's bytes as eager PyTorch runs it (here
    `relu(x) ** 2` as two kernels: relu reads and writes x, the square reads it and writes
    the output, 4 x 2 bytes per element; its backward one kernel, 3 x 2), charged wherever a
    framework runs the kind eagerly."""
    import attrs

    from opgraph.parallel import frameworks
    from opgraph.cost.costmodel import cost_model
    from opgraph.parallel.distributed import compile_parallel
    from opgraph.core.ir import Phase
    from opgraph.parallel.parallel import Parallel

    def two_kernels(ins, outs, params):
        return 4 * ins[0].nbytes

    def one_kernel(ins, outs, params):
        return 3 * ins[0].nbytes

    k = kinds.define_kind("relu_twice", shape=kinds.same_shape, flops=rules.per_element(2),
                          eager=two_kernels, eager_backward=one_kernel)
    try:
        assert kinds.kind("relu_twice").eager is two_kernels
        torchtitan = frameworks.FRAMEWORKS["torchtitan"]
        monkeypatch.setitem(frameworks.FRAMEWORKS, "torchtitan", attrs.evolve(
            torchtitan, eager=torchtitan.eager | {"relu_twice"}))
        g = compile_parallel(user_model(k), Parallel(dp=2, framework="torchtitan"))
        act = g.op("layers.act")
        (backward,) = [o for o in g.ops() if o.phase is Phase.BACKWARD and o.forward == act.name]
        x = g.tensor(act.inputs[0]).nbytes  # B x S x F in BF16
        cost = cost_model("roofline")
        assert cost.op_cost(g, act).bytes == 4 * x
        assert cost.op_cost(g, backward).bytes == 3 * x
    finally:
        kinds.remove_kind("relu_twice")
    assert "relu_twice" not in rules.EAGER_BYTES and "relu_twice" not in rules.EAGER_BACKWARD_BYTES


# --- a kind owns its traits: every one through define_kind, read back, cleared ----------------

def test_define_kind_takes_every_trait_a_kind_has():
    """Completeness: each of `define_kind`'s arguments is a field of `Kind` (but `replace`),
    and each field is an argument (but the backward's name, which follows from `vjp`, and the
    group, a user's kind being a forward kind)."""
    import inspect

    import attrs

    arguments = set(inspect.signature(kinds.define_kind).parameters)
    fields = {f.name for f in attrs.fields(kinds.Kind)}
    assert arguments - {"replace"} == fields - {"backward", "group"}


def test_every_table_row_is_a_kind_records_trait():
    """The built-in kinds are records declared in their families' modules; each per-trait
    table's row is the trait of a record (its backward kernel's for `<kind>_backward`), so no
    table holds a row no kind declares."""
    from opgraph.core.rules import attention, dense, kernels, loss, moe, norm, optimizer
    from opgraph.core.rules import pointwise, ssm, views

    declared = [k for family in (dense, norm, attention, ssm, pointwise, loss, moe, views,
                                 optimizer, kernels) for k in family.KINDS]
    builtin = set(rules.KINDS) - set(kinds.defined_kinds())
    assert {k.name for k in declared} == builtin
    assert len(declared) == len(builtin)  # each declared once
    owner = {k.backward: (k, "backward_") for k in declared if k.backward}
    owner |= {k.name: (k, "") for k in declared}
    traits = {"SHAPE_RULES": "shape", "FLOP_RULES": "flops", "VIEWS": "view",
              "GEMM_GRIDS": "grid", "ATTENTION_SCORES": "scores", "EFFICIENCY": "efficiency",
              "EAGER_BYTES": "eager", "SHARDING": "shards", "CP_GATHERS": "cp_gathers",
              "OPERANDS": "operands", "FP8_KINDS": "fp8_weight_dims", "VJP_RULES": "vjp",
              "BACKWARD_COST": "backward_cost", "ACTIVE_FRACTION": "active_fraction"}
    for table, trait in traits.items():
        for name, row in getattr(rules, table).items():
            if name not in owner:  # a user's kind (a fixture's), with its backward kernel
                continue
            record, prefix = owner[name]
            if prefix and trait in ("shape", "flops", "view", "scores", "efficiency"):
                trait_of = prefix + trait
            else:
                trait_of = trait
            assert row == getattr(record, trait_of), (table, name)


def _routed_share(tensor, op, weight):
    """K of E experts, as the built-in expert matmul's rule says."""
    return tensor(op.inputs[2]).shape[-1] / weight.shape[0]


def test_a_kind_with_every_trait_is_in_every_table_and_leaves_none():
    """A routed GEMM of the user's, every trait declared: each is in its table and `kind()`
    reads each back; `remove_kind` leaves no row in any table (`recompute.SAVE_KINDS` too)."""
    from opgraph.cost import costmodel
    from opgraph.core import fusion, parameters
    from opgraph.passes import precision, recompute

    traits = dict(shards=("column", "contracting", "expert"), cp_gathers=(), kept=True,
                  fusion_class="matmul", operands=2, active_fraction=_routed_share,
                  fp8_weight_dims=3, grid=rules.GEMM_GRIDS["expert_matmul"], category="matmul")
    made = kinds.define_kind("routed_gemm", shape=rules.SHAPE_RULES["expert_matmul"],
                             flops=rules.FLOP_RULES["expert_matmul"], **traits)
    try:
        assert rules.SHARDING["routed_gemm"] == traits["shards"]
        assert fusion.DEFINED_CLASSES["routed_gemm"] == "matmul"
        assert fusion.ELEMENTWISE_MATMUL.kind_class("routed_gemm_backward") == "matmul"
        assert "routed_gemm" in recompute.SAVE_KINDS
        assert costmodel.OPERANDS["routed_gemm"] == 2
        assert parameters.ACTIVE_FRACTION["routed_gemm"] is _routed_share
        assert precision.FP8_KINDS["routed_gemm"] == 3
        assert kinds.kind("routed_gemm") == made
        for name, value in traits.items():
            assert getattr(made, name) == value, name
    finally:
        kinds.remove_kind("routed_gemm")
    for table in kinds._tables():
        assert not {"routed_gemm", "routed_gemm_backward"} & set(table)
    assert "routed_gemm" not in recompute.SAVE_KINDS
    assert fusion.ELEMENTWISE_MATMUL.kind_class("routed_gemm") is None


def _routed_model(kind: str):
    g = GraphBuilder("routed", {B: 2, S: 64, D: 32, F: 64, dim("E"): 8, dim("K"): 2})
    x = g.input("x", (B, S, D))
    experts = g.input("experts", (B, S, dim("K")), dtype=kinds.INT32)
    g.op(kind, [x, g.weight("w", (dim("E"), D, F)), experts], category="matmul", name="gemm")
    return g.build()


def test_each_declared_trait_reaches_what_reads_it(squared_relu):
    """Declared, each trait changes what its reader does: the built-in fusion policy (`--fuse
    elementwise+matmul`) fuses a pointwise kind into its matmul; selective-op recomputation
    keeps a kept kind's output rather than re-running it; FP8 operands put a matrix multiply
    at the FP8 peak; a routed weight counts K/E of itself in the active parameters."""
    from opgraph.cost.costmodel import _operands_dtype
    from opgraph.core.ir import FP8, Tensor
    from opgraph.core.parameters import active_fraction
    from opgraph.core.pipeline import fusion_passes

    def fused_members(step):
        return {m.name for op in step.ops() if op.kind == "fused" for m in op.param("body")}

    def recomputed(step):
        return {op.name for op in step.ops() if op.phase is Phase.RECOMPUTE}

    options = {"extra_passes": fusion_passes("elementwise+matmul"), "recompute": "selective-op"}
    plain = compile_step(user_model(squared_relu), **options)
    assert "layers.act" not in fused_members(plain)
    assert any("act" in name for name in recomputed(plain))
    declared = kinds.define_kind("squared_relu_declared", shape=kinds.same_shape,
                                 flops=squared_relu_flops, fusion_class="pointwise", kept=True)
    try:
        step = compile_step(user_model(declared), **options)
        assert "layers.act" in fused_members(step)
        assert not any("act" in name for name in recomputed(step))
    finally:
        kinds.remove_kind("squared_relu_declared")

    fp8 = [Tensor(n, (S, D), FP8) for n in ("a", "b")]
    kinds.define_kind("fp8_gemm", shape=rules.SHAPE_RULES["matmul"],
                      flops=rules.FLOP_RULES["matmul"], operands=2)
    try:
        assert _operands_dtype(fp8, "fp8_gemm") == "fp8"
    finally:
        kinds.remove_kind("fp8_gemm")
    assert _operands_dtype(fp8, "fp8_gemm") is None  # undeclared: the BF16 peak

    # covered by the FP8 recipe: the user's MLP activation kind is no GEMM, so a GEMM kind
    # of the user's takes the MLP's up projection, and `--precision fp8` casts its operands
    for dims, expected in ((None, ["bf16", "bf16"]), (2, ["fp8", "fp8"])):
        kinds.define_kind("my_gemm", shape=rules.SHAPE_RULES["matmul"],
                          flops=rules.FLOP_RULES["matmul"], category="matmul", operands=2,
                          fp8_weight_dims=dims)
        try:
            graph = user_model(squared_relu)
            up = graph.op("layers.up")
            graph.replace_op(attrs.evolve(up, kind="my_gemm"))
            step = compile_step(graph, precision="fp8")
            assert [step.tensor(n).dtype.name for n in step.op("layers.up").inputs] == expected
        finally:
            kinds.remove_kind("my_gemm")

    for share, expected in ((None, 1), (_routed_share, sympy.Rational(2, 8))):
        kinds.define_kind("routed_gemm", shape=rules.SHAPE_RULES["expert_matmul"],
                          flops=rules.FLOP_RULES["expert_matmul"], active_fraction=share)
        try:
            graph = _routed_model("routed_gemm")
            assert active_fraction(graph, graph.tensor("w")).xreplace(graph.dims) == expected
        finally:
            kinds.remove_kind("routed_gemm")


@pytest.mark.parametrize("traits, message", [
    ({"efficiency": "fast"}, "efficiency='fast'; give one of matmul"),
    ({"scores": 3}, "scores must be a rule"),
    ({"example": ("x",)}, "example and variants are rules.Example records"),
])
def test_define_kind_refuses_a_trait_it_cannot_use(traits, message):
    """The library validates as the command line does: a trait of the wrong form is a one-line
    OpgraphError naming it, and no table gets a row."""
    with pytest.raises(OpgraphError, match=re.escape(message)):
        kinds.define_kind("bad_kind", shape=kinds.same_shape, flops=rules.per_element(1),
                          **traits)
    assert "bad_kind" not in rules.SHAPE_RULES
