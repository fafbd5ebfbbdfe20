"""The cost model: costs derived from the graph, its backward conventions, one change of it
reaching every engine, the utilisation conventions, and the values the library accepts."""

import attrs
import numpy as np
import pytest
import sympy
from opgraph.models import PRESETS, preset
from opgraph.passes.fuse_attention import fuse_attention

from opgraph import GraphBuilder, Op, VerifyError, compile_step, evaluate, hardware, verify
from opgraph.core import rules
from opgraph.cost.costmodel import DEFAULT, CostModel
from opgraph.core.errors import OpgraphError
from opgraph.cost.formula import formula, value
from opgraph.analysis.solve import max_share, ridge
from opgraph.analysis.sweep import compile_sweep
from opgraph.core.symbols import B, D, H, H_kv, S, V, d_h, dim

H100 = hardware.get("h100-sxm")
DERIVED = CostModel(backward="derived")
HALF = sympy.Rational(1, 2)


@pytest.fixture(scope="module")
def llama_step():
    return compile_step(preset("llama3-8b"))


def total_flops(graph, cost=DEFAULT):
    costs = cost.op_costs(graph)
    return sympy.expand(sympy.Add(*(costs[op.name].flops * op.count for op in graph.ops())))


# --- nothing stored, everything typed ---------------------------------------------------------

def test_an_op_stores_no_cost():
    fields = {f.name for f in attrs.fields(Op)}
    assert not fields & {"flops", "traffic", "bytes"}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_verifies_and_is_costed_in_every_convention(name):
    """compile_step verifies every phase by default; every op then has a FLOP rule and bytes
    under the plate's and the derived backward alike, and no op carries a cost parameter."""
    for fused in (True, False):
        step = compile_step(preset(name), fused_attention=fused)
        verify(step)
        for cost in (DEFAULT, DERIVED):
            costs = cost.op_costs(step)
            assert all(c.flops.free_symbols | c.bytes.free_symbols <= set(step.dims)
                       for c in costs.values())
        assert not any(k in ("flops", "traffic", "bytes") for op in step.ops()
                       for k, _ in op.params)


def test_backward_matmuls_have_real_matmul_shapes(llama_step):
    """dX = dY W^T: `lm_head.dA` multiplies [B, S, V] by the [D, V] weight transposed; dW =
    X^T dY sums the tokens and gives the weight's shape."""
    da, db = llama_step.op("lm_head.dA"), llama_step.op("lm_head.dB")
    ins = [llama_step.tensor(n) for n in da.inputs]
    assert [t.shape for t in ins] == [(B, S, V), (D, V)]
    assert rules.infer_shapes("matmul", ins, dict(da.params)) == [(B, S, D)]
    ins = [llama_step.tensor(n) for n in db.inputs]
    assert rules.infer_shapes("matmul", ins, dict(db.params)) == [(D, V)]
    # the same kernel without its transpose is the ill-typed one of before: rejected
    with pytest.raises(rules.ShapeError, match="inner dims"):
        rules.infer_shapes("matmul", [llama_step.tensor(n) for n in da.inputs], {})


def test_the_verifier_rejects_an_ill_typed_backward_kernel(llama_step):
    bad = llama_step.copy()
    da = bad.op("lm_head.dA")
    bad.remove_op(da.name)
    bad.add_op(attrs.evolve(da, params={}))  # dY [B, S, V] times W [D, V], untransposed
    with pytest.raises(VerifyError, match="lm_head.dA"):
        verify(bad)


def test_unfused_attention_backward_is_per_head_matmuls():
    step = compile_step(preset("llama3-8b"), fused_attention=False)
    dp, dv = step.op("layers.attn.pv.dA"), step.op("layers.attn.pv.dB")
    assert step.tensor(dp.outputs[0]).shape == (B, H, S, S)
    assert step.tensor(dv.outputs[0]).shape == (B, S, H_kv * d_h)
    pv = step.op("layers.attn.pv")
    for op in (dp, dv):  # each does P.V's multiply-adds, by its own FLOP rule
        assert sympy.expand(DERIVED.op_cost(step, op).flops
                            - DEFAULT.op_cost(step, pv).flops) == 0


# --- the backward conventions -----------------------------------------------------------------

def test_plate_backward_is_twice_forward_and_derived_is_close_to_it():
    step = compile_step(preset("llama3-8b"), fused_attention=False, check=False)
    fwd = [op for op in step.ops() if op.phase.value == "forward"]
    bwd = [op for op in step.ops() if op.phase.value == "backward"]
    for cost, low, high in ((DEFAULT, 2, 2), (DERIVED, 1.99, 2.01)):
        costs = cost.op_costs(step)

        def flops(ops, costs=costs):
            return sympy.Add(*(costs[op.name].flops * op.count for op in ops)).xreplace(step.dims)
        assert low <= flops(bwd) / flops(fwd) <= high


def test_flash_attention_backward_derived_is_two_and_a_half_forward(llama_step):
    fwd, bwd = llama_step.op("layers.attn.flash"), llama_step.op("layers.attn.flash.grad")
    forward = DEFAULT.op_cost(llama_step, fwd).flops
    assert sympy.expand(forward - 2 * B * H * S**2 * d_h) == 0  # causal: QK^T and P.V
    assert sympy.expand(DEFAULT.op_cost(llama_step, bwd).flops - 2 * forward) == 0
    assert sympy.expand(DERIVED.op_cost(llama_step, bwd).flops - 5 * forward / 2) == 0
    # the plate takes FlashAttention's backward bytes from its own tensors: dO, Q, K, V, O in,
    # dQ, dK, dV out, all BF16
    q, kv = 2 * B * S * H * d_h, 2 * B * S * H_kv * d_h
    assert sympy.expand(DEFAULT.op_cost(llama_step, bwd).bytes - (4 * q + 4 * kv)) == 0


def test_tensors_convention_keeps_the_flops_and_takes_bytes_from_tensors(llama_step):
    tensors = CostModel(backward="tensors")
    op = llama_step.op("layers.down_proj.dB")  # X^T dY, written in FP32
    assert sympy.expand(tensors.op_cost(llama_step, op).flops
                        - DEFAULT.op_cost(llama_step, op).flops) == 0
    assert sympy.expand(tensors.op_cost(llama_step, op).bytes
                        - (2 * B * S * dim("F") + 2 * B * S * D + 4 * D * dim("F"))) == 0


def test_an_unknown_convention_is_refused():
    with pytest.raises(ValueError):
        CostModel(backward="guess")


# --- one cost model, every engine ---------------------------------------------------------------

@attrs.frozen
class Derated(CostModel):
    """A later cost model: matmuls reach only part of the peak (an efficiency)."""

    efficiency: sympy.Rational = HALF

    def time(self, flops, nbytes, peak, bandwidth, maximum=max):
        return maximum(flops / (peak * self.efficiency), nbytes / bandwidth)


def test_one_change_to_the_cost_model_reaches_every_engine(llama_step):
    cost = Derated()
    dims = dict(llama_step.dims) | {B: 4}
    base = evaluate(llama_step, H100, {"B": 4})
    changed = evaluate(llama_step, H100, {"B": 4}, cost=cost)
    assert changed.step_time_s > base.step_time_s * 1.2  # matmuls are compute-bound
    # formula: the same times as formulas of the dimensions
    for category in ("matmul", "optimizer"):
        expr = formula(llama_step, "time", category=category, cost=cost)
        assert value(expr, dims, H100) == pytest.approx(changed.category(category).time_s,
                                                        rel=1e-12)
    # sweep: the same figures from the lambdified function
    row = compile_sweep(llama_step, cost=cost).run({"B": np.array([4.0]), "S": np.array([8192.0])},
                                                   H100.peak_flops, H100.bandwidth)
    assert row["step_time_s"][0] == pytest.approx(changed.step_time_s, rel=1e-12)
    assert row["mfu_ceiling"][0] == pytest.approx(changed.mfu_ceiling, rel=1e-12)
    assert row["hfu_ceiling"][0] == pytest.approx(changed.hfu_ceiling, rel=1e-12)
    # solve: its answer holds under the changed model and not one sequence earlier (solve
    # itself checks it against evaluate with the same model, and raises if they disagree)
    answer = max_share(llama_step, H100, "optimizer", 0.02, cost=cost)
    share = evaluate(llama_step, H100, {"B": answer.batch}, cost=cost).category("optimizer")
    assert share.time_share == answer.share <= 0.02 < answer.share_one_fewer


def test_the_backward_convention_reaches_every_engine(llama_step):
    derived = attrs.evolve(DEFAULT, backward="derived")
    p = evaluate(llama_step, H100, cost=derived)
    attention = formula(llama_step, "flops", category="attention", cost=derived)
    assert sympy.expand(attention - 7 * B * H * dim("L") * S**2 * d_h) == 0  # 2 + 5 (backward)
    assert value(attention, llama_step.dims) == p.category("attention").flops
    row = compile_sweep(llama_step, cost=derived).run({"B": np.array([1.0]),
                                                       "S": np.array([8192.0])},
                                                      H100.peak_flops, H100.bandwidth)
    assert row["step_time_s"][0] == pytest.approx(p.step_time_s, rel=1e-12)


def test_a_derated_peak_moves_the_ridge(llama_step):
    """q_proj: 2 T D HD FLOPs at half the peak against 2 (T D + T HD + D HD) bytes, HD = H d_h:
    they cross at T = peak D HD / (2 D HD bandwidth - peak (D + HD)), earlier than at the full
    peak (the same with D HD bandwidth)."""
    peak, bw, d, hd = H100.peak_flops, H100.bandwidth, 4096, 32 * 128
    base = ridge(llama_step, H100, "layers.q_proj")
    derated = ridge(llama_step, H100, "layers.q_proj", cost=Derated())
    assert base.value == pytest.approx(peak * d * hd / (d * hd * bw - peak * (d + hd)))
    assert derated.value == pytest.approx(peak * d * hd / (2 * d * hd * bw - peak * (d + hd)))


# --- utilisation --------------------------------------------------------------------------------

def test_hfu_never_exceeds_one():
    """Fuzz case 14: a part so slow that every op is compute-bound put HFU a few ulp above 1."""
    slow = attrs.evolve(H100, peak_flops=1e-6 * 1e12, bandwidth=1000 * 1e12)
    p = evaluate(compile_step(preset("mixtral-8x7b")), slow, {"tokens": 212992})
    assert all(r.bound == "compute" for r in p.ops if r.flops)
    # at most 1; below it by the copies that do no arithmetic (the dispatch's permutation)
    assert p.hfu_ceiling <= 1.0 and p.hfu_ceiling == pytest.approx(1.0, abs=1e-9)
    assert DEFAULT.hfu(np.array([1.0, 3.0]), np.array([1.0, 1.0]), 1.0, np.minimum).tolist() \
        == [1.0, 1.0]


def test_mfu_is_the_plates_convention():
    assert DEFAULT.mfu(8e9, 8192, 1.0, 1e15) == 6 * 8e9 * 8192 / 1e15


# --- values -------------------------------------------------------------------------------------

@pytest.mark.parametrize("values, says", [
    ({"B": 1.5}, "not a whole number"),
    ({"B": 0}, "not positive"),
    ({"B": -2}, "not positive"),
    ({"B": float("inf")}, "not a whole number"),
    ({"B": True}, "whole number"),
    ({"B": "8"}, "whole number"),
    ({"B": 10**400}, "digits"),
    ({"S": 2**30 + 1}, "more than opgraph's bound of 1,073,741,824"),  # the CLI's --seq-len bound
    ({"tokens": 2**41}, "more than opgraph's bound of 1,099,511,627,776"),  # and --tokens
    ({"tokens": 8193}, "not a multiple"),
    ({"tokens": 16384, "B": 2}, "not both"),
    ({"Q": 3}, "unknown dimension"),
])
def test_the_library_checks_values_as_the_cli_does(llama_step, values, says):
    with pytest.raises(OpgraphError, match=says) as e:
        evaluate(llama_step, H100, values)
    assert "\n" not in str(e.value)


def test_tokens_set_the_batch(llama_step):
    p = evaluate(llama_step, H100, {"tokens": 65536})
    assert (p.tokens, p.values["B"], p.values["S"]) == (65536, 8, 8192)
    assert evaluate(llama_step, H100, {"B": 8.0}).tokens == 65536  # a whole float is fine


def test_a_sequence_longer_than_the_positions_is_refused():
    with pytest.raises(OpgraphError, match="1,024 positions"):
        evaluate(compile_step(preset("gpt2")), H100, {"S": 2048})


# --- MLA-shaped attention -----------------------------------------------------------------------

def mla_block():
    """DeepSeek's MLA shapes: Q and K 192 per head, V 128."""
    d_qk, d_v = dim("d_qk"), dim("d_v")
    g = GraphBuilder("mla", {B: 1, S: 256, D: 512, H: 4, d_qk: 192, d_v: 128})
    x = g.activation("x", (B, S, D))
    q = g.matmul(x, g.weight("wq", (D, H * d_qk)), name="q")
    k = g.matmul(x, g.weight("wk", (D, H * d_qk)), name="k")
    v = g.matmul(x, g.weight("wv", (D, H * d_v)), name="v")
    o = g.attention(q, k, v, heads=H, kv_heads=H, causal=True, name="attn")
    g.matmul(o, g.weight("wo", (H * d_v, D)), name="o")
    return g.build(), d_qk, d_v


def test_mla_attention_keeps_its_flops_through_fusion():
    block, d_qk, d_v = mla_block()
    fused = fuse_attention(block)
    flash = fused.op("attn.flash")
    assert fused.tensor(flash.outputs[0]).shape == (B, S, H * d_v)
    # causal: QK^T 2 d_qk and P.V 2 d_v per score, half the S x S scores
    assert sympy.expand(DEFAULT.op_cost(fused, flash).flops
                        - B * H * S**2 * (d_qk + d_v)) == 0
    assert sympy.expand(total_flops(fused) - total_flops(block)) == 0
    # the whole step too (the plate's backward is twice the forward), fused before or after
    # the backward
    unfused_step = compile_step(block, fused_attention=False)
    before = compile_step(block)
    after = verify(fuse_attention(unfused_step))
    for step in (before, after):
        assert sympy.expand(total_flops(step) - total_flops(unfused_step)) == 0
        # FlashAttention's backward as it runs: QK^T recomputed, dV, dP, dQ, dK
        grad = step.op("attn.flash.grad")
        assert sympy.expand(DERIVED.op_cost(step, grad).flops
                            - B * H * S**2 * (3 * d_qk + 2 * d_v)) == 0


# --- the command line ---------------------------------------------------------------------------

def test_the_cli_names_the_backward_convention(cli, llama_step):
    import json

    for mode in ("plate", "tensors", "derived"):
        code, out, _ = cli("profile", "--json", "--backward-traffic", mode)
        assert code == 0
        expected = evaluate(llama_step, H100, cost=CostModel(backward=mode))
        assert json.loads(out)["step_time_s"] == expected.step_time_s
    code, out, _ = cli("formula", "--quantity", "flops", "--category", "attention", "--json",
                       "--backward-traffic", "derived")
    assert code == 0 and json.loads(out)["value"] == 7 * 32 * 32 * 8192**2 * 128  # 2 + 5


def test_hfu_from_the_cli_is_at_most_one(cli):
    import json

    code, out, _ = cli("profile", "--model", "mixtral-8x7b", "--tokens", "212992",
                       "--peak-tflops", "1e-6", "--bandwidth-tbs", "1000", "--json")
    assert code == 0 and json.loads(out)["hfu_ceiling"] <= 1


def test_batched_matmul_backward_keeps_the_batch_dims():
    """dA = dY B^T and dB = A^T dY per batch, for b[..., K, N] and b[..., N, K] alike: the
    gradients have their operands' shapes and do the forward's multiply-adds."""
    g = GraphBuilder("bmm", {B: 2, S: 16, D: 8})
    x, y = g.activation("x", (B, S, D)), g.activation("y", (B, S, D))
    g.matmul(x, y, name="xy", transpose_b=True)  # [B, S, S]
    step = compile_step(g.build())
    fwd = step.op("xy")
    for suffix, operand in (("dA", x), ("dB", y)):
        op = step.op(f"xy.{suffix}")
        assert step.tensor(op.outputs[0]).shape == operand.shape
        assert sympy.expand(DERIVED.op_cost(step, op).flops - 2 * B * S * S * D) == 0
        assert sympy.expand(DERIVED.op_cost(step, op).flops
                            - DEFAULT.op_cost(step, fwd).flops) == 0


@pytest.mark.parametrize("name", ["roofline", "calibrated"])
def test_op_times_is_op_time_over_arrays(name):
    """The array form `opgraph plan` evaluates layouts with gives each op's `op_time`, an op
    with no instances none."""
    from opgraph.cost.costmodel import cost_model

    cost, part = cost_model(name), hardware.get("h100-sxm")
    kinds = ["matmul", "rmsnorm", "flash_attention"]
    flops = np.array([[2e12, 4e12], [1e9, 0.0], [3e11, 6e11]])
    nbytes = np.array([[1e9, 2e9], [4e9, 0.0], [1e8, 2e8]])
    counts = np.array([[32.0, 32.0], [64.0, 0.0], [1.0, 2.0]])
    peaks = np.array([[part.peak_flops]] * 3)
    # the matmul's GEMM grid (GEMMs, M, N) per layout: a TP-1 and a TP-8 shard; none elsewhere
    grids = np.zeros((3, 3, 2))
    grids[:, 0, 0], grids[:, 0, 1] = (1, 8192, 14336), (1, 8192, 14336 / 8)
    for with_grids in (False, True):
        out = cost.op_times(part, kinds, flops, nbytes, counts, peaks,
                            grids if with_grids else None)
        for i, kind in enumerate(kinds):
            for j in range(2):
                grid = tuple(grids[:, i, j]) if with_grids and grids[:, i, j].any() else ()
                one = cost.op_time(part, kind, flops[i, j], nbytes[i, j], int(counts[i, j]),
                                   part.peak_flops, grid) if counts[i, j] else 0.0
                assert out[i, j] == pytest.approx(one, rel=1e-12)


@pytest.mark.parametrize("name", ["llama3-8b", "mixtral-8x7b", "deepseek-v2-lite"])
@pytest.mark.parametrize("fused", [True, False])
def test_every_matmul_has_a_grid_that_covers_its_output(name, fused):
    """Each matrix multiply's grid (`rules.gemm_grid`: GEMMs x M x N) is its output's
    elements (dV per head: each of the H heads' K x d, summed into the G groups' outputs; an
    expert dX over the K slots, each its GEMM row, summed into the token's), and
    2 x grid x K its FLOPs for a K of its dimensions; FlashAttention's (scores, d_qk + d_v)
    give its FLOPs as 2 x scores x (d_qk + d_v); no other kernel has a grid."""
    step = compile_step(preset(name), fused_attention=fused)
    costs = CostModel(backward="derived").op_costs(step)
    for op in step.ops():
        grid = costs[op.name].grid
        if op.kind in rules.ATTENTION_SCORES:  # (scores, d_qk + d_v, 0): 2 x each FLOPs each
            scores, dims, _ = grid
            if op.kind == "flash_attention":
                assert sympy.simplify(2 * scores * dims - costs[op.name].flops) == 0, op.name
            continue
        if op.kind not in rules.GEMM_GRIDS:
            assert grid == (), op.name
            continue
        count, m, n = grid
        out = step.tensor(op.outputs[0]).numel
        if op.param("grad") == "b":
            out = out * op.param("heads") / op.param("kv_heads")
        if op.param("reduce_slots"):
            out = out * step.tensor(op.inputs[2]).shape[-1]
        assert sympy.simplify(count * m * n - out) == 0, op.name
        k = sympy.cancel(costs[op.name].flops / (2 * count * m * n))
        assert k.free_symbols <= set(step.dims) and k.is_positive, op.name


def test_no_kernel_runs_faster_than_the_host_issues_it():
    """Eager PyTorch issues kernels one by one from the host: the calibrated time of a kernel is
    at least `host_s` (the median interval between launches in the real A100 training trace in
    shared/traces, 33 us), a view costs nothing, and a kernel longer than that is untouched."""
    from opgraph.cost.costmodel import cost_model

    calibrated = cost_model("calibrated")
    e = calibrated.efficiencies(H100)
    assert e.host_s == pytest.approx(33e-6)
    tiny = calibrated.op_time(H100, "matmul", 2e6, 3e3, 1, H100.peak_flops)  # 2 MFLOP: ~4 ns
    assert tiny == e.host_s
    assert calibrated.op_time(H100, "reshape", 0.0, 0.0, 5, H100.peak_flops) < e.host_s  # a view
    big = 2 * 8192 * 4096 * 4096  # an 8B projection over 8,192 tokens: hundreds of microseconds
    without = attrs.evolve(calibrated, table={"hopper": attrs.evolve(e, host_s=0.0)})
    assert calibrated.op_time(H100, "matmul", big, 1e8, 1, H100.peak_flops) == \
        without.op_time(H100, "matmul", big, 1e8, 1, H100.peak_flops) > 10 * e.host_s


def test_the_optimizer_update_is_issued_many_tensors_at_a_time():
    """Every framework runs AdamW as multi-tensor kernels (FusedAdam's multi_tensor_apply, torch's
    fused and foreach forms): a small tensor's update waits on no host floor, only its launch
    and its bytes; the same bytes in an element-wise kernel wait the 33 us. (A calibrated sweep
    and formula of a whole step, optimizer included, equal its profile: test_calibration.py,
    test_agreement.py.)"""
    from opgraph.cost.costmodel import BATCHED, cost_model

    calibrated = cost_model("calibrated")
    e = calibrated.efficiencies(H100)
    assert BATCHED == {"adamw"}
    small = 16 * 4096  # a 4,096-element norm weight's update: master, moments, gradient, copy
    assert calibrated.op_time(H100, "adamw", 4 * 4096, small, 1, H100.peak_flops) == \
        pytest.approx(e.launch_s + small / (e.bandwidth * H100.bandwidth))
    assert calibrated.op_time(H100, "add", 4096, small, 1, H100.peak_flops) == e.host_s
    # numbers and arrays alike
    kinds = ("adamw", "add")
    arrays = calibrated.op_times(H100, kinds, np.array([[4.0 * 4096], [4096.0]]),
                                 np.array([[small], [small]], dtype=float),
                                 np.array([[1.0], [1.0]]), np.array([[H100.peak_flops]] * 2))
    assert arrays[:, 0] == pytest.approx([calibrated.op_time(H100, k, f, small, 1,
                                                             H100.peak_flops)
                                          for k, f in zip(kinds, (4.0 * 4096, 4096.0))])
