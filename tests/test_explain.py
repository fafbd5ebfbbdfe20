"""`opgraph plan --compare` and `--sensitivity` (`opgraph.analysis.explain`): a layout as the plan
prints it reads back; the step's parts add up to it; a named layout is profiled as `profile`
profiles it, or gives its reason; the moved cost models really move what they say."""

import json

import attrs
import pytest

from opgraph.parallel import cluster as clusters
from opgraph import hardware
from opgraph.parallel import search
from opgraph.cost.costmodel import cost_model
from opgraph.parallel.distributed import profile_parallel, step_figures
from opgraph.core.errors import OpgraphError
from opgraph.analysis.explain import Perturbed, compare, named, perturb, sensitivity
from opgraph.io.launch import Launch, to_megatron, to_torchtitan
from opgraph.models import preset
from opgraph.io.outputs.report import format_compare, format_plan, format_sensitivity, layout_text
from opgraph.parallel.parallel import Parallel, parse_layout
from opgraph.parallel.schedule import GROUPS
from opgraph.parallel.search import Searcher, Space, rows
from opgraph.analysis.validate import LEFT_OUT_ERROR

H100 = hardware.get("h100-sxm")
SMALL = ("llama3.2-1b", 2048)  # 16 layers: pipelines of 2, 4, 8 and uneven ones of 3 (5/6/5)
FIGURES = ("step_time_s", "mfu", "bubble_s", "exposed_communication_s", "compute_s",
           "overlap_slowdown_s", "later_stage_tail_s")


@pytest.fixture(scope="module")
def planned():
    """One small search, shared: Llama 3.2 1B on 8 H100s, 32 sequences of 2,048 tokens."""
    model, seq = SMALL
    searcher = Searcher(preset(model), H100, seq_len=seq, cost=cost_model("calibrated"))
    space = Space(gpus=8, batch=32, recompute=("none",), precision=("bf16",))
    return searcher, space, searcher.search(space, 10)


# --- the compact layout ------------------------------------------------------------------------

def test_every_layout_the_plan_prints_reads_back_to_itself():
    """Each layout of a space (uneven pipelines and sequence parallelism among them; a mixture
    of experts folded into the tensor-parallel ranks), printed as the plan's table prints it,
    is read back by `parse_layout` to the same layout and options."""
    model, seq = SMALL
    forward = preset(model)
    found = rows(forward, H100, Space(gpus=24, batch=48, max_micro_batch=2), seq,
                 clusters.for_hardware(H100))
    assert any(r.first_stage_layers is not None for r in found)
    assert any(r.sequence_parallel for r in found)
    folded = rows(preset("mixtral-8x7b"), H100, Space(gpus=16, batch=16, expert_tp=1,
                                                       max_micro_batch=1), seq,
                  clusters.for_hardware(H100))
    assert any(r.tp > 1 and (r.dp * r.cp) % r.ep for r in folded)
    for r in found + folded:
        fields, options = parse_layout(layout_text(r.layout(), r.recompute, r.precision))
        assert Parallel(global_batch=r.batch, **fields) == r.layout()
        assert options == {"recompute": r.recompute, "precision": r.precision}


@pytest.mark.parametrize("text, words", [
    ("tq8", "'tq8' is not a layout word"),
    ("tp8,tp4", "tp twice"),
    ("full selective", "recompute twice"),
    ("zero1(1/.../2)", "not a layout word"),
    ("", "write it as plan prints one"),
    ("tp" + "9" * 40, "not a layout word"),
])
def test_a_text_that_is_no_layout_is_one_line(text, words):
    with pytest.raises(OpgraphError, match=words.replace("(", r"\(").replace(")", r"\)")):
        parse_layout(text)


# --- the step's parts --------------------------------------------------------------------------

@pytest.mark.parametrize("model, seq, layout, cost", [
    ("llama3.2-1b", 2048, Parallel(tp=2, pp=4, gpus=16, global_batch=32, zero=1,
                                   sequence_parallel=True), "calibrated"),
    ("llama3.2-1b", 2048, Parallel(tp=2, pp=4, gpus=16, global_batch=32, zero=3,
                                   virtual_stages=2), "roofline"),
    ("llama3.2-1b", 4096, Parallel(tp=2, cp=2, pp=2, gpus=16, global_batch=32, micro_batch=2,
                                   zero=2, overlap_grad_reduce=False), "calibrated"),
    ("mixtral-8x7b", 4096, Parallel(tp=2, ep=4, pp=2, gpus=32, global_batch=64, zero=1),
     "calibrated"),
])
def test_the_parts_add_up_to_the_step(model, seq, layout, cost):
    """The identity the schedule guarantees: rank 0's compute stream only runs or waits, so a
    micro-batch's span is its compute plus its waits (`schedule.simulate`); the pipeline's span
    is m of rank 0's micro-batches plus the bubble; the step adds the longest tail (rank 0's own,
    in its last micro-batch, and a later stage's excess) and the overlap slowdown. So

        step = compute + bubble + sum over groups of the wait + later stage's tail + slowdown.

    Each part is measured on its own: compute is the sum of rank 0's compute ops' times over the
    step (the profile's rows), the waits are the exposed communication less the tail."""
    profile = profile_parallel(preset(model), H100, layout, values={"S": seq},
                               cost=cost_model(cost))
    r = profile.parallel
    parts = r.parts()
    assert sum(parts.values()) == pytest.approx(r.step_time_s, rel=1e-12)
    assert all(value >= 0 for value in parts.values())
    compute = sum(row.time_s for row in profile.ops if row.bound != "network")
    assert r.compute_s == pytest.approx(compute, rel=1e-9)
    waits = dict(r.waited_by_group)
    assert sum(waits.values()) == pytest.approx(
        r.exposed_communication_s - r.later_stage_tail_s, rel=1e-12, abs=1e-15)
    assert list(waits) == [g for g in GROUPS if g in waits]  # the schedule's order
    assert {"tp", "dp", "pp"} <= set(waits)
    assert (r.overlap_slowdown_s > 0) == (cost == "calibrated")


# --- --compare ---------------------------------------------------------------------------------

def test_a_named_layout_equal_to_the_first_gives_the_first_rows_figures(planned):
    searcher, space, found = planned
    first = found.best[0]
    rows_ = compare(searcher, found.best, [named(layout_text(
        first.layout, first.candidate.recompute, first.candidate.precision), space)])
    top, second, mine = rows_
    assert (top.label, second.label, mine.label) == ("#1", "#2", "named")
    assert top.result is first.result and second.result is found.best[1].result
    assert mine.reason is None and mine.candidate.to_json() == first.candidate.to_json()
    for name in FIGURES:
        assert getattr(mine.result, name) == pytest.approx(getattr(top.result, name),
                                                           rel=1e-9, abs=1e-12), name
    assert dict(mine.result.waited_by_group) == pytest.approx(dict(top.result.waited_by_group),
                                                              rel=1e-9, abs=1e-12)
    assert mine.result.memory == top.result.memory


def test_a_layout_the_job_cannot_run_gives_its_reason(planned):
    searcher, space, found = planned
    rows_ = compare(searcher, found.best, [named("tp3", space), named("tp8,pp2", space),
                                           named("tp2,mb16", space), named("pp32", space)])
    reasons = [r.reason for r in rows_[2:]]
    assert all(r.result is None for r in rows_[2:])
    assert "not divisible by tp x cp x pp = 3 x 1 x 1" in reasons[0]
    assert "tp x cp x pp = 8 x 1 x 2 = 16" in reasons[1]
    # 32 sequences over dp 4: 8 a rank, not a multiple of micro-batches of 16
    assert "global batch 32 is not divisible by dp x micro-batch = 4 x 16" in reasons[2]
    assert reasons[3].startswith("pp32: ")


def test_a_layout_that_does_not_fit_gives_its_memory(planned):
    """Llama 3.2 1B with nothing sharded holds 18 bytes a parameter (BF16 weights, FP32
    gradients, AdamW's FP32 master weights and moments), 22 GB, and 4 sequences' activations
    besides: on a part of the H100's rates but 30 GB it does not fit."""
    searcher, space, found = planned
    small = Searcher(searcher.forward, attrs.evolve(H100, memory_bytes=30e9),
                     seq_len=searcher.seq, cost=searcher.cost)
    (row,) = compare(small, (), [named("tp1 mb4 zero0", space)])
    r = row.result
    assert r.memory.capacity == 30e9 < r.memory.total
    assert r.memory.weights + r.memory.gradients + r.memory.optimizer > 20e9
    assert row.reason == (f"does not fit: {r.memory.total / 1e9:,.1f} GB per GPU (pipeline "
                          "stage 0) of 30.0 GB")
    # the table still shows its figures, the headroom negative, and the reason beneath
    figures, why = format_compare([row]).splitlines()[2:]
    assert f"{r.step_time_s:.3f}" in figures
    assert figures.split()[-2:] == ["-" + f"{(r.memory.total - 30e9) / 1e9:.1f}", "GB"]
    assert why.strip() == row.reason


def test_the_plan_names_the_layouts_that_fill_their_gpus(planned):
    """A layout at 95% of its GPU's memory or more is named beneath the table (opgraph's
    figure leaves out the CUDA context, NCCL's buffers and the allocator's freed blocks): on a
    part whose memory the best layout fills to 97%, #1 is named; on the H100, none is."""
    searcher, space, found = planned
    assert all(r.result.memory.total < 0.95 * 80e9 for r in found.best)
    assert len(format_plan(found.best).splitlines()) == 1 + len(found.best)
    tight = Searcher(searcher.forward, attrs.evolve(H100, memory_bytes=found.best[0].result
                                                    .memory.total / 0.97),
                     seq_len=searcher.seq, cost=searcher.cost)
    again = tight.search(space, 10)
    note = format_plan(again.best).splitlines()[-1]
    named = {f"#{i}" for i, r in enumerate(again.best, 1)
             if r.result.memory.total >= 0.95 * r.result.memory.capacity}
    assert "#1" in named and set(note.split(" need")[0].split(", ")) == named
    assert "--headroom" in note


# the CLI's plans: a small space (no pipeline or context parallelism), searched in a second
PLAN = ("plan", "--model", "llama3.2-1b", "--seq-len", "2048", "--gpus", "8", "--global-batch",
        "32", "--recompute", "none", "--precision", "bf16", "--max-pp", "1", "--max-cp", "1")


def test_the_compare_table(planned):
    searcher, space, found = planned
    rows_ = compare(searcher, found.best, [named("tp2,mb2,zero1", space), named("tp3", space),
                                           named("tp4 pp2 full", space)])
    table = format_compare(rows_).splitlines()
    assert [line.split()[0] for line in table[2:]] == ["#1", "#2", "named", "named", "named"]
    assert table[5].startswith("named  tp3: --gpus 8 is not divisible")
    groups = [word for word in table[1].split() if word not in ("comm", "(s)")]
    assert groups[5:-4] == ["tp", "dp", "pp"]  # the groups rank 0 waits on, schedule's order
    for line, row in zip(table[2:], rows_):
        if row.reason is None:  # its figures, as the columns print them
            assert f"{row.result.step_time_s:.3f}" in line and row.text in line


def test_the_compare_json(cli, tmp_path):
    """One plan: named layouts, and a launch config of the same layout (Megatron-LM's
    arguments, read as `profile --megatron-args` reads them: a Megatron-LM job) giving the
    same figures where the plan follows Megatron-LM too; a torchtitan job of another model
    gives the reason."""
    layout = Parallel(tp=2, dp=4, micro_batch=2, global_batch=32, zero=1)
    args = tmp_path / "args.txt"
    args.write_text(to_megatron(Launch(model="llama3.2-1b", seq_len=2048, parallel=layout)))
    job = tmp_path / "job.toml"
    job.write_text(to_torchtitan(Launch(model="llama3-8b", seq_len=2048,
                                        parallel=Parallel(gpus=8, global_batch=32, zero=3))))
    code, out, _ = cli(*PLAN, "--framework", "megatron", "--top", "1", "--compare",
                       "tp2,mb2,zero1;tp3", "--compare-config", str(args), "--compare-config",
                       str(job), "--json")
    assert code == 0
    data = json.loads(out)
    assert len(data["layouts"]) == 1  # --top 1: the plan's own list keeps one
    rows_ = data["compare"]
    assert [r["label"] for r in rows_] == ["#1", "#2", "named", "named", "config", "config"]
    assert rows_[0]["step_time_s"] == data["layouts"][0]["step_time_s"]
    mine, bad, config, other = rows_[2:]
    for r in rows_[:3] + [config]:
        assert sum(r["parts_s"].values()) == pytest.approx(r["step_time_s"], rel=1e-12)
        assert r["headroom_bytes"] == r["capacity_bytes"] - r["memory_bytes"]
    assert "reason" in bad and "step_time_s" not in bad
    assert config["source"] == str(args) and "reason" not in config
    for name in ("step_time_s", "mfu", "memory_bytes"):
        assert config[name] == pytest.approx(mine[name], rel=1e-12)
    assert other["reason"] == (f"{job}: it trains llama3-8b, the plan llama3.2-1b; plan the "
                               "same job")


def test_a_config_of_another_framework_than_the_plans_is_noted(cli, tmp_path):
    """A launch config is its framework's job: beside a plan that follows another framework,
    the comparison says so on stderr, and not where the plan follows the config's."""
    args = tmp_path / "args.txt"
    args.write_text(to_megatron(Launch(model="llama3.2-1b", seq_len=2048,
                                       parallel=Parallel(tp=2, dp=4, micro_batch=2,
                                                         global_batch=32, zero=1))))
    code, _, err = cli(*PLAN, "--top", "1", "--compare-config", str(args))
    assert code == 0
    assert f"{args} runs megatron's behaviour, the plan's layouts the generic model's" in err
    code, _, err = cli(*PLAN, "--framework", "megatron", "--top", "1", "--compare-config",
                       str(args))
    assert code == 0 and "behaviour" not in err


def _no_search(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the search ran")
    monkeypatch.setattr(search.Searcher, "search", refuse)


@pytest.mark.parametrize("argv, words", [
    (("--compare", "tq8"), "'tq8' is not a layout word"),
    (("--compare", "tp2", "--gpus", "8:16:x2"), "--compare explains one job"),
    (("--sensitivity", "--emit", "megatron"), "give --emit or --sensitivity"),
    (("--sensitivity", "--cost", "roofline"), "give --cost calibrated"),
    (("--compare-config", "no-such.toml"), "no-such.toml"),
    (("--compare", ";".join(["tp2"] * 65)), "more than 64 layouts"),
])
def test_what_cannot_be_explained_fails_before_the_search(cli, monkeypatch, argv, words):
    _no_search(monkeypatch)
    gpus = () if "--gpus" in argv else ("--gpus", "8")
    code, out, err = cli("plan", "--model", "llama3-8b", "--global-batch", "32", *gpus, *argv)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and words in err


# --- --sensitivity -----------------------------------------------------------------------------

def test_the_error_sensitivity_moves_by_is_what_cv_family_measured():
    """`LEFT_OUT_ERROR`, which `--sensitivity` moves the model by and names as `opgraph
    validate --cv family`'s mean left-out error, is that figure as the README records it (the
    recorded output, rewritten by `docs/regenerate.py --slow` when the calibration changes)."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    (left_out,) = re.findall(r"^mean over \d+ families: left out ([\d.]+)%", readme, re.MULTILINE)
    assert round(LEFT_OUT_ERROR * 100, 1) == float(left_out)


def test_a_moved_model_moves_a_compute_bound_kernel_by_its_factor():
    """The calibrated time of a compute-bound matmul is `launch + FLOPs / (matmul x clock x
    peak)` (`CalibratedCostModel.scaled_time`, no waves without a grid, matmul_half_flops 0):
    the kernels' efficiencies times f make its compute term 1 / f as long. A collective's
    seconds per byte are 1 / (node x the tier's bandwidth): times f, 1 / f of them."""
    cost = cost_model("calibrated")
    e = cost.efficiencies(H100)
    f = 1 - LEFT_OUT_ERROR
    slower = perturb(cost, ("matmul", "attention"), f)
    flops, nbytes = 1e15, 1e6  # far above the ridge point: compute-bound
    before = cost.op_time(H100, "matmul", flops, nbytes, 1, H100.peak_flops)
    after = slower.op_time(H100, "matmul", flops, nbytes, 1, H100.peak_flops)
    assert before - e.launch_s == pytest.approx(flops / (e.matmul * H100.peak_flops))
    assert after - e.launch_s == pytest.approx((before - e.launch_s) / f, rel=1e-12)
    assert slower.efficiencies(H100).attention == e.attention * f
    assert slower.efficiencies(H100).node == e.node  # only what it names
    cluster = clusters.for_hardware(H100)
    lines = cost.comm_lines("all_reduce", 8, cluster, 1, H100)
    moved = perturb(cost, ("node", "network"), f).comm_lines("all_reduce", 8, cluster, 1, H100)
    for (base, slope), (base_, slope_) in zip(lines, moved, strict=True):
        assert base_ == base and slope_ == pytest.approx(slope / f, rel=1e-12)
    with pytest.raises(OpgraphError, match="--cost calibrated"):
        perturb(cost_model("roofline"), ("matmul",), f)


def test_sensitivity_reschedules_the_plans_layouts_under_each_moved_model(planned):
    searcher, _, found = planned
    best = found.best[:5]
    # unmoved: the search's own figures, from the same jobs
    (same, *_) = sensitivity(searcher, best, error=0.0)
    assert same.steps == tuple(r.step_time_s for r in best) and same.first_rank == 1
    moved = sensitivity(searcher, best)
    assert [(p.what, p.factor) for p in moved] == [
        ("kernels", 1 - LEFT_OUT_ERROR), ("kernels", 1 + LEFT_OUT_ERROR),
        ("collectives", 1 - LEFT_OUT_ERROR), ("collectives", 1 + LEFT_OUT_ERROR)]
    f = 1 - LEFT_OUT_ERROR
    kernels = ("matmul", "attention", "attention_fused")
    slower, network = (perturb(searcher.cost, names, f) for names in (kernels,
                                                                       ("node", "network")))
    for r, kernels_down, network_down in zip(best, moved[0].steps, moved[2].steps):
        job = searcher.job(r.candidate)
        assert step_figures(job, searcher.cost) == r.result
        k = step_figures(job, slower)
        assert k.step_time_s == kernels_down
        # compute grows, by at most 1 / f (a memory-bound kernel and a launch do not grow)
        assert r.result.compute_s < k.compute_s <= r.result.compute_s / f * (1 + 1e-12)
        n = step_figures(job, network)
        assert n.step_time_s == network_down
        assert n.compute_s == pytest.approx(r.result.compute_s, rel=1e-12)  # kernels unmoved
        comm = sum(t.time_s for t in r.result.communication)
        assert comm < sum(t.time_s for t in n.communication) <= comm / f * (1 + 1e-12)


def test_where_the_first_choice_ranks_under_a_moved_model():
    p = Perturbed("kernels", ("matmul",), 0.5, (2.0, 1.0, 3.0, 1.0))
    assert p.first_rank == 3 and p.first == 1  # a tie keeps the plan's order
    assert Perturbed("kernels", ("matmul",), 0.5, (1.0, 1.0)).first_rank == 1


def test_the_sensitivity_lines(planned):
    searcher, _, found = planned
    best = found.best[:4]
    moved = sensitivity(searcher, best)
    lines = format_sensitivity(moved, best, LEFT_OUT_ERROR).splitlines()
    assert f"{LEFT_OUT_ERROR:.1%}" in lines[0] and "top 4" in lines[0] and len(lines) == 2 + 4 + 1
    for line, p in zip(lines[2:6], moved):
        assert f"{p.first_rank} of 4" in line and f"{p.steps[0]:.3f}" in line
    stays = sum(p.first_rank == 1 for p in moved)
    assert lines[-1] == f"the first choice stays first in {stays} of the 4 moved models"


def test_the_sensitivity_json(cli):
    code, out, _ = cli(*PLAN, "--top", "2", "--sensitivity", "4", "--json")
    assert code == 0
    data = json.loads(out)
    assert len(data["layouts"]) == 2
    s = data["sensitivity"]
    assert s["error"] == LEFT_OUT_ERROR and s["top"] == 4 and len(s["models"]) == 4
    for m in s["models"]:
        steps = m["step_times_s"]
        assert len(steps) == 4 and steps[0] == m["first_step_time_s"]
        assert m["first_rank"] == 1 + sum(t < steps[0] for t in steps[1:])
        assert m["first_now"]["step_time_s"] == min(steps)


def test_the_error_constant_is_one_named_figure():
    """`plan --sensitivity` reads the left-out error from validate, not a copy of its own."""
    import inspect

    from opgraph.commands import plan

    assert str(LEFT_OUT_ERROR) not in inspect.getsource(plan)
    assert attrs.has(Perturbed) and 0 < LEFT_OUT_ERROR < 1
