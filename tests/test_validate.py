"""validate's judgement of the model: runs it cannot model listed with their reason, leave one
family out without leaking the family into its own fit, and the choice-quality figures of
`--rank` as Spearman and regret define them."""

import math

import attrs
import pytest

from opgraph.cost import calibration
from opgraph.analysis import validate as v
from opgraph.io.cases import Unmodelled, load_cases
from opgraph.core.errors import OpgraphError


@pytest.fixture(scope="module")
def shipped():
    return {c.id: c for c in load_cases()}


@pytest.mark.parametrize("case_id, backward", [
    ("korthikanti22_tab5_22B_seqsel", "plate"),  # tensor and sequence parallel, on A100s
    ("torchtitan_t1_fsdp_compile_fp8_8gpu", "plate"),  # FP8's peak, FSDP, fused element-wise
    ("simumax_b200_llama3_70b_l12_tp1_pp2_dp4_mbc4_cef", "derived"),  # two pipeline stages
])
def test_a_prediction_is_what_profile_gives_under_each_cost_model(shipped, case_id, backward):
    """`predict` compiles a case once a process (the fit's compiled jobs, shared across cost
    models of one backward convention) and schedules it under the cost model asked for: the
    figures `profile_parallel` gives compiling the case under that cost model on its own."""
    from opgraph.cost.costmodel import cost_model

    case = shipped[case_id]
    for name in ("calibrated", "roofline"):
        cost = cost_model(name, backward)
        got = v.predict(case, cost)
        r = case.job(cost).profile().parallel
        assert (got.predicted_step_time_s, got.predicted_peak_memory_bytes, got.mfu,
                got.predicted_allocated_bytes) == (r.step_time_s, r.memory.total, r.mfu,
                                                   r.memory.allocated), name


def test_a_prediction_says_where_its_step_goes(shipped):
    """Each prediction carries the step split as the schedule runs rank 0 (compute, bubble,
    each group's exposed communication, ...; `ParallelResult.parts`), in its JSON too: the
    parts add up to the predicted step, and a pipeline without virtual stages has a bubble."""
    case = shipped["simumax_b200_llama3_70b_l12_tp1_pp2_dp4_mbc4_cef"]
    got = v.predict(case)
    parts = got.to_json()["predicted_parts_s"]
    assert parts == dict(case.job(v.DEFAULT).profile().parallel.parts())
    assert sum(parts.values()) == pytest.approx(got.predicted_step_time_s, rel=1e-9)
    assert parts["compute"] > 0 and parts["bubble"] > 0


def test_memory_is_compared_on_the_stage_the_source_read_it_on():
    """nanotron writes its benchmark CSV on world rank 0, the first pipeline stage, so the
    playbook's cases say `peak_memory_stage` 0: the prediction compared is that stage's, here
    below the fullest stage's (the last, which holds the loss's FP32 logits of 8 sequences),
    while whether the layout fits is still the fullest stage's."""
    (case,) = [c for c in load_cases("playbook-sweep")
               if c.id.startswith("playbook_sweep_1B_8n_tp1_pp2_dp32_mbs8_ga1_z1")]
    assert case.measured_peak_memory_stage == 0
    from opgraph.analysis.fit import compile_cases

    got = v.predict(case)
    ((_, job),) = compile_cases([case], v.DEFAULT)
    first = job.stages[job.kinds[0]].memory
    fullest = case.job(v.DEFAULT).profile().parallel.memory
    assert (got.predicted_peak_memory_bytes, got.predicted_allocated_bytes) == (
        first.total, first.allocated)
    assert first.total < fullest.total and got.predicted_fit_bytes == fullest.allocated


def test_a_prediction_gives_the_reserved_and_the_allocated_peak():
    """A nanotron ZeRO-1 run of the playbook sweep: its JSON gives the reserved peak (the
    gather buffers the allocator keeps stacked on the live tensors) and, apart, the allocated
    one, less by those buffers; a source's figure is either."""
    (case,) = [c for c in load_cases("playbook-sweep")
               if c.id.startswith("playbook_sweep_1B_1n_tp1_pp1_dp8_mbs1_ga32_z1")]
    got = v.predict(case).to_json()
    memory = case.job(v.DEFAULT).profile().parallel.memory
    assert memory.buffers > 0
    assert got["predicted_peak_memory_gb"] == pytest.approx(
        got["predicted_allocated_memory_gb"] + memory.buffers / 1e9, rel=1e-12)


def test_a_run_that_cannot_be_predicted_is_listed_with_its_reason(shipped, monkeypatch):
    cases = [shipped["korthikanti22_tab5_22B_full"], shipped["korthikanti22_tab5_22B_seqsel"]]
    real = v.predict

    def predict(case, cost):
        if case.id.endswith("seqsel"):
            raise OpgraphError("a reason")
        return real(case, cost)

    monkeypatch.setattr(v, "predict", predict)
    report = v.validate(cases, unmodelled=[Unmodelled(id="x", source="s", reason="no layout")])
    assert [p.case.id for p in report.predictions] == ["korthikanti22_tab5_22B_full"]
    assert [(s.id, s.reason) for s in report.skipped] == [
        ("x", "no layout"), ("korthikanti22_tab5_22B_seqsel", "a reason")]
    text = v.format_report(report, "roofline")
    assert "not modelled: 2 runs" in text and "korthikanti22_tab5_22B_seqsel: a reason" in text


def test_a_family_left_out_is_predicted_without_its_own_measurements(shipped):
    """Doubling the measured time of the family left out changes its error only through the
    measurement: its prediction, fitted on the other family alone, stays put."""
    one = shipped["korthikanti22_tab5_22B_full"]
    others = [shipped["narayanan21_tab1_1.7B"], shipped["narayanan21_tab1_3.6B"]]
    table = calibration.catalog()
    first = v.cross_validate([one, *others], table, steps=8)
    doubled = attrs.evolve(one, measured_step_time_s=2 * one.measured_step_time_s)
    second = v.cross_validate([doubled, *others], table, steps=8)
    e = first[0].left_out_mape  # |predicted / measured - 1| of the one run
    assert first[0].family == "korthikanti22_tab5" and first[0].cases == 1
    assert any(second[0].left_out_mape == pytest.approx(abs((1 + s * e) / 2 - 1), rel=1e-9)
               for s in (1, -1))
    # the other family's fold did see the doubled run, so its fit moved
    assert second[1].left_out_mape != pytest.approx(first[1].left_out_mape, rel=1e-6)


def test_leave_one_family_out_needs_two_families(shipped):
    with pytest.raises(OpgraphError, match="two families"):
        v.cross_validate([shipped["korthikanti22_tab5_22B_full"]], calibration.catalog())


def test_spearman_is_pearson_of_ranks_with_ties_sharing_their_mean_rank():
    # ranks (1, 2.5, 2.5, 4) against (1, 2, 3, 4): Pearson's r of the ranks by hand
    a, b = [1, 2, 3, 4], [1, 2.5, 2.5, 4]
    mean = 2.5
    cov = sum((x - mean) * (y - mean) for x, y in zip(a, b))
    r = cov / math.sqrt(sum((x - mean) ** 2 for x in a) * sum((y - mean) ** 2 for y in b))
    assert v.spearman([10, 20, 30, 40], [5, 7, 7, 9]) == pytest.approx(r)
    assert math.isnan(v.spearman([1, 2, 3], [4, 4, 4]))


def test_rank_regret_is_the_measured_best_over_the_first_choices_measured_throughput():
    """Three layouts of one model on one GPU count; opgraph's first choice is the fastest it
    predicts among those it predicts fit, the regret how much faster the measured best ran."""
    sweep = [c for c in load_cases("playbook-sweep") if "_1B_1n_" in c.id][:3]
    measured = [c.tokens_per_step / (c.measured_step_time_s * c.gpus) for c in sweep]
    # predicted: the slowest measured predicted fastest, and one predicted not to fit
    order = sorted(range(3), key=lambda i: measured[i])
    steps = {order[0]: 1.0, order[1]: 2.0, order[2]: 0.5}
    memory = {order[0]: 10e9, order[1]: 10e9, order[2]: 500e9}
    report = v.Report(tuple(v.Prediction(c, steps[i], int(memory[i]), 0.0)
                            for i, c in enumerate(sweep)))
    (score,) = v.rank(report, {"h100-sxm": 80e9})
    assert score.choice == sweep[order[0]].id  # the fastest of the two that fit
    assert score.best == sweep[order[2]].id
    assert score.regret == pytest.approx(measured[order[2]] / measured[order[0]] - 1)
    predicted = [c.tokens_per_step / (steps[i] * c.gpus) for i, c in enumerate(sweep)]
    assert score.spearman == pytest.approx(v.spearman(predicted, measured))
    summary = v.rank_summary((score,))
    assert summary["mean_regret"] == score.regret and summary["median_spearman"] == score.spearman


def test_the_held_out_runs_are_never_fitted_on(shipped):
    """`holdout` (opgraph/data/holdout.json) is published runs kept out of every fit: none of
    its runs is a development run (by id, or by model, part, layout and sequence), the fit
    reads the development set alone, and each is predicted within a factor of two (a guard,
    not the figure: docs/calibration.md prints them)."""
    from opgraph.io.cases import HOLDOUT, NAMED, SHIPPED
    from opgraph.cost.costmodel import cost_model

    held = load_cases("holdout")
    assert NAMED["holdout"] == HOLDOUT and len(held) == 300

    def key(c):
        return (repr(c.model), c.hardware, c.parallel, c.seq_len, c.recompute, c.precision,
                c.fuse)

    assert not {c.id for c in held} & set(shipped)
    assert not {key(c) for c in held} & {key(c) for c in shipped.values()}
    from opgraph.commands.calibrate import SHIPPED_CASES
    assert NAMED[SHIPPED_CASES] == SHIPPED != HOLDOUT  # `calibrate --fit shipped`'s runs
    errors = [v.predict(c, cost_model("calibrated")).error for c in held]
    assert all(abs(e) < 1.0 for e in errors), errors


def test_the_family_mean_weighs_each_family_once(shipped):
    """`Report.family_mape` is the families' mean absolute errors averaged: Narayanan's Table 1
    (10 runs) and Table 2 (12) count once each, where the mean over runs weighs Table 2 by 12/22."""
    from opgraph.cost.costmodel import cost_model

    report = v.validate([c for c in shipped.values() if c.family.startswith("narayanan")],
                        cost_model("calibrated"))
    tables = [[abs(p.error) for p in report.predictions if p.case.family == f]
              for f in ("narayanan21_tab1", "narayanan21_tab2")]
    assert [len(t) for t in tables] == [10, 12]
    assert report.family_mape == pytest.approx((sum(tables[0]) / 10 + sum(tables[1]) / 12) / 2)
    assert report.mape == pytest.approx((sum(tables[0]) + sum(tables[1])) / 22)
    assert "mean over 2 families, each weighted equally: " in v.format_report(report, "calibrated")


def test_the_held_out_mpt_models_have_the_tables_parameter_counts():
    """Each of LLM Foundry's held-out runs is an MPT model written as a GPT-2 config; its
    parameters (biases, LayerNorms, a learned position embedding of the sequence length, the
    tied vocabulary) add up to the NumParams its table prints, quoted in the case's notes."""
    import re

    runs = [c for c in load_cases("holdout") if c.family.startswith("llm_foundry")]
    assert len(runs) == 209
    for c in runs:
        (published,) = re.findall(r"NumParams \(([\d,]+)\)", c.notes)
        graph = c.forward()
        assert int(graph.parameters().xreplace(graph.dims)) == int(published.replace(",", "")), \
            c.id


def test_the_help_counts_the_shipped_case_files():
    """`validate --help` says how many runs each shipped case file holds; the counts are the
    files' own."""
    import argparse
    import re

    from opgraph.commands import validate as command

    parser = argparse.ArgumentParser()
    command.register(parser.add_subparsers())
    text = " ".join(parser._subparsers._group_actions[0].choices["validate"].description.split())
    said = {"dev": r"`dev`: the (\d+) published runs", "playbook-sweep": r"Playbook's (\d+)",
            "holdout": r"`holdout`: the (\d+) published runs"}
    for name, pattern in said.items():
        assert int(re.search(pattern, text)[1]) == len(load_cases(name)), name


def test_a_case_file_that_does_not_exist_names_the_shipped_ones(tmp_path):
    """A name that is neither a file nor a shipped case file (a family given as a file, where
    --select picks it) is one line naming what exists; a file that exists is read."""
    from opgraph.io.cases import NAMED, resolve

    with pytest.raises(OpgraphError) as e:
        resolve(str(tmp_path / "megatron-core"))
    assert "does not exist" in str(e.value) and "--select" in str(e.value)
    assert all(name in str(e.value) for name in NAMED)
    assert resolve("holdout") == NAMED["holdout"]
    mine = tmp_path / "mine.json"
    mine.write_text("{}")
    assert resolve(str(mine)) == mine
