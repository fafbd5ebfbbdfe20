"""Context parallelism by all-to-all (`Parallel.cp_comm` "a2a": DeepSpeed-Ulysses, Jacobs et al.
2023; Megatron-LM's --cp-comm-type a2a): the queries, keys and values of each GPU's sequence
shard trade places for the whole sequence of H/cp heads before the attention, and its output
trades back after it. Expected figures are written from the model's shapes."""

import pytest

from opgraph import hardware
from opgraph.core.errors import OpgraphError
from opgraph.io.launch import read_megatron
from opgraph.io.outputs.report import layout_text
from opgraph.models import preset
from opgraph.parallel.distributed import profile_parallel
from opgraph.parallel.parallel import Parallel, parse_layout
from opgraph.parallel.schedule import overlapped
from opgraph.parallel.search import Searcher, Space, rows

H100 = hardware.get("h100-sxm")
# Llama 3 8B
D, H, H_KV, D_H, LAYERS = 4096, 32, 8, 128, 32
S, CP = 32768, 4


def _cp(layout: Parallel):
    return profile_parallel(preset("llama3-8b"), H100, layout, values={"S": S})


@pytest.fixture(scope="module")
def runs():
    """Llama 3 8B at 32,768 tokens on 8 GPUs, CP 4 x DP 2, FSDP: by ring and by all-to-all."""
    return {comm: _cp(Parallel(cp=CP, dp=2, zero=3, cp_comm=comm)) for comm in ("ring", "a2a")}


def test_the_all_to_all_moves_each_gpus_queries_keys_values_and_output(runs):
    """Per layer, forward: q and the output, S/cp tokens x H heads of d_h in BF16 each, and k
    and v, S/cp x H_kv x d_h; the backward moves their gradients the other way, the same
    bytes; every layer, over the 4 GPUs of the context-parallel group, on NVLink. No keys or
    values are gathered around a ring."""
    cp = [t for t in runs["a2a"].parallel.communication if t.group == "cp"]
    assert {t.collective for t in cp} == {"all_to_all"}
    assert all(t.group_size == CP and t.count == LAYERS and "NVLink" in t.tier for t in cp)
    per_layer = sum(t.bytes for t in cp)
    assert per_layer == 2 * 2 * (S // CP) * (2 * H + 2 * H_KV) * D_H  # 2 passes, BF16
    assert {t.name for t in cp} == {
        f"layers.{n}.all_to_all.cp{grad}" for n in ("q_rope", "k_rope", "v_proj", "attn.pv")
        for grad in ("", ".grad")}


def test_each_gpu_scores_as_many_pairs_either_way(runs):
    """Ring attention scores its S/cp queries against all S keys (half, causal) on every head;
    the all-to-all scores all S queries against all S keys on H/cp heads: the same FLOPs."""
    ring, a2a = ({c.name: c.flops for c in runs[comm].categories} for comm in ("ring", "a2a"))
    assert ring["attention"] > 0
    assert a2a["attention"] == pytest.approx(ring["attention"], rel=1e-12)
    assert a2a["matmul"] == pytest.approx(ring["matmul"], rel=1e-12)


def test_ring_attention_runs_each_query_row_once_a_step_it_takes_part_in():
    """The rows an attention kernel loops over (`rules.attention_scores`' third figure): by
    all-to-all, all S rows of H/cp heads, once; by the causal, load-balanced ring, S/cp rows of
    all H heads, in the local causal block and then on each of the cp - 1 steps either all of
    them (against half a block of keys) or half (against a whole block): 1 + 3/4 (cp - 1)
    passes. Its scores are the same either way."""
    from opgraph.core import rules
    from opgraph.parallel.distributed import compile_parallel

    figures = {}
    for comm in ("ring", "a2a"):
        g = compile_parallel(preset("llama3-8b"), Parallel(cp=CP, dp=2, zero=3, cp_comm=comm))
        (op,) = [o for o in g.ops() if o.kind == "flash_attention"]
        scores, _, rows = rules.attention_scores(op.kind, [g.tensor(n) for n in op.inputs],
                                                 [g.tensor(n) for n in op.outputs],
                                                 dict(op.params))
        at = {sym.name: value for sym, value in g.dims.items()} | {"S": S, "B": 1, "cp": CP}
        figures[comm] = [float(x.xreplace({sym: at[sym.name] for sym in x.free_symbols}))
                         for x in (scores, rows)]
    assert figures["a2a"] == [H // CP * S * S / 2, H // CP * S]
    assert figures["ring"] == [H * (S // CP) * S / 2, H * (S // CP) * (1 + 0.75 * (CP - 1))]


def test_the_attention_runs_on_a_head_shard_of_the_whole_sequence():
    """Under TP 2 and CP 4 the attention reads all S tokens of H / (tp cp) heads; the output's
    all-to-all, and the gradient's of the queries (its axes swapped), give back the shape the
    queries had: S / cp tokens of H / tp heads."""
    from opgraph.core.pipeline import compile_step

    step = compile_step(preset("llama3-8b"), layout=Parallel(cp=CP, tp=2, cp_comm="a2a",
                                                              sequence_parallel=True))
    flash = step.op("layers.attn.flash")
    assert str(step.tensor(flash.inputs[0]).shape) == "(B, S, H*d_h/(cp*tp))"
    assert (str(flash.param("heads")), str(flash.param("kv_heads"))) == ("H/(cp*tp)",
                                                                         "H_kv/(cp*tp)")
    queries = step.tensor("layers.q_rope").shape
    assert str(queries) == "(B, S/cp, H*d_h/tp)"
    for name in ("layers.attn.pv.all_to_all.cp", "layers.q_rope.all_to_all.cp.grad"):
        assert step.tensor(step.op(name).outputs[0]).shape == queries, name


def test_the_attention_waits_for_the_all_to_all_and_ring_attention_does_not():
    """Ring attention passes keys and values under the attention; the all-to-all's output is
    the attention's whole input, so the attention starts when it ends."""
    assert overlapped("cp", False, "all_gather") and overlapped("cp", False, "reduce_scatter")
    assert not overlapped("cp", False, "all_to_all")
    r = _cp(Parallel(cp=CP, dp=2, zero=0, cp_comm="a2a")).parallel
    waited = sum(t.exposed_s for t in r.communication if t.group == "cp")
    assert waited > 0


@pytest.mark.parametrize("layout, words", [
    (Parallel(cp=16, dp=1, cp_comm="a2a"), ("H_kv = 8", "tp x cp = 1 x 16", "--cp-comm ring")),
    (Parallel(tp=4, cp=4, cp_comm="a2a"), ("H_kv = 8", "tp x cp = 4 x 4")),
])
def test_heads_the_all_to_all_cannot_split_whole_are_one_line_errors(layout, words):
    with pytest.raises(OpgraphError) as e:
        profile_parallel(preset("llama3-8b"), H100, layout, values={"S": S})
    assert "\n" not in str(e.value)
    for word in words:
        assert word in str(e.value)


def test_an_unfused_attention_cannot_be_split_by_heads(cli):
    code, out, err = cli("profile", "--model", "llama3-8b", "--gpus", "4", "--cp", "4",
                         "--cp-comm", "a2a", "--no-fused-attention")
    assert code == 2 and not out
    assert err.count("\n") == 1 and "fused attention" in err and "--cp-comm ring" in err


def test_the_all_to_all_needs_the_sequence_to_split_cp_ways_only():
    """Ring attention cuts the sequence in 2 cp chunks (causal balance); the all-to-all needs
    cp pieces: 8,200 tokens (8 x 1,025) split over cp 8 only by all-to-all."""
    forward = preset("llama3-8b")
    profile_parallel(forward, H100, Parallel(cp=8, cp_comm="a2a"), values={"S": 8 * 1025})
    with pytest.raises(OpgraphError, match="2 x --cp 8"):
        profile_parallel(forward, H100, Parallel(cp=8), values={"S": 8 * 1025})


def test_a_layout_by_all_to_all_reads_back_from_its_text():
    layout = Parallel(cp=4, dp=2, zero=3, cp_comm="a2a")
    text = layout_text(layout, "full", "bf16")
    assert " cp4 a2a " in text
    fields, options = parse_layout(text)
    assert fields["cp_comm"] == "a2a" and options == {"recompute": "full", "precision": "bf16"}
    assert parse_layout("tp2,cp2,ring")[0]["cp_comm"] == "ring"
    assert " a2a" not in layout_text(Parallel(cp=4, dp=2), "none", "bf16")


def test_megatron_cp_comm_type_reads_as_opgraph_models_it():
    base = ("pretrain_gpt.py --num-layers 32 --hidden-size 4096 --num-attention-heads 32 "
            "--group-query-attention --num-query-groups 8 --seq-length 32768 "
            "--max-position-embeddings 32768 --vocab-size 128256 --swiglu "
            "--normalization RMSNorm --position-embedding-type rope "
            "--untie-embeddings-and-output-weights --disable-bias-linear "
            "--context-parallel-size 4 --micro-batch-size 1 --global-batch-size 8 --bf16")
    for given, comm, unknown in (("", "ring", ()), (" --cp-comm-type p2p", "ring", ()),
                                 (" --cp-comm-type allgather", "ring", ()),
                                 (" --cp-comm-type a2a", "a2a", ()),
                                 (" --cp-comm-type a2a+p2p", "ring", ("--cp-comm-type",))):
        launch = read_megatron(base + given, gpus=8)
        assert launch.parallel.cp_comm == comm, given
        assert launch.unknown == unknown, given


def test_plan_searches_by_all_to_all_and_its_figures_are_profiles():
    """`plan --cp-comm a2a`: every layout it lists runs the all-to-all where cp > 1, scheduled
    as `profile` schedules it (to 1e-9)."""
    from opgraph.cost.costmodel import cost_model

    forward, cost = preset("llama3.2-1b"), cost_model("calibrated")
    searcher = Searcher(forward, H100, seq_len=S, cost=cost)
    space = Space(gpus=8, batch=2, cp=4, cp_comm="a2a", precision=("bf16",),
                  recompute=("full",), micro_batch=1)
    found = rows(forward, H100, space, S, searcher.cluster)
    assert found and all(r.cp_comm == "a2a" for r in found)
    for row in found[:2]:
        candidate = row.candidate()
        mine = searcher.one(candidate).result
        theirs = profile_parallel(forward, H100, candidate.layout, values={"S": S}, cost=cost,
                                  recompute=candidate.recompute,
                                  precision=candidate.precision).parallel
        for name in ("step_time_s", "mfu", "exposed_communication_s"):
            assert getattr(mine, name) == pytest.approx(getattr(theirs, name), rel=1e-9,
                                                        abs=1e-12), (name, candidate)
        assert mine.memory.total == theirs.memory.total


def test_the_launch_writers_say_the_all_to_all_or_refuse_it():
    """Megatron-LM writes it as --cp-comm-type a2a (read back as written); torchtitan's context
    parallelism is ring attention only, so its writer refuses it on one line."""
    from opgraph.io.launch import Launch, to_megatron, to_torchtitan

    layout = Parallel(gpus=8, cp=4, zero=1, global_batch=8, cp_comm="a2a",
                      framework="megatron")
    line = to_megatron(Launch(model="llama3-8b", seq_len=S, parallel=layout))
    assert "--cp-comm-type a2a" in line
    assert read_megatron(line).parallel.cp_comm == "a2a"
    assert "--cp-comm-type" not in to_megatron(Launch(model="llama3-8b", seq_len=S, parallel=(
        Parallel(gpus=8, cp=4, zero=1, global_batch=8, framework="megatron"))))
    with pytest.raises(OpgraphError) as e:
        to_torchtitan(Launch(model="llama3-8b", seq_len=S, parallel=Parallel(
            gpus=8, cp=4, zero=3, global_batch=8, cp_comm="a2a", framework="torchtitan")))
    assert "\n" not in str(e.value) and "ring attention" in str(e.value)


def test_plan_tries_both_communications_where_asked(cli):
    """`plan --cp-comm both` (`Space(cp_comm=None)`): the ring and the all-to-all at every
    context-parallel degree the heads allow (Llama 3.2 1B's 8 KV heads: tp x cp <= 8), the
    ring alone without context parallelism; profile takes one of them."""
    from opgraph.parallel import cluster

    forward = preset("llama3.2-1b")
    found = rows(forward, H100, Space(gpus=16, batch=4, cp_comm=None, precision=("bf16",),
                                      recompute=("full",), pp=1), S, cluster.get("dgx-h100"))
    by = {}
    for r in found:
        by.setdefault((r.tp, r.cp), set()).add(r.cp_comm)
    assert by[(4, 1)] == {"ring"}  # no context parallelism: nothing to move
    assert by[(1, 4)] == by[(2, 4)] == {"ring", "a2a"}
    assert by[(1, 16)] == by[(2, 8)] == {"ring"}  # 8 KV heads do not split 16 ways
    code, out, err = cli("plan", "--model", "llama3.2-1b", "--gpus", "8", "--seq-len", str(S),
                         "--global-batch", "2", "--cp", "4", "--cp-comm", "both",
                         "--recompute", "full", "--precision", "bf16", "--json")
    assert code == 0
    import json

    assert {lay["cp_comm"] for lay in json.loads(out)["layouts"]} == {"ring", "a2a"}
    code, out, err = cli("profile", "--model", "llama3.2-1b", "--cp", "2", "--cp-comm", "both")
    assert code == 2 and "invalid choice" in err


def test_a_ring_keeps_its_own_block_of_keys_and_values():
    """Ring attention saves each GPU's S/cp of K and V and passes them around again in the
    backward (`passes.regather_inputs`): at a fixed block of 16,384 tokens a GPU, its saved
    activations do not grow with the ring's length, as they would by the gathered (cp - 1) x
    16,384 x H_kv x d_h x 2 x 2 bytes a layer if it kept the whole sequence's."""
    saved = {cp: profile_parallel(preset("llama3-8b"), H100, Parallel(cp=cp, dp=1, zero=3),
                                  values={"S": 16384 * cp}).parallel.memory.activations
             for cp in (2, 8)}
    assert saved[8] == saved[2]
