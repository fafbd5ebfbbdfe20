"""split_stages: the step one pipeline stage runs, for pipeline parallelism.

Layers are split into `pp` stages (Narayanan et al. 2021): the layer stack's trip count `L`
becomes the stage's share (`L/pp` for even stages, a number for Megatron's uneven first and
last stages or for a layout's `stage_layers`; a stage with none runs its end's ops alone, or
only passes the activations on), the ops before the stack (the embedding) run on the first
stage only, the ops after it (the final norm, the head, the loss) on the last, each with its
backward, its optimizer update, its weights and their collectives. A model with more stacks
than one splits the one its dimension counts (`layer_stack`); a fixed number of layers before
it (DeepSeek's dense-first layers) runs on the first stage as the embedding does, and after it
(DeepSeek-V3's prediction module) on the last, as the head does: `--first-stage-layers` /
`--last-stage-layers` give those stages fewer of the split stack to balance them. Which end an
op belongs to follows from the dataflow, not from names: a forward op outside the stack that
feeds it is the first stage's, any other the last's; a backward op goes with the forward op it
differentiates (`forward`); any other op with the producers of what it reads, or with the
weight it reads (a tied embedding, read at both ends, is held by both, as Megatron-LM keeps a
copy on each).

Between stages each micro-batch's activation travels forward and its gradient back: a stage
that is not the last sends the stack's output (`send_recv` over the group `pp`), a stage that is
not the first sends the gradient of the stack's input back. Where the framework's transfers
block the compute stream (`frameworks.Traits.blocking_p2p`: DeepSpeed's pipeline engine), the
receiving stage's receives are written too, just before what reads them, and every transfer
is marked `blocking` for the schedule to run in line. Left out: the tied embedding's gradient
all-reduce between the first and the last stage (once per step).
"""

from __future__ import annotations

import attrs
import sympy

from opgraph.core.errors import OpgraphError
from opgraph.core.ir import Graph, Op, Phase, Role, Tensor
from opgraph.core.symbols import pp, tp
from opgraph.parallel.frameworks import traits
from opgraph.parallel.parallel import Parallel, stage_layers

FIRST, LAST, STACK = "first", "last", "stack"


def layer_stack(graph: Graph):
    """The layer stack pipeline parallelism splits: the graph's one top-level region, or, where
    it has several, the one whose trip count is a dimension (DeepSeek's `layers`, L - k, beside
    its k dense-first layers and its prediction modules, fixed numbers); an error otherwise."""
    tops = [r for r in graph.regions() if r.parent is None]
    if len(tops) == 1:
        return tops[0]
    counted = [r for r in tops if sympy.sympify(r.count).free_symbols]
    if len(counted) != 1:
        raise OpgraphError(f"{graph.name} has {len(tops)} layer stacks"
                           f"{f', {len(counted)} of them counted by a dimension' if counted else ''}"
                           "; pipeline parallelism splits one (leave out --pp)")
    return counted[0]


def other_stacks(graph: Graph) -> list:
    """The model's top-level regions beside the stack the pipeline splits (`layer_stack`):
    DeepSeek's dense-first layers and its prediction modules; none for a model of one stack."""
    region = layer_stack(graph)
    return [r for r in graph.regions() if r.parent is None and r is not region]


def layers_before(graph: Graph) -> int:
    """The layers of the model's other stacks that run before the split one, on the first
    stage (DeepSeek's k dense-first layers): the fixed trip counts of the `other_stacks` whose
    ops feed the stack (`ends`); 0 for a model of one stack."""
    others = other_stacks(graph)
    if not others:
        return 0
    side = ends(graph)
    first = {op.region for op in graph.ops() if side.get(op.name) == {FIRST}}
    return sum(int(sympy.sympify(r.count).xreplace(graph.dims)) for r in others
               if any(graph.within(h, r.name) for h in first if h is not None))


def ends(graph: Graph) -> dict[str, set[str]]:
    """Each op's place: {STACK}, {FIRST}, {LAST} or {FIRST, LAST} (see the module)."""
    region = layer_stack(graph)
    inside = {op.name for op in graph.ops() if graph.within(op.region, region.name)}
    forward = [op for op in graph.ops() if op.phase is Phase.FORWARD]
    feeds: set[str] = set()
    for op in reversed(forward):  # ops outside the stack that (transitively) feed it
        readers = {c.name for t in op.outputs for c in graph.consumers(t)}
        if op.name not in inside and readers & (inside | feeds):
            feeds.add(op.name)
    side: dict[str, set[str]] = {}
    weight_side: dict[str, set[str]] = {}
    for op in forward:
        where = {STACK} if op.name in inside else {FIRST} if op.name in feeds else {LAST}
        side[op.name] = where
        for n in op.inputs:
            if graph.tensor(n).role is Role.WEIGHT:
                weight_side.setdefault(n, set()).update(where)
    for op in graph.ops():
        if op.name in side:
            continue
        if op.name in inside:
            side[op.name] = {STACK}
        elif op.forward is not None and op.forward in side:
            side[op.name] = side[op.forward]
        else:
            found: set[str] = set()
            for n in op.inputs:
                producer = graph.producer(n)
                if producer is not None and producer.name in side:
                    found |= side[producer.name]
                found |= weight_side.get(n, set())
            side[op.name] = (found - {STACK}) or found or {LAST}
    return side


def split_stages(graph: Graph, layout: Parallel, stage: int) -> Graph:
    """The step pipeline stage `stage` (0 first) of `layout` runs; `layout.pp` 1: `graph`."""
    if layout.pp == 1:
        return graph
    region = layer_stack(graph)
    layers = int(sympy.sympify(region.count).xreplace(graph.dims))
    counts = stage_layers(layers, layout)
    even = len(set(counts)) == 1
    mine = {FIRST} if stage == 0 else set()
    mine |= {LAST} if stage == layout.pp - 1 else set()
    side = ends(graph)
    out = Graph(graph.name, {**graph.dims, pp: layout.pp}, seq_len=graph.seq_len,
                max_seq_len=graph.max_seq_len)
    share = region.count / pp if even else sympy.Integer(counts[stage])
    swap = {region.count: share} if len(sympy.sympify(region.count).free_symbols) == 1 else {}
    if not swap:
        raise OpgraphError(f"{graph.name}'s layer stack runs {region.count} times; pipeline "
                           "parallelism needs a stack counted by one dimension")
    # a stage without layers (nanotron's last, with the head alone) runs its end's ops only
    runs = ({STACK} if counts[stage] else set()) | mine
    keep = [op for op in graph.ops() if side[op.name] & runs]
    used = {n for op in keep for n in (*op.inputs, *op.outputs)}
    for t in graph.tensors():
        if t.name in used:
            out.add_tensor(_recounted(t, swap))
    held = {op.region for op in keep}
    for r in graph.regions():  # those the stage runs ops of (a fixed stack at the other end: not)
        if any(graph.within(h, r.name) for h in held if h is not None):
            out.add_region(_recounted(r, swap) if r.name == region.name else r)
    for op in keep:
        out.add_op(_recounted(op, swap))
    blocking = traits(layout).blocking_p2p
    # partitioned where the receiving stage's gather is written: with the blocking receives
    how = _Transfers(blocking, blocking and traits(layout).partitions_p2p and layout.tp > 1
                     and not layout.sequence_parallel)
    _sends(out, graph, region, stage, layout.pp, empty=not counts[stage], how=how)
    if how.blocking:
        _receives(out, graph, region, stage, layout.pp, how)
    return out


def _recounted(record, swap: dict):
    """`record` (a tensor, op or region) with the stack's count swapped for the stage's in its
    own count; itself where its count does not hold it (most of a step's records)."""
    count = record.count.xreplace(swap)
    return record if count == record.count else attrs.evolve(record, count=count)


@attrs.frozen
class _Transfers:
    """How the framework moves a stage's activations and gradients: `blocking` the compute
    stream (`frameworks.Traits.blocking_p2p`), and `partitioned` over the tensor-parallel group
    (`Traits.partitions_p2p`: each TP rank sends its 1/tp slice, the receiver gathers it)."""

    blocking: bool = False
    partitioned: bool = False

    def params(self, when: str) -> dict:
        """A transfer's parameters; where it blocks, when it runs in line: "after" the pass
        that wrote it (a send), "before" the op placed after it (a receive)."""
        return {"group": "pp", **({"blocking": when} if self.blocking else {})}


def _sends(out: Graph, graph: Graph, region, stage: int, stages: int,
           empty: bool = False, how: _Transfers = _Transfers()) -> None:
    """The stage's point-to-point transfers per micro-batch: the stack's output forward (not
    on the last stage), the gradient of its input back (not on the first); a stage without
    layers (`empty`) passes on what it received, the stack's output and its gradient.
    Partitioned, each sends its tensor-parallel slice (`_slice`)."""
    entering, handed = region.carries[0] if region.carries else (None, None)
    if handed is None:
        raise OpgraphError(f"{graph.name}'s layer stack carries no tensor from layer to layer, "
                           "so its stages have nothing to pass on")
    transfers = []
    if stage < stages - 1:
        transfers.append((handed, Phase.FORWARD, "send_forward"))
    if stage > 0:
        grads = [t for t in graph.tensors() if t.grad_of == (handed if empty else entering)]
        if grads:
            transfers.append((grads[-1].name, Phase.BACKWARD, "send_backward"))
    for source, phase, what in transfers:
        t = out.tensor(source) if out.has_tensor(source) else graph.tensor(source)
        if not out.has_tensor(source):
            out.add_tensor(attrs.evolve(t, count=sympy.Integer(1), region=None))
        sent = source
        if how.partitioned:  # the slice is taken as soon as what it slices is written
            writer = out.producer(source)
            order = [op.name for op in out.ops()]
            after = order.index(writer.name) + 1 if writer is not None else 0
            sent = _slice(out, source, phase, order[after] if after < len(order) else None)
        name = f"{source}@{what}"
        out.add_tensor(Tensor(name, out.tensor(sent).shape, t.dtype, Role.ACTIVATION))
        out.add_op(Op(f"pp.{what}", "send_recv", "communication", (sent,), (name,),
                      phase=phase, params=how.params("after")))


def _slice(out: Graph, source: str, phase: Phase, before: str | None) -> str:
    """A view of `source`'s first 1/tp along its first axis: the bytes one tensor-parallel rank
    sends or receives of it (DeepSpeed's PartitionedTensor: a contiguous 1/tp of the flattened
    tensor, which it copies; the copy, 1/tp of the tensor's bytes, is left out)."""
    t = out.tensor(source)
    name = f"{source}@tp_slice"
    size = t.shape[0] / tp
    out.add_tensor(Tensor(name, (size, *t.shape[1:]), t.dtype, Role.ACTIVATION), before=before)
    out.add_op(Op(f"{name}.slice", "slice", "elementwise", (source,), (name,), phase=phase,
                  params={"axis": 0, "size": size}), before=before)
    return name


def _receives(out: Graph, graph: Graph, region, stage: int, stages: int,
              how: _Transfers) -> None:
    """Where transfers block the compute stream (`frameworks.Traits.blocking_p2p`), the
    stage's receives too, each just before the first op that reads what it receives: the
    stack's input in the forward (not on the first stage), the gradient of its output in the
    backward (not on the last); partitioned, the received slice is then gathered over the
    tensor-parallel group before that op. A stage whose ops read neither (one without layers)
    gets none."""
    entering, handed = region.carries[0]
    wanted = []
    if stage > 0:
        wanted.append(({entering}, Phase.FORWARD, "recv_forward"))
    if stage < stages - 1:
        grads = {t.name for t in graph.tensors() if t.grad_of == handed}
        wanted.append((grads, Phase.BACKWARD, "recv_backward"))
    for names, phase, what in wanted:
        reader = next((op for op in out.ops() if op.phase is phase
                       and any(n in names for n in op.inputs)), None)
        if reader is None:
            continue
        source = next(n for n in reader.inputs if n in names)
        # what arrives, sized as the sender's slice (a view of the tensor it stands for)
        arriving = _slice(out, source, phase, reader.name) if how.partitioned else source
        t = out.tensor(arriving)
        name = f"{source}@{what}"
        out.add_tensor(Tensor(name, t.shape, t.dtype, Role.ACTIVATION), before=reader.name)
        out.add_op(Op(f"pp.{what}", "send_recv", "communication", (arriving,), (name,),
                      phase=phase, params=how.params("before")), before=reader.name)
        if how.partitioned:
            full = out.tensor(source)
            gathered = f"{source}@{what}.gathered"
            out.add_tensor(Tensor(gathered, full.shape, full.dtype, Role.ACTIVATION),
                           before=reader.name)
            out.add_op(Op(f"pp.{what}.gather", "all_gather", "communication", (name,),
                          (gathered,), phase=phase,
                          params={"group": "tp", "axis": 0, "size": tp,
                                  "blocking": "before"}), before=reader.name)
