"""`opgraph plan` and `opgraph.parallel.search`: the layouts it returns carry `profile`'s figures,
the branch and bound returns the fastest, the launch configs read back to the same prediction, and
bad input is one line."""

import functools
import json
import random

import numpy as np
import pytest
import sympy

from opgraph import hardware
from opgraph.cost.costmodel import cost_model
from opgraph.parallel.distributed import profile_parallel
from opgraph.parallel.frameworks import end_split, own_split
from opgraph.core.errors import OpgraphError
from opgraph.models import preset
from opgraph.parallel.search import Searcher, Space, rows, structure
from opgraph.parallel.search.bounds import _compute_bound

H100 = hardware.get("h100-sxm")
FIGURES = ("step_time_s", "mfu", "bubble_s", "exposed_communication_s", "tokens_per_s_per_gpu")


@pytest.fixture(scope="module")
def searchers():
    """`searchers(model, seq, cost)`: one Searcher per model, sequence length and cost model for
    the whole module. A Searcher keeps the structures it compiled (rows of one structure differ
    only in numbers), so the tests that sample the same model share them, as a scaling curve's
    sizes do; what a test asserts is each row's figures, which a structure compiled for an
    earlier test must give alike. Tests of the search's own pruning make a fresh one."""
    made: dict[tuple, Searcher] = {}

    def get(model: str, seq: int, cost: str = "calibrated") -> Searcher:
        if (model, seq, cost) not in made:
            made[model, seq, cost] = Searcher(preset(model), H100, seq_len=seq,
                                              cost=cost_model(cost))
        return made[model, seq, cost]

    return get


def _same_as_profile(searcher: Searcher, row, forward, cost) -> None:
    candidate = row.candidate()
    mine = searcher.one(candidate).result
    theirs = profile_parallel(forward, H100, candidate.layout, values={"S": searcher.seq},
                              cost=cost, recompute=candidate.recompute,
                              precision=candidate.precision).parallel
    for name in FIGURES:
        assert getattr(mine, name) == pytest.approx(getattr(theirs, name), rel=1e-9, abs=1e-12), \
            (name, candidate)
    assert mine.memory == theirs.memory, candidate
    assert mine.memory_stage == theirs.memory_stage


def _sampled(searcher: Searcher, space: Space, seed: int, k: int
             ) -> tuple[random.Random, list[list]]:
    """Up to `k` random structures of `space`, each as its rows (the space's order), with the
    generator that drew them (for a test's further draws)."""
    by_structure: dict = {}
    for r in rows(searcher.forward, H100, space, searcher.seq, searcher.cluster):
        by_structure.setdefault(structure(r), []).append(r)
    rng = random.Random(seed)
    keys = rng.sample(sorted(by_structure, key=repr), min(k, len(by_structure)))
    return rng, [by_structure[key] for key in keys]


@pytest.mark.parametrize("model, gpus, batch, seq, cost", [
    ("llama3.2-1b", 16, 64, 4096, "calibrated"),
    ("llama3-8b", 64, 128, 8192, "roofline"),
    ("mixtral-8x7b", 32, 64, 4096, "calibrated"),
    # two layer stacks: pipelines split the expert layers, the dense one on the first stage
    ("deepseek-v2-lite", 8, 16, 1024, "calibrated"),
    # a Mamba-2 hybrid: one stack per layer kind, the scan's kernels, no CP nor PP
    ("nemotron-3-nano", 16, 32, 2048, "calibrated"),
])
def test_search_figures_are_profiles_on_a_random_sample(searchers, model, gpus, batch, seq,
                                                        cost):
    """A random layout of each of several structures, by the search's compiled formulas and by
    `profile` compiling it on its own: the same figures (relative 1e-9), the same memory."""
    searcher = searchers(model, seq, cost)
    rng, sampled = _sampled(searcher, Space(gpus=gpus, batch=batch), 13, 4)
    for group in sampled:
        _same_as_profile(searcher, rng.choice(group), searcher.forward, searcher.cost)


@pytest.mark.parametrize("model, gpus, batch, seq, framework", [
    # Megatron-LM's dispatcher sorts by local expert where a GPU holds more than one expert
    ("mixtral-8x7b", 32, 64, 4096, "megatron"),
    # torchtitan copies the keys and values to every query head, and its ring gathers them
    ("llama3.2-1b", 16, 64, 4096, "torchtitan"),
])
def test_a_frameworks_own_passes_are_profile_too(searchers, model, gpus, batch, seq, framework):
    """A random layout of each of several structures of a framework whose passes add ops (the
    sorts' bytes a function of E / ep, which a structure's rows vary): the search's figures
    are `profile`'s."""
    searcher = searchers(model, seq)
    space = Space(gpus=gpus, batch=batch, framework=framework)
    rng, sampled = _sampled(searcher, space, 7, 4)
    for group in sampled:
        _same_as_profile(searcher, rng.choice(group), searcher.forward, searcher.cost)
    if framework == "megatron":  # one structure, one expert a GPU and several: both exact
        found = rows(searcher.forward, H100, space, seq, searcher.cluster)
        r = next(r for r in found if r.ep == 8)  # Mixtral's 8 experts, one a GPU
        twin = next(o for o in found if structure(o) == structure(r) and o.ep == 2)
        for row in (r, twin):
            _same_as_profile(searcher, row, searcher.forward, searcher.cost)


def test_megatron_recompute_modules_are_profile_too(searchers):
    """A plan held to Megatron-Core's recompute modules (`--recompute selective:...`): a random
    layout of each of several structures is `profile`'s."""
    searcher = searchers("mixtral-8x7b", 4096)
    space = Space(gpus=32, batch=64, framework="megatron",
                  recompute=("selective:layernorm+moe_act+moe",))
    rng, sampled = _sampled(searcher, space, 5, 3)
    for group in sampled:
        row = rng.choice(group)
        assert row.recompute == "selective:layernorm+moe_act+moe"
        _same_as_profile(searcher, row, searcher.forward, searcher.cost)


def test_rowwise_fp8_is_searched_when_asked_and_its_figures_are_profiles(searchers):
    """`plan --precision fp8-rowwise` (torchtitan): its casts over axes, its rescales and its
    BF16 gathers, compiled by the search, give `profile`'s figures on a random layout of
    several structures (Mixtral: its grouped expert GEMMs cast along the tokens too); without
    the flag the search never tries it."""
    searcher = searchers("mixtral-8x7b", 4096)
    space = Space(gpus=32, batch=64, framework="torchtitan", precision=("fp8-rowwise",))
    rng, sampled = _sampled(searcher, space, 11, 3)
    for group in sampled:
        row = rng.choice(group)
        assert row.precision == "fp8-rowwise"
        _same_as_profile(searcher, row, searcher.forward, searcher.cost)
    default = rows(searcher.forward, H100, Space(gpus=32, batch=64, framework="torchtitan"),
                   4096, searcher.cluster)
    assert {r.precision for r in default} == {"bf16", "fp8"}


def test_folded_experts_are_searched_and_their_figures_are_profiles(searchers):
    """`plan --expert-tp 1`: every layout it lists with TP folds its experts (sequence
    parallel, EP 2 or more, EP dividing tp x dp x cp, some beyond dp x cp), and a random layout
    of each of several structures, Megatron-LM's sorts by local expert among them, is
    `profile`'s; a dense model has no experts to fold."""
    searcher = searchers("mixtral-8x7b", 4096)
    space = Space(gpus=32, batch=64, expert_tp=1, framework="megatron")
    found = rows(searcher.forward, H100, space, 4096, searcher.cluster)
    with_tp = [r for r in found if r.tp > 1]
    assert with_tp and all(r.expert_tp == 1 and r.sequence_parallel and r.ep > 1
                           and (r.tp * r.dp * r.cp) % r.ep == 0 for r in with_tp)
    assert any((r.dp * r.cp) % r.ep for r in with_tp)  # spread over the TP ranks too
    rng, sampled = _sampled(searcher, space, 5, 4)
    beyond = next(r for r in with_tp if (r.dp * r.cp) % r.ep)
    for row in [rng.choice(group) for group in sampled] + [beyond]:
        _same_as_profile(searcher, row, searcher.forward, searcher.cost)
    with pytest.raises(OpgraphError, match="has none; leave it out"):
        rows(preset("llama3.2-1b"), H100, Space(gpus=8, batch=8, expert_tp=1), 4096,
             searcher.cluster)


def test_plan_searches_split_and_folded_experts_together(searchers):
    """`plan --expert-tp both`: at every tensor-parallel degree above 1 a layout of each kind
    (the same degrees split and folded: two structures), none folded at TP 1, where they are
    one; a folded layout and its split twin searched together are each `profile`'s, and the
    best of both is the better of each one's best."""
    searcher = searchers("mixtral-8x7b", 4096)
    space = Space(gpus=32, batch=64, expert_tp="both", framework="megatron")
    found = rows(searcher.forward, H100, space, 4096, searcher.cluster)
    assert {r.expert_tp for r in found if r.tp == 1} == {None}
    folded = [r for r in found if r.expert_tp == 1]
    assert folded and all(r.tp > 1 for r in folded)
    twin = next((f, s) for f in folded for s in found
                if s.expert_tp is None and s._replace(expert_tp=1) == f)
    assert structure(twin[0]) != structure(twin[1])
    for row in twin:
        _same_as_profile(searcher, row, searcher.forward, searcher.cost)
    # the best of both is the better of the best of each
    def best(expert_tp):
        found = searcher.search(Space(gpus=16, batch=32, expert_tp=expert_tp,
                                      framework="megatron", zero=1), top=1)
        return found.best[0].result.step_time_s

    assert best("both") == pytest.approx(min(best(None), best(1)), rel=1e-12)
    with pytest.raises(OpgraphError, match="--expert-tp 'all'"):
        Space(gpus=8, batch=8, expert_tp="all")


def test_an_uneven_split_is_profile_too(searchers):
    """Llama 3's own split (7, 8 x 14, 7 layers), compiled by the search as an even one with
    the stages' layers a symbol, without interleaving and interleaved as the paper ran it
    (a middle stage's 8 layers in 1, 2, 4 or 8 chunks, the end stages' outer chunk one layer
    short: `schedule.interleaved_span`): `profile`'s figures."""
    searcher = searchers("llama3.1-405b", 8192)
    forward, c = searcher.forward, searcher.cost
    found = rows(forward, H100, Space(gpus=256, batch=32, tp=8, pp=16, cp=1, zero=1,
                                      micro_batch=1, recompute=("full",), precision=("bf16",),
                                      sequence_parallel=True), 8192, searcher.cluster)
    assert [(r.first_stage_layers, r.last_stage_layers, r.virtual_stages) for r in found] == [
        (7, 7, v) for v in (1, 2, 4, 8)]
    for r in (found[0], found[-1]):
        _same_as_profile(searcher, r, forward, c)


def test_the_space_covers_every_option():
    """Every degree, split and option the issue names is in the space of a mixture of experts
    on enough GPUs: uneven pipeline ends, interleaving, expert parallelism, every ZeRO stage and
    recomputation policy, sequence parallelism, FP8."""
    forward = preset("mixtral-8x7b")
    found = rows(forward, H100, Space(gpus=64, batch=256), 4096,
                 Searcher(forward, H100, seq_len=4096).cluster)
    assert {r.zero for r in found} == {0, 1, 2, 3}
    assert {r.recompute for r in found} == {"none", "selective", "selective-op", "full"}
    assert {r.precision for r in found} == {"bf16", "fp8"}
    assert any(r.ep > 1 for r in found) and any(r.cp > 1 for r in found)
    assert any(r.virtual_stages > 1 for r in found)
    assert any(r.sequence_parallel for r in found) and not any(
        r.sequence_parallel and r.tp == 1 for r in found)
    assert all(r.tp * r.cp * r.pp * r.dp == 64 for r in found)
    assert all(r.batch % (r.dp * r.micro_batch) == 0 for r in found)
    llama = preset("llama3.1-405b")  # 126 layers on 16 stages: Llama 3's 7, 8 x 14, 7
    split = rows(llama, H100, Space(gpus=128, batch=16, tp=8, pp=16, recompute=("full",),
                                    precision=("bf16",), zero=1), 8192,
                 Searcher(llama, H100, seq_len=8192).cluster)
    assert {(r.first_stage_layers, r.last_stage_layers) for r in split} == {(7, 7)}


def test_rows_group_themselves_by_structure():
    """The groups `rows` hands the search as it makes the rows are the rows' structures, each
    with exactly its rows, in the order of each structure's first row (HSDP's replicas and
    the framework's refused stages included)."""
    forward = preset("mixtral-8x7b")
    space = Space(gpus=64, batch=256, framework="torchtitan")
    groups: dict = {}
    found = rows(forward, H100, space, 4096, Searcher(forward, H100, seq_len=4096).cluster,
                 groups)
    expected: dict = {}
    for i, r in enumerate(found):
        expected.setdefault(structure(r), []).append(i)
    assert list(groups.items()) == list(expected.items())
    assert any(r.replicate > 1 for r in found)


def test_branch_and_bound_returns_the_fastest():
    """Every layout of a small space scheduled exactly, sorted: the search's top 5 are those,
    having scheduled only some, and each layout's bound is below its step."""
    forward = preset("llama3.2-1b")
    searcher = Searcher(forward, H100, seq_len=2048, cost=cost_model("calibrated"))
    space = Space(gpus=8, batch=8, recompute=("none", "full"), precision=("bf16",), max_pp=2,
                  max_micro_batch=2, max_cp=2, zero=1)
    found = searcher.search(space, 5)
    fit = searcher.fitting(space)
    pending = searcher._last
    exact = []
    for si, members in enumerate(pending.members):  # every structure any layout may fit
        if not np.isfinite(pending.floor[members]).any():
            continue
        g = searcher._group(pending, si)
        for col in np.flatnonzero(g.fullest <= H100.memory_bytes):
            step = searcher.exact(g, col).step_time_s
            assert max(g.bound[col], pending.floor[pending.members[si][col]]) <= step
            exact.append(step)
    exact.sort()
    assert len(exact) == fit
    assert [r.step_time_s for r in found.best] == pytest.approx(exact[:5], rel=1e-12)
    for t in (exact[len(exact) // 2], exact[-1]):  # --rank's count, upper bounds and all
        assert searcher.faster_than(space, t) == sum(e < t for e in exact)
    assert found.scheduled < fit  # the bounds pruned some
    assert found.searched == len(rows(forward, H100, space, 2048, searcher.cluster))


@pytest.mark.parametrize("model, seq, constraints", [
    ("llama3.2-1b", 4096, {"gpus": 24, "batch": 24}),  # uneven splits (2, 3 x 4, 2) too
    ("mixtral-8x7b", 4096, {"gpus": 16, "batch": 32, "max_pp": 2}),  # expert parallelism
    # FSDP's streams: the experts' (edp) and the rest's (dp), each its own
    ("mixtral-8x7b", 4096, {"gpus": 16, "batch": 32, "pp": 1, "zero": 3, "cp": 4,
                            "precision": ("bf16",), "recompute": ("none",)}),
    ("deepseek-v2-lite", 4096, {"gpus": 8, "batch": 16}),  # the dense layer on stage 0
    # Gemma 2's stack counts L / 2 pairs of layers: one trip is one pair's FLOPs, not 13's
    ("gemma2-2b", 4096, {"gpus": 16, "batch": 32, "pp": 2, "precision": ("bf16",)}),
    # Megatron's FP8 weight casts, cached a step, are weights the stage holds, not saved
    # activations a second time
    ("llama3.2-1b", 4096, {"gpus": 48, "batch": 96, "framework": "megatron", "tp": 2, "pp": 1,
                           "cp": 4, "zero": 0, "recompute": ("selective",),
                           "sequence_parallel": True, "precision": ("fp8",)}),
    # FP8 saves the residual stream the layers carry (31, 32, 32, 31): the most layers hold
    # one buffer of it, not a copy each
    ("llama3.1-405b", 8192, {"gpus": 1024, "batch": 256, "tp": 2, "cp": 1, "pp": 4, "zero": 1,
                             "precision": ("fp8",), "recompute": ("none",)}),
    # FSDP2 gathers a weight twice with recomputation, not three times; DeepSpeed reduces in
    # BF16: the ZeRO moves the bound charges follow the framework
    ("llama3.2-1b", 4096, {"gpus": 16, "batch": 32, "pp": 1, "zero": 3, "framework": "torchtitan",
                           "recompute": ("full", "selective-op")}),
    ("llama3.2-1b", 4096, {"gpus": 16, "batch": 32, "pp": 1, "framework": "deepspeed"}),
    # torchtitan's FSDP over pipeline stages runs as ZeRO-1
    ("llama3.2-1b", 4096, {"gpus": 16, "batch": 32, "pp": 2, "zero": 3,
                           "framework": "torchtitan"}),
    # Megatron's buckets: ZeRO-2's per-micro-batch reductions each pay a share of a call
    ("llama3.2-1b", 4096, {"gpus": 16, "batch": 32, "pp": 1, "zero": 2,
                           "framework": "megatron"}),
])
def test_the_compute_bound_is_below_the_bound_and_the_memory(searchers, model, seq,
                                                             constraints):
    """What the search knows of a row before its structure is compiled (`_compute_bound`,
    from the step before replication and stages) is at most what the compiled structure
    gives: its memory, and its step's bound or, where the structure's bound is the looser
    (an FP8 weight cast once a step splits the structure's runs of ops, so a sequence-parallel
    gather it crosses is not counted there), the row's exact step. On every row of up to 12
    random structures of a space (every ZeRO stage, recomputation policy and precision where
    not fixed). The search skips a structure on it, so a row it overstates could be lost."""
    searcher = searchers(model, seq)
    tight = 0.0
    for group in _sampled(searcher, Space(max_micro_batch=2, **constraints), 11, 12)[1]:
        g = searcher.evaluate(group)
        step, memory = _compute_bound(searcher.compute(group[0]), group, searcher.layers, H100,
                                      searcher.cost, searcher._line)
        for col in np.flatnonzero(step > g.bound):
            assert step[col] <= searcher.exact(g, col).step_time_s, group[col]
        assert (memory <= g.fullest).all(), group[0]
        tight = max(tight, (step / g.bound).max())
    assert tight > 0.9  # not vacuous


def test_the_memory_floor_counts_a_pipelines_micro_batches_in_flight(searchers):
    """1F1B's first stage holds the saved activations of up to `pp` micro-batches at once
    (`distributed.stage_in_flight`); the floor a structure is skipped on counts them, so on a
    4-stage pipeline of Llama 3.2 1B it comes within a fifth of the compiled memory for some
    layout (counting one micro-batch's activations, it stays further below), never above it."""
    searcher = searchers("llama3.2-1b", 4096)
    space = Space(gpus=16, batch=64, pp=4, tp=1, cp=1, zero=1, recompute=("none",),
                  precision=("bf16",))
    (group,) = _sampled(searcher, space, 3, 1)[1]
    g = searcher.evaluate(group)
    _, memory = _compute_bound(searcher.compute(group[0]), group, searcher.layers, H100,
                               searcher.cost, searcher._line)
    assert (memory <= g.fullest).all()
    assert (memory / g.fullest).max() > 0.8


def test_the_bound_sees_the_data_parallel_stream_hold_back_each_backward_layer(searchers):
    """Under ZeRO-3 each layer's backward reduces its gradients and the next layer's
    recomputation gathers its weights again, both on the data-parallel stream, the gather
    started only when its reader needs it: the stream holds every backward layer back by
    their sum (`schedule.cycles`). Across 8 nodes the 1B model's backward is so held, and
    the bound sees it: above 0.72 of the step (0.68 without the cycles), and below it."""
    searcher = searchers("llama3.2-1b", 4096, "roofline")
    space = Space(gpus=64, batch=128, tp=1, cp=1, pp=1, zero=3, recompute=("full",),
                  precision=("bf16",), max_micro_batch=1)
    group = rows(searcher.forward, H100, space, 4096, searcher.cluster)[:1]
    g = searcher.evaluate(group)
    f = g.structure.stages["first"]
    assert any(len(gathers) > 1 and len(reductions) > 1
               for _, _, gathers, reductions in f.cycles.segments)
    step = searcher.exact(g, 0).step_time_s
    assert 0.72 < g.bound[0] / step <= 1


def test_the_bound_waits_for_a_chain_of_collectives(searchers):
    """Under sequence parallelism a mixture of experts' tokens are all-gathered (tp) and then
    sent to their experts (ep all-to-all) before the experts' matmuls read them, the router
    running in between, and the experts' outputs come back the same way, in the backward too:
    the bound counts each chain whole, less the ops between its writer and its reader, so every
    all-to-all is in a chain of two; and the bound is then within 5.5% of the step under the
    shipped calibration (5.0% with its matmul share 0.688 of the ceiling; 5.3% under at 0.675
    while only a collective the very next op reads was counted)."""
    searcher = searchers("mixtral-8x7b", 4096)
    group = rows(searcher.forward, H100,
                 Space(gpus=16, batch=32, tp=2, ep=4, pp=1, cp=1, zero=1, sequence_parallel=True,
                       recompute=("none",), precision=("bf16",), max_micro_batch=2),
                 4096, searcher.cluster)
    g = searcher.evaluate(group)
    f = g.structure.stages["first"]
    chains = [chain for w in f.waits for _, found in w.targets for _, chain, _ in found]
    a2a = [k for k in range(f.n_ops) if f.kinds[k] == "all_to_all"]
    assert len(a2a) == 4
    for k in a2a:
        assert any(k in chain and len(chain) == 2
                   and {f.groups[c] for c in chain} == {"tp", "ep"} for chain in chains)
    for col in range(len(group)):
        assert 0.945 < g.bound[col] / searcher.exact(g, col).step_time_s <= 1


@pytest.mark.parametrize("model, gpus, batch, seq, max_pp, k, framework", [
    ("llama3.2-1b", 32, 64, 4096, None, 20, None),  # data, context, pipeline, tensor parallelism
    ("mixtral-8x7b", 16, 32, 4096, 2, 20, None),  # expert parallelism
    ("deepseek-v2-lite", 16, 32, 4096, None, 8, None),  # two stacks, shared experts: one stage
    # gathers that wait for the compute (no prefetch) and a copy per rank in every ZeRO-3 call
    ("llama3.2-1b", 32, 64, 4096, 1, 8, "deepspeed-0.3"),
])
def test_the_bound_is_below_every_step(searchers, model, gpus, batch, seq, max_pp, k,
                                       framework):
    """A layout's bound (compute, surely-waited collectives, the busiest stream, the
    optimizer's tail) is at most its step, on random layouts of k random structures of a
    space (every ZeRO stage, recomputation, pipeline depth): the branch and bound returns the
    fastest only if so. Its upper bound (every op one at a time) is at least its step: `--rank`
    counts a layout under it as faster unscheduled."""
    searcher = searchers(model, seq)
    space = Space(gpus=gpus, batch=batch, precision=("bf16",), recompute=("none", "full"),
                  max_micro_batch=2, max_pp=max_pp, framework=framework)
    rng, sampled = _sampled(searcher, space, 7, k)
    tight, tight_upper = 0.0, float("inf")
    for rows_ in sampled:
        group = rng.sample(rows_, min(3, len(rows_)))
        g = searcher.evaluate(group)
        for col in range(len(group)):
            step = searcher.exact(g, col).step_time_s
            assert g.bound[col] <= step <= g.upper[col], group[col]
            tight = max(tight, g.bound[col] / step)
            tight_upper = min(tight_upper, g.upper[col] / step)
    assert tight > 0.9  # the bound is not vacuous: some layout's is within 10% of its step
    assert tight_upper < 1.5  # nor the upper one


@pytest.mark.parametrize("framework, cost", [
    ("nanotron", "calibrated"),  # its ZeRO stages reduce after the backward (deferred)
    ("deepspeed-bf16", "roofline"),  # deferred reductions, the updated weights gathered after
    ("megatron", "roofline"),  # FP8 weight casts cached a step: ZeRO-3's gathers for them too
])
def test_the_bound_is_below_every_step_under_each_framework(searchers, framework, cost):
    """As above, for the frameworks whose reductions wait for the backward's end or whose FP8
    weights are cast once a step, FP8 included: a plain micro-batch starts neither a deferred
    reduction nor a gather only a cached cast reads, so the bound counts neither (it counted
    both, up to 2.5 x the step, before)."""
    searcher = searchers("llama3.2-1b", 4096, cost)
    space = Space(gpus=32, batch=64, precision=("bf16", "fp8"),
                  recompute=("none", "full", "selective-op"), max_micro_batch=2,
                  framework=framework)
    rng, sampled = _sampled(searcher, space, 1, 8)
    for rows_ in sampled:
        group = rng.sample(rows_, min(2, len(rows_)))
        g = searcher.evaluate(group)
        for col in range(len(group)):
            assert g.bound[col] <= searcher.exact(g, col).step_time_s, group[col]


def test_interleaving_with_uneven_ends_is_bounded_on_both_sides(searchers):
    """Llama 3.2 1B's 16 layers on 3 or 6 stages split unevenly (5, 6, 5 and 2, 3 x 4, 2),
    interleaved: the schedule is simulated chunk by chunk (`schedule.interleaved_span`), so the
    search bounds it by what that simulation cannot beat (each stage's own micro-batches and
    the fill and drain through chunk 0) and by 1F1B without interleaving. Every such row of
    the space: the compute bound <= the bound <= the step <= the upper bound, the step
    `profile`'s."""
    searcher = searchers("llama3.2-1b", 4096)
    forward, c = searcher.forward, searcher.cost
    by_structure: dict = {}
    for r in rows(forward, H100, Space(gpus=12, batch=24, cp=1, tp=1, precision=("bf16",),
                                       recompute=("none",), zero=1), 4096, searcher.cluster):
        if r.first_stage_layers is not None and r.virtual_stages > 1:
            by_structure.setdefault(structure(r), []).append(r)
    assert {(r.pp, r.first_stage_layers, r.virtual_stages)
            for g in by_structure.values() for r in g} >= {(3, 5, 2), (3, 5, 3), (3, 5, 6),
                                                          (6, 2, 3)}
    tight = 0.0
    for group in by_structure.values():
        g = searcher.evaluate(group)
        floor, _ = _compute_bound(searcher.compute(group[0]), group, searcher.layers, H100,
                                  searcher.cost, searcher._line)
        for col in range(len(group)):
            step = searcher.exact(g, col).step_time_s
            assert floor[col] <= g.bound[col] <= step <= g.upper[col], group[col]
            tight = max(tight, g.bound[col] / step)
    assert tight > 0.8  # not vacuous
    _same_as_profile(searcher, next(iter(by_structure.values()))[-1], forward, c)


def test_memory_filter_keeps_only_layouts_that_fit():
    """Llama 3.1 405B on 128 H100s at 8,192 tokens: every layout returned fits in 80 GB, and on
    8 GPUs none can (its BF16 weights alone are 810 GB)."""
    forward = preset("llama3.1-405b")
    searcher = Searcher(forward, H100, seq_len=8192)
    found = searcher.search(Space(gpus=128, batch=128, recompute=("full",),
                                  precision=("bf16",), tp=8, zero=3, max_pp=2,
                                  max_micro_batch=1), 3)
    assert found.best and found.fit < found.searched
    assert all(r.result.memory.total <= H100.memory_bytes for r in found.best)
    small = searcher.search(Space(gpus=8, batch=8, recompute=("full",), precision=("bf16",)), 3)
    assert small.best == () and small.smallest_memory > H100.memory_bytes


def _plan(cli, *argv):
    return cli("plan", "--model", "llama3.2-1b", "--seq-len", "2048", "--recompute", "none",
               "--precision", "bf16", *argv)


def test_plan_json(cli):
    code, out, _ = _plan(cli, "--gpus", "8", "--global-batch", "32", "--top", "3", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["searched"] >= data["fit"] >= len(data["layouts"]) == 3
    assert data["layouts_per_s"] > 0
    first = data["layouts"][0]
    for key in ("tp", "pp", "cp", "ep", "dp", "zero", "micro_batch", "virtual_stages",
                "sequence_parallel", "recompute", "precision", "step_time_s",
                "tokens_per_s_per_gpu", "mfu", "memory", "bubble_s", "exposed_communication_s"):
        assert key in first
    steps = [x["step_time_s"] for x in data["layouts"]]
    assert steps == sorted(steps)
    # tokens/s per GPU is the step's tokens over its time and the GPUs
    assert first["tokens_per_s_per_gpu"] == pytest.approx(32 * 2048 / first["step_time_s"] / 8)


def test_headroom_keeps_memory_free_of_every_layout(cli):
    """--headroom G: a layout fits where its memory is at most the part's less G GB. Kept just
    above what the best layout leaves free, that layout no longer fits; every layout listed fits
    in the rest, and one that did not fit without it does not come back."""
    argv = ("--gpus", "8", "--global-batch", "32", "--top", "50", "--json")
    code, out, _ = _plan(cli, *argv)
    assert code == 0
    before = json.loads(out)["layouts"]
    most = max(x["memory"]["total"] for x in before)
    headroom = (80e9 - most) / 1e9 + 0.5  # the fullest listed no longer fits
    code, out, _ = _plan(cli, *argv, "--headroom", f"{headroom}")
    assert code == 0
    after = json.loads(out)["layouts"]
    assert after and all(x["memory"]["total"] <= 80e9 - headroom * 1e9 for x in after)
    # under a headroom the table names no layout as filling what is left: the headroom is the
    # user's margin. The best layout then fills 97% of it.
    best = before[0]["memory"]["total"]
    kept = 80 - best / 0.97 / 1e9
    code, out, _ = _plan(cli, *argv, "--headroom", f"{kept}")
    listed = json.loads(out)["layouts"]
    assert any(x["memory"]["total"] >= 0.95 * (80e9 - kept * 1e9) for x in listed)
    code, out, _ = _plan(cli, *argv[:-1], "--headroom", f"{kept}")
    assert code == 0 and "of each GPU's memory or more" not in out
    fullest = [x for x in before if x["memory"]["total"] == most]
    key = ("tp", "pp", "cp", "dp", "zero", "micro_batch", "virtual_stages", "recompute")
    assert not {tuple(x[k] for k in key) for x in fullest} & {tuple(x[k] for k in key)
                                                             for x in after}
    # 0, what the help calls the default, keeps nothing free: the same layouts as without it
    code, out, _ = _plan(cli, *argv, "--headroom", "0")
    assert code == 0 and json.loads(out)["layouts"] == before


@pytest.mark.parametrize("emit, framework", [("torchtitan", "torchtitan"),
                                             ("torchtitan", "torchtitan-2024"),
                                             ("megatron", "megatron")])
def test_emitted_config_profiles_back_to_the_same_figures(cli, tmp_path, emit, framework):
    """The best layout torchtitan (or Megatron-LM) can express, emitted, then read by
    `profile --torchtitan` (`--megatron-args`): the plan's figures, each layout ranked as the
    framework it is written for runs it (`--emit X` plans as `--framework X`, or as the row of
    that framework `--framework` names: torchtitan-2024)."""
    argv = ("plan", "--model", "llama3-8b", "--gpus", "16", "--global-batch", "32",
            "--seq-len", "4096", "--recompute", "full", "--precision", "bf16",
            "--zero", "3", "--cp", "1", "--max-pp", "2", "--max-micro-batch", "2",
            "--max-virtual-stages", "2", "--framework", framework)
    code, out, _ = cli(*argv, "--top", "30", "--json")
    ranked = json.loads(out)["layouts"]
    code, text, _ = cli(*argv, "--top", "1", "--emit", emit)
    assert code == 0
    path = tmp_path / ("job.toml" if emit == "torchtitan" else "args.txt")
    path.write_text(text)
    flag = "--torchtitan" if emit == "torchtitan" else "--megatron-args"
    code, out, _ = cli("profile", flag, str(path) if emit == "torchtitan" else f"@{path}",
                       "--cost", "calibrated", "--json")
    assert code == 0
    prof = json.loads(out)
    keys = ("tp", "pp", "cp", "dp", "micro_batch", "virtual_stages", "zero", "replicate",
            "sequence_parallel")
    (best,) = [x for x in ranked if all(x[k] == prof["parallel"][k] for k in keys)
               and (x["recompute"], x["precision"]) == (prof["recompute"], prof["precision"])]
    if emit == "megatron":  # Megatron-LM can express the best one
        assert best == ranked[0]
    for name in ("step_time_s", "mfu", "bubble_s", "exposed_communication_s"):
        assert prof[name] == pytest.approx(best[name], rel=1e-9, abs=1e-12), name
    assert prof["memory"]["total"] == best["memory"]["total"]


def test_scaling_curve_and_plot(cli, tmp_path):
    plot = tmp_path / "curve.png"
    code, out, _ = _plan(cli, "--gpus", "8:32:x2", "--global-batch", "64", "--top", "1",
                         "--json", "--plot", str(plot), "--tp", "1")
    assert code == 0
    sizes = json.loads(out)["sizes"]
    assert [s["gpus"] for s in sizes] == [8, 16, 32]
    assert all(s["layouts"][0]["gpus"] == s["gpus"] for s in sizes)
    assert plot.stat().st_size > 1000
    code, out, _ = _plan(cli, "--gpus", "8:32:x2", "--global-batch", "64", "--top", "1",
                         "--tp", "1")
    assert code == 0 and len(out.strip().splitlines()) == 1 + 1 + 3


def test_rank_of_a_constrained_layout(cli):
    code, out, _ = cli("plan", "--model", "llama3.2-1b", "--seq-len", "2048", "--gpus", "8",
                       "--global-batch", "16", "--top", "1", "--tp", "2", "--recompute", "full",
                       "--precision", "bf16",
                       "--max-pp", "1", "--max-cp", "1", "--max-micro-batch", "2", "--json",
                       "--rank")
    ranking = json.loads(out)["ranking"]
    assert ranking["rank"] > 1 and ranking["slower_than_best"] > 0
    assert ranking["best"]["tp"] != 2 or ranking["best"]["recompute"] != "full"
    assert ranking["best"]["precision"] == "bf16"  # --precision is kept: not a layout


@pytest.mark.parametrize("argv, words", [
    (("--gpus", "8", "--global-batch", "32", "--tp", "3"), "no layout"),
    (("--gpus", "8", "--global-batch", "32", "--tp", "8", "--max-tp", "4"), "contradicts"),
    (("--gpus", "8", "--global-batch", "32", "--tp", "1", "--sequence-parallel"), "contradicts"),
    (("--gpus", "7", "--global-batch", "32"), "no layout"),
    (("--gpus", "8", "--global-batch", "32", "--plot", "x.png"), "range"),
    (("--gpus", "8", "--tokens", "1000"), "multiple"),
    (("--gpus", "8:32:x2", "--global-batch", "32", "--emit", "megatron"), "one --gpus"),
    (("--gpus", "8", "--global-batch", "32", "--emit", "megatron", "--json"), "not both"),
    (("--gpus", "8", "--global-batch", "32", "--emit", "megatron", "--rank"), "not both"),
    (("--gpus", "8", "--global-batch", "32", "--emit", "megatron", "--framework", "deepspeed"),
     "--framework deepspeed"),
    (("--gpus", "8", "--global-batch", "32", "--micro-batch", "32"), "contradicts"),
    (("--gpus", "8", "--global-batch", "32", "--precision", "fp8", "--hardware", "a100-sxm-80gb"),
     "FP8"),
    (("--gpus", "8", "--global-batch", "32", "--headroom", "80"), "leaves nothing"),
    (("--gpus", "8", "--global-batch", "32", "--headroom", "-1"), "0 or more"),
])
def test_bad_input_is_one_line(cli, argv, words):
    code, out, err = _plan(cli, *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and words in err and "Traceback" not in err


def test_a_model_that_fits_nowhere(cli):
    code, _, err = cli("plan", "--model", "llama3.1-405b", "--gpus", "8", "--global-batch", "8",
                       "--recompute", "full", "--precision", "bf16", "--tp", "8")
    assert code == 2 and "fits in memory" in err and "GB per GPU" in err


def test_sequence_parallel_constraint_keeps_only_tensor_parallel_layouts():
    forward = preset("llama3.2-1b")
    found = rows(forward, H100, Space(gpus=8, batch=8, sequence_parallel=True), 2048,
                 Searcher(forward, H100, seq_len=2048).cluster)
    assert found and all(r.sequence_parallel and r.tp > 1 for r in found)


def test_space_rejects_contradictions():
    with pytest.raises(OpgraphError, match="contradicts"):
        Space(gpus=8, batch=8, pp=1, virtual_stages=2)
    with pytest.raises(OpgraphError, match="--recompute 'some': give one of none"):
        Space(gpus=8, batch=8, recompute=("some",))
    with pytest.raises(OpgraphError, match="write it 'selective:moe_act\\+moe'"):
        Space(gpus=8, batch=8, recompute=("selective:moe,moe_act",))


@pytest.mark.parametrize("model, seq, constraints", [
    ("llama3.2-1b", 4096, {"gpus": 32, "batch": 64}),
    ("llama3.2-1b", 4096, {"gpus": 16, "batch": 32, "async_tp": True}),
    ("mixtral-8x7b", 4096, {"gpus": 16, "batch": 32, "max_pp": 2}),
])
def test_a_steady_state_stack_is_what_running_every_layer_gives(searchers, model, seq,
                                                               constraints, monkeypatch):
    """`schedule.simulate` steps over a layer stack's last layers once two run alike; drawing a
    timeline runs every layer. Both give the same span, compute, communication and waits, on
    both micro-batches of every stage of random layouts of 20 random structures (every ZeRO
    stage, recomputation, pipeline depth; context and expert parallelism, async TP)."""
    from opgraph.parallel import schedule
    from opgraph.parallel.distributed import _times
    from opgraph.parallel.schedule import simulate
    from opgraph.parallel.search.bounds import _job

    stepped = []
    repeat = schedule.Streams._repeat
    monkeypatch.setattr(schedule.Streams, "_repeat", lambda self, trip, left: (
        stepped.append(left), repeat(self, trip, left))[1])

    searcher = searchers(model, seq)
    forward = searcher.forward
    rng, sampled = _sampled(searcher, Space(max_micro_batch=2, precision=("bf16",),
                                            **constraints), 5, 20)
    for group in sampled:
        row = rng.choice(group)
        g = searcher.evaluate([row])
        job = _job(g, 0, forward, H100, searcher.cluster, row.batch * seq, searcher.n_mfu,
                   searcher.values, searcher.layers)
        for stage in job.stages:
            times = _times(stage, job, searcher.cost)
            for planned in (stage.plain, stage.last):
                fast, every = (simulate(planned, times, async_tp=row.async_tp,
                                        keep_events=keep) for keep in (False, True))
                assert fast.time_s == pytest.approx(every.time_s, rel=1e-9), row
                assert fast.compute_s == pytest.approx(every.compute_s, rel=1e-9)
                for name, seconds in every.comm_s.items():
                    assert fast.comm_s[name] == pytest.approx(seconds, rel=1e-9, abs=1e-15)
                    assert fast.exposed_s[name] == pytest.approx(every.exposed_s[name],
                                                                 rel=1e-9, abs=1e-15), name
                    assert fast.queued_s[name] == pytest.approx(every.queued_s[name],
                                                                rel=1e-9, abs=1e-15), name
    assert sum(stepped) > 20 * 4  # most layers were stepped over, not run


def test_a_pass_added_to_the_pipeline_runs_in_plan(cli, monkeypatch):
    """The search keys its shared passes by the pipeline's own declarations
    (`pipeline.pass_key`), not by a list of its own: a pass added to `step_passes` runs in
    `plan` (it used to raise KeyError) and, changing nothing, leaves its answer as it was."""
    from opgraph.core import contracts, pipeline
    from opgraph.parallel.parallel import Parallel
    from opgraph.passes.shard import shard as shard_pass

    _, out, _ = _plan(cli, "--gpus", "8", "--global-batch", "8", "--top", "2", "--json")
    before = [x["step_time_s"] for x in json.loads(out)["layouts"]]
    seen = []

    def note_it(graph, note):  # a pure pass in all but its note that it ran
        seen.append(note)
        return graph

    original = pipeline.step_passes
    monkeypatch.setattr(pipeline, "step_passes", lambda **options: [
        *original(**options), functools.partial(note_it, note="ran")])
    code, out, err = _plan(cli, "--gpus", "8", "--global-batch", "8", "--top", "2", "--json")
    assert code == 0, err
    assert seen and set(seen) == {"ran"}
    assert [x["step_time_s"] for x in json.loads(out)["layouts"]] == before
    # a layout's degrees are symbols of the sharded graph: only which exceed 1 makes a new key
    key = pipeline.pass_key
    shard = dict(contracts.placement_of(shard_pass).structure)["layout"]
    assert shard(Parallel(tp=2, dp=4)) == shard(Parallel(tp=4, dp=2)) != shard(Parallel(dp=8))
    assert key(functools.partial(note_it, note="a")) != key(functools.partial(note_it, note="b"))


def test_the_bound_counts_megatrons_reductions_as_replicate_charges_them():
    """The cheap bound's data-parallel stream (`_moved`) charges each ZeRO-2 gradient
    reduce-scatter the share of a call `replicate` gives it under Megatron's buckets, so the
    bound reads the same latency the step pays: per micro-batch, the sum of the reductions'
    counts times their calls."""
    from opgraph.parallel.distributed import compile_parallel
    from opgraph.parallel.frameworks import FRAMEWORKS
    from opgraph.core.ir import Phase
    from opgraph.parallel.parallel import Parallel
    from opgraph.passes.evaluate import resolve
    from opgraph.core.pipeline import compile_step
    from opgraph.parallel.search.bounds import _moved

    forward = preset("llama3-8b")
    layout = Parallel(tp=2, dp=8, zero=2, framework="megatron")
    step = compile_parallel(forward, layout)
    subs = resolve(step, {})
    costs = cost_model("calibrated").op_costs(step)
    charged = sum(float((op.count * costs[op.name].calls).xreplace(subs)) for op in step.ops()
                  if op.kind == "reduce_scatter" and op.param("group") == "dp"
                  and op.phase is Phase.BACKWARD)
    before = compile_step(forward, layout=layout, replicated=False)  # before `replicate`
    parts = _moved(before, None, True, FRAMEWORKS["megatron"].buckets_grads)
    # `_moved` gives (gathered, gathers, reduced, reductions) for each of the stack and the
    # ends, each of dp and edp: the reductions are every fourth; with no stack, all are ends
    reductions = sympy.Add(*parts[3::4])
    assert float(reductions.xreplace(subs)) == pytest.approx(charged, rel=1e-9)
    calls = sum(float(sympy.sympify(op.count).xreplace(subs))
                for op in step.ops() if op.kind == "reduce_scatter"
                and op.param("group") == "dp" and op.phase is Phase.BACKWARD)
    assert charged < calls / 2  # a call per weight would charge every reduction one


def test_a_pipeline_balances_the_decoder_layers_of_a_model_with_dense_first_layers():
    """A model with layers before the stack the pipeline splits (DeepSeek's dense-first ones,
    on the first stage) is split with its decoder layers balanced: each middle stage takes
    c = ceil(all / stages), the first stage c less the dense ones, the last the rest. For
    DeepSeek-V3's 61 layers (3 dense) that is Megatron-Bridge's own layouts: on 16 stages 4
    (3 dense and 1), 4 x 14, 1; on 8 stages 8 (3 and 5), 8 x 6, 5; on 4, 16 (3 and 13), 16,
    16, 13 (`recipes/deepseek/deepseek_v3.py`, layout_map)."""
    import attrs

    from opgraph.models import deepseek
    from opgraph.parallel.search.space import _splits
    from opgraph.passes.split_stages import layers_before

    v3 = deepseek.build(attrs.evolve(deepseek.DEEPSEEK_V2_LITE, layers=61, first_dense=3,
                                     mtp_depth=1))
    assert layers_before(v3) == 3
    assert _splits(58, 16, v3) == [(1, 1)] and 1 + 14 * 4 + 1 == 58
    assert _splits(58, 8, v3) == [(5, 5)] and 5 + 6 * 8 + 5 == 58
    assert _splits(58, 4, v3) == [(13, 13)] and 13 + 2 * 16 + 13 == 58
    lite = preset("deepseek-v2-lite")  # 27 layers: 1 dense, 26 of experts
    assert layers_before(lite) == 1 and layers_before(preset("llama3-8b")) == 0
    assert _splits(26, 3, lite) == [(8, 9)]  # 9 decoder layers on each stage
    assert _splits(26, 2, lite) == [(None, None)]  # even where it divides
    rows_ = rows(lite, H100, Space(gpus=3, batch=3, pp=3, tp=1, ep=1), 4096,
                 Searcher(lite, H100, seq_len=4096).cluster)
    assert rows_ and {(r.first_stage_layers, r.last_stage_layers) for r in rows_} == {(8, 9)}


def test_an_odd_layer_stack_splits_over_two_stages_in_plan_and_profile_alike():
    """Gemma 2's stack is 13 pairs of layers: two stages take 7 and 6 under the generic
    framework (the head's one fewer, `distributed.uneven_ends`) and nanotron's own split under
    nanotron (`frameworks.own_split`: its blocks' costs), and the planner's figure is
    `profile`'s for the same layout."""
    forward = preset("gemma2-2b")
    nanotron = end_split(own_split(forward, 2, "nanotron"))
    for framework in (None, "nanotron"):
        searcher = Searcher(forward, H100, seq_len=4096, cost=cost_model("roofline"))
        space = Space(gpus=16, batch=32, tp=2, pp=2, zero=1, sequence_parallel=True,
                      recompute=("none",), precision=("bf16",), max_micro_batch=1,
                      framework=framework)
        found = searcher.search(space, top=1).best[0]
        layout = found.layout
        assert (layout.first_stage_layers, layout.last_stage_layers) == (
            (13 - 13 // 2, 13 // 2) if framework is None else nanotron)
        step = profile_parallel(forward, H100, layout, cost=cost_model("roofline"),
                                values={"S": 4096}).parallel.step_time_s
        assert found.step_time_s == pytest.approx(step, rel=1e-9)


def test_the_rows_columns_are_each_rows_own_figures():
    """`bounds._columns` reads the rows into arrays once and works out each rule of a few
    fields once per distinct value of them: every column equals the row's own figure, the
    rule applied to the row itself, over rows of every framework, ZeRO stage, pipeline split
    and interleaving, some with the gradient reduction not overlapped."""
    from opgraph.parallel.frameworks import defers_grad_reduce, sharding
    from opgraph.parallel.search.bounds import ROLES, _columns, _stage_layers
    from opgraph.core.symbols import B, cp, dp, edp, ep, tp

    forward = preset("llama3.2-1b")
    searcher = Searcher(forward, H100, seq_len=2048)
    found = []
    for framework in (None, "megatron", "torchtitan", "deepspeed", "nanotron"):
        found += rows(forward, H100, Space(gpus=16, batch=32, framework=framework), 2048,
                      searcher.cluster)
    picked = random.Random(5).sample(found, 3000)
    picked = [r._replace(overlap_grad_reduce=False) if i % 3 == 0 else r
              for i, r in enumerate(picked)]
    assert {r.framework for r in picked} == {None, "megatron", "torchtitan", "deepspeed",
                                             "nanotron"}
    assert {r.pp for r in picked} >= {1, 2, 4} and {r.virtual_stages for r in picked} > {1}
    cols = _columns(picked, searcher.layers)
    expected = {tp: [r.tp for r in picked], cp: [r.cp for r in picked],
                ep: [r.ep for r in picked], dp: [r.size("dp") for r in picked],
                edp: [r.size("edp") for r in picked], B: [r.micro_batch for r in picked]}
    for symbol, values in expected.items():
        assert cols.env[symbol].tolist() == values, symbol
    assert cols.p.tolist() == [r.pp for r in picked]
    assert cols.m.tolist() == [r.micro_batches for r in picked]
    assert cols.v.tolist() == [r.virtual_stages for r in picked]
    assert cols.zero.tolist() == [sharding(r) for r in picked]
    for role in ROLES:
        assert cols.layers[role].tolist() == [
            _stage_layers(r, searcher.layers).get(role, 0) for r in picked], role
    assert cols.chunked.tolist() == [
        float(r.virtual_stages > 1 and (r.first_stage_layers, r.last_stage_layers)
              != (None, None)) for r in picked]
    deferred = cols.deferred.tolist()
    assert deferred == [defers_grad_reduce(r) for r in picked]
    assert any(deferred) and not all(deferred)


def test_memory_alone_is_the_structures_memory():
    """`fitting` compiles a structure no search needed for its stages' memory alone
    (`bounds._compile_memory`); each row's memory from that is the full structure's, row by
    row, over structures of every pipeline depth, ZeRO stage and recomputation policy."""
    from opgraph.parallel.search.bounds import (_compile_memory, _memory_of, _representative,
                                                _roles, _step)
    from opgraph.passes.split_stages import split_stages

    forward = preset("llama3.2-1b")
    searcher = Searcher(forward, H100, seq_len=2048)
    found = rows(forward, H100, Space(gpus=16, batch=32, max_micro_batch=2), 2048,
                 searcher.cluster)
    groups: dict = {}
    for r in found:
        groups.setdefault(structure(r), []).append(r)
    picked = random.Random(3).sample(sorted(groups.values(), key=len), 12)
    assert {g[0].pp > 1 for g in picked} == {True, False}
    for group in picked:
        full = searcher.evaluate(group).fullest
        r = group[0]
        layout = _representative(r, searcher.layers)
        step = _step(forward, r, layout, {})
        stages = {role: _compile_memory(split_stages(step, layout, i), searcher.values,
                                        searcher.layers, {}, searcher.program)
                  for role, i in _roles(layout.pp)}
        assert _memory_of(stages, group, searcher.layers).tolist() == full.tolist()


def test_the_overlap_slowdown_adds_its_least_share_to_the_bound():
    """`_slowed`: a step is at least max(bound, C + W) + s x max(0, T - W) over every wait W,
    least at W = bound - C. Compute 1.8 s and a bound of 2.0 leave 0.2 s of waits; 1.0 s of
    communication then hides at least 0.8 s, slowing compute by 10% of it; none where the
    waits can cover it all, or with no slowdown."""
    from opgraph.parallel.search.bounds import _slowed

    bound, computed = np.array([2.0, 2.0, 1.0]), np.array([1.8, 1.8, 1.5])
    communicated = np.array([1.0, 0.1, 0.5])
    assert _slowed(bound, computed, communicated, 0.1) == pytest.approx([2.08, 2.0, 1.55])
    assert (_slowed(bound, computed, communicated, 0.0) == bound).all()


def test_a_pass_shared_between_layouts_keeps_frameworks_apart():
    """A search shares each pass's result between the layouts whose passes read the same
    (`pipeline.pass_key`, from what each pass declares it reads); Megatron-LM pads the
    vocabulary's tensor-parallel shard and the generic model does not, so the same degrees
    under each compile apart: through one shared memo, in either order, each step is the one
    `compile_parallel` makes on its own."""
    from opgraph.core import pipeline
    from opgraph.parallel.distributed import compile_parallel
    from opgraph.parallel.parallel import Parallel

    f = preset("llama3.2-1b")
    layouts = [Parallel(tp=2, dp=2, zero=1, sequence_parallel=True, framework=fw)
               for fw in (None, "megatron", "nanotron")]
    for order in (layouts, layouts[::-1]):
        memo: dict = {}
        for layout in order:
            graph, key = f, ()
            for run in pipeline.step_passes(layout=layout):
                key += (pipeline.pass_key(run),)
                if key not in memo:
                    memo[key] = run(graph)
                graph = memo[key]
            assert str(graph) == str(compile_parallel(f, layout)), layout.framework
