"""Hostile and careless input (issue 25): each class is refused in one line and exit status 2
(130 for Ctrl-C), within the limits of `opgraph.limits`, never a traceback or a wrong profile."""

import pytest

# A 2-layer MLP language model, as a user writes it (tests/test_user_model.py's, in short).
MLP = '''
from opgraph import GraphBuilder
from opgraph.symbols import B, D, F, L, S, V


def build():
    g = GraphBuilder("tiny-mlp", {B: 4, S: 128, D: 256, F: 1024, V: 1000, L: 2})
    ids, targets = g.input("ids", (B, S)), g.input("targets", (B, S))
    table = g.weight("embed.weight", (V, D))
    x = g.embedding(ids, table)
    with g.repeat(L, "layers"):
        h = g.gelu(g.matmul(x, g.weight("up", (D, F)), name="up_proj"))
        x = g.add(x, g.matmul(h, g.weight("down", (F, D)), name="down_proj"), name="residual")
    g.output_head(x, table, targets)
    return g.build()
'''
# The test's MLP binds D: 256 and L: 2; each case rebinds one dimension as a user might.
DIMS = "{B: 4, S: 128, D: 256, F: 1024, V: 1000, L: 2}"


def _model(tmp_path, text: str, name: str = "hostile.py"):
    path = tmp_path / name
    path.write_text(text)
    return f"{path}:build"


def _one_line_error(code, out, err, status=2):
    assert code == status and out == "", err
    assert err.startswith("opgraph: ") and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("dims, says", [
    ("{B: 4, S: 128, D: -256, F: 1024, V: 1000, L: 2}", "dimension D = -256 is not positive"),
    ("{B: 4, S: 128, D: 0, F: 1024, V: 1000, L: 2}", "dimension D = 0 is not positive"),
    ("{B: 4, S: 128, D: 2.5, F: 1024, V: 1000, L: 2}", "dimension D = 2.5 is not a whole number"),
    ("{B: 4, S: 128, D: 10**30, F: 1024, V: 1000, L: 2}", "more than opgraph's bound of "
                                                          "1,073,741,824"),
    ("{B: 4, S: 128, D: 'abc', F: 1024, V: 1000, L: 2}", "dimension D = 'abc' is not a whole"),
    ("{B: 4, S: 128, D: float('nan'), F: 1024, V: 1000, L: 2}", "dimension D = nan is not"),
    ("{B: 4, S: 128, D: 256, F: 1024, V: 1000, L: -2}", "dimension L = -2 is not positive"),
    ("{B: 4, S: True, D: 256, F: 1024, V: 1000, L: 2}", "dimension S = True is not a whole"),
])
def test_a_user_models_dimensions_are_checked(cli, tmp_path, dims, says):
    code, out, err = cli("profile", "--model", _model(tmp_path, MLP.replace(DIMS, dims)))
    _one_line_error(code, out, err)
    assert says in err


@pytest.mark.parametrize("change, says", [
    ("graph.dims[D] = -256", "dimension D = -256 is not positive"),
    ("graph.dims[L] = 10**12", "dimension L = 1,000,000,000,000 is more than"),
    ("del graph.dims[F]", "tensor layers.up: F has no value in the graph's dimensions"),
    ("graph.seq_len = 0", "the graph's seq_len 0 is not positive"),
])
def test_dims_changed_after_build_are_checked_too(cli, tmp_path, change, says):
    text = MLP.replace("    return g.build()\n", f"    graph = g.build()\n    {change}\n"
                                                  "    return graph\n", 1)
    assert change in text
    code, out, err = cli("profile", "--model", _model(tmp_path, text))
    _one_line_error(code, out, err)
    assert says in err


def test_a_model_without_a_loss_is_refused(cli, tmp_path):
    text = MLP.replace("    g.output_head(x, table, targets)\n", "", 1)
    code, out, err = cli("profile", "--model", _model(tmp_path, text))
    _one_line_error(code, out, err)
    assert "no loss" in err


def test_a_pass_binding_a_bad_dimension_is_caught_by_the_pipeline():
    from opgraph.models import preset
    from opgraph.pipeline import compile_step
    from opgraph.symbols import D
    from opgraph.verify import VerifyError

    def corrupt(graph):
        out = graph.copy()
        out.dims[D] = -1
        return out

    with pytest.raises(VerifyError, match="dimension D = -1 is not positive"):
        compile_step(preset("gpt2"), extra_passes=[corrupt])


@pytest.mark.parametrize("text, says", [
    ("import sys\nsys.exit(0)\n", "importing"),
    ("raise SystemExit(3)\n", "SystemExit(3)"),
    ("import sys\ndef build():\n    sys.exit('bye')\n", "build() raised SystemExit('bye')"),
    ("def build():\n    raise MemoryError\n", "build() raised MemoryError"),
])
def test_a_model_file_cannot_exit_the_program(cli, tmp_path, text, says):
    spec = _model(tmp_path, text)
    code, out, err = cli("profile", "--model", spec)
    _one_line_error(code, out, err)
    assert spec.rpartition(":")[0] in err and says in err


def test_ctrl_c_in_a_model_stops_the_program_in_one_line(cli, tmp_path):
    spec = _model(tmp_path, "def build():\n    raise KeyboardInterrupt\n")
    code, out, err = cli("profile", "--model", spec)
    _one_line_error(code, out, err, status=130)  # 128 + SIGINT, as a shell reports it
