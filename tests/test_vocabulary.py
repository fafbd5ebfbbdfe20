"""The CLI speaks one vocabulary: every flag of every command says what it does, a flag means
one thing, units are said in headers, and options that do nothing say so."""

import argparse

import pytest

from opgraph.cli import build_parser


def _commands():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


def test_every_flag_of_every_command_has_help():
    missing = [f"{name} {action.option_strings or action.dest}"
               for name, command in _commands().items() for action in command._actions
               if not isinstance(action, argparse._HelpAction) and not action.help]
    assert missing == []


def test_profiles_timeline_gpu_is_trace_rank_and_the_old_name_warns_once(cli, tmp_path):
    argv = ("profile", "--model", "llama3.2-1b", "--seq-len", "2048", "--gpus", "4", "--pp",
            "2", "--global-batch", "8", "--json")
    code, new, err = cli(*argv, "--trace-rank", "3")
    assert code == 0 and err == ""
    code, old, err = cli(*argv, "--rank", "1", "--rank", "3")
    assert code == 0 and old == new
    assert err.count("warning") == 1 and "--trace-rank" in err
    code, _, err = cli(*argv, "--trace-rank", "4")
    assert code == 2 and "--trace-rank 4 is not a GPU" in err
    shown = _commands()["profile"].format_help()
    assert "--trace-rank" in shown and "--rank " not in shown  # the old name is hidden


def test_an_unknown_flag_points_to_the_commands_own_help(cli):
    code, _, err = cli("plan", "--gpus", "8", "--global-batch", "8", "--frobnicate")
    assert code == 2 and "opgraph plan --help" in err
    code, _, err = cli("validate", "--selct", "x")
    assert code == 2 and "opgraph validate --help" in err and "did you mean --select?" in err
    code, _, err = cli("nope")
    assert code == 2 and "`opgraph --help`" in err


PIPELINE = ("profile", "--model", "llama3.2-1b", "--seq-len", "2048")


def test_zero_without_ranks_to_shard_over_warns(cli):
    code, _, err = cli(*PIPELINE, "--gpus", "4", "--tp", "4", "--zero", "3")
    assert code == 0 and err.count("\n") == 1
    assert err.startswith("opgraph: warning: --zero 3 does nothing") and "dp x cp = 1" in err
    # one data-parallel rank, but cp = 2 ranks hold the same weights: ZeRO shards over them
    code, _, err = cli(*PIPELINE, "--gpus", "2", "--cp", "2", "--zero", "3")
    assert code == 0 and err == ""


def test_a_pipeline_with_fewer_micro_batches_than_stages_warns(cli):
    import json

    code, out, err = cli(*PIPELINE, "--gpus", "4", "--pp", "4", "--global-batch", "2", "--json")
    assert code == 0 and err == ""  # with --json, the warning is in the object
    (warning,) = json.loads(out)["warnings"]
    # 1F1B's bubble is (p - 1) / m of the busy time (Narayanan et al. 2021): p = 4, m = 2
    assert "2 micro-batches per step through 4 pipeline stages" in warning
    assert f"{3 / (2 + 3):.0%} of the step" in warning
    code, _, err = cli(*PIPELINE, "--gpus", "4", "--pp", "4", "--global-batch", "4")
    assert code == 0 and err == ""  # as many micro-batches as stages: no word


def test_validate_prints_gb_like_every_other_command(cli):
    from opgraph.io.cases import load_cases

    case = next(c for c in load_cases() if c.measured_peak_memory_bytes is not None)
    code, out, _ = cli("validate", "--select", case.id)
    assert code == 0 and "memory GB (measured)" in out and "GiB" not in out
    assert f"({case.measured_peak_memory_bytes / 1e9:.1f})" in out  # GB = 1e9 bytes


def test_the_many_gpu_plot_names_the_cost_model_it_used(cli, tmp_path):
    pytest.importorskip("matplotlib")
    figure = tmp_path / "job.svg"
    code, _, err = cli(*PIPELINE, "--gpus", "4", "--tp", "2", "--global-batch", "4", "--cost",
                       "calibrated", "--plot", str(figure))
    assert code == 0, err
    text = figure.read_text()
    assert "calibrated, scheduled over 4 GPUs" in text and "roofline" not in text


def test_plan_says_when_its_best_layout_has_a_zero_stage_that_does_nothing(cli):
    code, out, err = cli("plan", "--model", "llama3.2-1b", "--seq-len", "2048", "--gpus", "8",
                         "--global-batch", "8", "--tp", "8", "--zero", "3", "--top", "1",
                         "--recompute", "none", "--precision", "bf16")
    assert code == 0 and "dp1" in out and "zero3" in out
    assert err.count("\n") == 1 and err.startswith("opgraph: warning: #1: --zero 3 does nothing")
