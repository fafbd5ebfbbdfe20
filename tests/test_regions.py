"""Regions: `repeat` makes an explicit region (trip count, parent, loop-carried tensors) that
every op and tensor made inside names, and every pass keeps."""

import pytest
import sympy
from opgraph.models import preset

from opgraph import GraphBuilder, OpgraphError, VerifyError, compile_step, verify
from opgraph.core.ir import Phase, Region, Role, format_graph, format_region, region_problems
from opgraph.core.symbols import B, D, L, S, V


def _embed(g):
    return g.embedding(g.input("tokens", (B, S)), g.weight("embed.weight", (V, D)))


def _head(g, x):
    logits = g.matmul(x, g.weight("head.weight", (D, V)), name="head", category="output_head")
    g.cross_entropy(logits, g.input("targets", (B, S)))
    return g.build()


DIMS = {B: 1, S: 4, D: 8, V: 16, L: 3}


def test_llama_stack_is_one_region_carrying_the_residual_stream():
    graph = preset("llama3-8b")
    assert graph.regions() == [Region("layers", L, None, [("embed", "layers.mlp_residual")])]
    stack = [op for op in graph.ops() if op.region == "layers"]
    assert stack[0].name == "layers.attn_norm" and stack[-1].name == "layers.mlp_residual"
    # everything in the stack, and nothing else, runs L times
    assert all(op.count == L for op in stack)
    assert all(op.count == 1 for op in graph.ops() if op.region is None)
    assert {t.region for t in graph.tensors() if t.count == L} == {"layers"}
    assert graph.tensor("layers.q_proj.weight").region == "layers"
    assert graph.tensor("embed.weight").region is None


def test_gpt2_carries_the_embedding_sum():
    assert preset("gpt2").region("layers").carries == (("embed_sum", "layers.mlp_residual"),)


def test_region_line_in_the_textual_form():
    graph = preset("llama3-8b")
    assert format_region(graph.region("layers")) == (
        "region layers x L carries embed -> layers.mlp_residual")
    text = format_graph(graph).splitlines()
    assert text[1] == "  region layers x L carries embed -> layers.mlp_residual"
    assert format_graph(graph, regions=False) == "\n".join(text[:1] + text[2:])


def test_the_same_name_twice_makes_two_regions():
    g = GraphBuilder("twice", DIMS)
    x = _embed(g)
    with g.repeat(L, "layers") as a:
        x = g.add(x, g.matmul(x, g.weight("w", (D, D))))
    with g.repeat(L, "layers") as b:
        x = g.add(x, g.matmul(x, g.weight("w", (D, D))))
    graph = _head(g, x)
    assert (a.name, b.name) == ("layers", "layers_1")
    assert [r.name for r in graph.regions()] == ["layers", "layers_1"]
    assert graph.op("layers_1.matmul").region == "layers_1"
    assert graph.region("layers").carries == (("embed", "layers.add"),)
    assert graph.region("layers_1").carries == (("layers.add", "layers_1.add"),)


def test_nested_regions_multiply_counts():
    g = GraphBuilder("nested", DIMS)
    x = _embed(g)
    with g.repeat(L, "outer") as outer:
        x = g.rmsnorm(x, g.weight("norm.weight", (D,)))
        with g.repeat(2, "inner") as inner:
            x = g.add(x, g.matmul(x, g.weight("w", (D, D))))
    graph = _head(g, x)
    assert (outer.name, inner.name) == ("outer", "outer.inner")
    assert graph.region("outer.inner").parent == "outer"
    assert [r.name for r in graph.region_chain("outer.inner")] == ["outer", "outer.inner"]
    assert graph.trip_count("outer.inner") == 2 * L and graph.trip_count(None) == 1
    assert graph.op("outer.inner.matmul").count == 2 * L
    assert graph.within("outer.inner", "outer") and not graph.within("outer", "outer.inner")
    # the inner body hands its add to the next inner iteration; the outer body its last add
    assert graph.region("outer.inner").carries == (("outer.rmsnorm", "outer.inner.add"),)
    assert graph.region("outer").carries == (("embed", "outer.inner.add"),)


def _encoder_decoder(declare: bool):
    """A decoder reading both its own stream and the encoder's output, two [B, S, D] tensors:
    which one it carries cannot be told from shapes."""
    g = GraphBuilder("enc-dec", DIMS)
    x = _embed(g)
    with g.repeat(L, "enc"):
        x = g.add(x, g.matmul(x, g.weight("w", (D, D))))
    memory = x
    y = g.rmsnorm(x, g.weight("dec_in.weight", (D,)), name="dec_in")
    with g.repeat(L, "dec") as dec:
        h = g.add(y, g.matmul(memory, g.weight("cross", (D, D))), name="cross")
        out = g.add(h, g.matmul(h, g.weight("w", (D, D))))
        if declare:
            dec.carry(y, out)
    return _head(g, out)


def test_ambiguous_carries_ask_to_be_declared():
    with pytest.raises(OpgraphError, match=r"region 'dec'.*enc\.add.*dec_in.*r\.carry"):
        _encoder_decoder(declare=False)


def test_declared_carries_are_kept():
    graph = _encoder_decoder(declare=True)
    assert graph.region("dec").carries == (("dec_in", "dec.add"),)
    assert graph.region("enc").carries == (("embed", "enc.add"),)  # still inferred


@pytest.mark.parametrize("pair, why", [
    (("x", "nope"), "no tensor 'nope'"),
    (("layers.h", "layers.h"), "made inside the region"),
    (("x", "x"), "not made inside the region"),
    (("x", "layers.w_out"), r"bf16\[B, S, D\] but .* bf16\[B, S, 2\*D\]"),
    (("unread", "layers.h"), "no op of the region reads unread"),
])
def test_bad_declared_carries_say_why(pair, why):
    g = GraphBuilder("bad", DIMS)
    x = g.activation("x", (B, S, D))
    g.activation("unread", (B, S, D))
    with g.repeat(L, "layers") as layer:
        h = g.add(x, x, name="h")
        g.matmul(h, g.weight("w", (D, 2 * D)), name="w_out")
        layer.carry(*pair)
    with pytest.raises(OpgraphError, match=why):
        g.build()


def test_build_inside_a_repeat_is_an_error():
    g = GraphBuilder("early", DIMS)
    with g.repeat(L, "layers"), pytest.raises(OpgraphError, match="after the `with` block"):
        g.build()


@pytest.mark.parametrize("fused", [True, False])
def test_passes_keep_regions(fused):
    """Backward ops and gradients take their forward op's / primal's region, AdamW updates and
    their states their weight's, fused attention kernels the region of the core they replace."""
    forward = preset("llama3-8b")
    step = compile_step(forward, fused_attention=fused)
    assert step.regions() == forward.regions()
    assert region_problems(forward) == [] and region_problems(step) == []
    for op in step.ops():
        if op.phase is Phase.BACKWARD:
            assert op.region == step.op(op.forward).region, op.name
        elif op.phase is Phase.OPTIMIZER:
            (weight,) = [step.tensor(n).grad_of for n in op.inputs
                         if step.tensor(n).role is Role.GRADIENT]
            assert op.region == step.tensor(weight).region, op.name
        # a region's trip count is how often its ops run
        assert sympy.simplify(op.count - step.trip_count(op.region)) == 0, op.name
    for t in step.tensors():
        if t.grad_of is not None:
            assert t.region == step.tensor(t.grad_of).region, t.name
    flash = [op for op in step.ops() if op.kind.startswith("flash_attention")]
    assert len(flash) == (2 if fused else 0)
    assert all(op.region == "layers" for op in flash)


def test_region_problems_name_each_inconsistency():
    import attrs

    graph = preset("gpt2").copy()
    op = graph.op("layers.gelu")
    graph.replace_op(attrs.evolve(op, count=1))
    graph.update_region(Region("layers", L, None, [("layers.ln_1", "ln_f")]))
    assert region_problems(graph) == [
        "op layers.gelu runs 1 times, its region layers L",
        "region layers carries layers.ln_1, which is not a tensor made before it",
        "region layers hands on ln_f, which is not a tensor made inside it"]
    with pytest.raises(VerifyError, match="region layers carries layers.ln_1"):
        verify(graph)  # the verifier runs the region checks too


def test_the_carry_links_a_layers_last_op_to_the_next_layers_first():
    """What fusing layer i's last residual add with layer i+1's first norm needs to see: the
    op making the handed tensor, and the ops of the body reading the entering one."""
    graph = preset("llama3-8b")
    ((entering, handed),) = graph.region("layers").carries
    assert graph.producer(handed).name == "layers.mlp_residual"
    readers = [op.name for op in graph.consumers(entering) if graph.within(op.region, "layers")]
    assert readers == ["layers.attn_norm", "layers.attn_residual"]
