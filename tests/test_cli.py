"""`opgraph profile` as a user runs it."""

import json
import subprocess
import sys

import pytest

CATEGORY_IDS = {"matmul", "attention", "norm", "elementwise", "output_head", "embedding",
                "optimizer"}


def test_json_defaults_match_the_plate(cli):
    code, out, _ = cli("profile", "--json")
    assert code == 0
    j = json.loads(out)
    assert j["parameters"] == 8_030_261_248 and isinstance(j["parameters"], int)
    assert (j["tokens"], j["seq_len"], j["fused_attention"]) == (8192, 8192, True)
    assert j["step_time_s"] == pytest.approx(0.556, rel=0.01)
    assert j["mfu_ceiling"] == pytest.approx(0.67, abs=0.01)
    cats = {c["name"]: c for c in j["categories"]}
    assert set(cats) == CATEGORY_IDS
    for c in cats.values():
        assert set(c) >= {"name", "time_s", "time_share", "flops", "flop_share", "bytes"}
    assert cats["matmul"]["time_share"] == pytest.approx(0.62, abs=0.01)
    assert cats["optimizer"]["time_share"] == pytest.approx(0.15, abs=0.005)
    assert 0.00020 <= cats["optimizer"]["flop_share"] <= 0.00024
    assert "ops" not in j


def test_flags_reach_the_pipeline(cli):
    _, out, _ = cli("profile", "--json", "--no-fused-attention")
    j = json.loads(out)
    assert j["fused_attention"] is False
    attention = next(c for c in j["categories"] if c["name"] == "attention")
    assert attention["time_share"] == pytest.approx(0.34, abs=0.01)
    assert j["mfu_ceiling"] == pytest.approx(0.50, abs=0.01)
    _, out, _ = cli("profile", "--json", "--tokens", "65536")
    j = json.loads(out)
    assert (j["tokens"], j["batch"]) == (65536, 8)
    optimizer = next(c for c in j["categories"] if c["name"] == "optimizer")
    assert optimizer["time_share"] == pytest.approx(0.02, abs=0.005)


def test_ops_listing(cli):
    _, out, _ = cli("profile", "--json", "--ops")
    j = json.loads(out)
    ops = j["ops"]
    for row in ops:
        assert set(row) >= {"name", "kind", "category", "phase", "count", "flops", "bytes",
                            "time_s", "bound"}
    assert {r["phase"] for r in ops} == {"forward", "backward", "optimizer"}
    head = [r for r in ops if r["category"] == "output_head" and r["kind"] == "matmul"]
    assert head and all(r["count"] == 1 for r in head)
    q = next(r for r in ops if r["name"] == "layers.q_proj")
    assert q["count"] == 32  # once per layer, totals for the step
    assert q["flops"] == 2 * 8192 * 4096 * 4096 * 32
    assert sum(r["time_s"] for r in ops) == pytest.approx(j["step_time_s"], rel=1e-12)


def test_hardware_overrides(cli):
    _, out, _ = cli("profile", "--json", "--peak-tflops", "500", "--bandwidth-tbs", "2")
    j = json.loads(out)
    assert j["hardware"]["peak_flops"] == 500e12
    assert j["hardware"]["bandwidth_bytes_per_s"] == 2e12


def test_text_table(cli):
    code, out, _ = cli("profile")
    assert code == 0
    for cat in CATEGORY_IDS:
        assert f"\n{cat} " in out
    assert "step time" in out and "MFU ceiling" in out


@pytest.mark.parametrize("argv, needle", [
    (["--model", "llama9"], "unknown model"),
    (["--hardware", "tpu-v9"], "unknown hardware"),
    (["--tokens", "10000"], "not a multiple"),
    (["--tokens", "abc"], "not a whole number"),
    (["--tokens", "0"], "not positive"),
    (["--tokens", "-8192"], "--tokens"),
    (["--seq-len", "1.5"], "not a whole number"),
    (["--peak-tflops", "-3"], "not a positive number"),
    (["--bandwidth-tbs", "nan"], "not a positive number"),
    (["--peak-tflops", "fast"], "not a number"),
    (["--hardware", "missing.toml"], "does not exist"),
    (["--frobnicate"], "unrecognized"),
])
def test_bad_input_is_one_line_and_exit_2(cli, argv, needle):
    code, out, err = cli("profile", *argv)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("opgraph: error: ")
    assert needle in err


def test_a_mistyped_id_is_answered_with_the_near_ones(cli):
    """An id that is not in a catalog names the ids it begins (whatever the case), else the
    nearest by spelling, nearest first; gibberish gets the list alone. Still one line, exit 2."""
    from opgraph.core.errors import did_you_mean

    ids = ["h100-sxm", "h100-sxm-96gb", "b200", "llama3-8b", "llama3-70b"]
    assert did_you_mean("H100", ids) == " (did you mean h100-sxm or h100-sxm-96gb?)"
    assert did_you_mean("llama-3-8b", ids).startswith(" (did you mean llama3-8b or")
    assert did_you_mean("zzz", ids) == did_you_mean("", ids) == ""
    for argv, hint in ((["--hardware", "H100"], "did you mean h100-sxm or "),
                       (["--model", "LLAMA3-70B"], "did you mean llama3-70b?"),
                       (["--cluster", "dgx-h10"], "did you mean dgx-h100?")):
        code, out, err = cli("profile", *argv)
        assert code == 2 and out == "" and err.count("\n") == 1 and hint in err, err


def test_malformed_hardware_file(cli, tmp_path):
    path = tmp_path / "gpu.toml"
    path.write_text("[gpu]\nbf16_tflops = 'fast'\nbandwidth_tbs = 2\n")
    code, _, err = cli("profile", "--hardware", str(path))
    assert code == 2 and "bf16_tflops" in err and err.count("\n") == 1
    path.write_text("[gpu\n")
    code, _, err = cli("profile", "--hardware", str(path))
    assert code == 2 and "not valid TOML" in err and err.count("\n") == 1


def test_a_users_own_hardware_file(cli, tmp_path):
    path = tmp_path / "gpu.toml"
    path.write_text('[my-gpu]\nname = "Mine"\nbf16_tflops = 500\nbandwidth_tbs = 2.5\n')
    code, out, _ = cli("profile", "--json", "--hardware", str(path))
    assert code == 0
    assert json.loads(out)["hardware"]["peak_flops"] == 500e12


def test_the_installed_command_and_python_m(tmp_path):
    for cmd in (["opgraph", "profile", "--json"], [sys.executable, "-m", "opgraph", "--json"]):
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              cwd=tmp_path, check=True)
        # stdout and stderr together still parse: warnings are inside the object
        assert json.loads(done.stdout)["parameters"] == 8_030_261_248
    bad = subprocess.run([sys.executable, "-m", "opgraph", "profile", "--tokens", "x"],
                         capture_output=True, text=True, cwd=tmp_path, check=False)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.count("\n") == 1


# --- profile --case: a run of a case file, profiled ----------------------------------------------

CASE = "holdout:torchtitan_t4_70b_2d_asynctp_256gpu"


def test_profile_of_a_case_is_what_validate_predicts(cli):
    """`profile --case FILE:ID` profiles the case's job (its model, part, cluster, layout and
    options), the figures `validate` gives it; flags beside it change the job: the same
    run at TP 4 is another layout, another step."""
    from opgraph.analysis.validate import predict
    from opgraph.cost.costmodel import cost_model
    from opgraph.io.cases import load_cases

    (case,) = [c for c in load_cases("holdout") if c.id == CASE.split(":")[1]]
    code, out, _ = cli("profile", "--case", CASE, "--json")
    got = json.loads(out)
    expected = predict(case, cost_model("calibrated")).predicted_step_time_s
    assert code == 0 and got["step_time_s"] == pytest.approx(expected, rel=1e-12)
    assert (got["parallel"]["tp"], got["hardware"]["id"]) == (8, case.part_id)
    assert (got["recompute"], got["precision"]) == (case.recompute, case.precision)
    code, out, _ = cli("profile", "--case", CASE, "--tp", "4", "--dp", "64",
                       "--micro-batch", "8", "--json")
    other = json.loads(out)
    assert code == 0 and other["parallel"]["tp"] == 4
    assert other["step_time_s"] != got["step_time_s"]


@pytest.mark.parametrize("argv, needle", [
    (["--case", "holdout"], "give FILE:ID"),
    (["--case", "holdout:no_such_run"], "has no case 'no_such_run'"),
    (["--case", "missing.json:x"], "does not exist"),
    (["--case", CASE, "--megatron-args", "--tensor-model-parallel-size 2"], "not both"),
])
def test_a_bad_case_is_one_line_and_exit_2(cli, argv, needle):
    code, out, err = cli("profile", *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("opgraph: error: ") and needle in err
