"""fuse_elementwise: chains of element-wise and norm ops become one kernel, across the layer
boundary too; FLOPs are kept exactly and the bytes saved are the inner tensors' traffic."""

import json

import pytest
import sympy
from opgraph.models import PRESETS, preset
from opgraph.passes.evaluate import evaluate
from opgraph.passes.fuse_elementwise import fuse_elementwise, rewrite_elementwise, rotate_loops

from opgraph import compile_step, hardware
from opgraph.cost.costmodel import CostModel
from opgraph.core.errors import OpgraphError
from opgraph.core.fusion import ELEMENTWISE, ELEMENTWISE_MATMUL, POLICIES, FusionPolicy
from opgraph.core.ir import BF16, Phase, region_problems
from opgraph.cost.memory import footprint
from opgraph.core.symbols import B, D, L, S
from opgraph.core.verify import verify

PLATE, DERIVED = CostModel(), CostModel(backward="derived")
ROW = B * S * D * BF16.itemsize  # one [B, S, D] activation in BF16


def totals(graph, cost=PLATE):
    costs = cost.op_costs(graph)
    flops = sympy.Add(*(costs[op.name].flops * op.count for op in graph.ops()))
    nbytes = sympy.Add(*(costs[op.name].bytes * op.count for op in graph.ops()))
    return sympy.expand(flops), sympy.expand(nbytes)


@pytest.fixture(scope="module")
def llama():
    return compile_step(preset("llama3-8b"))


@pytest.fixture(scope="module")
def fused(llama):
    return rewrite_elementwise(llama)


def test_the_pairs_of_each_layer_are_fused(fused):
    graph, _, made = fused
    verify(graph)
    assert not region_problems(graph)
    kernels = {f.op: f.members for f in made}
    assert kernels == {
        "layers.attn_residual+mlp_norm": ("layers.attn_residual", "layers.mlp_norm"),
        # across the layer boundary: layer i's residual add with layer i+1's norm
        "layers.mlp_residual+attn_norm.next": ("layers.mlp_residual", "layers.attn_norm.next"),
        "layers.mlp_norm.grad+attn_residual.grad": ("layers.mlp_norm.grad",
                                                    "layers.attn_residual.grad"),
    }
    for name in kernels:
        op = graph.op(name)
        assert op.kind == "fused" and op.region == "layers" and op.count == L
    # nothing is fused into a library matmul by default
    assert all(graph.op(m).kind != "matmul" for f in made for m in f.members if graph.has_op(m))
    assert all(m.kind != "matmul" for f in made for m in graph.op(f.op).param("body"))


def test_the_boundary_is_crossed_by_rotating_the_loop(llama, fused):
    graph, rotated, _ = fused
    (r,) = rotated
    assert (r.region, r.peeled, r.moved, r.absorbed) == (
        "layers", "layers.attn_norm", "layers.attn_norm.next", "final_norm")
    # layer 0's norm runs once, before the stack, on the embedding
    peeled = graph.op("layers.attn_norm")
    assert (peeled.region, peeled.count, peeled.inputs[0]) == (None, 1, "embed")
    # the region hands the next layer's normed input on, beside the residual stream
    carries = graph.region("layers").carries
    assert carries == (("embed", "layers.mlp_residual"),
                       ("layers.attn_norm", "layers.attn_norm.next"))
    # after the stack, the head reads the last iteration's norm: the final norm is gone
    assert not graph.has_op("final_norm")
    assert graph.op("lm_head").inputs[0] == "layers.attn_norm.next"
    # the fused kernel reads the add's operands and writes the stream and the normed input
    kernel = graph.op("layers.mlp_residual+attn_norm.next")
    assert set(kernel.outputs) == {"layers.mlp_residual", "layers.attn_norm.next"}
    assert {"layers.attn_residual", "layers.down_proj"} <= set(kernel.inputs)


@pytest.mark.parametrize("cost", [PLATE, DERIVED], ids=["plate", "derived"])
def test_rotation_alone_moves_no_flop_and_no_byte(llama, cost):
    rotated, _ = rotate_loops(llama)
    verify(rotated)
    assert totals(rotated, cost) == totals(llama, cost)
    assert sympy.expand(footprint(rotated).total - footprint(llama).total) == 0


def test_llama_bytes_removed_as_a_formula(llama, fused):
    """Per layer, two forward pairs (attn_residual + mlp_norm; mlp_residual + the next layer's
    norm) each stop re-reading one [B, S, D] tensor: 2 ROW per layer. The plate charges a
    backward twice its forward, so the backward saves 4 ROW more; with each kernel's own
    tensors ("derived"), the fused norm + add backward keeps its [B, S, D] gradient inside:
    one write and one read, 2 ROW."""
    graph = fused[0]
    for cost, saved in ((PLATE, 3 * 2 * ROW * L), (DERIVED, (2 + 2) * ROW * L)):
        (f0, b0), (f1, b1) = totals(llama, cost), totals(graph, cost)
        assert sympy.expand(f1 - f0) == 0
        assert sympy.expand(b0 - b1 - saved) == 0
    assert sympy.expand(footprint(graph).total - footprint(llama).total) == 0


def test_each_kernel_reports_the_bytes_it_saves(fused):
    made = {f.op: f for f in fused[2]}
    assert sympy.expand(made["layers.attn_residual+mlp_norm"].saved_bytes - ROW) == 0
    assert sympy.expand(made["layers.mlp_residual+attn_norm.next"].saved_bytes - ROW) == 0
    assert sympy.expand(made["layers.mlp_norm.grad+attn_residual.grad"].saved_bytes
                        - 2 * ROW) == 0


def test_a_fused_backward_is_linked_to_its_fused_forward(fused):
    graph = fused[0]
    backward = graph.op("layers.mlp_norm.grad+attn_residual.grad")
    assert backward.phase is Phase.BACKWARD
    assert backward.forward == "layers.attn_residual+mlp_norm"
    costs = PLATE.op_costs(graph)
    forward = costs["layers.attn_residual+mlp_norm"]
    assert sympy.expand(costs[backward.name].flops - 2 * forward.flops) == 0
    assert sympy.expand(costs[backward.name].bytes - 2 * forward.bytes) == 0
    # the boundary kernel's backward kernels (not fused: the add's and the norm's are a layer
    # apart in the backward) share its plate cost between them
    kernels = [op for op in graph.ops() if op.forward == "layers.mlp_residual+attn_norm.next"]
    assert sorted(op.name for op in kernels) == ["layers.attn_norm.grad",
                                                 "layers.mlp_residual.grad"]


def test_under_the_plate_no_flop_moves_between_backward_kernels(llama):
    """Each backward kernel names the member it differentiates, so the plate charges it what it
    was charged before; the fusion's saving comes off the bytes only."""
    graph = fuse_elementwise(llama, ELEMENTWISE_MATMUL)
    before, after = PLATE.op_costs(llama), PLATE.op_costs(graph)
    kept = [op for op in graph.ops() if op.phase is Phase.BACKWARD and op.name in before]
    assert len(kept) >= 10
    for op in kept:
        assert sympy.expand(after[op.name].flops - before[op.name].flops) == 0, op.name
    merged = graph.op("layers.swiglu.grad+gate_proj.dB")
    assert merged.param("of") == ("layers.swiglu", "layers.gate_proj")
    was = before["layers.swiglu.grad"].flops + before["layers.gate_proj.dB"].flops
    assert sympy.expand(after[merged.name].flops - was) == 0


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_keeps_its_flops_and_saves_bytes(name):
    step = compile_step(preset(name))
    graph = fuse_elementwise(step)
    verify(graph)
    assert not region_problems(graph)
    for cost in (PLATE, DERIVED):
        (f0, b0), (f1, b1) = totals(step, cost), totals(graph, cost)
        assert sympy.expand(f1 - f0) == 0
        saved = sympy.expand(b0 - b1)
        assert saved != 0 and saved.subs(graph.dims) > 0


def test_matmul_prologues_and_epilogues_hold_one_matmul(llama, fused):
    graph, _, made = rewrite_elementwise(llama, ELEMENTWISE_MATMUL)
    verify(graph)
    kinds = {f.op: [m.kind for m in graph.op(f.op).param("body")] for f in made}
    assert all(k.count("matmul") <= 1 for k in kinds.values())
    assert ["matmul", "rope"] == kinds["layers.q_proj+q_rope"]
    assert "layers.down_proj+mlp_residual+attn_norm.next" in kinds
    (f0, b0), (f1, b1) = totals(llama), totals(graph)
    assert sympy.expand(f1 - f0) == 0
    fewer = totals(fused[0])[1]
    assert (b1.subs(llama.dims) < fewer.subs(llama.dims) < b0.subs(llama.dims))


def test_the_policy_is_data_a_user_changes(llama):
    assert ELEMENTWISE.kind_class("rmsnorm_backward") == "reduction"
    assert ELEMENTWISE.may_fuse("add", "rmsnorm") and not ELEMENTWISE.may_fuse("matmul", "add")
    assert ELEMENTWISE_MATMUL.may_fuse("matmul", "add")
    # without norms, no pair is left: the adds are a whole MLP apart
    no_norms = ELEMENTWISE.without_kinds("rmsnorm")
    assert no_norms.kind_class("rmsnorm_backward") is None
    graph, rotated, made = rewrite_elementwise(llama, no_norms)
    assert (rotated, made) == ([], [])
    assert [op.name for op in graph.ops()] == [op.name for op in llama.ops()]
    # letting the embedding gather fuse joins it to layer 0's norm
    gather = ELEMENTWISE.with_kinds(embedding="pointwise")
    assert gather.kind_class("embedding_backward") == "pointwise"
    made = rewrite_elementwise(llama, gather)[2]
    assert "embed+layers.attn_norm" in {f.op for f in made}
    with pytest.raises(OpgraphError, match="unknown classes"):
        FusionPolicy("bad", {"add": "vector"}, set())


def test_gpt2s_position_add_fuses_with_layer_0s_norm():
    """GPT-2's stream starts as an add (token plus position embedding): once the loop is
    rotated, that add and layer 0's peeled LayerNorm are neighbours before the stack."""
    graph, rotated, made = rewrite_elementwise(compile_step(preset("gpt2")))
    assert [(r.peeled, r.absorbed) for r in rotated] == [("layers.ln_1", "ln_f")]
    entry = graph.op("embed_sum+layers.ln_1")
    assert (entry.region, entry.count) == (None, 1)
    assert [m.kind for m in entry.param("body")] == ["add", "layernorm"]
    assert "layers.mlp_residual+ln_1.next" in {f.op for f in made}


def test_compile_step_takes_extra_passes():
    forward = preset("gpt2")
    step = compile_step(forward, extra_passes=[fuse_elementwise])
    assert any(op.kind == "fused" for op in step.ops())
    assert not any(op.kind == "fused" for op in compile_step(forward).ops())


def test_a_fused_step_profiles_faster(fused, llama):
    h100 = hardware.get("h100-sxm")
    before, after = evaluate(llama, h100), evaluate(fused[0], h100)
    assert after.step_time_s < before.step_time_s
    assert after.flops == pytest.approx(before.flops, rel=1e-12)


def test_cli_fuse_and_diff(cli):
    code, out, _ = cli("diff", "--model", "llama3-8b", "--b-fuse", "elementwise")
    assert code == 0
    assert "+ layers.mlp_residual+attn_norm.next" in out
    assert "+ layers.attn_residual+mlp_norm" in out
    assert "- final_norm" in out
    assert "bytes   -12*B*D*L*S" in out and "flops   0" in out
    # each fused kernel with its members and what it saves: one [B, S, D] BF16 read per layer
    assert ("  layers.mlp_residual+attn_norm.next = layers.mlp_residual + "
            "layers.attn_norm.next: saves 2.15 GB (2*B*D*L*S)") in out
    code, out, _ = cli("profile", "--json", "--fuse", "elementwise+matmul", "--model", "gpt2")
    assert code == 0 and json.loads(out)["step_time_s"] > 0
    assert set(POLICIES) == {"elementwise", "elementwise+matmul"}


def test_cli_rejects_an_unknown_policy(cli):
    code, out, err = cli("profile", "--fuse", "everything")
    assert code == 2 and not out
    assert err.startswith("opgraph: error: argument --fuse: invalid choice: 'everything'")
    assert "Traceback" not in err


def test_fusion_keeps_the_mfu_parameter_count(fused, llama):
    """The loop rotation moves the final norm into the stack; the MFU's N must not lose its
    weight (read by its gradient alone afterwards)."""
    h100 = hardware.get("h100-sxm")
    assert evaluate(fused[0], h100).mfu_parameters == evaluate(llama, h100).mfu_parameters


def test_an_fp8_matmul_fused_with_its_epilogue_keeps_the_fp8_peak(llama):
    """A fused kernel computes in its matrix multiply's dtype: fusing FP8 GEMMs with their
    neighbours must not move them to the BF16 peak (the step must not get slower)."""
    from opgraph.models import preset

    from opgraph.cost.costmodel import DEFAULT, compute_dtype
    from opgraph.core.fusion import ELEMENTWISE_MATMUL

    h100 = hardware.get("h100-sxm")
    fp8 = compile_step(preset("llama3-8b"), precision="fp8")
    fused = fuse_elementwise(fp8, ELEMENTWISE_MATMUL)
    q = next(op for op in fused.ops() if op.kind == "fused"
             and "layers.q_proj" in {m.name for m in op.param("body")})
    assert compute_dtype(fused, q) == "fp8" == DEFAULT.op_cost(fused, q).compute
    assert evaluate(fused, h100).step_time_s < evaluate(fp8, h100).step_time_s


@pytest.mark.parametrize("name", ["mixtral-8x7b", "deepseek-v2-lite"])
def test_experts_fused_into_a_kernel_still_count_k_of_e(name):
    """An expert matmul inside a fused kernel still reads K of its E experts per token: the
    active parameters (and so the MFU's N) do not change with fusion."""
    from opgraph.models import preset

    from opgraph.core.fusion import ELEMENTWISE_MATMUL
    from opgraph.core.parameters import active_parameters

    step = compile_step(preset(name))
    fused = fuse_elementwise(step, ELEMENTWISE_MATMUL)
    assert any(op.kind == "fused" and "expert_matmul" in {m.kind for m in op.param("body")}
               for op in fused.ops())
    assert sympy.expand(active_parameters(fused) - active_parameters(step)) == 0
