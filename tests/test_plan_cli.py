"""`opgraph plan` as a newcomer runs it: what cannot work fails before the search, in one
line."""

import time

import pytest

from opgraph.parallel import search


def _no_search(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the search ran")
    monkeypatch.setattr(search.Searcher, "search", refuse)


def test_a_hopeless_plan_fails_at_once_with_the_reason(cli, monkeypatch):
    """Llama 3.1 405B on 8 H100s: BF16 weights (2 bytes), FP32 gradients (4) and AdamW's FP32
    master weights and two moments (12) are 18 bytes a parameter, 913 GB per GPU even sharded
    over all 8, against 80 GB (H100 SXM datasheet)."""
    _no_search(monkeypatch)
    code, out, _ = cli("profile", "--model", "llama3.1-405b", "--json")
    import json

    parameters = json.loads(out)["parameters"]
    started = time.perf_counter()
    code, out, err = cli("plan", "--model", "llama3.1-405b", "--gpus", "8", "--global-batch", "8")
    assert time.perf_counter() - started < 3
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    per_gpu = 18 * parameters / 8 / 1e9
    assert f"{per_gpu:,.1f} GB per GPU" in err and "weights, gradients and optimizer" in err
    assert f"at least {-(-18 * parameters // 80_000_000_000):,}" in err


def test_the_floor_is_below_every_layout_found(cli):
    """The floor (resident parts over all GPUs) is below what each layout a search returns
    needs: it is a floor, not an estimate."""
    from opgraph import hardware
    from opgraph.commands.plan import _resident_bytes
    from opgraph.models import preset

    forward = preset("llama3.2-1b")
    space = search.Space(gpus=8, batch=16, max_micro_batch=2, precision=("bf16",))
    found = search.Searcher(forward, hardware.get("h100-sxm"), seq_len=2048).search(space, 20)
    floor = _resident_bytes(forward, 2048, space) / 8
    assert found.best and all(r.result.memory.total >= floor for r in found.best)
    assert min(r.result.memory.total for r in found.best) < 4 * floor  # and not far below


def test_a_scaling_curve_skips_the_hopeless_sizes(cli, monkeypatch):
    _no_search(monkeypatch)
    code, _, err = cli("plan", "--model", "llama3.1-405b", "--gpus", "8:16:x2",
                       "--global-batch", "16")
    assert code == 2 and "at any of 8:16:x2 GPUs" in err


@pytest.mark.parametrize("argv, words", [
    (("--model", "bert-base", "--emit", "megatron"), "bert-base is not one"),
    (("--model", "llama3.2-1b", "--emit", "torchtitan"), "llama3.2-1b is not one"),
    (("--model", "gpt2", "--gpus", "8:16:x2", "--rank"), "one --gpus"),
])
def test_options_that_cannot_work_fail_before_the_search(cli, monkeypatch, argv, words):
    _no_search(monkeypatch)
    code, out, err = cli("plan", "--gpus", "8", "--global-batch", "8", *argv)
    assert code == 2 and out == "" and words in err


# --- --emit round trips ------------------------------------------------------------------------
# One small space per preset the emitters write (the degrees mostly fixed, so each search takes
# seconds): the layout --emit writes, read back by `profile --torchtitan` / `--megatron-args`,
# gives the plan's figures. The 70B case is the one a newcomer hit: tp4 cp8 pp8 dp1, where the
# sharding group is cp = 8 although dp is 1.
EMITTED = [
    ("torchtitan", "llama3-8b", "16", ("--tp", "2", "--pp", "2")),
    ("torchtitan", "llama3-70b", "256", ("--tp", "4", "--cp", "8", "--pp", "8",
                                         "--seq-len", "32768")),
    # (torchtitan keeps FSDP's weights gathered over a pipeline's micro-batches: at pp 2 the
    # 405B fits no GPU, and 126 layers split evenly over no more stages)
    ("torchtitan", "llama3.1-405b", "512", ("--tp", "8", "--pp", "1", "--cp", "1", "--zero", "3")),
    ("torchtitan", "deepseek-v2-lite", "16", ("--tp", "1", "--pp", "1", "--cp", "1", "--ep", "8")),
    ("megatron", "llama3-8b", "16", ("--tp", "2", "--cp", "2")),
    ("megatron", "llama3-70b", "256", ("--tp", "4", "--cp", "8", "--pp", "8",
                                       "--seq-len", "32768")),
    ("megatron", "llama3.1-405b", "512", ("--tp", "8", "--pp", "16", "--cp", "1")),
    # Llama 3's interleaved stages, one layer short at each end: --pipeline-model-parallel-layout
    ("megatron", "llama3.1-405b", "512", ("--tp", "8", "--pp", "16", "--cp", "1",
                                          "--virtual-stages", "8")),
    ("megatron", "llama3.2-1b", "8", ("--tp", "1", "--pp", "2")),
    ("megatron", "mixtral-8x7b", "16", ("--tp", "2", "--pp", "1", "--cp", "1")),
    ("megatron", "qwen2-7b", "16", ("--tp", "2", "--pp", "2", "--cp", "1")),
    ("megatron", "gpt2", "4", ("--tp", "1", "--pp", "1")),
    ("megatron", "gpt3-175b", "256", ("--tp", "1", "--pp", "16", "--cp", "1")),  # 50,257 rows: tp 1
    # latent attention, a dense first layer and 64 experts: one GEMM per expert under Megatron
    ("megatron", "deepseek-v2-lite", "16", ("--tp", "1", "--pp", "1", "--cp", "1", "--ep", "8")),
    # soft-capping and sandwich norms, which Megatron-LM's flags lack: Megatron-Bridge's recipe
    ("megatron", "gemma2-2b", "8", ("--pp", "1")),
]


def test_megatron_writes_the_llama_3_papers_interleaved_split(cli, monkeypatch):
    """126 layers on 16 stages of 8 chunks split only with the end stages a layer short (the
    first chunk the embedding alone): Megatron-LM takes that as a layout string, so the plan's
    first choice is the one written."""
    code, text, err = cli("plan", "--model", "llama3.1-405b", "--gpus", "512",
                          "--global-batch", "1024", "--max-micro-batch", "1", "--recompute",
                          "full", "--precision", "bf16", "--tp", "8", "--pp", "16", "--cp", "1",
                          "--virtual-stages", "8", "--top", "1", "--emit", "megatron")
    assert code == 0, err
    assert "wrote layout #1 for megatron: tp8 cp1 pp16(7/.../7)" in err
    assert "--pipeline-model-parallel-layout 'E|t|t|" in text


def test_every_preset_an_emitter_writes_has_a_round_trip():
    from opgraph.io.launch import BRIDGE_PRESETS, PRESET_CONFIGS, TORCHTITAN_MODELS

    tried = {(framework, model) for framework, model, _, _ in EMITTED}
    assert tried == ({("megatron", m) for m in (*PRESET_CONFIGS, *BRIDGE_PRESETS)}
                     | {("torchtitan", m) for m in TORCHTITAN_MODELS.values()})


@pytest.mark.parametrize("framework, model, gpus, constraints", EMITTED,
                         ids=[f"{f}-{m}" for f, m, _, _ in EMITTED])
def test_the_emitted_layout_reads_back_to_the_plans_figures(cli, monkeypatch, tmp_path,
                                                            framework, model, gpus, constraints):
    import json

    from opgraph.commands import plan

    written = []  # the layouts --emit turned into configs, the last one the one it wrote
    launch_of = plan._launch
    monkeypatch.setattr(plan, "_launch", lambda ranked, *a: (written.append(ranked),
                                                             launch_of(ranked, *a))[1])
    code, text, err = cli("plan", "--model", model, "--gpus", gpus, "--global-batch",
                          str(2 * int(gpus)), "--max-micro-batch", "1", "--recompute", "full",
                          "--precision", "bf16", "--top", "3", *constraints, "--emit", framework)
    assert code == 0, err
    ranked = written[-1]
    assert f"wrote layout #{len(written)} for {framework}: " in err  # says which it wrote
    assert f"{ranked.result.memory.total / 1e9:.1f} GB per GPU" in err
    path = tmp_path / ("job.toml" if framework == "torchtitan" else "args.txt")
    path.write_text(text)
    source = ("--torchtitan", str(path)) if framework == "torchtitan" else (
        "--megatron-args", f"@{path}")  # its launcher line says the GPUs
    code, out, err = cli("profile", *source, "--json")  # no flags: one default cost model
    assert code == 0, err
    back = json.loads(out)
    assert back["cost"] == "calibrated"
    layout = ranked.layout
    assert {k: back["parallel"][k] for k in ("tp", "cp", "pp", "dp", "ep", "zero")} == {
        "tp": layout.tp, "cp": layout.cp, "pp": layout.pp, "dp": layout.dp_degree,
        "ep": layout.ep, "zero": layout.zero}
    assert back["step_time_s"] == pytest.approx(ranked.step_time_s, rel=1e-9)
    assert back["memory"]["total"] == pytest.approx(ranked.result.memory.total, rel=1e-9)


# --- plan --case: a published run's job, planned ---------------------------------------------

def test_plan_of_a_case_compares_the_runs_own_layout(cli):
    """`plan --case FILE:ID` plans the run's job (its model, part, cluster, sequence, GPUs,
    batch, framework and precision) and sets the run's own layout beside the first choices:
    that row is the step `validate` predicts for the run, and the first choice is no slower.
    Constrained to the run's TP and pipeline degrees so that the search takes seconds."""
    import json

    from opgraph.analysis.validate import predict
    from opgraph.cost.costmodel import cost_model
    from opgraph.io.cases import load_cases

    given = "holdout:torchtitan_t3_fsdp_128gpu"
    (case,) = [c for c in load_cases("holdout") if c.id == given.split(":")[1]]
    code, out, _ = cli("plan", "--case", given, "--tp", "1", "--pp", "1", "--cp", "1",
                       "--top", "1", "--json", "--no-cache")
    got = json.loads(out)
    assert code == 0 and got["gpus"] == case.gpus and got["seq_len"] == case.seq_len
    assert got["hardware"] == case.part_id
    row = next(r for r in got["compare"] if r["label"] == "case")
    assert row["layout"].startswith("tp1 cp1 pp1 dp128")
    assert row["step_time_s"] == pytest.approx(
        predict(case, cost_model("calibrated")).predicted_step_time_s, rel=1e-9)
    assert got["layouts"][0]["step_time_s"] <= row["step_time_s"]


@pytest.mark.parametrize("argv, words", [
    (("--model", "llama3-8b", "--tokens", "8192"), "give --gpus"),
    (("--model", "llama3-8b", "--gpus", "8"), "give --global-batch or --tokens"),
    (("--case", "holdout:torchtitan_t3_fsdp_128gpu", "--gpus", "64:128:x2"), "one --gpus"),
    (("--case", "holdout:nope"), "has no case 'nope'"),
])
def test_a_plan_without_its_job_fails_before_the_search(cli, monkeypatch, argv, words):
    _no_search(monkeypatch)
    code, out, err = cli("plan", *argv)
    assert code == 2 and out == "" and words in err and err.count("\n") == 1
