"""Sweeps: ranges, the grid, rows equal to `evaluate`, the files, and bad input."""

import csv
import json

import numpy as np
import pytest
from opgraph.models import preset

from opgraph import compile_step, evaluate, hardware
from opgraph.core.errors import OpgraphError
from opgraph.io.outputs.numfmt import csv_block, float_bytes, int_bytes, text_bytes
from opgraph.analysis.sweep import compile_sweep, make_grid, parse_range, run_grid

PARTS = [hardware.get("h100-sxm"), hardware.get("h100-pcie")]


@pytest.fixture(scope="module")
def step():
    return compile_step(preset("llama3-8b"))


@pytest.mark.parametrize("text, expected", [
    ("8192:65536:+8192", [8192 * k for k in range(1, 9)]),
    ("1:10:+4", [1, 5, 9]),
    ("1024:1048576:x2", [1024 * 2**k for k in range(11)]),
    ("3:100:x3", [3, 9, 27, 81]),
    ("8_192", [8192]),
    ("4096,8192", [4096, 8192]),
])
def test_ranges(text, expected):
    assert parse_range(text).tolist() == expected


@pytest.mark.parametrize("text, says", [
    ("10:5:+1", "below start"),
    ("1:10:+0", "must be positive"),
    ("1:10:-2", "must be positive"),
    ("1:10:x1", "above 1"),
    ("1:10:x1.5", "whole number above 1"),
    ("1:10", "not a range"),
    ("a:b:+1", "not a range"),
    ("0:10:+1", "start must be positive"),
    ("1:20000000:+1", "more than 10,000,000"),
    ("1:10:*2", "neither"),
])
def test_bad_ranges(text, says):
    with pytest.raises(OpgraphError, match=says):
        parse_range(text, "--tokens")


def _check_rows(step, rows, parts, extra=()):
    for i in range(len(rows["tokens"])):
        values = {"B": int(rows["batch"][i]), "S": int(rows["seq_len"][i])}
        values |= {name: int(rows[name][i]) for name in extra}
        p = evaluate(step, parts[int(rows["hardware"][i])], values)
        assert int(rows["tokens"][i]) == p.tokens
        pairs = [(rows["step_time_s"][i], p.step_time_s), (rows["mfu_ceiling"][i], p.mfu_ceiling),
                 (rows["hfu_ceiling"][i], p.hfu_ceiling), (rows["flops"][i], p.flops),
                 (rows["bytes"][i], p.bytes)]
        pairs += [(rows[f"{c.name}_time_share"][i], c.time_share) for c in p.categories]
        for got, expected in pairs:
            assert float(got) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("fused", [True, False])
def test_rows_equal_evaluate(fused):
    step = compile_step(preset("llama3-8b"), fused_attention=fused)
    sweep = compile_sweep(step, free=("B", "S", "L"))
    grid = make_grid({"seq_len": np.array([2048, 32768]), "batch": np.array([1, 64]),
                      "L": np.array([1, 126])}, PARTS, 8192)
    assert len(grid) == 16
    _check_rows(step, run_grid(sweep, grid), PARTS, extra=("L",))


def test_tokens_axis_holds_the_models_sequence_length(step):
    grid = make_grid({"tokens": parse_range("8192:81920:+8192")}, PARTS[:1], 8192)
    rows = run_grid(compile_sweep(step), grid)
    assert rows["seq_len"].tolist() == [8192] * 10
    assert rows["batch"].tolist() == list(range(1, 11))
    grid = make_grid({"tokens": np.array([65536]), "batch": np.array([2, 4])}, PARTS[:1], 8192)
    rows = run_grid(compile_sweep(step), grid)
    assert rows["seq_len"].tolist() == [32768, 16384]


def test_whole_sequences_only():
    with pytest.raises(OpgraphError, match="1,024, 2,048, 4,096 not a whole multiple of "
                                           "seq_len 8,192"):
        make_grid({"tokens": parse_range("1024:65536:x2")}, PARTS[:1], 8192)
    with pytest.raises(OpgraphError, match="at most two"):
        make_grid({"tokens": np.array([8192]), "seq_len": np.array([8192]),
                   "batch": np.array([1])}, PARTS[:1], 8192)
    with pytest.raises(OpgraphError, match="more than 10,000,000"):
        make_grid({"tokens": parse_range("8192:49152000000:+8192", "--tokens", 2**40)},
                  PARTS, 8192)


def test_cli_csv_rows_equal_evaluate(cli, tmp_path, step):
    out = tmp_path / "s.csv"
    code, text, _ = cli("sweep", "--tokens", "8192:32768:x2", "--seq-len", "4096,8192",
                        "--hardware", "h100-sxm,h100-pcie", "--out", str(out))
    assert code == 0 and "12 points" in text and f"wrote 12 rows to {out}" in text
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 12
    assert {"tokens", "seq_len", "batch", "hardware", "step_time_s", "mfu_ceiling",
            "optimizer_time_share"} <= set(rows[0])
    ids = [p.id for p in PARTS]
    cols = {k: [r[k] for r in rows] for k in rows[0]}
    cols["hardware"] = [ids.index(h) for h in cols["hardware"]]
    _check_rows(step, cols, PARTS)
    assert [p.name for p in tmp_path.iterdir()] == ["s.csv"]  # no temporary file left


def test_cli_json_and_long_tables(cli, tmp_path):
    out = tmp_path / "s.json"
    code, text, _ = cli("sweep", "--batch", "1:100:+1", "--out", str(out))
    assert code == 0
    j = json.loads(out.read_text())
    assert j["points"] == 100 and len(j["rows"]) == 100
    assert j["rows"][-1]["batch"] == 100 and j["rows"][-1]["tokens"] == 819200
    assert "80 rows not shown" in text
    assert len(text.splitlines()) == 2 + 20 + 1 + 1


@pytest.mark.parametrize("argv, says", [
    (["--tokens", "65536:8192:+8192"], "below start"),
    (["--tokens", "8192:65536:+0"], "must be positive"),
    (["--tokens", "8192:65536:-8192"], "must be positive"),
    (["--seq-len", "1:20000000:+1"], "more than 10,000,000"),
    (["--tokens", "8192:49152000000:+8192", "--hardware", "h100-sxm,h100-pcie"],
     "more than 10,000,000"),
    (["--dim", "Q=1:4:+1"], "unknown dimension 'Q'"),
    (["--dim", "L"], "write NAME=RANGE"),
    (["--width", "1:4:+1"], "unrecognized arguments"),
    (["--tokens", "1000:8192:+1000"], "not a whole multiple"),
    (["--hardware", "h100-sxm,tpu9"], "unknown hardware 'tpu9'"),
])
def test_cli_bad_input(cli, tmp_path, argv, says):
    out = tmp_path / "s.csv"
    code, text, err = cli("sweep", *argv, "--out", str(out))
    assert code == 2 and text == ""
    assert says in err and err.count("\n") == 1
    assert not list(tmp_path.iterdir())


def test_cli_bad_output(cli, tmp_path):
    code, _, err = cli("sweep", "--out", str(tmp_path / "s.parquet"))
    assert code == 2 and "write a .csv or a .json file" in err
    code, _, err = cli("sweep", "--out", str(tmp_path / "none" / "s.csv"))
    assert code == 2 and "does not exist" in err


def test_number_formatting():
    rng = np.random.default_rng(0)
    floats = np.concatenate([rng.random(2000) * 10.0 ** rng.integers(-250, 250, 2000),
                             [0.0, -0.0, 1.0, -2.5, 10.0, 9.999999999995, 1e-289, 1.5e289]])
    texts = [bytes(r[r != 0]).decode() for r in float_bytes(floats)]
    python = [format(x, ".11e") for x in floats.tolist()]
    for got, want, x in zip(texts, python, floats.tolist()):
        # the same, or one unit off in the twelfth digit
        assert got == want or (abs(float(got) - x) <= abs(x) * 1e-11 and len(got) == len(want))
    assert sum(got == want for got, want in zip(texts, python)) > 0.99 * len(texts)
    ints = np.array([0, 1, -1, 9, 10, -10, 8192, 2**63 - 1, -(2**63 - 1)])
    assert [bytes(r[r != 0]).decode() for r in int_bytes(ints)] == [str(i) for i in
                                                                    ints.tolist()]
    odd = [bytes(r[r != 0]).decode() for r in float_bytes(np.array([np.inf, np.nan, 1e300]))]
    assert odd == ["inf", "nan", format(1e300, ".11e")]
    block = csv_block([np.array([1, 2]), text_bytes(["a", "bcd"], np.array([1, 0])),
                       np.array([0.5, 2.0])])
    assert block == b"1,bcd,5.00000000000e-01\n2,a,2.00000000000e+00\n"
