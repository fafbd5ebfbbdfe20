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
    with pytest.raises(OpgraphError, match="recompute 'some': give one of none, selective"):
        recompute(derive_backward(llama), "some")
    with pytest.raises(OpgraphError, match="'mlp_act' is not one of Megatron-Core's modules"):
        recompute(derive_backward(llama), "selective:mlp_act")
    with pytest.raises(ValueError, match="no backward"):
        recompute(llama, "full")
    code, _out, err = cli("profile", "--recompute", "some")
    assert code == 2 and "argument --recompute" in err and "Traceback" not in err


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


# --- Megatron-Core's modules ("selective:...") ---------------------------------------------------

def _rerun(model, policy):
    return rewrite_recompute(compile_step(preset(model)), policy)[1]


def test_a_layers_blocks_are_found_from_the_dataflow():
    """Each block opens at a norm read from the residual stream and runs to the add that joins
    it: Llama's attention and MLP, Mixtral's attention and experts, Nemotron's three kinds,
    Gemma 2's norm after each sublayer inside its block."""
    from opgraph.passes.recompute import blocks

    def kinds(model):
        return [(b.norm.name, b.kind) for b in blocks(compile_step(preset(model)))]
    assert kinds("llama3-8b") == [("layers.attn_norm", "attention"), ("layers.mlp_norm", "mlp")]
    assert kinds("mixtral-8x7b") == [("layers.attn_norm", "attention"),
                                     ("layers.mlp_norm", "moe")]
    assert [k for _, k in kinds("nemotron-3-nano")] == ["mamba", "attention", "moe"]
    gemma = blocks(compile_step(preset("gemma2-2b")))
    assert all(any(op.kind == "rmsnorm" for op in b.ops) for b in gemma)  # the post-norms


def test_megatron_modules_rerun_their_ops_and_free_what_the_backward_read():
    """mlp: Llama's gate, up, SwiGLU and down re-run, their three inner outputs no longer kept
    (the down projection's output feeds only the residual add, whose backward keeps nothing);
    moe_act: Mixtral's experts' SwiGLU, its output freed; layernorm: both norms, their outputs
    freed; core_attn alone is "selective"."""
    mlp = _rerun("llama3-8b", "selective:mlp")
    assert mlp.ops == ("layers.gate_proj.re", "layers.up_proj.re", "layers.swiglu.re",
                       "layers.down_proj.re")
    assert mlp.freed == ("layers.gate_proj", "layers.swiglu", "layers.up_proj")
    act = _rerun("mixtral-8x7b", "selective:moe_act")
    assert act.ops == ("layers.experts.swiglu.re",) and act.freed == ("layers.experts.swiglu",)
    norms = _rerun("llama3-8b", "selective:layernorm")
    assert norms.ops == ("layers.attn_norm.re", "layers.mlp_norm.re")
    assert norms.freed == ("layers.attn_norm", "layers.mlp_norm")
    step = compile_step(preset("llama3-8b"))
    assert str(recompute(step, "selective:core_attn")) == str(recompute(step, "selective"))


def test_the_moe_module_reruns_the_whole_mixture_with_its_collectives():
    """moe: under TP 2 with sequence parallelism and EP 4 (Megatron-LM), the router, the
    dispatch's all-gathers and all-to-alls, the experts, the combine: every op between the
    pre-MLP norm and the residual add, the norm itself not (layernorm is its own module)."""
    from opgraph.parallel.distributed import compile_parallel
    from opgraph.parallel.parallel import Parallel

    step = compile_parallel(preset("mixtral-8x7b"), Parallel(
        tp=2, ep=4, dp=4, sequence_parallel=True, framework="megatron"),
        recompute="selective:moe")
    rerun = [op for op in step.ops() if op.name.endswith(".re")]
    assert {"matmul", "topk", "moe_permute", "expert_matmul", "all_gather", "all_to_all",
            "reduce_scatter", "moe_combine"} <= {op.kind for op in rerun}
    # nothing of the attention block (Megatron's re-gather of its input under SP aside)
    assert not {op.kind for op in rerun if "attn" in op.name} - {"all_gather"}
    assert "layers.mlp_norm.re" not in {op.name for op in rerun}


def test_shared_experts_and_mla_up_projections_are_their_modules():
    """DeepSeek-V2-Lite: shared_experts re-runs the shared experts' four ops, nothing of the
    router or the routed experts; mla_up_proj the up-projection from the K/V latent after its
    norm and what reshapes it for the core, not the core."""
    shared = _rerun("deepseek-v2-lite", "selective:shared_experts")
    assert shared.ops == tuple(f"layers.shared_experts.{n}.re"
                               for n in ("gate_proj", "up_proj", "swiglu", "down_proj"))
    up = _rerun("deepseek-v2-lite", "selective:mla_up_proj")
    assert "layers.kv_b_proj.re" in up.ops and "dense_layers.kv_b_proj.re" in up.ops
    assert not any(".attn" in name or "kv_a_proj" in name for name in up.ops)


def test_a_modules_policy_has_one_spelling_everywhere(cli):
    """The CLI, a layout's text and a case take "selective:" and modules in any order, commas
    or "+", and say them in RECOMPUTE_MODULES' order joined by "+"."""
    from opgraph.parallel.parallel import parse_layout

    code, out, _err = cli("profile", "--model", "mixtral-8x7b", "--recompute",
                          "selective:moe_act,layernorm")
    assert code == 0 and "--recompute selective:layernorm+moe_act" in out
    assert parse_layout("tp2 dp4 selective:moe+moe_act")[1] == {
        "recompute": "selective:moe_act+moe"}
