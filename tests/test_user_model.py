"""`--model path/to/file.py:build`: a user's own model, for every command that takes a model."""

import json

import pytest
import sympy

from opgraph.core.symbols import B, D, F, L, S, V

# A 2-layer MLP language model, as a user writes it in their own file.
MLP = '''
from opgraph import GraphBuilder
from opgraph.core.symbols import B, D, F, L, S, V


def build():
    g = GraphBuilder("tiny-mlp", {B: 4, S: 128, D: 256, F: 1024, V: 1000, L: 2})
    ids = g.input("ids", (B, S))
    targets = g.input("targets", (B, S))
    table = g.weight("embed.weight", (V, D))
    x = g.embedding(ids, table)
    with g.repeat(L, "layers"):
        h = g.gelu(g.matmul(x, g.weight("up", (D, F)), name="up_proj"))
        x = g.add(x, g.matmul(h, g.weight("down", (F, D)), name="down_proj"), name="residual")
    g.output_head(x, table, targets)
    return g.build()


def not_a_graph():
    return 42


def broken():
    raise ValueError("width must be even")
'''
DIMS = {B: 4, S: 128, D: 256, F: 1024, V: 1000, L: 2}


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "tiny_mlp.py"
    path.write_text(MLP)
    return path


def test_profile_of_a_users_model(cli, model):
    code, out, err = cli("profile", "--model", f"{model}:build", "--json", "--ops")
    assert code == 0, err
    j = json.loads(out)
    assert j["model"] == "tiny-mlp"
    assert j["parameters"] == (V * D + L * 2 * D * F + D * V).subs(DIMS)
    assert (j["seq_len"], j["tokens"]) == (128, 128)  # its S is the default sequence length
    up = next(o for o in j["ops"] if o["name"] == "layers.up_proj")
    assert up["count"] == 2 and up["flops"] == int((2 * B * S * D * F * L).subs({**DIMS, B: 1}))


def test_the_function_name_defaults_to_build(cli, model):
    code, out, _ = cli("profile", "--model", str(model), "--json")
    assert code == 0 and json.loads(out)["model"] == "tiny-mlp"


def test_formula_solve_sweep_trace_and_diff_take_it(cli, model, tmp_path):
    spec = f"{model}:build"
    code, out, _ = cli("formula", "--model", spec, "--op", "layers.up_proj", "--json")
    assert code == 0
    assert sympy.sympify(json.loads(out)["expression"], locals={s.name: s for s in DIMS}) \
        == 2 * B * S * D * F * L
    code, out, _ = cli("solve", "--model", spec, "--category", "optimizer", "--max-share",
                       "0.5", "--json")
    assert code == 0 and json.loads(out)["seq_len"] == 128
    rows = tmp_path / "rows.json"
    code, _, _ = cli("sweep", "--model", spec, "--batch", "1,2", "--out", str(rows))
    assert code == 0 and [r["batch"] for r in json.loads(rows.read_text())["rows"]] == [1, 2]
    trace = tmp_path / "trace.json"
    code, _, _ = cli("profile", "--model", spec, "--trace", str(trace))
    assert code == 0 and "layers.up_proj" in trace.read_text()
    code, out, _ = cli("diff", "--model", spec, "--b-tokens", "256", "--json")
    assert code == 0
    j = json.loads(out)
    assert (j["a"]["model"], j["b"]["tokens"]) == ("tiny-mlp", 256)


@pytest.mark.parametrize("spec, says", [
    ("{dir}/missing.py:build", "no such file"),
    ("{model}:nothing", "has no function 'nothing'; it defines broken, build, not_a_graph"),
    ("{model}:not_a_graph", "not_a_graph() returned int, not a forward Graph"),
    ("{model}:broken", "broken() raised ValueError: width must be even"),
    ("{dir}/syntax.py:build", "importing"),
    ("{dir}/model.txt:build", "a user's model is a .py file"),
])
def test_bad_model_files_are_one_line(cli, model, tmp_path, spec, says):
    (tmp_path / "syntax.py").write_text("def build(:\n")
    (tmp_path / "model.txt").write_text(MLP)
    code, out, err = cli("profile", "--model", spec.format(dir=tmp_path, model=model))
    assert code == 2 and out == ""
    assert err.startswith("opgraph: error: --model ") and err.count("\n") == 1
    assert says in err


def test_a_weight_nothing_reads_is_one_line(cli, tmp_path):
    model = tmp_path / "unused.py"
    model.write_text(
        "from opgraph import GraphBuilder\n"
        "from opgraph.core.symbols import B, S, D, V\n"
        "def build():\n"
        "    g = GraphBuilder('unused', {B: 1, S: 16, D: 8, V: 32})\n"
        "    t, y = g.input('tokens', (B, S)), g.input('targets', (B, S))\n"
        "    table = g.weight('embed.weight', (V, D))\n"
        "    g.weight('unused', (D, D))\n"
        "    g.output_head(g.embedding(t, table), table, y, tied=True)\n"
        "    return g.build()\n")
    code, _out, err = cli("profile", "--model", f"{model}:build")
    assert code == 2 and err.count("\n") == 1
    assert "weight unused of unused is read by no op" in err


def test_a_model_without_attention_does_not_say_unfused_attention(cli, tmp_path):
    model = tmp_path / "mlp.py"
    model.write_text(MLP)
    code, out, _err = cli("profile", "--model", f"{model}:build")
    assert code == 0 and ", no attention, " in out.splitlines()[1]
