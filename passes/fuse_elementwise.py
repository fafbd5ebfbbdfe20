"""fuse_elementwise: chains of element-wise and row-reduction ops become one kernel each.

Invariant established: ops that the fusion policy (`opgraph.core.fusion`) lets share a kernel,
joined by a dataflow edge, in one region, phase and multiplicity, are one kernel wherever the greedy
merge keeps it convex (no path leaves the group and re-enters it). Each group is one
op of kind `fused` (`rewrite.Replacement.fuse`) carrying its members, so its FLOPs are exactly
its members' (each by its kind's rule) and its traffic is its boundary tensors: an inner tensor
read by nothing outside the group is never written, and a tensor written once and read by a
member is not read back. Members are grouped greedily, XLA-style, along producer -> consumer
edges in the graph's op order.

**Across the layer boundary.** A region holds one iteration, so the residual add that ends
layer i and the norm that starts layer i+1 are never in one iteration's graph. Where the region
hands `h` (the add's output) to the next iteration in place of `x` (its carry `x -> h`), the
iteration's first op `n` reads only `x` and weights, and the op after the region that reads the
last `h` computes what `n` does (`final_norm` beside `attn_norm`: one kind, parameters and
shapes), the loop is rotated first (`rotate_loops`, cost-neutral on its own):

- `n` is peeled: it runs once before the region, on the entering `x` (layer 0's norm; it keeps
  its name and its output, which becomes the region's new entering carry);
- a copy, `<n>.next`, runs at the bottom of every iteration on `h`: iteration i computes layer
  i+1's norm, and the last iteration the op after the region, which goes (its readers read the
  last `<n>.next`, as ops after a region read its last handed tensor); the region carries
  `<n> -> <n>.next`;
- so the step still runs L + 1 norms and L adds, the same FLOPs and bytes; now the add and
  `<n>.next` are one iteration's neighbours and fuse like any pair: the carried tensor is written
  once and not read back, once per layer.

The weights stay where they were: `<n>.next` reads the region's per-layer norm weight (in
iteration i the next layer's instance; in the last, the final norm's, of the same shape, so of the
same cost), and the peeled op reads it once (layer 0's). The absorbed op's weight is then read
only by its backward and its optimizer update, so the MFU convention's N (weights a forward op
reads) no longer counts it: the final norm's D weights, 4,096 of Llama 3 8B's 7.5 billion.

**Backward.** The pass runs on a forward graph or, as `compile_step(extra_passes=...)` runs it,
after `derive_backward`. Every backward kernel's `forward` link is moved to the kernel its
forward op became (the rotation moves `n`'s backward to `<n>.next` and the absorbed op's to the
peeled `n`, whose multiplicities match), and the kernel names the member it differentiates (its
`of` parameter). Backward kernels then fuse by the same table, each pair read against the
dataflow (the backward of a -> b is b' -> a'), within the backward of one forward kernel, so a
fused backward kernel is linked to one forward kernel and the plate's convention stays well
defined: a fused kernel's backward kernels cost twice it between them, each keeping the FLOPs
its members' backward had and an even share of twice the bytes the forward fusion saved
(`CostModel._member_share`), so FLOPs are kept exactly, per kernel too. Under the "derived"
convention a fused backward kernel costs its members' own FLOPs and its boundary tensors. A
forward op that has backward kernels never fuses with one that has none (the plate would charge
the latter a backward). The backward across the layer boundary is not rotated: under "plate" it
costs twice the fused forward; under "derived" its add and norm kernels stay apart.
"""

from __future__ import annotations

import attrs
import sympy

from opgraph.core.fusion import ELEMENTWISE, FusionPolicy
from opgraph.core.ir import Graph, Op, Phase, Region, Role
from opgraph.core.rewrite import Replacement, is_convex
from opgraph.core.rules import same
from opgraph.cost.costmodel import members_of


@attrs.frozen
class Rotation:
    """One rotated region: `peeled` now runs once before it, `moved` at its bottom, and the op
    after it that `moved` now computes in the last iteration, `absorbed`, is gone."""

    region: str
    peeled: str
    moved: str
    absorbed: str


@attrs.frozen
class Fused:
    """One kernel the pass made: its members (in execution order), its phase, how many times it
    runs, and the HBM bytes one instance no longer moves (the members' bytes minus its own)."""

    op: str
    members: tuple[str, ...]
    phase: Phase
    count: sympy.Expr
    saved_bytes: sympy.Expr


# --- graph surgery that keeps an op's place in the order ------------------------------------

def _retag_tensor(graph: Graph, name: str, **changes) -> None:
    graph.replace_tensor(attrs.evolve(graph.tensor(name), **changes))


def _backward_of(graph: Graph) -> set[str]:
    return {op.forward for op in graph.ops() if op.phase is Phase.BACKWARD and op.forward}


# --- loop rotation ------------------------------------------------------------------------------

def _head(graph: Graph, region: Region, entering: str, policy: FusionPolicy, add: Op) -> Op | None:
    """The iteration's first op `n` on the carried tensor: reads it once, otherwise only tensors
    made outside the iteration (weights, loop constants); fusible after the add; one output."""
    for op in graph.consumers(entering):
        if (op.phase is not Phase.FORWARD or op.region != region.name or len(op.outputs) != 1
                or op.inputs.count(entering) != 1 or not policy.may_fuse(add.kind, op.kind)):
            continue
        others = [graph.tensor(n) for n in op.inputs if n != entering]
        if all(t.role is Role.WEIGHT or not graph.within(t.region, region.name) for t in others):
            return op
    return None


def _same_type(graph: Graph, a: str, b: str) -> bool:
    ta, tb = graph.tensor(a), graph.tensor(b)
    return (ta.dtype == tb.dtype and len(ta.shape) == len(tb.shape)
            and all(same(x, y) for x, y in zip(ta.shape, tb.shape)))


def _tail(graph: Graph, region: Region, handed: str, head: Op, entering: str) -> Op | None:
    """The op after the region (in its parent, so it runs as often as the peeled head will) that
    computes, on the last handed tensor, what `head` computes on the entering one: one kind and
    parameters, every other operand of the same type."""
    at = head.inputs.index(entering)
    for op in graph.consumers(handed):
        if (op.phase is Phase.FORWARD and op.region == region.parent
                and op.kind == head.kind and op.params == head.params
                and len(op.inputs) == len(head.inputs) and op.inputs.index(handed) == at
                and op.inputs.count(handed) == 1 and len(op.outputs) == 1
                and _same_type(graph, op.outputs[0], head.outputs[0])
                and all(_same_type(graph, a, b) for i, (a, b) in
                        enumerate(zip(op.inputs, head.inputs)) if i != at)):
            return op
    return None


def _rotation(graph: Graph, region: Region, policy: FusionPolicy):
    with_backward = _backward_of(graph)
    for entering, handed in region.carries:
        add = graph.producer(handed)
        if add is None or add.phase is not Phase.FORWARD or add.region != region.name:
            continue
        head = _head(graph, region, entering, policy, add)
        tail = head and _tail(graph, region, handed, head, entering)
        if tail and len({op.name in with_backward for op in (add, head, tail)}) == 1:
            return entering, handed, head, tail
    return None


def rotate_loops(graph: Graph, policy: FusionPolicy = ELEMENTWISE
                 ) -> tuple[Graph, list[Rotation]]:
    """Rotate each region whose carried tensor's producer may fuse with the next iteration's
    first op (see the module's docstring): same FLOPs and bytes, the pair now in one iteration.

        >>> from opgraph import compile_step
        >>> from opgraph.models import preset
        >>> step, done = rotate_loops(compile_step(preset("llama3-8b")))
        >>> done[0].moved, done[0].absorbed
        ('layers.attn_norm.next', 'final_norm')
    """
    out = graph.copy()
    done = []
    for region in graph.regions():
        found = _rotation(out, out.region(region.name), policy)
        if found is None:
            continue
        entering, handed, head, tail = found
        parent = region.parent
        out_name = head.outputs[0]
        moved_name = f"{head.name}.next"
        if out.has_op(moved_name) or out.has_tensor(moved_name):
            continue
        # the head, peeled: layer 0's, once before the region
        out.replace_op(attrs.evolve(head, region=parent, count=out.trip_count(parent)))
        _retag_tensor(out, out_name, region=parent, count=out.trip_count(parent))
        # its copy at the bottom: iteration i computes layer i+1's (the last, the tail's)
        template = out.tensor(out_name)
        out.add_tensor(attrs.evolve(template, name=moved_name, region=region.name,
                                    count=head.count))
        inputs = [handed if n == entering else n for n in head.inputs]
        out.add_op(attrs.evolve(head, name=moved_name, inputs=inputs, outputs=[moved_name]))
        # the tail's readers read the last iteration's copy; the tail goes
        gone = tail.outputs[0]
        for reader in out.consumers(gone):
            out.replace_op(attrs.evolve(reader, inputs=[moved_name if n == gone else n
                                                       for n in reader.inputs]))
        out.remove_op(tail.name)
        out.remove_tensor(gone)
        for t in out.tensors():  # its gradient is the last copy's
            if t.grad_of == gone:
                _retag_tensor(out, t.name, grad_of=moved_name)
        # backward links follow the multiplicities: the head's kernels to the copy (L), the
        # tail's to the peeled head (once)
        for op in out.ops():
            link = {head.name: moved_name, tail.name: head.name}.get(op.forward)
            if op.phase is Phase.BACKWARD and link:
                out.replace_op(attrs.evolve(op, forward=link))
        out.update_region(attrs.evolve(out.region(region.name),
                                       carries=(*region.carries, (out_name, moved_name))))
        done.append(Rotation(region.name, head.name, moved_name, tail.name))
    return out, done


# --- grouping -----------------------------------------------------------------------------------

def _compatible(graph: Graph, a: Op, b: Op, with_backward: set[str]) -> bool:
    if (a.phase is not b.phase or a.region != b.region or not same(a.count, b.count)):
        return False
    if a.phase is Phase.FORWARD:
        return (a.name in with_backward) == (b.name in with_backward)
    return a.phase is Phase.BACKWARD and a.forward == b.forward


def _groups(graph: Graph, policy: FusionPolicy, phase: Phase) -> list[list[str]]:
    """Groups of ops of `phase` that become one kernel each (two or more ops), in op order."""
    with_backward = _backward_of(graph)
    order = graph.ops()
    group: dict[str, int] = {}
    members: dict[int, list[str]] = {}
    for i, op in enumerate(order):
        if (op.phase is phase and policy.kind_class(op.kind) is not None
                and op.param("eager") != "always"):  # outside what the compiler sees
            group[op.name] = i
            members[i] = [op.name]
    for op in order:
        if op.name not in group:
            continue
        for name in dict.fromkeys(op.inputs):
            producer = graph.producer(name)
            if producer is None or producer.name not in group:
                continue
            a, b = group[producer.name], group[op.name]
            # a backward edge runs against its forward one: the backward of a -> b is b' -> a'
            pair = (producer.kind, op.kind) if phase is not Phase.BACKWARD else (op.kind,
                                                                                 producer.kind)
            if a == b or not policy.may_fuse(*pair):
                continue
            if not _compatible(graph, producer, op, with_backward):
                continue
            merged = members[a] + members[b]
            matmuls = sum(policy.kind_class(graph.op(n).kind) == "matmul" for n in merged)
            if matmuls > policy.max_matmuls or not is_convex(graph, merged):
                continue
            for n in members[b]:
                group[n] = a
            members[a] = merged
            del members[b]
    index = {op.name: i for i, op in enumerate(order)}
    found = [sorted(m, key=index.__getitem__) for m in members.values() if len(m) > 1]
    return sorted(found, key=lambda m: index[m[0]])


def _kernel_name(graph: Graph, names: list[str]) -> str:
    """`layers.attn_residual+mlp_norm`: the first member's name, then the others' without the
    region's prefix."""
    region = graph.op(names[0]).region
    prefix = f"{region}." if region else ""
    rest = [n.removeprefix(prefix) if n.startswith(prefix) else n for n in names[1:]]
    name = "+".join([names[0], *rest])
    return name if not graph.has_op(name) else f"{name}#fused"


def _fuse_groups(graph: Graph, groups: list[list[str]]) -> tuple[Graph, list[Fused]]:
    out = graph.copy()
    made = []
    for names in groups:
        first = out.op(names[0])
        forward = first.forward if first.phase is Phase.BACKWARD else None
        of = tuple(dict.fromkeys(m for n in names for m in members_of(out.op(n))))
        plan = Replacement.fuse(out, names, name=_kernel_name(out, names), forward=forward,
                                params={"of": of} if of else ())
        before = sympy.Add(*(out.op_bytes(out.op(n)) for n in names))
        for n in plan.remove_ops:
            out.remove_op(n)
        for n in plan.remove_tensors:
            out.remove_tensor(n)
        (kernel,) = plan.add_ops
        out.add_op(kernel)
        gone = set(plan.remove_tensors)
        for t in out.tensors():  # a gradient whose primal stays inside the kernel: no primal
            if t.grad_of in gone:
                _retag_tensor(out, t.name, grad_of=None)
        saved = sympy.expand(before - out.op_bytes(kernel))
        made.append(Fused(kernel.name, tuple(names), kernel.phase, kernel.count, saved))
    return out, made


def _relink(graph: Graph, made: list[Fused]) -> Graph:
    """Backward kernels linked to a fused op's member, linked to the fused op, naming the
    member they differentiate (`of`, which the cost model reads)."""
    kernel_of = {m: f.op for f in made for m in f.members}
    out = graph.copy()
    for op in graph.ops():
        if op.phase is Phase.BACKWARD and op.forward in kernel_of:
            params = {**dict(op.params), "of": op.forward}
            out.replace_op(attrs.evolve(op, forward=kernel_of[op.forward], params=params))
    return out


def rewrite_elementwise(graph: Graph, policy: FusionPolicy = ELEMENTWISE
                        ) -> tuple[Graph, list[Rotation], list[Fused]]:
    """The fused graph, the regions rotated and the kernels made:
    `step, rotated, fused = rewrite_elementwise(step)`."""
    out, rotated = rotate_loops(graph, policy)
    out, forward = _fuse_groups(out, _groups(out, policy, Phase.FORWARD))
    out = _relink(out, forward)
    out, backward = _fuse_groups(out, _groups(out, policy, Phase.BACKWARD))
    return out, rotated, forward + backward


def fuse_elementwise(graph: Graph, policy: FusionPolicy = ELEMENTWISE) -> Graph:
    """`graph` with its element-wise and reduction chains fused under `policy`:
    `compile_step(preset("llama3-8b"), extra_passes=[fuse_elementwise])`. A compiler generates
    the kernels of every kind its policy lists, alone or fused, so an op of such a kind no
    longer runs eager PyTorch's kernels (`passes.decompose`'s mark is dropped), unless the
    framework leaves it outside the compiled code (`eager="always"`: neither fused nor
    unmarked)."""
    return _compiled(rewrite_elementwise(graph, policy)[0], policy)


def _compiled(graph: Graph, policy: FusionPolicy) -> Graph:
    kinds = dict(policy.kinds)
    marked = [op for op in graph.ops() if op.param("eager") is True and op.kind in kinds]
    if not marked:
        return graph
    out = graph.copy()
    for op in marked:
        out.replace_op(attrs.evolve(op, params={k: v for k, v in op.params if k != "eager"}))
    return out
