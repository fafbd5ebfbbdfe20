"""Pass contracts (`opgraph.core.contracts`): a pass says what its input graph must hold, the driver
(`pipeline.run_passes`) checks it before the pass runs and verifies the graph after it."""

import functools

import pytest
from opgraph.core.contracts import FACTS, Contract, contract, contract_of
from opgraph.models import preset
from opgraph.parallel.parallel import Parallel
from opgraph.core.pipeline import run_passes, step_passes
from opgraph.core.verify import VerifyError
from passes.replicate import replicate

from opgraph import (OpgraphError, apply_precision, attach_adamw, derive_backward, fuse_attention,
                     recompute)

FORWARD = preset("llama3-8b")


def test_replicate_before_the_optimizer_is_refused():
    """Before `attach_adamw` the step has no optimizer reading the gradients, so `replicate`
    would shard nothing and reduce nothing (it verified with 0 gradient collectives of 22)."""
    order = [derive_backward, functools.partial(replicate, layout=Parallel(dp=8, zero=1)),
             attach_adamw]
    with pytest.raises(OpgraphError, match="replicate needs a graph with an optimizer; run "
                                           "attach_adamw before it"):
        run_passes(FORWARD, order)


def test_precision_after_recompute_is_refused():
    """After `recompute` the re-run forward copies would keep BF16: the cast must come first."""
    order = [derive_backward, functools.partial(recompute, policy="full"),
             functools.partial(apply_precision, precision="fp8")]
    with pytest.raises(OpgraphError, match="apply_precision runs on a graph without a "
                                           "recomputation; run it before recompute"):
        run_passes(FORWARD, order)


def test_a_pass_without_a_contract_runs_where_it_is_put():
    """`fuse_attention` fuses a step's attention cores before or after the backward is derived
    (`tests/test_passes.py` compares the two), so it declares nothing and the driver lets it run
    after `derive_backward`."""
    assert contract_of(fuse_attention) is None
    step = run_passes(FORWARD, [derive_backward, fuse_attention, attach_adamw])
    assert any(op.kind == "flash_attention_backward" for op in step.ops())


def test_every_built_in_order_keeps_every_contract():
    """The pipeline's own orders (every recompute policy and precision, sharded and not) run
    through the driver: each pass's contract holds where the pipeline puts it."""
    from opgraph.parallel.distributed import compile_parallel

    for recompute_policy in ("none", "full"):
        for precision in ("bf16", "fp8"):
            run_passes(FORWARD, step_passes(recompute=recompute_policy, precision=precision))
    compile_parallel(FORWARD, Parallel(tp=2, dp=4, zero=1, sequence_parallel=True,
                                       framework="megatron"))


def test_a_pass_that_breaks_the_graph_is_named():
    """Verified after each pass, a malformed graph names the pass that made it."""
    import attrs

    def halve_a_projection(graph):  # its output no longer what its kind's shape rule gives
        out = graph.copy()
        t = out.tensor(out.op("layers.q_proj").outputs[0])
        out.replace_tensor(attrs.evolve(t, shape=(*t.shape[:-1], t.shape[-1] / 2)))
        return out

    with pytest.raises(VerifyError, match="after pass halve_a_projection"):
        run_passes(FORWARD, [halve_a_projection])


def test_a_contract_names_only_known_facts_and_stays_on_its_pass():
    with pytest.raises(ValueError, match="unknown facts"):
        Contract(requires=("speed",))

    @contract(requires=("backward",))
    def mine(graph):
        return graph

    assert contract_of(mine) == Contract(("backward",), ())
    assert contract_of(functools.partial(mine)) == contract_of(mine)
    assert mine(FORWARD) is FORWARD  # the pass itself is unchanged
    assert set(FACTS) >= {"backward", "recomputed", "optimizer", "replicated"}
    with pytest.raises(OpgraphError, match="mine needs a graph with a backward"):
        run_passes(FORWARD, [mine])
