"""What a user or a contributor adds reaches `profile` and `plan` with no edit outside its own
file: a built-in pass (a new module of `opgraph.passes`), a user's pass over the forward graph
(`--pass FILE.py:FUNCTION`). Expected figures are formulas of the model's sizes."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

import opgraph.passes
from opgraph.core import pipeline
from opgraph.cost.hardware import get as part

# A pass as a contributor would add it: one file in passes/, declaring its place and contract.
# Gradient clipping to a global norm scales every gradient once after the backward: it reads
# and writes each (FP32) gradient, in the optimizer's phase.
CLIP = textwrap.dedent('''
    """clip_gradients: every gradient scaled to a global norm before the update."""
    from opgraph.core.contracts import OPTIMIZER, contract, step_pass
    from opgraph.core.ir import Graph, Op, Phase, Tensor
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
        from opgraph.core.symbols import L

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


# A kind as a user defines it: BitNet's linear layer (a matmul by a ternary weight), here with
# a matmul's shape, FLOPs and GEMM grid; `shards` says how tensor parallelism splits it.
BITLINEAR = textwrap.dedent('''
    import attrs

    from opgraph.core import rules
    from opgraph.core.kinds import define_kind
    from opgraph.models import preset

    define_kind("bitlinear", shape=rules.SHAPE_RULES["matmul"],
                flops=rules.FLOP_RULES["matmul"], grid=rules.GEMM_GRIDS["matmul"],
                category="matmul", shards=SHARDS, replace=True)


    def build():
        """Llama 3.2 1B with its MLP's projections as bitlinear."""
        g = preset("llama3.2-1b")
        out = g.copy()
        for op in g.ops():
            if op.name.endswith(("gate_proj", "up_proj", "down_proj")):
                out.replace_op(attrs.evolve(op, kind="bitlinear"))
        return out
''')


@pytest.fixture
def bitlinear(tmp_path):
    """Write the model file with its kind's roles; the kind is taken out after the test."""
    from opgraph.core.kinds import remove_kind

    def write(shards) -> str:
        path = tmp_path / f"bitnet_{len(shards)}.py"
        path.write_text(BITLINEAR.replace("SHARDS", repr(shards)))
        return f"{path}:build"
    yield write
    remove_kind("bitlinear")


def _tp_collectives(report: dict) -> list:
    return sorted((c["collective"], c["bytes"], c["count"]) for c in report["communication"]
                  if c["group"] == "tp")


def test_a_kind_with_a_sharding_role_is_split_in_profile_and_plan(cli, bitlinear):
    """Declared column-parallel and contracting, the user's kind is split as Megatron splits a
    matmul: under --tp 2 its MLP has the same f and g collectives as the built-in matmul's, in
    `profile` and in `plan`'s search path (which agrees with `profile` to 1e-9)."""
    from opgraph.cost.costmodel import cost_model
    from opgraph.parallel.distributed import profile_parallel
    from opgraph.parallel.parallel import Parallel
    from opgraph.parallel.search import Candidate, Searcher

    model = bitlinear(("column", "contracting"))
    layout = ("--tp", "2", "--micro-batch", "1", "--global-batch", "2", "--seq-len", "1024")
    code, out, err = cli("profile", "--model", model, "--json", *layout)
    assert code == 0, err
    mine, builtin = json.loads(out), _profile(cli, *layout)
    assert _tp_collectives(mine) == _tp_collectives(builtin) != []
    assert {c["name"] for c in mine["communication"]} >= {  # f before the MLP, g after it
        "layers.mlp_norm.identity.tp.grad", "layers.down_proj.all_reduce.tp"}

    forward = sys.modules[_module_of(model)].build()
    h100, calibrated = part("h100-sxm"), cost_model("calibrated")
    parallel = Parallel(tp=2, micro_batch=1, global_batch=2)
    planned = Searcher(forward, h100, seq_len=1024, cost=calibrated).one(
        Candidate(parallel, "none", "bf16")).result
    profiled = profile_parallel(forward, h100, parallel, values={"S": 1024}, cost=calibrated)
    assert planned.step_time_s == pytest.approx(profiled.parallel.step_time_s, rel=1e-9)
    assert planned.step_time_s == pytest.approx(mine["step_time_s"], rel=1e-9)


def _module_of(spec: str) -> str:
    """The module name `--model FILE.py:build` imported the file as."""
    return next(name for name, m in sys.modules.items()
                if getattr(m, "__file__", None) == spec.rpartition(":")[0])


def test_a_kind_without_a_role_that_reads_a_split_weight_is_an_error(cli, bitlinear):
    """No role, a weight --tp splits: one line naming the kind, in `profile` and `plan`, not a
    step whose MLP runs as a replica on a shard with its partial sums never reduced."""
    model = bitlinear(())
    for command in (("profile", "--tp", "2"),
                    ("plan", "--gpus", "8", "--global-batch", "8", "--tp", "2")):
        code, out, err = cli(*command, "--model", model)
        assert code == 2 and out == "", err
        assert "of kind bitlinear reads, and bitlinear declares no sharding role" in err
        assert len(err.strip().splitlines()) == 1
    code, _, err = cli("profile", "--model", model)  # no --tp: nothing to split
    assert code == 0, err
