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
- "selective:" and Megatron-Core's modules (its `--recompute-modules`, RECOMPUTE_MODULES:
  core_attn, layernorm, moe_act, moe, shared_experts, mlp, mla_up_proj) joined by "+": the
  ops each re-runs, found from the dataflow (`blocks`: a layer's residual blocks, each a norm
  read from the residual stream and the ops up to the add that joins the stream; `_module_ops`
  says which of a block's ops each module takes). Megatron's output-discarding modules
  (layernorm, moe_act, mla_up_proj) and its checkpointed ones (moe, mlp, shared_experts) both
  come out as a re-run whose outputs the backward reads instead of kept ones.

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
from opgraph.core.choices import RECOMPUTE_MODULES, SELECTIVE, recompute_policy
from opgraph.core.contracts import RECOMPUTE, contract, step_pass
from opgraph.core.ir import Graph, Op, Phase

ATTENTION_CORE = ("attention_scores", "flash_attention")  # and the P.V matmul that reads scores
SAVE_KINDS = rules.KEPT  # the matmuls and the attention kernel (a kind's `kept`)
MODULES = RECOMPUTE_MODULES  # Megatron-Core's recompute modules ("selective:core_attn+moe")


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


# --- Megatron-Core's modules ("selective:layernorm+moe"): each layer's residual blocks -------

NORMS = ("rmsnorm", "layernorm")
ACTIVATIONS = ("swiglu", "geglu", "gelu", "relu", "relu2")


@attrs.frozen
class Block:
    """One residual block of a layer: its `norm` (read from the residual stream), the ops
    after it up to the add that joins its output to the stream (`ops`, in order), and its kind:
    "attention", "moe" (it routes to experts), "mamba" (it scans along the sequence) or "mlp"."""

    norm: Op
    ops: tuple[Op, ...]
    kind: str


def blocks(graph: Graph) -> list[Block]:
    """Each region's residual blocks, found from the dataflow: the residual stream is the
    region's entering carries and every `add` that reads the stream; a block opens at a norm
    that reads the stream and holds every forward op downstream of it, within the region, that
    does not read the stream itself (the residual add, the next block's norm)."""
    out = []
    for region in graph.regions():
        ops = [op for op in graph.ops()
               if op.phase is Phase.FORWARD and op.region == region.name]
        stream = {entering for entering, _ in region.carries}
        for op in ops:
            if op.kind == "add" and any(n in stream for n in op.inputs):
                stream.update(op.outputs)
        for norm in ops:
            if norm.kind not in NORMS or norm.inputs[0] not in stream:
                continue
            inside, frontier = set(), list(norm.outputs)
            while frontier:
                for reader in graph.consumers(frontier.pop()):
                    if (reader.phase is Phase.FORWARD and reader.region == region.name
                            and reader.name not in inside
                            and not any(n in stream for n in reader.inputs)):
                        inside.add(reader.name)
                        frontier.extend(reader.outputs)
            members = tuple(op for op in ops if op.name in inside)
            kinds = {op.kind for op in members}
            kind = ("attention" if kinds & {*ATTENTION_CORE} else
                    "moe" if "expert_matmul" in kinds else
                    "mamba" if kinds & set(rules.ALONG_SEQUENCE) else "mlp")
            out.append(Block(norm, members, kind))
    return out


def _reach(ops: tuple[Op, ...], of: set[str], graph: Graph, down: bool) -> set[str]:
    """The names of `ops` that read, through `ops`, an output of an op named in `of` (`down`),
    or whose outputs reach one (not `down`)."""
    names = {op.name for op in ops}
    found, frontier = set(), [graph.op(n) for n in of]
    while frontier:
        op = frontier.pop()
        near = ([r for t in op.outputs for r in graph.consumers(t)] if down
                else [p for p in map(graph.producer, op.inputs) if p is not None])
        for other in near:
            if other.name in names and other.name not in found:
                found.add(other.name)
                frontier.append(other)
    return found


def _module_ops(graph: Graph, block: Block, module: str) -> set[str]:
    """The ops of `block` Megatron-Core's recompute module `module` re-runs
    (`TransformerConfig.recompute_modules`): core_attn the attention core; layernorm the
    block's norm (input_layernorm, pre_mlp_layernorm; not Mamba's, a layer of another class);
    moe_act the routed experts' activation; moe the whole mixture of experts, shared experts
    and collectives in it; shared_experts the ops of a mixture that neither feed its router nor
    follow its routing; mlp a dense MLP; mla_up_proj the attention's up-projections, the ops
    after its inner (latent) norms that feed its core."""
    ops = block.ops
    if module == "core_attn":
        return {op.name for op in ops if _attention_core(graph, op)}
    if module == "layernorm":
        return {block.norm.name} if block.kind != "mamba" else set()
    if block.kind == "moe" and module == "moe":
        return {op.name for op in ops}
    if block.kind == "moe" and module == "moe_act":
        return {op.name for op in ops if op.kind in ACTIVATIONS and any(
            (p := graph.producer(n)) is not None and p.kind == "expert_matmul"
            for n in op.inputs)}
    if block.kind == "moe" and module == "shared_experts":
        routing = {op.name for op in ops if op.kind == "topk"}
        router = {p.name for op in ops if op.kind == "topk"
                  for p in map(graph.producer, op.inputs) if p is not None}
        return ({op.name for op in ops} - routing - router - _reach(ops, router, graph, False)
                - _reach(ops, routing, graph, True))
    if block.kind == "mlp" and module == "mlp":
        return {op.name for op in ops}
    if block.kind == "attention" and module == "mla_up_proj":
        core = {op.name for op in ops if _attention_core(graph, op)}
        latent = {op.name for op in ops if op.kind in NORMS}
        return (_reach(ops, latent, graph, True) & _reach(ops, core, graph, False)) - core
    return set()


def modules_policy(modules: tuple[str, ...]) -> Callable[[Graph, Op], bool]:
    """The predicate of Megatron-Core's selective recomputation of `modules` (names of
    `choices.RECOMPUTE_MODULES`): whether an op is one they re-run. Worked out once per graph."""
    memo: dict = {}

    def chosen(graph: Graph, op: Op) -> bool:
        if memo.get("graph") is not graph:
            memo["graph"] = graph
            memo["names"] = {name for block in blocks(graph) for m in modules
                             for name in _module_ops(graph, block, m)}
        return op.name in memo["names"]
    chosen.__name__ = f"_recompute_{'_'.join(modules)}"
    return chosen


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
    name = recompute_policy(policy)  # one line for a policy it is not
    if name.startswith(SELECTIVE):
        return modules_policy(tuple(name[len(SELECTIVE):].split("+")))
    return POLICIES[name]


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


__all__ = ["ATTENTION_CORE", "MODULES", "POLICIES", "SAVE_KINDS", "Block", "Recomputed", "blocks",
           "copy_name", "modules_policy", "plan", "recompute", "rewrite_recompute"]
