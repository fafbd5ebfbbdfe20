"""Activation recomputation as a pass: what it re-runs costs exactly that op's forward, counts in
the HFU and not the MFU, and frees exactly the tensors the backward no longer reads."""

import pytest
import sympy
from opgraph.models import preset
from opgraph.passes.evaluate import mfu_parameters
from opgraph.passes.recompute import POLICIES, recompute, rewrite_recompute

from opgraph import (CostModel, OpgraphError, Phase, compile_step, derive_backward, evaluate,
                     hardware, verify)
from opgraph.cost.formula import formula
from opgraph.cost.memory import footprint
from opgraph.core.symbols import B, D, F, H, H_kv, L, S, V, d_h

H100 = hardware.get("h100-sxm")


@pytest.fixture(scope="module")
def llama():
    return preset("llama3-8b")


@pytest.fixture(scope="module")
def steps(llama):
    return {(policy, fused): compile_step(llama, recompute=policy, fused_attention=fused)
            for policy in POLICIES for fused in (True, False)}


def _added_flops(steps, policy, fused=True):
    return sympy.expand(formula(steps[policy, fused], "flops")
                        - formula(steps["none", fused], "flops"))


def test_full_adds_exactly_the_layer_stacks_forward(steps):
    # one Llama layer's forward: RMSNorm x2 (4 per element), Q K V O, RoPE on Q and K (3),
    # causal FlashAttention (QK^T and P.V over half the scores), the residual adds, gate, up,
    # SwiGLU (5), down
    layer = (8 * B * S * D + 2 * B * S * D * (2 * H * d_h + 2 * H_kv * d_h)
             + 3 * B * S * (H + H_kv) * d_h + 2 * B * H * S**2 * d_h + 2 * B * S * D
             + 6 * B * S * D * F + 5 * B * S * F)
    assert sympy.expand(_added_flops(steps, "full") - L * layer) == 0


def test_selective_adds_exactly_the_attention_cores_forward(steps):
    # unfused: the scores QK^T and P.V, each 2 d_h per score over the causal half
    core = 2 * (2 * B * H * S * S * d_h / 2)
    assert sympy.expand(_added_flops(steps, "selective", fused=False) - L * core) == 0
    # fused: the FlashAttention kernel re-run, the same FLOPs
    assert sympy.expand(_added_flops(steps, "selective") - L * core) == 0


def test_selective_op_re_runs_everything_but_matmuls_and_attention(steps):
    # RMSNorm x2, RoPE on Q and K, the residual adds, SwiGLU
    rest = 8 * B * S * D + 3 * B * S * (H + H_kv) * d_h + 2 * B * S * D + 5 * B * S * F
    assert sympy.expand(_added_flops(steps, "selective-op") - L * rest) == 0


def test_a_predicate_picks_the_ops(llama):
    step = compile_step(llama, recompute=lambda graph, op: op.kind == "swiglu")
    added = formula(step, "flops") - formula(compile_step(llama), "flops")
    assert sympy.expand(added - L * 5 * B * S * F) == 0
    assert [op.name for op in step.ops() if op.phase is Phase.RECOMPUTE] == ["layers.swiglu.re"]


@pytest.mark.parametrize("mode", ["plate", "tensors", "derived"])
def test_a_re_run_op_costs_its_forward_op(steps, mode):
    cost = CostModel(backward=mode)
    step = steps["full", True]
    costs = cost.op_costs(step)
    for op in step.ops():
        if op.phase is Phase.RECOMPUTE:
            fwd = step.op(op.forward)
            assert (op.kind, op.count, op.region) == (fwd.kind, fwd.count, fwd.region)
            assert costs[op.name] == costs[fwd.name]


def test_the_backward_reads_what_the_re_run_produces(llama):
    step, report = rewrite_recompute(derive_backward(llama), "full")
    verify(step)
    freed = set(report.freed)
    assert "layers.swiglu" in freed and "layers.mlp_residual" not in freed  # the carry is kept
    for op in step.ops():
        if op.phase is Phase.BACKWARD and op.region is not None:
            assert not freed & set(op.inputs), op.name
    assert step.op("layers.swiglu.grad").inputs[1:3] == ("re.layers.gate_proj",
                                                         "re.layers.up_proj")


def test_mfu_ignores_and_hfu_counts_re_run_flops(steps):
    none, full = (evaluate(steps[p, True], H100) for p in ("none", "full"))
    assert mfu_parameters(steps["none", True]) == mfu_parameters(steps["full", True])
    # the MFU's numerator, 6 N tokens, is the same: MFU x step time does not move
    assert full.mfu_ceiling * full.step_time_s == pytest.approx(
        none.mfu_ceiling * none.step_time_s, rel=1e-12)
    added = float(_added_flops(steps, "full").xreplace(
        {sym: v for sym, v in steps["none", True].dims.items()}))
    assert full.flops - none.flops == pytest.approx(added, rel=1e-12)
    assert full.hfu_ceiling * full.step_time_s == pytest.approx(
        (none.flops + added) / H100.peak_flops, rel=1e-12)


def test_derived_backward_and_recompute_both_count_in_the_hfu(llama):
    """FlashAttention's backward re-computes QK^T (2.5x its forward) under the derived
    convention; selective re-runs the kernel on top: both are FLOPs the HFU counts."""
    derived = CostModel(backward="derived")
    step = compile_step(llama, recompute="selective")
    costs = derived.op_costs(step)
    fwd, bwd, re = (costs[n].flops for n in ("layers.attn.flash", "layers.attn.flash.grad",
                                             "layers.attn.flash.re"))
    assert sympy.simplify(bwd / fwd) == sympy.Rational(5, 2) and re == fwd
    p = evaluate(step, H100, cost=derived)
    assert p.flops == pytest.approx(sum(o.flops for o in p.ops))
    assert p.hfu_ceiling == pytest.approx(p.flops / (p.step_time_s * H100.peak_flops))


def test_saved_activations_fall_from_none_to_selective_to_full(steps):
    values = dict(steps["none", True].dims)
    for fused in (True, False):
        saved = [float(footprint(steps[p, fused]).activations.xreplace(values))
                 for p in ("none", "selective", "full")]
        assert saved[0] > saved[1] > saved[2], (fused, saved)


def test_gpt_layer_saves_what_its_backward_reads():
    """GPT-2's layer, per policy: the tensors a backward kernel (or a re-run op) reads."""
    gpt = preset("gpt2")
    around = 2 * 2 * B * S * D + 2 * B * S * V + 3 * 4 * B * S  # x in, ln_f, logits, ids
    per_layer = {
        # ln_1 out, Q, K, V, O, the attention residual, ln_2 out, fc out, GELU out, the output
        "none": 2 * B * S * (4 * D + 4 * H * d_h + 2 * F),
        "selective": 2 * B * S * (4 * D + 3 * H * d_h + 2 * F),  # O comes from the re-run
        # matmul and attention outputs kept: Q, K, V, O, o_proj and proj outputs, fc; the output
        "selective-op": 2 * B * S * (3 * D + 4 * H * d_h + F),
        "full": 2 * B * S * D,  # the layer's output, the next layer's input
    }
    for policy, expected in per_layer.items():
        step = compile_step(gpt, recompute=policy)
        assert sympy.expand(footprint(step).activations - L * expected - around) == 0, policy


def test_unfused_selective_frees_the_score_matrix(steps):
    none, selective = (footprint(steps[p, False]).activations for p in ("none", "selective"))
    # P (B x H x S x S) and the core's output O, read from the re-run
    assert sympy.expand(none - selective - L * (2 * B * H * S**2 + 2 * B * S * H * d_h)) == 0


def test_none_changes_nothing(llama):
    step = derive_backward(llama)
    assert str(recompute(step, "none")) == str(step)
    assert str(compile_step(llama, recompute="none")) == str(compile_step(llama))


def test_bad_policies_are_one_line_errors(llama, cli):
    with pytest.raises(OpgraphError, match="unknown recompute policy 'some'"):
        recompute(derive_backward(llama), "some")
    with pytest.raises(ValueError, match="no backward"):
        recompute(llama, "full")
    code, _out, err = cli("profile", "--recompute", "some")
    assert code == 2 and "invalid choice" in err and "Traceback" not in err


def test_cli_echoes_the_policy_and_reports_the_peak(cli):
    import json

    code, out, _err = cli("profile", "--recompute", "full", "--json")
    data = json.loads(out)
    assert code == 0 and (data["recompute"], data["precision"]) == ("full", "bf16")
    peak = data["memory"]
    assert peak["total"] == sum(peak[k] for k in ("weights", "gradients", "optimizer",
                                                  "activations", "transient"))
    code, out, _err = cli("profile", "--json")
    assert code == 0 and json.loads(out)["recompute"] == "none"
    assert json.loads(out)["memory"]["activations"] > peak["activations"]  # full saves less


def test_sweep_and_profile_agree_on_a_recomputed_step(steps):
    import numpy as np

    from opgraph.analysis.sweep import compile_sweep

    step = steps["selective-op", True]
    p = evaluate(step, H100, {"tokens": 16384})
    row = compile_sweep(step).run({"B": np.array([2.0]), "S": np.array([8192.0])},
                                  H100.peak_flops, H100.bandwidth)
    assert row["step_time_s"][0] == pytest.approx(p.step_time_s, rel=1e-9)
    assert row["hfu_ceiling"][0] == pytest.approx(p.hfu_ceiling, rel=1e-9)
