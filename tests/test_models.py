"""The model zoo against published figures, and the mixture of experts' costs as formulas."""

import json

import pytest
import sympy
from opgraph.models import PRESETS, gpt2, preset
from opgraph.passes.evaluate import mfu_parameters

from opgraph import Phase, compile_step, evaluate, hardware, verify
from opgraph.cost.costmodel import DEFAULT, CostModel
from opgraph.core.parameters import active_parameters
from opgraph.core.symbols import B, D, E, F, H, H_kv, K, L, S, V, d_h

H100 = hardware.get("h100-sxm")

# Published parameter counts. Exact where the checkpoint's count is published, else rounded.
EXACT = {
    "llama3-8b": 8_030_261_248,  # Meta Llama 3 8B: the HF checkpoint's tensors (model card)
    "llama3-70b": 70_553_706_496,  # Meta Llama 3 70B: the HF checkpoint's tensors
    "llama3.1-405b": 405_853_388_800,  # Meta Llama 3.1 405B: the HF checkpoint's tensors
    "gpt2": 124_439_808,  # OpenAI GPT-2 small ("124M"): the HF openai-community/gpt2 tensors
    "llama3.2-1b": 1_235_814_400,  # HF meta-llama/Llama-3.2-1B: the checkpoint's tensors
    "gemma2-2b": 2_614_341_888,  # HF google/gemma-2-2b: the checkpoint's tensors
    "deepseek-v2-lite": 15_706_484_224,  # HF deepseek-ai/DeepSeek-V2-Lite: the tensors
    "bert-base": 109_514_298,  # HF google-bert/bert-base-uncased as BertForMaskedLM
}
ROUNDED = {
    "gpt3-175b": 175.0e9,  # arXiv:2005.14165 Table 2.1: "GPT-3 175B", n_params 175.0B
    "mixtral-8x7b": 46.7e9,  # Mistral AI, "Mixtral of experts" (2023): 46.7B total parameters
    "qwen2-7b": 7.62e9,  # Qwen2-7B, 7.62B (HF Qwen/Qwen2-7B model page; arXiv:2407.10671)
}
MIXTRAL_ACTIVE = 12.9e9  # Mistral AI, "Mixtral of experts": "only uses 12.9B parameters per token"
DEEPSEEK_V2_LITE_ACTIVE = 2.66e9  # arXiv:2405.04434 appendix B: 2.4 B active without the
# embedding (and head); the issue's ~2.66 B counts them


def count(graph, expr=None):
    return int((graph.parameters() if expr is None else expr).xreplace(graph.dims))


@pytest.fixture(scope="module")
def graphs():
    return {name: preset(name) for name in PRESETS}


@pytest.fixture(scope="module")
def mixtral_step(graphs):
    return compile_step(graphs["mixtral-8x7b"], check=True)


@pytest.mark.parametrize("name", sorted(EXACT))
def test_exact_parameter_counts(graphs, name):
    assert count(graphs[name]) == EXACT[name]


@pytest.mark.parametrize("name", sorted(ROUNDED))
def test_rounded_parameter_counts(graphs, name):
    assert count(graphs[name]) == pytest.approx(ROUNDED[name], rel=0.005)


def test_mixtral_active_parameters(graphs):
    graph = graphs["mixtral-8x7b"]
    active = active_parameters(graph)
    assert count(graph, active) == pytest.approx(MIXTRAL_ACTIVE, rel=0.005)
    # K of E experts' weights per token, the rest dense: a formula, not a typed-in number
    experts = 3 * E * D * F * L
    assert sympy.expand(graph.parameters() - active - (1 - K / E) * experts) == 0


def test_gpt2_parameters_as_a_formula(graphs):
    graph = graphs["gpt2"]
    # per layer: two LayerNorms (weight, bias); Q, K, V with biases; O with its bias; the MLP's
    # two projections with biases. Around: token and position tables, the final LayerNorm; the
    # head is tied to the token table, so it adds nothing.
    per_layer = (2 * 2 * D + 3 * (D * H * d_h + H * d_h) + (H * d_h * D + D)
                 + (D * F + F) + (F * D + D))
    expected = V * D + gpt2.P * D + L * per_layer + 2 * D
    assert sympy.expand(graph.parameters() - expected) == 0


def test_tied_head_counts_for_mfu_and_the_position_table_does_not(graphs):
    graph = graphs["gpt2"]
    head = graph.op("lm_head")
    assert head.inputs[1] == "wte.weight" and head.param("transpose_b") is True
    mfu = mfu_parameters(graph)
    # every parameter but the position table (read only by its lookup) counts
    assert sympy.expand(graph.parameters() - mfu - gpt2.P * D) == 0


def test_qwen2_has_biases_on_q_k_v_only(graphs):
    biases = {w.name for w in graphs["qwen2-7b"].weights() if w.name.endswith(".bias")}
    assert biases == {"layers.q_proj.bias", "layers.k_proj.bias", "layers.v_proj.bias"}


def test_llama3_70b_shapes(graphs):
    dims = graphs["llama3-70b"].dims
    assert (dims[D], dims[L], dims[H], dims[H_kv], dims[F]) == (8192, 80, 64, 8, 28672)


def test_every_preset_compiles_and_profiles(graphs):
    for name, graph in graphs.items():
        step = compile_step(graph, check=True)
        p = evaluate(step, H100)
        assert p.step_time_s > 0 and 0 < p.mfu_ceiling < 1, name
        assert p.fused_attention, name


def flops(graph, op, cost=DEFAULT):
    return cost.op_cost(graph, op).flops


def test_expert_matmuls_count_only_the_routed_experts(mixtral_step):
    gate = mixtral_step.op("layers.experts.gate_proj")
    assert gate.count == L
    assert sympy.expand(flops(mixtral_step, gate) - 2 * B * S * K * D * F) == 0
    down = mixtral_step.op("layers.experts.down_proj")
    assert sympy.expand(flops(mixtral_step, down) - 2 * B * S * K * F * D) == 0
    # its backward is two expert matmuls, each the forward's FLOPs (dX and dW), by the plate's
    # convention and by their own FLOP rules alike
    backward = [op for op in mixtral_step.ops() if op.forward == gate.name]
    assert sorted(op.kind for op in backward) == ["expert_matmul", "expert_matmul"]
    for op in backward:
        assert sympy.expand(flops(mixtral_step, op) - flops(mixtral_step, gate)) == 0
        # by their own rules: the same, and one add per element where dX accumulates into the
        # gradient of the token slots (the permutation's output, read by gate and up)
        accumulated = B * S * K * D if op.param("accumulate") else 0
        derived = flops(mixtral_step, op, CostModel(backward="derived"))
        assert sympy.expand(derived - flops(mixtral_step, gate) - accumulated) == 0
    # bytes: all E experts' weights are read (at these token counts every expert is used)
    w = mixtral_step.tensor("layers.experts.gate_proj.weight")
    assert w.shape == (E, D, F)
    weight_bytes = 2 * E * D * F
    x, out = 2 * B * S * K * D, 2 * B * S * K * F  # it reads each token's K slots
    assert sympy.expand(mixtral_step.op_bytes(gate) - weight_bytes - x - out - 4 * B * S * K) == 0


def test_the_dispatch_copies_each_token_to_its_k_experts(mixtral_step):
    """The permutation before the expert GEMMs (Megatron-Core's `permute`) writes K copies of
    each token and reads the tokens and the routing (int32 ids); no arithmetic. Its backward
    sums each token's K slot gradients back: it reads dY and the routing, writes dX, one add
    per element of dY by its own rule, and is charged its own bytes, not twice the forward's."""
    permute = mixtral_step.op("layers.experts.permute")
    assert permute.kind == "moe_permute" and permute.count == L
    assert mixtral_step.tensor(permute.outputs[0]).shape == (B, S, K, D)
    tokens, slots, ids = 2 * B * S * D, 2 * B * S * K * D, 4 * B * S * K
    assert sympy.expand(mixtral_step.op_bytes(permute) - tokens - slots - ids) == 0
    assert flops(mixtral_step, permute) == 0
    (grad,) = [op for op in mixtral_step.ops() if op.forward == permute.name]
    assert grad.kind == "moe_permute_backward" and len(grad.inputs) == 2
    assert mixtral_step.tensor(grad.outputs[0]).shape == (B, S, D)
    cost = CostModel().op_cost(mixtral_step, grad)
    assert sympy.expand(cost.bytes - tokens - slots - ids) == 0
    derived = flops(mixtral_step, grad, CostModel(backward="derived"))
    assert sympy.expand(derived - B * S * K * D) == 0
    # the experts' gate and up GEMMs read the slots, and keep them for their weight gradients
    for name in ("gate_proj", "up_proj"):
        assert mixtral_step.op(f"layers.experts.{name}").inputs[0] == permute.outputs[0]


def test_the_forward_matmuls_are_two_flops_per_active_parameter_per_token(mixtral_step):
    fwd = [op for op in mixtral_step.ops() if op.phase is Phase.FORWARD
           and op.kind in ("matmul", "expert_matmul") and op.category in ("matmul", "output_head")]
    total = sympy.Add(*(flops(mixtral_step, op) * op.count for op in fwd))
    norms = sympy.Add(*(w.numel * w.count for w in mixtral_step.weights() if "norm" in w.name))
    assert sympy.expand(total - 2 * B * S * (mfu_parameters(mixtral_step) - norms)) == 0


def test_the_optimizer_updates_every_parameter(mixtral_step):
    updates = [op for op in mixtral_step.ops() if op.phase is Phase.OPTIMIZER]
    moved = sympy.Add(*(mixtral_step.op_bytes(op) * op.count for op in updates))
    assert sympy.expand(moved - 34 * mixtral_step.parameters()) == 0  # all 46.7 B, not 12.9 B


def test_mixtral_mfu_counts_active_parameters(mixtral_step):
    p = evaluate(mixtral_step, H100)
    assert p.active_parameters == count(mixtral_step, active_parameters(mixtral_step))
    embedding = 32000 * 4096  # the input embedding, read only by its lookup
    assert p.mfu_parameters == p.active_parameters - embedding
    assert 0 < p.mfu_ceiling < 1


def test_a_dense_model_has_no_active_parameters_field(graphs):
    p = evaluate(compile_step(graphs["qwen2-7b"]), H100)
    assert p.active_parameters is None and "active_parameters" not in p.to_json()


def test_verifier_rejects_a_routing_that_does_not_fit():
    from opgraph import GraphBuilder
    from opgraph.core.rules import ShapeError

    g = GraphBuilder("bad", {B: 1, S: 4, D: 8, F: 16, E: 4, K: 2})
    x = g.activation("x", (B, S, D))
    _, experts = g.topk(g.matmul(x, g.weight("router", (D, E))), K)
    with pytest.raises(ShapeError, match="inner dims"):
        g.expert_matmul(x, g.weight("w", (E, F, D)), experts)
    verify(g.build())


def test_models_command_lists_every_preset(cli):
    code, out, _ = cli("models", "--json")
    assert code == 0
    rows = {r["name"]: r for r in json.loads(out)}
    assert set(rows) == set(PRESETS)
    for name, n in EXACT.items():
        assert rows[name]["parameters"] == n
    assert rows["mixtral-8x7b"]["active_parameters"] == pytest.approx(MIXTRAL_ACTIVE, rel=0.005)
    assert "active_parameters" not in rows["gpt2"]
    code, out, _ = cli("models")
    assert code == 0 and "124,439,808" in out and "2 of 8" in out


def test_profile_json_reports_total_and_active_parameters(cli):
    code, out, _ = cli("profile", "--model", "mixtral-8x7b", "--json", "--ops")
    assert code == 0
    j = json.loads(out)
    assert j["parameters"] == pytest.approx(ROUNDED["mixtral-8x7b"], rel=0.005)
    assert j["active_parameters"] == pytest.approx(MIXTRAL_ACTIVE, rel=0.005)
    ops = {r["name"]: r for r in j["ops"]}
    tokens, d, f, k, layers = 8192, 4096, 14336, 2, 32
    assert ops["layers.experts.gate_proj"]["flops"] == 2 * tokens * k * d * f * layers
    optimizer = sum(r["bytes"] for r in j["ops"] if r["phase"] == "optimizer")
    assert optimizer == 34 * j["parameters"]


def test_gpt2_sequence_longer_than_its_position_table_is_refused(cli):
    code, out, err = cli("profile", "--model", "gpt2", "--seq-len", "2048")
    assert code == 2 and out == "" and err.count("\n") == 1 and "1,024 positions" in err


def test_a_mixtral_sweep_row_equals_its_profile(mixtral_step):
    import numpy as np

    from opgraph.analysis.sweep import compile_sweep, make_grid, run_grid

    grid = make_grid({"batch": np.array([1, 4])}, [H100], 8192)
    rows = run_grid(compile_sweep(mixtral_step), grid)
    for i, batch in enumerate((1, 4)):
        p = evaluate(mixtral_step, H100, {"B": batch})
        assert float(rows["mfu_ceiling"][i]) == pytest.approx(p.mfu_ceiling, rel=1e-9)
        assert float(rows["step_time_s"][i]) == pytest.approx(p.step_time_s, rel=1e-9)


# --- the presets issue 9 added: each profiles end to end, fused and unfused -----------------------

NEW_PRESETS = ("gemma2-2b", "deepseek-v2-lite", "bert-base", "llama3.2-1b")


@pytest.mark.parametrize("name", NEW_PRESETS)
@pytest.mark.parametrize("fused", [True, False])
def test_new_presets_profile_fused_and_unfused(graphs, name, fused):
    step = compile_step(graphs[name], fused_attention=fused, check=True)
    p = evaluate(step, H100)
    assert p.step_time_s > 0 and 0 < p.mfu_ceiling < 1 and p.fused_attention is fused


def test_deepseek_v2_lite_active_parameters(graphs):
    from opgraph.core.symbols import F_e

    graph = graphs["deepseek-v2-lite"]
    active = active_parameters(graph)
    assert count(graph, active) == pytest.approx(DEEPSEEK_V2_LITE_ACTIVE, rel=0.005)
    # K of the E routed experts in every layer after the first (dense) one
    routed = 3 * E * D * F_e * (L - 1)
    assert sympy.expand(graph.parameters() - active - (1 - K / E) * routed) == 0


def test_gemma2_alternates_windowed_and_global_soft_capped_attention(graphs):
    from opgraph.core.symbols import W

    graph = graphs["gemma2-2b"]
    local, glob = graph.op("layers.local.attn.scores"), graph.op("layers.global.attn.scores")
    assert local.param("window") == W and glob.param("window") is None
    assert local.param("softcap") == glob.param("softcap") == 50.0
    assert local.count == glob.count == L / 2
    assert graph.op("final_softcap").param("cap") == 30.0
    norms = [op for op in graph.ops() if op.kind == "rmsnorm" and op.region == "layers"]
    assert len(norms) == 8  # a norm before and after each of the two sublayers, two layers
    step = compile_step(graph)
    w = sympy.Min(S, W)
    scores, per_score = {"local": S * w - w**2 / 2, "global": S**2 / 2}, 4 * d_h + 3
    for kind, pairs in scores.items():
        flash = step.op(f"layers.{kind}.attn.flash")
        assert sympy.expand(flops(step, flash) - B * H * pairs * per_score) == 0


def test_deepseek_mla_head_sizes_and_views(graphs):
    from opgraph.core.symbols import d_nope, d_rope, d_v

    graph = graphs["deepseek-v2-lite"]
    attn = graph.producer("layers.attn.pv")
    q, k, v = (graph.tensor(n) for n in ("layers.q_flat", "layers.k_flat", "layers.v_flat"))
    assert (q.shape[-1], k.shape[-1], v.shape[-1]) == (H * (d_nope + d_rope),) * 2 + (H * d_v,)
    step = compile_step(graph)
    flash = step.op("layers.attn.flash")
    expected = 2 * B * H * S**2 / 2 * (d_nope + d_rope + d_v)
    assert sympy.expand(flops(step, flash) - expected) == 0
    assert attn.count == L - 1
    costs = DEFAULT.op_costs(step)
    for name in ("layers.q_heads", "layers.k_pe_head", "layers.k_pe_heads", "layers.q_flat"):
        assert costs[name].bytes == 0, name  # reshapes and a broadcast: views
    # each head's parts joined: a copy, read both parts, write the whole
    bf16 = 2
    assert sympy.expand(costs["layers.k_concat"].bytes
                        - 2 * bf16 * B * S * H * (d_nope + d_rope)) == 0


def test_bert_predicts_the_masked_positions_only(graphs):
    from opgraph.core.symbols import M

    graph = graphs["bert-base"]
    assert graph.tensor("masked").shape == (B, M, D)
    head = graph.op("lm_head")
    assert head.inputs[1] == "word_embeddings.weight" and head.param("transpose_b") is True
    assert sympy.expand(flops(graph, head) - 2 * B * M * D * V - B * M * V) == 0
    assert graph.op("layers.gelu").param("approximate") == "none"
    step = compile_step(graph)
    flash = step.op("layers.attn.flash")  # bidirectional: every key for every query
    assert flash.param("causal") is False
    assert sympy.expand(flops(step, flash) - 2 * B * H * S**2 * 2 * d_h) == 0
