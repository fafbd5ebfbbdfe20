"""Cost formulas: closed forms checked by sympy equality, values against `evaluate`."""

import functools
import json

import pytest
import sympy
from opgraph.models import preset
from opgraph.passes.evaluate import resolve

from opgraph import compile_step, evaluate, hardware
from opgraph.cost.formula import BANDWIDTH, PEAK, formula, select, symbol_values, tidy, value
from opgraph.core.symbols import B, D, F, H, H_kv, L, S, V, d_h

H100 = hardware.get("h100-sxm")

# Llama 3 8B's shapes (arXiv:2407.21783, Table 3), written out rather than read from the preset.
LLAMA3_8B = {D: 4096, L: 32, H: 32, H_kv: 8, d_h: 128, F: 14336, V: 128256, S: 8192, B: 1}


@pytest.fixture(scope="module")
def step():
    return compile_step(preset("llama3-8b"))


@pytest.fixture(scope="module")
def step_formula(step):
    """`formula(step, ...)` worked out once per distinct question for the module: a formula is
    a pure function of the step and its arguments, and the parametrised checks below compare
    the same formulas with `evaluate` at each point."""
    return functools.cache(functools.partial(formula, step))


def same(a, b) -> bool:
    return sympy.expand(a - b) == 0


def test_matmul_flops_are_six_times_projection_weights_times_tokens(step):
    expr = formula(step, "flops", category="matmul")
    read = {n for op in select(step, category="matmul") for n in op.inputs}
    weights = [t for t in step.weights() if t.name in read]
    assert len(weights) == 7  # q, k, v, o, gate, up, down
    assert same(expr, 6 * B * S * sum(w.numel * w.count for w in weights))
    assert same(expr, 6 * B * S * L * (2 * D * H * d_h + 2 * D * H_kv * d_h + 3 * D * F))
    # It reads as one product with the layer count factored out.
    assert isinstance(expr, sympy.Mul) and L in expr.args


def test_matmul_flops_value_and_the_issues_figure(step):
    """The issue's 6,979,588,096 is every parameter but the embedding and the head; the matmul
    category's weights are that less the 2L + 1 RMSNorm vectors, which do no matmul."""
    projection = LLAMA3_8B[L] * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    assert projection == 6_979_321_856
    expr = formula(step, "flops", category="matmul")
    assert value(expr, LLAMA3_8B) == 6 * projection * 8192
    dims = resolve(step)
    head_and_embedding = 2 * 128256 * 4096
    no_embed_no_head = int(step.parameters().xreplace(dims)) - head_and_embedding
    assert no_embed_no_head == 6_979_588_096
    assert no_embed_no_head - projection == (2 * 32 + 1) * 4096


def test_attention_and_optimizer_closed_forms(step):
    # PLATE.md: forward 2 x (2 S^2 d_h / 2) per head and sequence; backward twice that.
    assert same(formula(step, "flops", category="attention"), 3 * 2 * B * H * L * S**2 * d_h)
    # The fused core moves Q, K, V and O in BF16; its backward reads those and dO, writes dQ, dK,
    # dV: (2 + 4 + 2) x 2 bytes x B*S*d_h per head of queries and of keys/values, alike.
    q_o, kv = B * S * H * d_h, B * S * H_kv * d_h
    forward = 2 * (2 * q_o + 2 * kv)
    backward = 2 * (3 * q_o + 2 * kv + q_o + 2 * kv)
    assert same(formula(step, "bytes", category="attention"), L * (forward + backward))
    params = step.parameters()
    assert same(formula(step, "bytes", category="optimizer"), 34 * params)
    assert same(formula(step, "flops", category="optimizer"), 12 * params)


def test_op_time_is_the_roofline_max(step):
    expr = formula(step, "time", op="layers.q_proj")
    flops = 2 * B * S * D * H * d_h
    nbytes = 2 * (B * S * D + D * H * d_h + B * S * H * d_h)
    expected = L * sympy.Max(flops / PEAK, nbytes / BANDWIDTH)
    assert expr.expand() == expected.expand()
    assert expr.free_symbols == {B, S, D, H, d_h, L, PEAK, BANDWIDTH}
    numeric = formula(step, "time", op="layers.q_proj", hardware=H100)
    assert PEAK not in numeric.free_symbols
    assert same(numeric.xreplace(resolve(step)), expr.xreplace(resolve(step)).xreplace(
        {PEAK: sympy.Integer(989 * 10**12), BANDWIDTH: sympy.Integer(335 * 10**10)}))


def test_elementwise_roofline_collapses_with_numbers(step):
    """With the part's numbers sympy can tell the memory term always wins for SwiGLU
    (5 FLOPs against 6 bytes per element)."""
    expr = formula(step, "time", op="layers.swiglu", hardware=H100)
    assert not expr.has(sympy.Max)
    assert same(expr, L * 6 * B * S * F / sympy.Integer(335 * 10**10))


@pytest.mark.parametrize("values", [{}, {"B": 3, "S": 4096}])
def test_values_match_evaluate(step, step_formula, values):
    p = evaluate(step, H100, values)
    dims = resolve(step, values)
    for c in p.categories:
        for quantity, expected in (("flops", c.flops), ("bytes", c.bytes), ("time", c.time_s)):
            got = value(step_formula(quantity, category=c.name), dims, H100)
            assert got == pytest.approx(expected, rel=1e-12), (c.name, quantity)
    assert value(step_formula("time"), dims, H100) == pytest.approx(p.step_time_s, rel=1e-12)
    numeric = step_formula("time", hardware=H100)
    assert value(numeric, dims) == pytest.approx(p.step_time_s, rel=1e-12)
    op = p.ops[5]
    assert value(step_formula("flops", op=op.name), dims) == pytest.approx(op.flops, rel=1e-12)


def test_tidy_collects_on_depth():
    expr = tidy(L * B * S * D + L * B * S * F + D * V, [L])
    assert same(expr, L * B * S * (D + F) + D * V)
    assert any(isinstance(a, sympy.Mul) and L in a.args for a in sympy.Add.make_args(expr))


def test_depth_is_not_unrolled():
    small, big = preset("llama3-8b"), preset("llama3.1-405b")
    assert len(compile_step(small).ops()) == len(compile_step(big).ops())
    assert int(big.parameters().xreplace(resolve(big))) == 405_853_388_800
    step = compile_step(big)
    layer_ops = [op for op in step.ops() if op.name.startswith(("layers.", "adamw.layers."))]
    assert layer_ops and all(op.count == L for op in layer_ops)
    assert L in formula(step, "flops").free_symbols


def test_cli_json(cli, step):
    code, out, _ = cli("formula", "--category", "matmul", "--quantity", "flops", "--json")
    assert code == 0
    j = json.loads(out)
    expr = formula(step, "flops", category="matmul")
    assert j["expression"] == str(expr)
    assert set(j["symbols"]) == {s.name for s in expr.free_symbols}
    assert j["symbols"] == {s.name: LLAMA3_8B[s] for s in expr.free_symbols}
    assert j["value"] == 6 * 6_979_321_856 * 8192
    assert "\\left(" in j["latex"]


def test_cli_time_symbols_cover_the_hardware(cli, step):
    code, out, _ = cli("formula", "--category", "optimizer", "--quantity", "time",
                       "--json", "--tokens", "16384")
    j = json.loads(out)
    expr = formula(step, "time", category="optimizer")
    assert j["symbols"] == symbol_values(expr, resolve(step, {"B": 2}), H100)
    assert j["symbols"]["peak"] == 989e12 and j["symbols"]["bandwidth"] == 3.35e12
    p = evaluate(step, H100, {"B": 2})
    assert j["value"] == pytest.approx(p.category("optimizer").time_s, rel=1e-12)
    code, out, _ = cli("formula", "--op", "layers.q_proj", "--quantity", "time",
                       "--latex")
    assert code == 0 and "\\max" in out and "\\mathrm{peak}" in out and out.count("\n") == 1


@pytest.mark.parametrize("argv, says", [
    (["--op", "layers.qproj"], "did you mean layers.q_proj"),
    (["--category", "attn"], "choose one of: matmul"),
    (["--quantity", "joules"], "invalid choice"),
    (["--op", "embed", "--category", "matmul"], "not allowed with"),
])
def test_cli_bad_input(cli, argv, says):
    code, out, err = cli("formula", *argv)
    assert code == 2 and out == ""
    assert says in err and err.count("\n") == 1


# --- the calibrated cost model's formulas (issue 21: it used to give the roofline's) ------------

A100 = hardware.get("a100-sxm-80gb")  # ampere: the one generation with a fitted half-rate term


@pytest.mark.parametrize("part", [H100, A100], ids=lambda h: h.id)
def test_a_calibrated_time_formula_is_evaluates_time(step, part):
    from opgraph.cost.costmodel import CalibratedCostModel

    cost = CalibratedCostModel()
    expr = formula(step, "time", hardware=part, cost=cost)
    p = evaluate(step, part, cost=cost)
    assert float(value(expr, dict(step.dims))) == pytest.approx(p.step_time_s, rel=1e-9)
    roof = evaluate(step, part)
    assert p.step_time_s > 1.05 * roof.step_time_s  # not the roofline's in its place


def test_a_calibrated_op_time_is_launch_plus_the_scaled_roofline(step):
    """`CalibratedCostModel`'s kernel: launch_s + Max((FLOPs x waves + matmul_half_flops) /
    (matmul x peak), bytes / (bandwidth x HBM bandwidth)), per instance, times the layer count;
    waves the A100's: 256 x 128 output tiles of the B*S x H*d_h output over 108 SMs, K split
    in floor(108 / tiles) where the tiles fill less than a wave (split-K)."""
    import math

    from opgraph.cost.calibration import for_hardware
    from opgraph.cost.costmodel import CalibratedCostModel

    e = for_hardware(A100)
    got = formula(step, "time", op="layers.q_proj", hardware=A100,
                  cost=CalibratedCostModel())
    nbytes = formula(step, "bytes", op="layers.q_proj") / L
    for seq in (64, 8192):  # memory- and compute-bound; 32 tiles (K split in 3), 1,024 tiles
        at = {k: int(v) for k, v in step.dims.items()} | {S: seq}
        b, s, d, h, dh, layers = (at[x] for x in (B, S, D, H, d_h, L))
        flops = 2 * b * s * d * h * dh  # per layer (Megatron's 2 x tokens x weights)
        tiles = math.ceil(b * s / 256) * math.ceil(h * dh / 128)
        split = max(1, 108 // tiles)
        waves = math.ceil(tiles * split / 108) * 108 * 256 * 128 / (b * s * h * dh * split)
        want = layers * (e.launch_s + max(
            (flops * waves + e.matmul_half_flops) / (e.matmul * A100.peak_flops),
            float(nbytes.xreplace(at)) / (e.bandwidth * A100.bandwidth)))
        assert float(got.xreplace(at)) == pytest.approx(want, rel=1e-12)


def test_a_calibrated_formula_without_a_part_is_one_line(step, cli):
    from opgraph.cost.costmodel import CalibratedCostModel
    from opgraph.core.errors import OpgraphError
    from opgraph.cost.formula import op_time, step_time
    from opgraph.analysis.solve import max_share

    cost = CalibratedCostModel()
    for call in (lambda: formula(step, "time", cost=cost),
                 lambda: op_time(step, step.op("layers.q_proj"), cost=cost),
                 lambda: step_time(step, step.ops(), cost=cost)):
        with pytest.raises(OpgraphError, match="calibrated time formula") as e:
            call()
        assert "\n" not in str(e.value)
    # FLOPs and bytes are the calibrated model's too: the roofline's
    assert same(formula(step, "flops", cost=cost), formula(step, "flops"))
    with pytest.raises(OpgraphError, match="roofline's formulas"):
        max_share(step, H100, "optimizer", cost=cost)
    code, out, err = cli("formula", "--cost", "calibrated", "--quantity", "time")
    assert code == 2 and out == "" and "calibrated time formula" in err
    code, out, err = cli("solve", "--cost", "calibrated", "--category", "optimizer",
                         "--max-share", "0.02")
    assert code == 2 and out == "" and "roofline's formulas" in err
    code, out, _ = cli("formula", "--cost", "calibrated", "--quantity", "time",
                       "--numeric-hardware", "--json")
    assert code == 0
    assert json.loads(out)["value"] == pytest.approx(
        evaluate(step, H100, cost=cost).step_time_s, rel=1e-9)
