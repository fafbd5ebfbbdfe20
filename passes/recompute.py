"""recompute: run chosen forward ops again in the backward instead of keeping their outputs.

Invariant established: for the policy's ops (forward ops inside a layer region), the graph has
one op of phase `recompute` each, `<op>.re`: the same kind, parameters, count and region, its
`forward` link naming the op it re-runs, reading the re-run copies of its inputs where those are
re-run too and the kept forward tensors otherwise, and writing copies of the op's outputs
(`re.<tensor>`). Every backward kernel inside a region reads the re-run copy of a tensor instead
of the forward's, so the forward's is no longer saved for the backward (`opgraph.cost.memory`). A
region's handed carry (the layer's output, the next layer's input) is the checkpoint: it is kept,
never swapped for a copy. Nothing is costed here: a re-run op costs what its kind's rules say,
exactly its forward op's FLOPs and bytes, and its FLOPs count in the HFU, never in the MFU (6 N
tokens does not read the graph's FLOPs).

Policies (`POLICIES`, or any predicate `(graph, op) -> bool` over forward ops in a region):

- "none": nothing re-run.
- "selective" (Megatron-LM's selective recomputation, Korthikanti et al. 2022): the attention
  core is re-run, the ops of kinds in ATTENTION_CORE (unfused: the scores and the P.V product;
  fused: the FlashAttention kernel). Unfused, this frees the S x S score matrix each layer keeps.
  Fused, FlashAttention keeps no S x S matrix anyway: `selective` then re-runs the kernel (as
  Megatron with Transformer Engine's `checkpoint_core_attention` does) and frees only its output
  O, which the backward kernels read from the re-run; it mostly costs time.
- "selective-op" (torchtitan's per-op selective checkpointing): the outputs of the ops in
  SAVE_KINDS (the matrix multiplies and the attention kernel) are kept; every other op of the
  layer is re-run. (torchtitan also re-runs every second matmul; that is not modelled.)
- "full": every op of the layer is re-run before its backward; each layer keeps only its input,
  the region's carried tensor.

    >>> from opgraph.models import preset
    >>> from opgraph.core.pipeline import compile_step
    >>> step = compile_step(preset("llama3-8b"), recompute="full")
    >>> step.op("layers.q_proj.re").phase.value
    'recompute'
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from opgraph.core import rules
from opgraph.core.contracts import RECOMPUTE, contract, step_pass
from opgraph.core.errors import OpgraphError
from opgraph.core.ir import Graph, Op, Phase

ATTENTION_CORE = ("attention_scores", "flash_attention")  # and the P.V matmul that reads scores
SAVE_KINDS = rules.KEPT  # the matmuls and the attention kernel (a kind's `kept`)


def _none(graph: Graph, op: Op) -> bool:
    return False


def _reads_scores(graph: Graph, op: Op) -> bool:
    """Whether `op` reads a score matrix: an `attention_scores` op's output, or that output
    after a dropout (`_attention_core`)."""
    return any((p := graph.producer(n)) is not None and (
        p.kind == "attention_scores" or p.kind == "dropout" and _reads_scores(graph, p))
        for n in op.inputs)


def _attention_core(graph: Graph, op: Op) -> bool:
    """The attention core: the scores (or the fused kernel), the dropout of the probabilities
    where there is one, and the per-head matmul P.V that reads them (Korthikanti et al.'s
    selective recomputation re-runs all of these, the 5as/h of a layer's activations)."""
    if op.kind in ATTENTION_CORE:
        return True
    if op.kind == "dropout":
        return _reads_scores(graph, op)
    return op.kind == "matmul" and op.param("heads") is not None and _reads_scores(graph, op)


def _not_saved_kind(graph: Graph, op: Op) -> bool:
    return op.kind not in SAVE_KINDS


def _everything(graph: Graph, op: Op) -> bool:
    return True


POLICIES: dict[str, Callable[[Graph, Op], bool]] = {
    "none": _none,
    "selective": _attention_core,
    "selective-op": _not_saved_kind,
    "full": _everything,
}


@attrs.frozen
class Recomputed:
    """What the pass re-ran: the re-run ops, and the forward tensors the backward kernels now
    read from the re-run instead (saved no more, unless a re-run op or a kernel outside the
    layer still reads them)."""

    ops: tuple[str, ...]
    freed: tuple[str, ...]


def copy_name(tensor: str) -> str:
    """The name of a tensor's re-run copy: `re.layers.q_proj`."""
    return f"re.{tensor}"


def _policy(policy) -> Callable[[Graph, Op], bool]:
    if callable(policy):
        return policy
    try:
        return POLICIES[policy]
    except KeyError:
        raise OpgraphError(f"unknown recompute policy {policy!r}; choose one of "
                           f"{', '.join(POLICIES)}") from None


def _handed(graph: Graph) -> set[str]:
    return {handed for region in graph.regions() for _, handed in region.carries}


def plan(graph: Graph, policy="none") -> list[Op]:
    """The forward ops `policy` re-runs, in execution order: the forward ops inside a region
    it chooses."""
    if not any(op.phase is Phase.BACKWARD for op in graph.ops()):
        raise ValueError(f"graph {graph.name} has no backward: run derive_backward first")
    chosen = _policy(policy)
    return [op for op in graph.ops()
            if op.phase is Phase.FORWARD and op.region is not None and chosen(graph, op)]


def rewrite_recompute(graph: Graph, policy="none") -> tuple[Graph, Recomputed]:
    """The graph with `policy`'s ops re-run in the backward, and what was re-run."""
    ops = plan(graph, policy)
    if not ops:
        return graph.copy(), Recomputed((), ())
    if any(op.phase is Phase.RECOMPUTE for op in graph.ops()):
        raise ValueError(f"graph {graph.name} is already recomputed")
    out = graph.copy()
    keep = _handed(graph)
    copies: dict[str, str] = {}  # forward tensor -> its re-run copy
    for op in ops:
        outs = []
        for name in op.outputs:
            t = graph.tensor(name)
            out.add_tensor(attrs.evolve(t, name=copy_name(name)))
            outs.append(copy_name(name))
        ins = [copies.get(n, n) for n in op.inputs]
        out.add_op(attrs.evolve(op, name=f"{op.name}.re", inputs=ins, outputs=outs,
                                phase=Phase.RECOMPUTE, forward=op.name))
        copies |= {n: copy_name(n) for n in op.outputs if n not in keep}
    freed = set()
    for op in graph.ops():
        if op.phase is not Phase.BACKWARD or op.region is None:
            continue
        reads = [copies.get(n, n) for n in op.inputs]
        if reads != list(op.inputs):
            freed |= {n for n in op.inputs if n in copies}
            out.replace_op(attrs.evolve(op, inputs=reads))
    return out, Recomputed(tuple(f"{op.name}.re" for op in ops), tuple(sorted(freed)))


@step_pass(at=RECOMPUTE,
           bind=lambda o: o.recompute != "none" and {"policy": o.recompute})
@contract(requires=("backward",), forbids=("recomputed",))
def recompute(graph: Graph, policy="none") -> Graph:
    """`graph` (a step with its backward) with `policy`'s ops re-run before the backward
    reads them: `recompute(derive_backward(forward), "full")`. `policy` is a name of
    POLICIES or a predicate `(graph, op) -> bool` over the forward ops inside a region."""
    return rewrite_recompute(graph, policy)[0]


__all__ = ["ATTENTION_CORE", "POLICIES", "SAVE_KINDS", "Recomputed", "copy_name", "plan",
           "recompute", "rewrite_recompute"]
