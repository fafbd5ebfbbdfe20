"""What a user or a contributor adds reaches `profile` and `plan` with no edit outside its own
file: a built-in pass (a new module of `opgraph.passes`), a user's pass over the forward graph
(`--pass FILE.py:FUNCTION`). Expected figures are formulas of the model's sizes."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

import opgraph.passes
from opgraph import pipeline
from opgraph.hardware import get as part

# A pass as a contributor would add it: one file in passes/, declaring its place and contract.
# Gradient clipping to a global norm scales every gradient once after the backward: it reads
# and writes each (FP32) gradient, in the optimizer's phase.
CLIP = textwrap.dedent('''
    """clip_gradients: every gradient scaled to a global norm before the update."""
    from opgraph.contracts import OPTIMIZER, contract, step_pass
    from opgraph.ir import Graph, Op, Phase, Tensor
    from opgraph.passes.derive_backward import gradient_of


    @step_pass(at=OPTIMIZER + 5)
    @contract(requires=("optimizer",), forbids=("replicated",))
    def clip_gradients(graph: Graph) -> Graph:
        out = graph.copy()
        for w in graph.weights():
            g = gradient_of(graph, w.name)
            clipped = out.add_tensor(Tensor(f"{g.name}.clipped", g.shape, g.dtype, g.role,
                                            g.count, region=g.region)).name
            out.add_op(Op(f"clip.{w.name}", "scale", "optimizer", (g.name,), (clipped,),
                          count=g.count, phase=Phase.OPTIMIZER, params={"factor": 1},
                          region=g.region))
        return out
''')

MODEL = "llama3.2-1b"
# Llama 3.2 1B: D 2,048, H_kv d_h 512, F 8,192, 16 layers of 2 D^2 + 2 D (H_kv d_h) + 3 D F
# + 2 D parameters, a tied embedding of V 128,256 x D, a final norm of D
D, KV, F, V = 2048, 512, 8192, 128256
PER_LAYER = 2 * D * D + 2 * D * KV + 3 * D * F + 2 * D
PARAMETERS = V * D + 16 * PER_LAYER + D


@pytest.fixture
def added_pass(tmp_path, monkeypatch):
    """`clip_gradients` as a new module of `opgraph.passes` (its folder joined to the
    package's path, as a new file in passes/ would be), for one test."""
    (tmp_path / "clip_gradients.py").write_text(CLIP)
    monkeypatch.setattr(opgraph.passes, "__path__", [*opgraph.passes.__path__, str(tmp_path)])
    pipeline.builtin_passes.cache_clear()
    yield
    pipeline.builtin_passes.cache_clear()
    sys.modules.pop("opgraph.passes.clip_gradients", None)


def _profile(cli, *args) -> dict:
    code, out, err = cli("profile", "--model", MODEL, "--json", *args)
    assert code == 0, err
    return json.loads(out)


def _plan(cli, *args) -> dict:
    code, out, err = cli("plan", "--model", MODEL, "--gpus", "8", "--global-batch", "8",
                         "--top", "1", "--json", *args)
    assert code == 0, err
    return json.loads(out)["layouts"][0]


def test_a_builtin_pass_added_as_a_file_runs_in_profile_and_plan(cli, added_pass):
    """The new file alone puts the pass in the step: one GPU's roofline step grows by reading
    and writing every FP32 gradient once, 2 x 4 bytes a parameter over the HBM bandwidth;
    `plan` runs it too, on every layout it schedules."""
    assert "clip_gradients" in [f.__name__ for f in pipeline.builtin_passes()]
    with_pass = _profile(cli)
    plan_with = _plan(cli)
    pipeline.builtin_passes.cache_clear()
    sys.modules.pop("opgraph.passes.clip_gradients", None)
    opgraph.passes.__path__ = opgraph.passes.__path__[:-1]
    without = _profile(cli)
    plan_without = _plan(cli)
    added = 2 * 4 * PARAMETERS / part("h100-sxm").bandwidth
    assert with_pass["step_time_s"] - without["step_time_s"] == pytest.approx(added, rel=1e-6)
    assert plan_with["step_time_s"] > plan_without["step_time_s"]


def test_a_user_forward_pass_runs_in_profile_and_plan(cli, tmp_path):
    """`--pass FILE.py:FUNCTION` runs the user's pass over the forward graph before the
    built-in ones, in `profile` and `plan` alike: a pass that keeps the first half of the
    layers leaves the parameters less 8 layers'."""
    (tmp_path / "prune.py").write_text(textwrap.dedent('''
        from opgraph.symbols import L

        def half_the_layers(graph):
            out = graph.copy()
            out.dims = {**graph.dims, L: graph.dims[L] // 2}
            return out
    '''))
    spec = f"{tmp_path / 'prune.py'}:half_the_layers"
    code, out, err = cli("profile", "--model", MODEL, "--pass", spec)
    assert code == 0, err
    assert f"{PARAMETERS:,} parameters" in cli("profile", "--model", MODEL)[1]
    assert f"{PARAMETERS - 8 * PER_LAYER:,} parameters" in out
    assert _plan(cli, "--pass", spec)["step_time_s"] < _plan(cli)["step_time_s"]


@pytest.mark.parametrize("spec, message", [
    ("{dir}/prune.py", "give a .py file and the pass in it"),
    ("{dir}/missing.py:f", "no such file"),
    ("{dir}/prune.py:nothing", "has no function 'nothing'; it defines half_the_layers"),
    ("{dir}/prune.py:returns_none", "pass returns_none returned NoneType, not a Graph"),
    ("{dir}/prune.py:raises", "raises() raised ValueError: no"),
])
def test_a_broken_user_pass_is_one_line(cli, tmp_path, spec, message):
    (tmp_path / "prune.py").write_text(textwrap.dedent('''
        def half_the_layers(graph):
            return graph

        def returns_none(graph):
            return None

        def raises(graph):
            raise ValueError("no")
    '''))
    for command in (("profile",), ("plan", "--gpus", "8", "--global-batch", "8")):
        code, out, err = cli(*command, "--model", MODEL, "--pass",
                             spec.format(dir=tmp_path))
        assert code == 2 and out == ""
        assert message in err and len(err.strip().splitlines()) == 1, err
