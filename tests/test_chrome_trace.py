"""The predicted timeline (`opgraph profile --trace`): a valid Chrome trace whose kernels run the
compiled step's ops in execution order, one event per layer instance, summing to the step time."""

import itertools
import json

import pytest
from opgraph.models import preset

from opgraph import GraphBuilder, compile_step, evaluate, hardware
from opgraph.cli import main
from opgraph.io.outputs.chrome_trace import (STREAM_TID, blocks, chrome_trace, instance_name,
                                             write_chrome_trace)
from opgraph.core.symbols import B, D, L, S, V

H100 = hardware.get("h100-sxm")
LAYERS = 32  # Llama 3 8B (arXiv:2407.21783, Table 3)


@pytest.fixture(scope="module")
def step():
    return compile_step(preset("llama3-8b"))


@pytest.fixture(scope="module")
def profile(step):
    return evaluate(step, H100)


@pytest.fixture(scope="module")
def trace(profile, step):
    return json.loads(json.dumps(chrome_trace(profile, step)))  # through JSON and back


def kernel_events(trace):
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == STREAM_TID]


def test_is_a_chrome_trace(trace):
    assert isinstance(trace["traceEvents"], list)
    assert trace["displayTimeUnit"] in ("ms", "ns")
    for e in trace["traceEvents"]:
        assert e["ph"] in ("X", "M")
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    assert next(e["args"]["name"] for e in meta if e["name"] == "process_name").startswith(
        "opgraph roofline: llama3-8b")
    labelled = {e["tid"] for e in meta if e["name"] == "thread_name"}
    used = {e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert labelled == used and len(used) == 2  # the kernels' stream and the phases


def test_kernels_sum_to_the_step_time(profile, trace):
    kernels = kernel_events(trace)
    assert sum(e["dur"] for e in kernels) * 1e-6 == pytest.approx(profile.step_time_s, rel=1e-9)
    # back to back: each kernel starts where the one before ended
    for a, b in itertools.pairwise(kernels):
        assert b["ts"] == pytest.approx(a["ts"] + a["dur"], rel=1e-12, abs=1e-9)


def test_one_event_per_kernel_instance(profile, trace):
    kernels = kernel_events(trace)
    assert len(kernels) == sum(o.count for o in profile.ops)
    by_op = {}
    for e in kernels:
        by_op[e["args"]["op"]] = by_op.get(e["args"]["op"], 0) + 1
    assert by_op == {o.name: o.count for o in profile.ops}
    # each layer of the stack runs every op of the layer once
    q = [e["args"]["layer"] for e in kernels if e["args"]["op"] == "layers.q_proj"]
    assert sorted(q) == list(range(LAYERS))


def test_args_are_per_instance(profile, trace):
    q_proj = next(o for o in profile.ops if o.name == "layers.q_proj")
    e = next(e for e in kernel_events(trace) if e["name"] == "layers.3.q_proj")
    assert e["args"]["flops"] == pytest.approx(q_proj.flops / LAYERS, rel=1e-12)
    assert e["args"]["bytes"] == pytest.approx(q_proj.bytes / LAYERS, rel=1e-12)
    assert e["dur"] * 1e-6 == pytest.approx(q_proj.time_s / LAYERS, rel=1e-12)
    assert e["args"] | {"flops": 0, "bytes": 0} == {
        "flops": 0, "bytes": 0, "bound": "compute", "category": "matmul", "kind": "matmul",
        "phase": "forward", "op": "layers.q_proj", "layer": 3}
    assert e["cat"] == "matmul"


def test_execution_order(trace):
    names = [e["name"] for e in kernel_events(trace)]
    phases = [e["args"]["phase"] for e in kernel_events(trace)]
    assert names[0] == "embed"
    assert names[-1].startswith("adamw.")
    assert phases == sorted(phases, key=["forward", "backward", "optimizer"].index)
    assert names[phases.index("backward")] == "loss.grad"
    # forward: embed, layer 0 from its first op to layer 31's last, then the head and the loss
    assert names[1] == "layers.0.attn_norm"
    final = names.index("final_norm")
    assert names[final - 1] == f"layers.{LAYERS - 1}.mlp_residual"
    assert names[final:final + 3] == ["final_norm", "lm_head", "loss"]
    # backward: the loss, head and final norm, then the layers from the last down, then embed
    back = names.index("final_norm.grad")
    assert names[back + 1] == f"layers.{LAYERS - 1}.mlp_residual.grad"
    embed = names.index("embed.grad")
    assert names[embed - 1] == "layers.0.attn_norm.grad"
    assert phases[embed + 1] == "optimizer"


def test_layers_interleave(trace):
    """Within a stack, every op of layer i runs before any op of the next layer."""
    kernels = kernel_events(trace)
    for phase, step in (("forward", 1), ("backward", -1), ("optimizer", 1)):
        layers = [e["args"]["layer"] for e in kernels
                  if e["args"]["phase"] == phase and e["args"]["layer"] is not None]
        assert layers[0] == (0 if step == 1 else LAYERS - 1)
        assert all((b - a) * step in (0, 1) for a, b in itertools.pairwise(layers))


def test_phase_ranges_enclose_their_kernels(profile, trace):
    ranges = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] != STREAM_TID]
    assert [r["name"] for r in ranges] == ["forward", "backward", "optimizer"]
    assert ranges[0]["ts"] == 0
    assert sum(r["dur"] for r in ranges) * 1e-6 == pytest.approx(profile.step_time_s, rel=1e-9)
    span = {r["name"]: (r["ts"], r["ts"] + r["dur"]) for r in ranges}
    for e in kernel_events(trace):
        start, end = span[e["args"]["phase"]]
        assert start - 1e-6 <= e["ts"] and e["ts"] + e["dur"] <= end + 1e-6


def _embed(g):
    return g.embedding(g.input("tokens", (B, S)), g.weight("embed.weight", (V, D)))


def _head(g, x):
    logits = g.matmul(x, g.weight("head.weight", (D, V)), name="head", category="output_head")
    g.cross_entropy(logits, g.input("targets", (B, S)))
    return g.build()


def _timeline(graph, values=None):
    step = compile_step(graph)
    p = evaluate(step, H100, values)
    return p, step, kernel_events(chrome_trace(p, step))


def test_blocks_follow_regions_and_phase():
    """Two stacks of different depth, one after the other: each is its own block."""
    g = GraphBuilder("two-stacks", dims={B: 1, S: 4, D: 8, V: 16})
    x = _embed(g)
    with g.repeat(2, "enc"):
        x = g.matmul(g.rmsnorm(x, g.weight("norm.weight", (D,))), g.weight("w", (D, D)))
    with g.repeat(3, "dec"):
        x = g.add(x, g.matmul(x, g.weight("w", (D, D))))
    p, step, events = _timeline(_head(g, x))
    shape = [(b.ops[0].phase, b.region, b.count, len(b.ops)) for b in blocks(p.ops, step, p)]
    assert shape[:4] == [("forward", None, 1, 1), ("forward", "enc", 2, 2),
                         ("forward", "dec", 3, 2), ("forward", None, 1, 1)]
    assert ("backward", "dec", 3, 3) in shape and ("backward", "enc", 2, 3) in shape
    assert shape.index(("backward", "dec", 3, 3)) < shape.index(("backward", "enc", 2, 3))
    names = [e["name"] for e in events]
    assert names[:6] == ["embed", "enc.0.rmsnorm", "enc.0.matmul", "enc.1.rmsnorm",
                         "enc.1.matmul", "dec.0.matmul"]
    assert len(names) == sum(o.count for o in p.ops)


@pytest.mark.parametrize("names", [("layers", "layers"), ("enc", "dec")])
def test_two_stacks_of_the_same_depth_run_one_after_the_other(names):
    """An encoder then a decoder, both `repeat(L, ...)`: the encoder's L layers all run before
    the decoder's first (in the backward, the decoder's all before the encoder's last), even
    under one name, where a name-based timeline interleaved them layer by layer."""
    g = GraphBuilder("enc-dec", dims={B: 1, S: 4, D: 8, V: 16, L: 3})
    x = _embed(g)
    with g.repeat(L, names[0]) as enc:
        x = g.add(x, g.matmul(g.rmsnorm(x, g.weight("norm.weight", (D,))),
                              g.weight("w", (D, D)), name="enc"))
    with g.repeat(L, names[1]) as dec:
        x = g.add(x, g.matmul(x, g.weight("w", (D, D)), name="dec"))
    p, step, events = _timeline(_head(g, x))
    assert enc.name != dec.name
    assert len(events) == sum(o.count for o in p.ops)
    for phase, first, second in (("forward", enc, dec), ("backward", dec, enc),
                                 ("optimizer", enc, dec)):
        mine = [e for e in events
                if e["args"]["phase"] == phase and e["args"]["layer"] is not None]
        regions = [step.op(e["args"]["op"]).region for e in mine]
        n, m = regions.count(first.name), regions.count(second.name)
        assert regions == [first.name] * n + [second.name] * m  # no interleaving
        for stack in (mine[:n], mine[n:]):
            layers = [e["args"]["layer"] for e in stack]
            assert layers == sorted(layers, reverse=phase == "backward")
            assert set(layers) == {0, 1, 2} and len(layers) % 3 == 0
    forward = [e["name"] for e in events if e["args"]["phase"] == "forward"]
    assert forward[1:4] == [f"{enc.name}.0.rmsnorm", f"{enc.name}.0.enc", f"{enc.name}.0.add"]
    assert forward[1 + 3 * 3] == f"{dec.name}.0.dec"


def test_nested_regions_expand_inside_each_iteration():
    """`repeat(2)` around `repeat(3)`: each outer iteration runs its own op, then the inner
    block three times; counts multiply to 6 instances of the inner op."""
    g = GraphBuilder("nested", dims={B: 1, S: 4, D: 8, V: 16})
    x = _embed(g)
    with g.repeat(2, "outer"):
        x = g.rmsnorm(x, g.weight("norm.weight", (D,)))
        with g.repeat(3, "inner"):
            x = g.matmul(x, g.weight("w", (D, D)))
    p, step, events = _timeline(_head(g, x))
    assert step.trip_count("outer.inner") == 6
    forward = [(e["name"], e["args"]["layer"]) for e in events
               if e["args"]["phase"] == "forward"]
    assert forward[1:9] == [
        ("outer.0.rmsnorm", 0), ("outer.0.inner.0.matmul", [0, 0]),
        ("outer.0.inner.1.matmul", [0, 1]), ("outer.0.inner.2.matmul", [0, 2]),
        ("outer.1.rmsnorm", 1), ("outer.1.inner.0.matmul", [1, 0]),
        ("outer.1.inner.1.matmul", [1, 1]), ("outer.1.inner.2.matmul", [1, 2])]
    backward = [e["name"] for e in events if e["args"]["phase"] == "backward"]
    inner = [n for n in backward if n.startswith("outer.")]
    assert inner[0].startswith("outer.1.inner.2.") and inner[-1] == "outer.0.rmsnorm.grad"
    assert len(events) == sum(o.count for o in p.ops)


def test_instance_names_come_from_the_region():
    from opgraph.core.ir import Region

    layers = Region("layers", L)
    assert instance_name("layers.q_proj.dA", (layers,), (3,)) == "layers.3.q_proj.dA"
    assert instance_name("adamw.layers.q_proj.weight", (layers,), (3,)) == (
        "adamw.layers.3.q_proj.weight")
    assert instance_name("w_q", (layers,), (3,)) == "w_q [3]"  # named outside the convention
    assert instance_name("embed", (), ()) == "embed"


def test_timeline_needs_the_graph_that_was_profiled(profile):
    other = compile_step(preset("gpt2"))
    with pytest.raises(KeyError, match="no op"):
        chrome_trace(profile, other)


def test_cli_writes_the_trace(tmp_path, capsys):
    out = tmp_path / "step.json"
    assert main(["profile", "--trace", str(out)]) == 0
    trace = json.loads(out.read_text())
    assert kernel_events(trace)[0]["name"] == "embed"
    assert [p.name for p in tmp_path.iterdir()] == ["step.json"]  # no temp file left


def test_cli_bad_trace_path(tmp_path, capsys):
    out = tmp_path / "missing" / "step.json"
    assert main(["profile", "--trace", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "does not exist" in err
    assert not out.parent.exists()


def test_write_failure_leaves_no_file(tmp_path, profile, step, monkeypatch):
    import opgraph.io.outputs.chrome_trace as ct

    def broken(f):
        raise RuntimeError("boom")

    monkeypatch.setattr(ct.json, "dump", lambda trace, f: broken(f))
    with pytest.raises(RuntimeError):
        write_chrome_trace(profile, step, tmp_path / "step.json")
    assert list(tmp_path.iterdir()) == []


def test_an_op_with_a_count_outside_any_region_still_runs_count_times():
    """A graph written with the IR directly (no `repeat`): an op of count 3 is three kernels."""
    from opgraph.core.ir import Graph, Op, Tensor

    g = Graph("bare", {B: 1, S: 4, D: 8})
    g.add_tensor(Tensor("x", (D,)))
    g.add_tensor(Tensor("y", (D,), count=3))
    g.add_op(Op("scale", "gelu", "elementwise", ["x"], ["y"], count=3))
    p = evaluate(g, H100)
    names = [e["name"] for e in kernel_events(chrome_trace(p, g))]
    assert names == ["scale [0]", "scale [1]", "scale [2]"]


# --- a many-GPU timeline adds up to the table (issue 21) ----------------------------------------

MANY_GPU_JOBS = {
    # ZeRO-1 reduces gradients once per step: drawn in every micro-batch, the dp track was 1.9 x
    # the table's dp time
    "8b-zero1": ("--model", "llama3-8b", "--gpus", "16", "--tp", "2", "--zero", "1",
                 "--global-batch", "64"),
    # a pipeline: the bubble on the compute track
    "8b-pp2": ("--model", "llama3-8b", "--gpus", "8", "--tp", "2", "--pp", "2", "--zero", "1",
               "--global-batch", "8"),
    # experts: the ep and edp tracks, ZeRO-0's all-reduce once per step
    "mixtral-ep": ("--model", "mixtral-8x7b", "--gpus", "64", "--tp", "2", "--ep", "8",
                   "--global-batch", "64"),
}


@pytest.mark.parametrize("job", sorted(MANY_GPU_JOBS))
def test_every_track_of_a_many_gpu_timeline_sums_to_the_table(job, tmp_path, capsys):
    """The compute track's kernels are the ops' time over the step (the table's categories but
    communication) and its bubble events the bubble; each group's track is that group's
    collectives' time over the step (the communication table)."""
    path = tmp_path / "rank0.json"
    assert main(["profile", *MANY_GPU_JOBS[job], "--json", "--ops", "--trace", str(path)]) == 0
    o = json.loads(capsys.readouterr().out)
    events = json.loads(path.read_text())["traceEvents"]
    track = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    drawn: dict = {}
    for e in events:
        if e.get("ph") == "X":
            key = "bubble" if e["args"]["kind"] == "bubble" else track[e["tid"]]
            drawn[key] = drawn.get(key, 0.0) + e["dur"] / 1e6
    compute = sum(r["time_s"] for r in o["ops"] if r["category"] != "communication")
    assert drawn.pop("compute stream") == pytest.approx(compute, rel=1e-9)
    assert drawn.pop("bubble", 0.0) == pytest.approx(o["bubble_s"], rel=1e-9, abs=1e-12)
    groups: dict = {}
    for c in o["communication"]:
        groups[c["group"]] = groups.get(c["group"], 0.0) + c["time_s"]
    assert drawn == pytest.approx({f"{g} communication": t for g, t in groups.items() if t})
