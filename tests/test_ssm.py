"""Mamba-2's mixer and the Nemotron-H hybrid: costs by the SSD algorithm's formulas (Dao and Gu
2024, section 6), parameter counts against the published ones, and how parallelism treats them."""

import json

import attrs
import pytest
import sympy
from opgraph.models import nemotron_h, preset
from opgraph.models.hf import from_config

from opgraph import compile_step, hardware
from opgraph.analysis.traces.rules import classify
from opgraph.cli import main
from opgraph.core import rules
from opgraph.core.errors import OpgraphError
from opgraph.core.ir import FP32, Phase
from opgraph.core.parameters import active_parameters, mfu_parameters
from opgraph.cost.costmodel import cost_model
from opgraph.parallel.distributed import compile_parallel
from opgraph.parallel.parallel import Parallel

NANO = nemotron_h.NEMOTRON_3_NANO
ROOFLINE = cost_model("roofline")


def _value(expr, graph):
    return sympy.sympify(expr).xreplace(graph.dims)


def test_nemotron_3_nano_has_its_published_parameter_counts():
    """31.6 B parameters, 3.2 B active (6 N's convention: the embedding's lookup not counted),
    3.6 B active with it (the model card; arXiv:2512.20848)."""
    g = preset("nemotron-3-nano")
    total = _value(g.parameters(), g)
    assert abs(total / 31.6e9 - 1) < 0.002
    assert abs(_value(mfu_parameters(g), g) / 3.2e9 - 1) < 0.01  # the lookup left out
    assert abs(_value(active_parameters(g), g) / 3.6e9 - 1) < 0.01


def test_a_mamba_layer_holds_the_mixer_weights_megatron_builds():
    """in_proj D x (2 H P + 2 G N + H); the depthwise conv over x, B and C, k wide, with its
    bias; dt_bias, A and D per head; the group norm's weight over H P; out_proj H P x D; the
    block's norm."""
    c = attrs.evolve(NANO, name="mamba-only", pattern="MMM")
    g = nemotron_h.build(c)
    d, h, p, n, grp, k = c.d_model, c.mamba_heads, c.mamba_head_dim, c.state, c.groups, 4
    inner, conv = h * p, h * p + 2 * grp * n
    layer = d * (2 * inner + 2 * grp * n + h) + conv * (k + 1) + 3 * h + inner + inner * d + d
    head = 2 * c.vocab * d + d  # embedding, untied head, final norm
    assert _value(g.parameters(), g) == 3 * layer + head


def test_the_ssd_kernels_cost_the_chunked_algorithm():
    """Per token and head (width P, state N, groups G, chunks of Q): the chunk states 2 N P and
    their passing 2 N P / Q; the chunk scan C B^T 2 Q N per group, its product with x 2 Q P, the
    incoming state 2 N P, the skip 2 P. Backward: the scan's kernel twice its forward with the
    states recomputed, the chunk state's twice its own. The states cross HBM in FP32."""
    g = preset("nemotron-3-nano")
    tokens, h, p, n, grp, q = NANO.seq_len, NANO.mamba_heads, NANO.mamba_head_dim, NANO.state, \
        NANO.groups, NANO.chunk
    state = ROOFLINE.op_cost(g, g.op("mamba_layers.chunk_state"))
    scan = ROOFLINE.op_cost(g, g.op("mamba_layers.chunk_scan"))
    state_flops = 2 * tokens * h * p * n * (1 + sympy.Rational(1, q))
    scan_flops = 2 * tokens * (q * grp * n + q * h * p + h * n * p + h * p)
    assert _value(state.flops, g) == state_flops
    assert _value(scan.flops, g) == scan_flops
    states = g.tensor(g.op("mamba_layers.chunk_state").outputs[0])
    assert states.dtype is FP32
    assert _value(states.numel, g) == tokens // q * h * p * n
    x, bc, dt = tokens * h * p * 2, tokens * grp * n * 2, tokens * h * 2
    per_head = 2 * h * 2  # dt_bias and A, BF16
    assert _value(state.bytes, g) == x + dt + per_head + bc + 4 * tokens // q * h * p * n
    step = compile_step(g)
    (grad,) = [o for o in step.ops() if o.forward == "mamba_layers.chunk_scan"]
    own = rules.count_flops(grad.kind, [step.tensor(t) for t in grad.inputs],
                            [step.tensor(t) for t in grad.outputs], dict(grad.params))
    assert _value(own, g) == 2 * scan_flops + state_flops  # the states re-run once
    (grad,) = [o for o in step.ops() if o.forward == "mamba_layers.chunk_state"]
    own = rules.count_flops(grad.kind, [step.tensor(t) for t in grad.inputs],
                            [step.tensor(t) for t in grad.outputs], dict(grad.params))
    # and one add an element accumulating into the gradients the scan's kernel wrote first
    partials = tokens * h * p + tokens * h + 2 * h + tokens * grp * n  # x, dt, dt_bias, A, B
    assert _value(own, g) == 2 * state_flops + partials


def test_the_backward_recomputes_the_states_rather_than_keeping_them():
    """No backward kernel reads the chunk states (mamba_ssm recomputes them); the scan's
    backward writes the states' gradient, which the chunk state's backward reads."""
    step = compile_step(preset("nemotron-3-nano"))
    states = step.op("mamba_layers.chunk_state").outputs[0]
    assert [o.name for o in step.consumers(states)] == ["mamba_layers.chunk_scan"]
    (scan,) = [o for o in step.ops() if o.forward == "mamba_layers.chunk_scan"]
    forward = step.op("mamba_layers.chunk_scan")
    assert {step.tensor(t).grad_of for t in scan.outputs} == set(forward.inputs)
    (state,) = [o for o in step.ops() if o.forward == "mamba_layers.chunk_state"]
    d_states = next(t for t in scan.outputs if step.tensor(t).grad_of == states)
    assert d_states in state.inputs and states not in state.inputs


def test_the_split_pieces_are_strided_views_both_ways():
    """mamba_ssm's kernels read the pieces of in_proj's output through their strides and its
    backward writes their gradients into one buffer: no copy either way."""
    step = compile_step(preset("nemotron-h-8b"))
    for name in ("mamba_layers.in_split", "mamba_layers.xbc_split"):
        ops = [step.op(name)] + [o for o in step.ops() if o.forward == name]
        assert len(ops) == 2
        assert all(ROOFLINE.op_cost(step, o).bytes == 0 for o in ops)


def test_tensor_parallelism_splits_the_heads_and_groups():
    """Megatron-Core's MambaMixer: in_proj column-parallel, out_proj row-parallel (one
    all-reduce after it), everything between on tp's share of the heads and groups."""
    g = preset("nemotron-h-8b")
    c = nemotron_h.NEMOTRON_H_8B
    tp2 = compile_parallel(g, Parallel(tp=2))
    w = tp2.tensor("mamba_layers.in_proj.weight")
    width = 2 * c.mamba_heads * c.mamba_head_dim + 2 * c.groups * c.state + c.mamba_heads
    assert [_value(s, tp2) for s in w.shape] == [c.d_model, width // 2]
    scan = tp2.op("mamba_layers.chunk_scan")
    assert _value(scan.param("heads"), tp2) == c.mamba_heads // 2
    assert _value(scan.param("groups"), tp2) == c.groups // 2
    reduces = [o.name for o in tp2.ops() if o.phase is Phase.FORWARD and o.kind == "all_reduce"
               and o.region == "mamba_layers"]
    assert reduces == ["mamba_layers.out_proj.all_reduce.tp"]


def test_groups_tensor_parallelism_cannot_divide_are_an_error():
    c = attrs.evolve(NANO, name="two-groups", pattern="MM", groups=2)
    with pytest.raises(OpgraphError, match="G_m = 2 is not divisible by --tp 4"):
        compile_parallel(nemotron_h.build(c), Parallel(tp=4))


def test_context_parallelism_trades_the_sequence_for_heads_as_megatron_does():
    """Megatron-Core's Mamba context parallelism (mamba_context_parallel.py): z, xBC and dt
    pass an all-to-all from this GPU's S/cp tokens of every channel to all S tokens of 1/cp of
    them; the convolution and the scan run there on H_m/cp heads and G_m/cp groups, their
    per-channel weights sliced; the gated output passes one back before the group norm. Each
    all-to-all moves its tensor once: (S/cp) x width x 2 bytes."""
    c = nemotron_h.NEMOTRON_H_8B
    step = compile_parallel(preset("nemotron-h-8b"), Parallel(cp=2))
    fwd = [o for o in step.ops() if o.phase is Phase.FORWARD and o.region == "mamba_layers"]
    a2a = {o.inputs[0]: o for o in fwd if o.kind == "all_to_all"}
    inner, bc = c.mamba_heads * c.mamba_head_dim, c.groups * c.state
    widths = {"mamba_layers.in_split": inner, "mamba_layers.in_split:1": inner + 2 * bc,
              "mamba_layers.in_split:2": c.mamba_heads, "mamba_layers.gate": inner}
    assert set(a2a) == set(widths) and all(o.param("group") == "cp" for o in a2a.values())
    for source, width in widths.items():
        sent = step.tensor(a2a[source].inputs[0])
        assert _value(sent.nbytes, step) == c.seq_len // 2 * width * 2
    scan = step.op("mamba_layers.chunk_scan")
    assert (_value(scan.param("heads"), step), _value(scan.param("groups"), step)) == (
        c.mamba_heads // 2, c.groups // 2)
    conv = step.op("mamba_layers.conv1d")
    assert [_value(d, step) for d in step.tensor(conv.inputs[1]).shape] == [
        (inner + 2 * bc) // 2, 4]
    norm = step.op("mamba_layers.mixer_norm")
    assert step.producer(norm.inputs[0]).kind == "all_to_all"
    assert _value(step.tensor(norm.inputs[0]).shape[1], step) == c.seq_len // 2


def test_degrees_a_hybrid_cannot_take_are_one_line(capsys):
    """Whole Mamba heads and groups per GPU (tp x cp divides both), and no pipeline over the
    pattern."""
    assert main(["profile", "--model", "nemotron-h-8b", "--gpus", "16", "--cp", "16"]) == 2
    err = capsys.readouterr().err
    assert "G_m = 8 is not divisible by tp x cp = 1 x 16" in err and len(
        err.strip().splitlines()) == 1
    assert main(["profile", "--model", "nemotron-3-nano", "--gpus", "8", "--pp", "2"]) == 2
    assert "leave out --pp" in capsys.readouterr().err


def test_the_profile_files_the_scan_under_its_own_category():
    rows = {r["name"]: r for r in _profile_json("nemotron-h-8b")["categories"]}
    assert rows["scan"]["flops"] > 0 and "attention" in rows


def _profile_json(model):
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["profile", "--model", model, "--json"]) == 0
    return json.loads(out.getvalue())


NANO_CONFIG = {  # nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16's fields that shape a cost
    "model_type": "nemotron_h", "hidden_size": 2688, "num_hidden_layers": 52,
    "hybrid_override_pattern": NANO.pattern, "num_attention_heads": 32,
    "num_key_value_heads": 2, "head_dim": 128, "mamba_num_heads": 64, "mamba_head_dim": 64,
    "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4, "chunk_size": 128,
    "intermediate_size": 1856, "n_routed_experts": 128, "num_experts_per_tok": 6,
    "moe_intermediate_size": 1856, "moe_shared_expert_intermediate_size": 3712,
    "vocab_size": 131072, "mlp_hidden_act": "relu2", "tie_word_embeddings": False,
    "max_position_embeddings": 262144, "rms_norm_eps": 1e-5,
}


def _write(tmp_path, fields):
    path = tmp_path / "Nemotron" / "config.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(fields))
    return path


def test_the_hf_config_builds_the_preset(tmp_path):
    g = from_config(_write(tmp_path, NANO_CONFIG))
    p = preset("nemotron-3-nano")
    assert _value(g.parameters(), g) == _value(p.parameters(), p)
    assert g.seq_len == 8192
    assert sorted(r.name for r in g.regions()) == sorted(r.name for r in p.regions())
    # transformers' older field names (Nemotron-H v0.1's configuration) give the same graph
    older = {k: v for k, v in NANO_CONFIG.items()
             if k not in ("head_dim", "n_groups", "conv_kernel", "chunk_size")}
    older |= {"attention_head_dim": 128, "mamba_n_groups": 8, "mamba_d_conv": 4,
              "mamba_chunk_size": 128}
    again = from_config(_write(tmp_path, older))
    assert str(compile_step(again)) == str(compile_step(g))


@pytest.mark.parametrize("change, message", [
    ({"hybrid_override_pattern": "MX*"}, "not a string of M"),
    ({"num_hidden_layers": 51}, "num_hidden_layers = 51 but hybrid_override_pattern has 52"),
    ({"mlp_hidden_act": "silu"}, "mlp_hidden_act"),
    ({"n_groups": 7}, "64 Mamba heads are not a multiple of 7 groups"),
    ({"num_experts_per_tok": 200}, "num_experts_per_tok"),
])
def test_bad_hf_fields_are_one_line_errors(tmp_path, change, message):
    with pytest.raises(OpgraphError, match=message) as e:
        from_config(_write(tmp_path, NANO_CONFIG | change))
    assert "config.json" in str(e.value) and "\n" not in str(e.value)


def test_relu2_and_the_convolution_count_their_flops():
    """ReLU squared: the max and a multiply a element; the convolution 2 k multiply-adds, its
    bias and SiLU (5) an element."""
    step = compile_step(preset("nemotron-h-8b"))
    c = nemotron_h.NEMOTRON_H_8B
    tokens = c.seq_len
    relu2 = ROOFLINE.op_cost(step, step.op("mlp_layers.relu2"))
    assert _value(relu2.flops, step) == 2 * tokens * c.d_ff
    conv = ROOFLINE.op_cost(step, step.op("mamba_layers.conv1d"))
    channels = c.mamba_heads * c.mamba_head_dim + 2 * c.groups * c.state
    assert _value(conv.flops, step) == (2 * 4 + 5) * tokens * channels


def test_a_trace_files_mamba_ssm_kernels_under_scan():
    for name in ("_chunk_scan_fwd_kernel", "_chunk_state_bwd_db_kernel",
                 "_state_passing_fwd_kernel", "_bmm_chunk_fwd_kernel",
                 "void causal_conv1d_fwd_kernel<128, 4>"):
        assert classify(name) == "scan"
    assert classify("void cutlass::Kernel<cutlass_80_tensorop_bf16_s16816gemm>") == "matmul"


def test_the_step_runs_on_a_part_with_its_expert_parallel_layout():
    """The Megatron-Bridge layout of its H100 row: EP 8 over 16 GPUs, TP 1, FP8."""
    g = preset("nemotron-3-nano")
    h100 = hardware.get("h100-sxm")
    assert h100 is not None
    step = compile_parallel(g, Parallel(dp=16, ep=8, framework="megatron"), precision="fp8")
    kinds = {o.kind for o in step.ops()}
    assert {"ssd_chunk_scan", "ssd_chunk_scan_backward", "all_to_all", "relu2"} <= kinds


def test_plan_searches_a_hybrid_with_context_parallelism_as_profile_runs_it():
    """A long-sequence plan of a Mamba-2 hybrid takes context parallelism, no pipeline; its
    figures for a CP layout are profile's (1e-9), the all-to-alls around the scan included."""
    from opgraph.parallel.distributed import profile_parallel
    from opgraph.parallel.search import Searcher, Space, rows

    forward, h100 = preset("nemotron-h-8b"), hardware.get("h100-sxm")
    searcher = Searcher(forward, h100, seq_len=65536, cost=cost_model("calibrated"))
    space = Space(gpus=16, batch=16)
    found = rows(forward, h100, space, 65536, searcher.cluster)
    assert any(r.cp > 1 for r in found) and all(r.pp == 1 for r in found)
    sampled = [r for r in found if r.cp == 4 and r.tp == 2 and r.micro_batch == 1][:2]
    assert sampled
    for row in sampled:
        c = row.candidate()
        mine = searcher.one(c).result
        theirs = profile_parallel(forward, h100, c.layout, values={"S": 65536},
                                  cost=searcher.cost, recompute=c.recompute,
                                  precision=c.precision).parallel
        assert mine.step_time_s == pytest.approx(theirs.step_time_s, rel=1e-9)
        assert mine.memory == theirs.memory
