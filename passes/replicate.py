"""replicate: the data-parallel replicas of a step: reduce its gradients, shard its optimizer
(ZeRO-1/2) and its parameters (ZeRO-3 / FSDP), inserting the collectives that needs.

Runs on a step graph (after `attach_adamw`); returns the step ONE data-parallel rank runs. Per
weight `w` with gradient `g` and `dp` ranks (Rajbhandari et al. 2020, ZeRO; PyTorch FSDP):

- ZeRO-0, plain data parallelism: `g` is all-reduced before the update.
- ZeRO-1 (Megatron's distributed optimizer): `g` is reduce-scattered; each rank updates its
  1/dp of the optimizer states (FP32 master and moments) and all-gathers the updated BF16
  weights. The full gradient buffer stays. A framework that all-reduces it whole instead
  (`Traits.zero1_all_reduces`, nanotron) updates from its shard of the reduced buffer.
- ZeRO-2: as ZeRO-1, and the full gradient is a per-layer transient (reduce-scattered as soon as
  it is made); only its 1/dp shard stays resident.
- ZeRO-3 / FSDP: the weight itself is a 1/dp shard; every op that reads it (forward, and again
  backward, as FSDP reshards after the forward) reads a gathered copy, a transient buffer.
- HSDP (the layout's `replicate` > 1): each of the replicas shards as above over its own ranks
  (the group `dp`, `Parallel.size`), and the gradient reduced within it is all-reduced across
  the replicas that hold the same shard (the group `dpr`), in the reduction's dtype.

Shards split a tensor's first dimension (FSDP's dim-0 sharding). The group is every rank that
holds the same weight: the data-parallel ranks and the context-parallel ones (they hold the same
weights too), `dp` x `cp` GPUs, the symbol `dp` in the formulas; an expert-parallel weight's is
the expert data-parallel group, dp x cp / ep, the symbol `edp`. A weight whose group is one GPU
(the experts when ep = dp x cp) is left as one GPU holds it: no collective, no transient copy
beside a "shard" that is the whole tensor.
The gradient reduction's message travels in `frameworks.reduce_dtype(layout)` (FP32 by default:
Megatron-LM's main gradients, torchtitan's FSDP reduce dtype; BF16 under DeepSpeed), its
collective's `dtype` parameter (`costmodel.message_bytes` sizes it so); the reduced gradient
keeps the gradient's dtype. FSDP (ZeRO-3) gathers a weight for the forward and again for the
backward; a recomputation of the layer reads a gather of its own where the framework gathers
again (`Traits.regather_in_recompute`: DeepSpeed, the generic model) and the backward's where it
does not (FSDP2, torchtitan: the backward's unshard is made before the layer's recomputation
and serves it). The stage is the framework's (`frameworks.sharding`): torchtitan's FSDP over
pipeline stages keeps the parameters gathered for the step, ZeRO-1's shape. Each collective
is a call of its own unless the framework issues one call for many: Megatron's buckets
(`frameworks.reduces_in_buckets`) and FSDP's wrapped modules (`frameworks.groups_by_module`: a
layer's weights, or the root's, in one call); each weight then pays its share of that call's
latency (its `calls` parameter). A framework whose ZeRO-3 calls take a list of one tensor per
rank (`Traits.list_collectives`) runs a copy kernel per rank beside each (its `launches`); one
that gathers into a module's flat buffer copies each weight out of it on the compute stream
before its readers (`Traits.copies_out_gathers`: FSDP2). When a data-parallel reduction runs
(each micro-batch or once per step) and what it overlaps is the schedule's business
(`opgraph.parallel.schedule`).
"""

from __future__ import annotations

import attrs
import sympy

from opgraph.core import rules
from opgraph.core.contracts import REPLICATE, contract, step_pass
from opgraph.core.ir import Graph, Op, Phase, Role, Tensor
from opgraph.core.symbols import dp, edp, ep
from opgraph.parallel.frameworks import (
    Traits,
    bucket_share,
    groups_by_module,
    reduce_dtype,
    reduces_in_buckets,
    sharding,
    traits,
)
from opgraph.parallel.parallel import SHARDED_FROM, Parallel

AXIS = 0  # FSDP shards a parameter along its first dimension


GROUPS = {"dp": dp, "edp": edp}


def gather_phases(regather: bool) -> dict[Phase, tuple[Phase, ...]]:
    """The all-gathers ZeRO-3 issues for one weight, by the phase each is made for, and the
    phases whose readers each serves: one a phase, or, where the framework does not gather
    again for the recomputation (`Traits.regather_in_recompute` off: FSDP2, whose backward's
    unshard is made before the layer's recomputation), the backward's serving both."""
    if regather:
        return {phase: (phase,) for phase in (Phase.FORWARD, Phase.RECOMPUTE, Phase.BACKWARD)}
    return {Phase.FORWARD: (Phase.FORWARD,), Phase.BACKWARD: (Phase.RECOMPUTE, Phase.BACKWARD)}


def group_of(w: Tensor) -> str:
    """The group that holds the same copy of weight `w`: "edp" for an expert-parallel
    weight (its shape divides by `ep`), else "dp"."""
    return "edp" if ep in sympy.Add(*w.shape).free_symbols else "dp"


def _shard(t: Tensor, group: str) -> Tensor:
    shape = (t.shape[AXIS] / GROUPS[group], *t.shape[1:]) if t.shape else t.shape
    return attrs.evolve(t, shape=shape)


def _collective(graph: Graph, source: str, kind: str, name: str, *, phase: Phase, region,
                count, group: str, role: Role = Role.ACTIVATION, grad_of: str | None = None,
                forward: str | None = None, before: str | None = None,
                dtype: str | None = None, calls=None, launches=None,
                bucket: str | None = None, flat: bool = False) -> str:
    t = graph.tensor(source)
    params = {"group": group, "axis": AXIS, "size": GROUPS[group]} if kind != "all_reduce" \
        else {"group": group}
    if dtype is not None and dtype != t.dtype.name:  # the message travels cast (a gradient's)
        params["dtype"] = dtype
    if calls is not None:  # its share of a bucket's or a module's one call (`Cost.calls`)
        params["calls"] = calls
    if launches is not None:  # the kernels its call runs (`Cost.launches`)
        params["launches"] = launches
    if bucket is not None:  # DDP's resident copy of what it reduces (`Traits.ddp_buckets`)
        params["bucket"] = bucket
    if flat:  # gathered through packed buffers (`Traits.flattens_gathers`, `memory.buffer_tensors`)
        params["flat"] = True
    (shape,) = rules.infer_shapes(kind, [t], params)
    graph.add_tensor(Tensor(name, shape, t.dtype, role, t.count, grad_of=grad_of, region=region),
                     before=before)
    graph.add_op(Op(f"{name}.{kind}", kind, "communication", (source,), (name,), count=count,
                    phase=phase, params=params, region=region, forward=forward), before=before)
    return name


@step_pass(at=REPLICATE, bind=lambda o: o.replicated and o.layout and {"layout": o.layout},
           structure={"layout": lambda p: (sharding(p), p.size("dp") > 1, p.size("edp") > 1,
                                           p.replicate > 1,
                                           reduce_dtype(p), traits(p).regather_in_recompute,
                                           traits(p).zero1_all_reduces, groups_by_module(p),
                                           traits(p).list_collectives, traits(p).ddp_buckets,
                                           traits(p).copies_out_gathers,
                                           traits(p).flattens_gathers)})
@contract(requires=("optimizer",), forbids=("replicated",))
def replicate(graph: Graph, layout: Parallel) -> Graph:
    """The step one data-parallel rank runs (see the module); `layout.dp_degree` 1 changes
    nothing."""
    if layout.size("dp") == 1:
        return graph
    out = graph.copy()
    out.dims = {**out.dims, dp: layout.size("dp")}
    if layout.ep > 1:
        out.dims[edp] = layout.size("edp")
    # where the backward's gather serves the recomputation too, it goes before whichever runs
    # first: the ops' place in the order, which no insertion here changes
    how = _How(sharding(layout), reduce_dtype(layout), reduces_in_buckets(layout), traits(layout),
               None if traits(layout).regather_in_recompute else {
                   op.name: i for i, op in enumerate(graph.ops())}, layout.replicate)
    weights = [(update, graph.tensor(graph.tensor(update.inputs[0]).grad_of))
               for update in graph.ops() if update.kind == "adamw"]
    # a group of one GPU has nothing to reduce or shard
    weights = [(u, w) for u, w in weights if layout.size(group_of(w)) > 1]
    modules: dict = {}  # FSDP's wrapped modules (`groups_by_module`): (region, group) -> numel
    if groups_by_module(layout):
        for _, w in weights:
            key = (w.region, group_of(w))
            modules[key] = modules.get(key, 0) + w.numel
    for update, w in weights:
        module_numel = modules.get((w.region, group_of(w)))
        # its share of its module's one call: its parameters over the module's
        _replicate_update(out, update, how,
                          None if module_numel is None else w.numel / module_numel)
    return out


@attrs.frozen
class _How:
    """What the layout decides of every weight's reduction and sharding: the ZeRO stage it
    runs, the dtype its gradients travel in, whether they go in buckets, its framework's
    traits, and each op's place in the order where the backward's gather serves the
    recomputation too (else None)."""

    zero: int
    wire: str
    bucketed: bool
    traits: Traits
    order: dict | None
    replicas: int = 1


def _replicate_update(out: Graph, update: Op, how: _How, module=None) -> None:
    """One weight's reduction and sharding; `module`: its share of its FSDP module's call."""
    zero, wire = how.zero, how.wire
    grad = out.tensor(update.inputs[0])
    w = out.tensor(grad.grad_of)
    group = group_of(w)
    where = {"region": update.region, "count": update.count, "group": group}
    # in a bucket (`frameworks.reduces_in_buckets`) or an FSDP module (`module`, its share:
    # `frameworks.groups_by_module`) the weight's reduction and gather are its share of one call
    if how.bucketed:
        where["calls"] = bucket_share(grad.numel, GROUPS[group])
    if module is not None:
        where["calls"] = module
    # a list-form call copies each rank's piece by a kernel of its own
    # (`Traits.list_collectives`): its NCCL kernel and one copy per rank
    sharded = {part: zero >= least for part, least in SHARDED_FROM.items()}
    copies = ({"launches": 1 + GROUPS[group]}
              if sharded["weights"] and how.traits.list_collectives else {})
    if not sharded["gradients"] and (not sharded["optimizer"] or how.traits.zero1_all_reduces):
        # DDP's resident copy (`Traits.ddp_buckets`)
        ddp = not sharded["optimizer"] and how.traits.ddp_buckets
        reduced = _collective(out, grad.name, "all_reduce", f"{grad.name}@dp",
                              phase=Phase.BACKWARD, role=Role.GRADIENT, grad_of=w.name,
                              dtype=wire, bucket=w.dtype.name if ddp else None, **where)
        reduced = _across_replicas(out, reduced, how, where)
        out.replace_tensor(attrs.evolve(grad, grad_of=None))
        if not sharded["optimizer"]:
            out.replace_op(attrs.evolve(update, inputs=(reduced, *update.inputs[1:])))
            return
        # ZeRO-1 all-reducing the whole gradient (`Traits.zero1_all_reduces`): the rank's
        # update reads its shard of the reduced buffer, a view
        shard = _slice(out, reduced, group, update)
    else:
        shard = None
    if sharded["weights"]:
        _gather_weight(out, w, group, how.order, where.get("calls"), copies.get("launches"),
                       how.traits.copies_out_gathers)
    # ZeRO-1 keeps the full gradient buffer (the shard is a view of it); ZeRO-2/3 keep only the
    # shard, the full gradient a per-layer transient
    full = [t for t in out.tensors() if t.grad_of == w.name]
    if shard is None:
        shard = _collective(out, grad.name, "reduce_scatter", f"{grad.name}@dp",
                            phase=Phase.BACKWARD, role=Role.GRADIENT,
                            grad_of=w.name if sharded["gradients"] else None,
                            dtype=wire, **where,
                            **copies)
        shard = _across_replicas(out, shard, how, where)
    if sharded["gradients"]:
        for t in full:
            out.replace_tensor(attrs.evolve(t, grad_of=None))
    # without master weights (`attach_adamw`'s "no-master", "bf16") the update writes the
    # weights themselves: under ZeRO-3 their shard (`_gather_weight`), under ZeRO-1/2 this
    # rank's shard of the whole weights, a view of them (a part of no memory of its own, as the
    # gradient's shard is: not a weight, which would count its parameters twice)
    in_place = update.inputs[1] == w.name
    view = (_slice(out, w.name, group, update, Role.ACTIVATION)
            if in_place and not sharded["weights"] else w.name)
    for name in (*update.inputs[1:], *update.outputs):  # the optimizer works on its shard
        if name != w.name:
            out.replace_tensor(_shard(out.tensor(name), group))
    out.replace_op(attrs.evolve(update, inputs=(shard, *(view if n == w.name else n
                                                         for n in update.inputs[1:]))))
    if not sharded["weights"] and (update.param("copy") or in_place):
        # the updated weights (the BF16 copy, or the weights themselves), gathered back
        updated = (update.outputs[0] if in_place else
                   update.outputs[-2] if update.param("zero_grad") else update.outputs[-1])
        _collective(out, updated, "all_gather", f"{w.name}@updated", phase=Phase.OPTIMIZER,
                    flat=how.traits.flattens_gathers, **where)


def _across_replicas(out: Graph, reduced: str, how: _How, where: dict) -> str:
    """HSDP (`how.replicas` > 1): the gradient `reduced` within a replica, all-reduced across
    the replicas that hold the same shard (the "dpr" group), in the reduction's dtype; it takes
    over what `reduced` was a gradient of. Without replicas, `reduced` itself."""
    if how.replicas == 1:
        return reduced
    t = out.tensor(reduced)
    name = _collective(out, reduced, "all_reduce", f"{reduced}@dpr", phase=Phase.BACKWARD,
                       role=Role.GRADIENT, grad_of=t.grad_of, dtype=how.wire,
                       **{**where, "group": "dpr"})
    if t.grad_of is not None:
        out.replace_tensor(attrs.evolve(t, grad_of=None))
    return name


def _copy_out(out: Graph, gathered: str, reader: Op) -> str:
    """The weight `gathered` as its readers see it: copied out of the gathered buffer by a
    kernel on the compute stream just before its first `reader` (a reshape to its own shape,
    made a copy), in that reader's phase."""
    t = out.tensor(gathered)
    name = f"{gathered}.out"
    out.add_tensor(attrs.evolve(t, name=name), before=reader.name)
    out.add_op(Op(f"{name}.copy", "reshape", "elementwise", (gathered,), (name,), count=t.count,
                  phase=reader.phase, params={"shape": t.shape, "copy": True},
                  region=t.region), before=reader.name)
    return name


def _slice(out: Graph, source: str, group: str, update: Op, role: Role = Role.GRADIENT) -> str:
    """This rank's 1/size shard of `source` along the first dimension, a view of it."""
    t = out.tensor(source)
    name, shape = f"{source}@shard", _shard(t, group).shape
    params = {"axis": AXIS, "size": shape[AXIS]}
    out.add_tensor(Tensor(name, shape, t.dtype, role, t.count, region=update.region))
    out.add_op(Op(f"{name}.slice", "slice", "elementwise", (source,), (name,),
                  count=update.count, phase=Phase.OPTIMIZER, params=params,
                  region=update.region))
    return name


def _gather_weight(out: Graph, w: Tensor, group: str, order: dict | None = None,
                   calls=None, launches=None, copy_out: bool = False) -> None:
    """FSDP: `w` becomes its shard; each phase's readers read a copy gathered for them. With
    `order` (each op's place in the order), the recomputation and the backward share one,
    gathered before the first of them (FSDP2). `calls`: its share of its module's one call;
    `launches`: the kernels a call runs (`Traits.list_collectives`); `copy_out`: the readers
    read it through a copy out of the gathered buffer (`Traits.copies_out_gathers`)."""
    readers = [op for op in out.consumers(w.name) if op.phase is not Phase.OPTIMIZER]
    out.replace_tensor(_shard(w, group))
    phases = gather_phases(regather=order is None)
    if order is not None:
        readers.sort(key=lambda op: order[op.name])
    for phase, served in phases.items():
        mine = [op for op in readers if op.phase in served]
        if not mine:
            continue
        # placed just before its first reader: appended, it would hold that reader back
        # while ops the order puts later (a recomputation) went ahead
        gathered = _collective(out, w.name, "all_gather", f"{w.name}@{phase.value}",
                               phase=phase, region=w.region, count=w.count, group=group,
                               before=mine[0].name, calls=calls, launches=launches)
        if copy_out:
            gathered = _copy_out(out, gathered, mine[0])
        out.reroute(mine, w.name, gathered)
    for t in out.tensors():  # the full-size gradients are the gathered copy's
        if t.grad_of == w.name:
            out.replace_tensor(attrs.evolve(t, grad_of=f"{w.name}@{Phase.FORWARD.value}"))
