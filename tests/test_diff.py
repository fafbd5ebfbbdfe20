"""`opgraph diff` and `diff_steps`: what a change removed, added and changed, and what it bought."""

import json

import pytest
import sympy
from opgraph.models import preset
from opgraph.passes.fuse_attention import rewrite_attention

from opgraph import CostModel, Phase, compile_step, derive_backward, evaluate, hardware
from opgraph.analysis.diff import diff_profiles, diff_steps, format_diff
from opgraph.core.symbols import B, H, L, S

H100 = hardware.get("h100-sxm")


@pytest.fixture(scope="module")
def llama():
    return preset("llama3-8b")


@pytest.fixture(scope="module")
def steps(llama):
    return compile_step(llama, fused_attention=False), compile_step(llama)


@pytest.fixture(scope="module")
def fusion(steps):
    unfused, fused = steps
    return diff_steps(unfused, fused, H100)


def attention_core(step):
    """The unfused core's kernels: scores, P.V, and the backward kernels of either."""
    forward = {op.name for op in step.ops() if op.kind == "attention_scores"
               or op.kind == "matmul" and op.category == "attention"}
    return forward | {op.name for op in step.ops() if op.forward in forward}


def test_fusion_removes_the_core_and_adds_the_flash_kernels(fusion, steps, llama):
    unfused, fused = steps
    removed = {o.name for o in fusion.removed}
    assert removed == attention_core(unfused) and len(removed) == 5
    (report,) = rewrite_attention(derive_backward(llama))[1]  # what the pass says it replaced
    assert removed == set(report.replaced)
    assert {o.name for o in fusion.added} == {report.op, report.backward}
    assert {o.kind for o in fusion.added} == {"flash_attention", "flash_attention_backward"}
    assert fusion.changed == []
    assert fusion.unchanged == len(unfused.ops()) - 5 == len(fused.ops()) - 2


def test_fusion_saves_the_score_matrix_traffic_and_keeps_the_flops(fusion):
    score_matrix = 2 * B * H * S**2  # B*H*S*S BF16 values per layer
    # written and read once forward (2), the backward twice the forward (4): the plate's rule
    assert sympy.expand(fusion.totals_formula("bytes") + L * 6 * score_matrix) == 0
    assert fusion.totals_formula("flops") == 0
    assert fusion.totals()["flops"]["delta"] == 0
    # the score matrix is no longer kept for the backward
    assert sympy.expand(fusion.totals_formula("memory") + L * score_matrix) == 0


def test_per_op_changes_add_up_to_the_totals(fusion):
    t = fusion.totals()
    assert sum(o.delta("time") for o in fusion.ops) == pytest.approx(
        t["step_time_s"]["delta"], rel=1e-9)
    assert sum(o.delta("bytes") for o in fusion.ops) == pytest.approx(t["bytes"]["delta"])
    assert sum(o.delta("memory") for o in fusion.ops) == t["memory_bytes"]["delta"]
    saved = [o.time_saved for o in fusion.ops]
    assert saved == sorted(saved, reverse=True)
    assert t["mfu_ceiling"]["b"] > t["mfu_ceiling"]["a"]
    per_op = sympy.Add(*(o.delta_formula("bytes") for o in fusion.ops))
    assert sympy.expand(per_op - fusion.totals_formula("bytes")) == 0


def test_an_op_carries_its_formulas(fusion):
    scores = next(o for o in fusion.removed if o.kind == "attention_scores")
    assert scores.b is None and scores.a.cost.phase == "forward"
    assert sympy.expand(scores.a.formula("memory") - L * 2 * B * H * S**2) == 0
    assert scores.a.formula("flops") == -scores.delta_formula("flops")
    values = {sym: sympy.Integer(v) for sym, v in scores.a.graph.dims.items()}
    assert float(scores.a.formula("flops").xreplace(values)) == scores.a.cost.flops


def test_profiles_alone_give_the_same_ops_without_formulas(fusion, steps):
    unfused, fused = steps
    d = diff_profiles(evaluate(unfused, H100), evaluate(fused, H100))
    assert [(o.name, o.status) for o in d.ops] == [(o.name, o.status) for o in fusion.ops]
    assert d.totals_formula("bytes") is None and d.ops[0].a.memory is None
    assert "B - A as formulas" not in format_diff(d)


def test_backward_traffic_changes_backward_bytes_only(llama, steps):
    plate = steps[1]
    d = diff_steps(plate, plate, H100, cost=CostModel(backward="plate"),
                   b_cost=CostModel(backward="tensors"))
    assert d.ops and not d.removed and not d.added
    assert all(o.phase == "backward" and o.why == ("bytes",) for o in d.changed)
    assert d.totals()["flops"]["delta"] == 0
    assert all(plate.op(o.name).phase is Phase.BACKWARD for o in d.changed)


def run_json(cli, *argv):
    code, out, err = cli("diff", *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def test_cli_fused_then_unfused(cli):
    j = run_json(cli, "--model", "llama3-8b", "--b-no-fused-attention")
    assert set(j) >= {"a", "b", "removed", "added", "changed", "totals"}
    assert (j["a"]["fused_attention"], j["b"]["fused_attention"]) == (True, False)
    assert j["b"]["options"] == ["--no-fused-attention"]
    assert {o["kind"] for o in j["removed"]} == {"flash_attention", "flash_attention_backward"}
    assert len(j["added"]) == 5 and j["changed"] == []
    step = j["totals"]["step_time_s"]
    assert step["b"] > step["a"] and step["speedup"] == pytest.approx(step["a"] / step["b"])
    assert j["totals"]["flops"]["formula"]["delta"] == "0"
    for o in j["removed"]:
        assert o["b"] is None and set(o["a"]["formulas"]) == {"flops", "bytes", "time", "memory"}
        assert o["delta"]["time_s"] == -o["a"]["time_s"]


def test_cli_text_what_fusion_bought(cli):
    code, out, _ = cli("diff", "--no-fused-attention", "--b-fused-attention")
    assert code == 0
    lines = out.splitlines()
    assert lines[1].endswith("(A with --fused-attention)")
    assert "5 removed, 2 added, 0 changed" in out
    assert "- layers.attn.scores.grad" in out and "+ layers.attn.flash " in out
    assert "  bytes   -12*B*H*L*S**2" in out
    assert any(line.startswith("MFU ceiling") for line in lines)


def test_tokens_and_models(steps, llama):
    fused = steps[1]
    d = diff_steps(fused, fused, H100, {"B": 1}, b_values={"B": 8})
    why = {o.name: o.why for o in d.changed}
    assert why["layers.q_proj"] == ("flops", "bytes")
    assert not any(o.phase == "optimizer" for o in d.changed)  # AdamW ignores tokens
    assert d.totals()["memory_bytes"]["delta"] > 0  # more activations kept
    assert d.totals_formula("bytes") is None  # different dimensions: B - A is not a formula
    assert d.side_formula("a", "bytes") == d.side_formula("b", "bytes")  # but each side's is

    big = compile_step(preset("llama3-70b"))
    d = diff_steps(fused, big, H100)
    assert not d.comparable and d.totals_formula("bytes") is None
    q = next(o for o in d.changed if o.name == "layers.q_proj")
    assert (q.a.cost.count, q.b.cost.count) == (32, 80) and "count" in q.why
    assert q.delta_formula("flops") is None  # two models: no difference of formulas
    assert sympy.expand(q.b.formula("flops") - q.a.formula("flops")) == 0  # same form


def test_cli_tokens_hardware_and_models(cli):
    code, out, _ = cli("diff", "--b-tokens", "65536")
    assert code == 0 and out.splitlines()[1].startswith("B: llama3-8b on h100-sxm, 65,536 tokens")
    assert "~ layers.q_proj " in out and "~ adamw." not in out

    j = run_json(cli, "--b-hardware", "b200")
    assert (j["removed"], j["added"], j["changed"]) == ([], [], [])
    b200 = evaluate(compile_step(preset("llama3-8b")), hardware.get("b200"))
    assert j["totals"]["step_time_s"]["b"] == pytest.approx(b200.step_time_s, rel=1e-12)
    code, out, _ = cli("diff", "--b-hardware", "b200", "--all")  # the unchanged ops, listed
    rows = [line for line in out.splitlines() if line.startswith(" layers.")]
    assert code == 0 and len(rows) == len([o for o in b200.ops if o.name.startswith("layers.")])

    code, out, _ = cli("diff", "--model", "llama3-8b", "--b-model", "llama3-70b")
    assert code == 0 and out.splitlines()[1].startswith("B: llama3-70b")
    assert "(count, flops, bytes)" in out and "B - A as formulas" not in out


def test_every_model_option_has_a_side_b_twin():
    from opgraph.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices
    profile = {s for a in sub["profile"]._actions for s in a.option_strings}
    diff = {s for a in sub["diff"]._actions for s in a.option_strings}
    import argparse

    from opgraph.commands.layout import add_parallel_args

    many = argparse.ArgumentParser()
    add_parallel_args(many)  # a job over many GPUs is profile's alone: diff compares one GPU's
    layout = {s for a in many._actions for s in a.option_strings}
    model = profile - {"-h", "--help", "--ops", "--json", "--plot", "--trace"} - layout
    assert model and {f"--b-{s[2:]}" for s in model} <= diff


@pytest.mark.parametrize("argv, says", [
    ([], "side B is the same as side A"),
    (["--b-tokens", "abc"], "not a whole number"),
    (["--b-model", "llama9"], "side B (--model llama9): unknown model 'llama9'"),
    (["--b-backward-traffic", "some"], "invalid choice"),
    (["--b-tokens", "10000"], "not a multiple"),
])
def test_cli_bad_input(cli, argv, says):
    code, out, err = cli("diff", *argv)
    assert code == 2 and out == ""
    assert err.startswith("opgraph: error: ") and err.count("\n") == 1 and says in err


def test_side_b_is_side_a_with_the_b_options():
    from opgraph.cli import build_parser
    from opgraph.commands.diff import side_b

    args = build_parser().parse_args(["diff", "--config", "x.json", "--tokens", "16384",
                                      "--b-model", "gpt2", "--b-fused-attention",
                                      "--b-no-fused-attention"])
    b, changes = side_b(args)
    assert (b.model, b.config, b.tokens) == ("gpt2", None, 16384)  # --model replaces --config
    assert b.no_fused_attention is True  # of a switch's two twins, the last one given wins
    assert changes == ["--model gpt2", "--no-fused-attention"]
    assert (args.model, args.config) == (None, "x.json")  # side A is left alone
