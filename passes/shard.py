"""shard: split a forward graph over tensor-, sequence-, context- and expert-parallel GPUs, the
way Megatron-LM splits a transformer, inserting the collectives it runs.

The pass returns the graph ONE GPU runs. It shards the weights, then walks the ops in order,
re-deriving every activation's shape from its kind's shape rule (as XLA's SPMD partitioner
propagates shardings), and inserts a collective wherever the layout of a tensor must change:

- **Tensor parallel** (Shoeybi et al. 2019): the dimensions `TENSOR_SPLITS` names (heads, the
  MLP's hidden width, the vocabulary) are divided by the degree `tp` in every weight. A matrix
  multiply whose weight is split along its output is column-parallel: its replicated input first
  passes Megatron's f (`identity`: a copy forward, an all-reduce of the gradient backward). An op
  of a "contracting" kind (`rules.SHARDING`) whose inputs are split but whose output is not (a
  row-parallel matmul, the vocabulary-parallel embedding) leaves partial sums: Megatron's g, an
  `all_reduce`, follows it (its backward is the identity).
- **Sequence parallel** (Korthikanti et al. 2022): the replicated activations between the
  blocks hold S/tp of the sequence; g becomes a `reduce_scatter` along the sequence and f an
  `all_gather` (each the other's backward), so the norms and residual adds run on S/tp tokens. A
  replicated tensor that meets a sequence shard (GPT's position embedding) is cut to its shard
  locally (a `slice`, no communication).
- **Context parallel** (ring attention, as Megatron-LM's and torchtitan's): every activation
  holds S/cp of the sequence; each attention op's keys and values (`rules.CP_GATHERS`) are
  gathered from the ring (`all_gather` over `cp`: the same bytes as passing the blocks around
  the ring; the overlap with the attention is the schedule's, `opgraph.parallel.schedule`); their
  gradients are reduce-scattered back. Attention FLOPs are then (S/cp) x S query-key pairs per
  GPU (half that, causal; a sliding window's, the busiest rank's band: `rules._score_pairs`).
  With the layout's `cp_comm` "a2a" (DeepSpeed-Ulysses, Jacobs et al. 2023; Megatron-LM's
  `--cp-comm-type a2a`) a fused attention's queries, keys and values instead pass an
  `all_to_all` over `cp` that trades each GPU's sequence shard of every head for the whole
  sequence of H/cp of the heads, the attention runs on those, and its output passes the
  all-to-all back: four all-to-alls forward, four back, none overlapped with the attention
  (it waits for them), and the same S x S / cp pairs per GPU.
- **Expert parallel**: the expert weights hold E/ep experts; the tokens routed to them travel by
  `all_to_all` (over `ep`) before the first expert matmul (K copies of each token: the slots
  the dispatch's `moe_permute` wrote, or `fanout` where the matmul reads the tokens themselves)
  and back before the combine. Tensor parallelism splits each expert's width as it splits an
  MLP's, the tokens gathered from the sequence shards first; folded (`Parallel.expert_tp` 1,
  Megatron-Core's `--expert-tensor-parallel-size 1`) the experts stay whole, and each rank
  sends its own sequence shard's tokens, with no tensor-parallel collective around them.

Degrees are symbols (`tp`, `cp`, `ep`, declared in `opgraph.core.symbols`), so every shape and
cost of the sharded graph is a formula in them; the graph's `dims` gain their values. A degree of 1
changes nothing: `shard(g, Parallel())` is `g`.

- **Context parallelism over a state-space layer** (Megatron-Core's Mamba): the kinds that run
  along the sequence (`rules.ALONG_SEQUENCE`: Mamba-2's convolution and scan) get the whole
  sequence of 1/cp of the heads by all-to-all (z, xBC and dt in; the gated output back before
  the group norm), their per-channel weights sliced to this GPU's heads (`_trade_sequence`).

Left out: the vocabulary-parallel cross-entropy's all-reduces of per-token statistics (3 x 4
bytes per token, a 1/D-th of a block's); replicating K/V heads when tp exceeds H_kv (an error
instead, as Megatron requires); load imbalance between experts.
"""

from __future__ import annotations

import attrs
import sympy

from opgraph.core import rules
from opgraph.core.contracts import SHARD, contract, step_pass
from opgraph.core.errors import OpgraphError
from opgraph.core.ir import Graph, Op, Phase, Role, Tensor
from opgraph.core.kinds import defined_kinds
from opgraph.core.symbols import E, F, F_e, F_s, G_m, H, H_kv, H_m, S, V, cp, ep, tp
from opgraph.parallel.frameworks import padded_vocab_shard, traits
from opgraph.parallel.parallel import Parallel

# Dimensions tensor parallelism splits, in every weight that has them (Megatron: attention heads,
# the MLP's, each routed expert's and a shared expert's hidden width, the vocabulary of the
# embedding and the head; Megatron-Core's `MambaMixer`: a state-space mixer's heads and the groups
# of its B and C).
TENSOR_SPLITS = (H, H_kv, F, F_e, F_s, V, H_m, G_m)
SEQ_AXIS = 1  # activations are [B, S, ...]
RESHAPES = ("reshape",)  # kinds whose parameters name a shape (the sequence's extent in it)


# Context parallelism's all-to-all (`cp_comm` "a2a"): into the attention, a sequence shard of
# every head ([B, S/cp, heads x d]) becomes the whole sequence of a head shard; out of it, back.
A2A_IN = {"gather_axis": SEQ_AXIS, "split_axis": 2}
A2A_OUT = {"gather_axis": 2, "split_axis": SEQ_AXIS}


def _sub(value, mapping):
    """`value` (a parameter: a number, an expression, or a tuple of them) with `mapping`."""
    if isinstance(value, sympy.Basic):
        return value.xreplace(mapping)
    if isinstance(value, tuple | list):
        return type(value)(_sub(v, mapping) for v in value)
    return value


def _symbols(value) -> set:
    """The symbols in a parameter: an expression, or a tuple of them."""
    if isinstance(value, sympy.Basic):
        return value.free_symbols
    if isinstance(value, tuple | list):
        return set().union(*map(_symbols, value)) if value else set()
    return set()


def check_divides(graph: Graph, layout: Parallel, seq: int | None = None) -> None:
    """One-line errors for degrees the model's dimensions do not divide, at sequence length
    `seq` (default: the model's)."""
    dims = {s.name: v for s, v in graph.dims.items()}
    if seq is not None:
        dims["S"] = seq
    pads = traits(layout).vocab_multiple is not None  # a padded vocabulary always splits
    for sym in TENSOR_SPLITS:
        value = dims.get(sym.name)
        if sym == V and pads:
            continue
        if value is not None and layout.tp > 1 and value % layout.tp:
            pad = (" (or, for the vocabulary, a framework that pads it: --framework megatron "
                   "or nanotron)") if sym == V else ""
            raise OpgraphError(f"{graph.name}: {sym.name} = {value} is not divisible by --tp "
                               f"{layout.tp}; pick a tensor-parallel degree that divides it"
                               + pad)
    seq = dims.get("S")
    split = layout.cp * (layout.tp if layout.sequence_parallel else 1)
    if layout.cp > 1 and layout.cp_comm == "ring":
        need, why = 2 * layout.cp, (f"2 x --cp {layout.cp} (ring attention balances causal "
                                    "work with two chunks per GPU)")
    elif layout.cp > 1:
        need, why = split, f"--cp {layout.cp}" + (
            f" x --tp {layout.tp} (context and sequence parallelism split it)"
            if layout.sequence_parallel else " (context parallelism splits it)")
    else:
        need, why = split, f"--tp {layout.tp} (sequence parallelism splits it)"
    if seq is not None and seq % need:
        raise OpgraphError(f"sequence length {seq} is not divisible by {why}")
    whole = []  # the counts tp x cp must divide, with why: each GPU takes whole ones
    if layout.cp > 1 and layout.cp_comm == "a2a":
        whole.append(((H, H_kv), " heads are", "the all-to-all gives each GPU whole heads "
                      "(--cp-comm a2a); pick degrees that divide them, or --cp-comm ring"))
    if layout.cp > 1 and any(op.kind in rules.ALONG_SEQUENCE for op in graph.ops()):
        whole.append(((H_m, G_m), " is", "context parallelism gives each GPU whole state-space "
                      "heads and groups; pick degrees that divide it"))
    for symbols, noun, why in whole:
        for sym in symbols:
            value = dims.get(sym.name)
            if value is not None and value % (layout.tp * layout.cp):
                raise OpgraphError(f"{graph.name}: {sym.name} = {value}{noun} not divisible by "
                                   f"tp x cp = {layout.tp} x {layout.cp}: {why}")
    if layout.tp > 1 and not any(set(TENSOR_SPLITS) & sympy.Add(*w.shape).free_symbols
                                 for w in graph.weights()):
        # a model built on symbols of its own would otherwise run replicated, silently
        raise OpgraphError(f"{graph.name}: --tp {layout.tp} splits nothing: tensor parallelism "
                           "divides the weights' heads, MLP width and vocabulary, the symbols "
                           f"{', '.join(s.name for s in TENSOR_SPLITS)} of opgraph.core.symbols, "
                           "and "
                           "no weight has one; build the model with them, or leave out --tp")
    experts = dims.get("E")
    if layout.ep > 1 and (experts is None or experts % layout.ep):
        raise OpgraphError(f"{graph.name}: " + (f"E = {experts} experts are not divisible by --ep "
                                               f"{layout.ep}" if experts else
                                               "has no experts to spread; leave out --ep"))
    if layout.ep > 1 and not any(rules.shards_as(op.kind, "expert") for op in graph.ops()):
        raise OpgraphError(f"{graph.name}: --ep {layout.ep} spreads the experts' weights over "
                           "GPUs, and the model has none; build its experts with "
                           "GraphBuilder.expert_matmul (or a kind defined with "
                           "shards=('expert', ...)), or leave out --ep")


@step_pass(at=SHARD, bind=lambda o: o.layout and {"layout": o.layout},
           # the degrees are symbols of the sharded graph: only which exceed 1 decides its ops;
           # under TP the framework's padding of the vocabulary decides its shard's size
           structure={"layout": lambda p: (p.tp > 1, p.cp > 1, p.ep > 1,
                                           p.sequence_parallel,
                                           p.cp_comm if p.cp > 1 else None,
                                           traits(p).vocab_multiple if p.tp > 1 else None,
                                           p.folds_experts and p.tp > 1)})
@contract(forbids=("backward",))
def shard(graph: Graph, layout: Parallel) -> Graph:
    """The forward graph one GPU of `layout` runs, its collectives inserted (see the module).

        >>> from opgraph.models import preset
        >>> g = shard(preset("llama3-8b"), Parallel(tp=8))
        >>> g.tensor("layers.q_proj.weight").shape
        (D, H*d_h/tp)
    """
    if any(op.phase is not Phase.FORWARD for op in graph.ops()):
        raise ValueError(f"shard runs on a forward graph; {graph.name} has a backward already")
    if layout.tp == layout.cp == layout.ep == 1:
        return graph
    check_divides(graph, layout)
    return _Sharder(graph, layout).run()


class _Sharder:
    def __init__(self, graph: Graph, layout: Parallel):
        self.src, self.layout = graph, layout
        self.out = Graph(graph.name, graph.dims, seq_len=graph.seq_len,
                         max_seq_len=graph.max_seq_len)
        self.out.dims |= {sym: value for sym, value in
                          ((tp, layout.tp), (cp, layout.cp), (ep, layout.ep)) if value > 1}
        self.split = {s: s / tp for s in TENSOR_SPLITS} if layout.tp > 1 else {}
        if self.split:  # the framework's padded vocabulary, where it pads one
            self.split[V] = padded_vocab_shard(V, layout, tp)
        # what an op's parameters (a reshape's target, a head count) see: split dimensions,
        # and a context-parallel GPU's share of the sequence
        self.params = self.split | ({S: S / cp} if layout.cp > 1 else {})
        self.name: dict[str, str] = {}  # source tensor -> the tensor consumers read now
        self.seq: set[str] = set()  # tensors holding S/tp of the sequence (sequence parallel)
        self.made: dict[tuple, str] = {}  # (tensor, what) -> the inserted op's output
        self.routed: set[str] = set()  # tokens on their experts' GPUs (expert parallel)
        # the whole sequence of 1/cp of the channels: a state-space layer's, under CP
        self.heads: set[str] = set()
        self.defined = set(defined_kinds())  # kinds of the user's, whose roles are declared

    # --- tensors ----------------------------------------------------------------------------
    def _weight(self, t: Tensor) -> Tensor:
        expert = any(rules.shards_as(op.kind, "expert") and op.inputs[1] == t.name
                     for op in self.src.consumers(t.name))
        # folded experts (`Parallel.expert_tp` 1) stay whole under tensor parallelism
        mapping = {} if expert and self.layout.folds_experts else dict(self.split)
        if expert and self.layout.ep > 1:
            mapping[E] = E / ep
        return Tensor(t.name, tuple(d.xreplace(mapping) for d in t.shape), t.dtype, t.role,
                      t.count, t.grad_of, t.region)

    def _input(self, t: Tensor) -> Tensor:
        if self.layout.cp == 1 or not t.shape or len(t.shape) < 2:
            return t
        shape = list(t.shape)
        shape[SEQ_AXIS] = shape[SEQ_AXIS] / cp
        return Tensor(t.name, tuple(shape), t.dtype, t.role, t.count, t.grad_of, t.region)

    @staticmethod
    def _on_shard(t: Tensor) -> bool:
        """Whether activation `t` runs along a sequence shard: its second dimension is S/tp."""
        if t.role is not Role.ACTIVATION or len(t.shape) <= SEQ_AXIS:
            return False
        return {S, tp} <= sympy.sympify(t.shape[SEQ_AXIS]).free_symbols

    def _splits_params(self, op: Op) -> bool:
        """Whether `op`'s parameters name a split dimension (a broadcast to H/tp heads)."""
        return any(tp in _symbols(_sub(v, self.split)) for _, v in op.params)

    def _is_split(self, name: str) -> bool:
        return name not in self.seq and tp in sympy.Add(*self.out.tensor(name).shape).free_symbols

    # --- inserted ops -----------------------------------------------------------------------
    def _collective(self, source: str, kind: str, group: str, region, count, **params) -> str:
        key = (source, kind, group)
        if key in self.made:
            return self.made[key]
        t = self.out.tensor(source)
        size = {"tp": tp, "cp": cp, "ep": ep}[group]
        params = {"group": group, **params}
        if kind in ("all_gather", "reduce_scatter"):
            params |= {"axis": SEQ_AXIS, "size": size}
        shape = rules.infer_shapes(kind, [t], params)[0]
        name = f"{source}@{kind}.{group}"
        self.out.add_tensor(Tensor(name, shape, t.dtype, Role.ACTIVATION, count,
                                   region=region))
        self.out.add_op(Op(f"{source}.{kind}.{group}", kind, "communication", (source,), (name,),
                           count=count, params=params, region=region))
        self.made[key] = name
        if kind == "all_to_all" and source in self.seq:  # tokens move, the shard stays
            self.seq.add(name)
        # an expert dispatch routes, a combine ends
        if (source in self.routed) != (kind == "all_to_all" and group == "ep"):
            self.routed.add(name)
        return name

    def _local_slice(self, source: str, op: Op) -> str:
        """A full-sequence replicated tensor cut to this GPU's sequence shard (no traffic)."""
        name = self._cut(source, op, SEQ_AXIS, tp, "seq_shard")
        self.seq.add(name)
        return name

    def _cut(self, source: str, op: Op, axis: int, degree, tag: str) -> str:
        """`source` cut along `axis` to this GPU's 1/`degree` (a `slice`, no traffic), once."""
        key = (source, "slice", tag)
        if key not in self.made:
            t = self.out.tensor(source)
            params = {"axis": axis, "size": t.shape[axis] / degree}
            name = f"{source}@{tag}"
            self.out.add_tensor(Tensor(name, rules.infer_shapes("slice", [t], params)[0],
                                       t.dtype, Role.ACTIVATION, op.count, region=op.region))
            self.out.add_op(Op(f"{source}.{tag}", "slice", "elementwise", (source,), (name,),
                               count=op.count, params=params, region=op.region))
            self.made[key] = name
        return self.made[key]

    # --- the walk ---------------------------------------------------------------------------
    def run(self) -> Graph:
        src, out = self.src, self.out
        for region in src.regions():
            out.add_region(region)
        for t in src.tensors():
            if src.producer(t.name) is None:
                out.add_tensor(self._weight(t) if t.role is Role.WEIGHT else self._input(t))
                self.name[t.name] = t.name
        for op in src.ops():
            inputs = [self.name[n] for n in op.inputs]
            self._check_role(op, inputs)
            inputs = self._before(op, inputs)
            inputs = self._trade_sequence(op, inputs)
            params = {k: _sub(v, self.params) for k, v in op.params}
            if self._a2a(op):  # it runs on a head shard: H/cp of this GPU's heads
                params |= {k: params[k] / cp for k in ("heads", "kv_heads") if k in params}
            if any(n in self.heads for n in inputs):  # and a state-space layer's, H_m/cp
                params |= {k: params[k] / cp for k in ("heads", "groups") if k in params}
                if "sizes" in params:  # a cut of the channels (x, B, C): 1/cp of each
                    params["sizes"] = tuple(size / cp for size in params["sizes"])
            ins = [out.tensor(n) for n in inputs]
            if op.kind in RESHAPES and inputs[0] in self.seq:  # it keeps its sequence shard
                # (the input's extent, context parallelism's share already in it)
                params["shape"] = _sub(op.param("shape"),
                                       self.split | {S: ins[0].shape[SEQ_AXIS]})
            shapes = rules.infer_shapes(op.kind, ins, params)
            for name, shape in zip(op.outputs, shapes):
                t = src.tensor(name)
                out.add_tensor(Tensor(name, shape, t.dtype, t.role, t.count, t.grad_of,
                                      t.region))
                self.name[name] = name
            out.add_op(Op(op.name, op.kind, op.category, inputs, op.outputs, op.count, op.phase,
                          params, op.forward, op.region))
            if any(n in self.heads for n in inputs):
                self.heads.update(op.outputs)
            self._after(op, inputs)
        for region in src.regions():
            carries = [(self.name.get(a, a), self.name.get(b, b)) for a, b in region.carries]
            out.update_region(attrs.evolve(region, carries=carries))
        return out

    def _check_role(self, op: Op, inputs: list[str]) -> None:
        """A kind of the user's (`kinds.define_kind`) that declares no sharding role and reads
        a weight tensor parallelism split: an error, where it would run as a replica on a
        shard and leave partial sums unreduced."""
        if op.kind not in self.defined or rules.SHARDING.get(op.kind):
            return
        split = [n for n in inputs if self.out.tensor(n).role is Role.WEIGHT
                 and tp in sympy.Add(*self.out.tensor(n).shape).free_symbols]
        if split:
            raise OpgraphError(
                f"--tp {self.layout.tp} splits weight {split[0]}, which op {op.name} of kind "
                f"{op.kind} reads, and {op.kind} declares no sharding role; define it with "
                "shards=('column', 'contracting') if it multiplies by the weight as a matmul "
                "does, shards=('local',) if it runs on each shard alone, or leave out --tp")

    def _trade_sequence(self, op: Op, inputs: list[str]) -> list[str]:
        """Context parallelism around a state-space layer, as Megatron-Core runs Mamba's
        (`megatron/core/ssm/mamba_context_parallel.py`): before an op that runs along the
        sequence (`rules.ALONG_SEQUENCE`), and before an element-wise op or view that meets
        what one made, each activation on this GPU's sequence shard passes an all-to-all over
        `cp` to the whole sequence of 1/cp of its channels (`pre_conv_ssm`: z, x, B, C and dt;
        whole heads and groups, which `check_divides` checks), and the per-channel weights it
        reads are sliced to this GPU's channels (`get_conv1d_weight`, `get_dt_bias`, ...: views
        of the whole weight each GPU holds); any other op reading a head shard gets it back on
        the sequence shard first (`post_conv_ssm`)."""
        if self.layout.cp == 1:
            return inputs
        out = self.out
        along = op.kind in rules.ALONG_SEQUENCE
        held = any(n in self.heads for n in inputs)
        local = along or (held and (rules.VIEWS.get(op.kind) is not None
                                    or rules.FUSION_CLASSES.get(op.kind) == "pointwise"))
        inputs = list(inputs)
        for i, n in enumerate(inputs):
            t = out.tensor(n)
            if local and n not in self.heads and t.role is Role.ACTIVATION and len(t.shape) == 3:
                inputs[i] = self._collective(n, "all_to_all", "cp", op.region, op.count,
                                             size=cp, **A2A_IN)
                self.heads.add(inputs[i])
            elif along and t.role is Role.WEIGHT:
                inputs[i] = self._cut(n, op, 0, cp, "cp_shard")  # per-channel: axis 0
            elif not local and n in self.heads:
                inputs[i] = self._collective(n, "all_to_all", "cp", op.region, op.count,
                                             size=cp, **A2A_OUT)
        return inputs

    def _before(self, op: Op, inputs: list[str]) -> list[str]:
        layout, out = self.layout, self.out
        inputs = list(inputs)
        if layout.tp > 1 and rules.shards_as(op.kind, "column") and len(inputs) > 1:
            a, w = inputs[0], inputs[1]
            if tp in sympy.Add(*out.tensor(w).shape).free_symbols and not self._is_split(a):
                if a in self.seq:  # sequence parallel: gather the sequence (f = all-gather)
                    inputs[0] = self._collective(a, "all_gather", "tp", op.region, op.count)
                    for i, n in enumerate(inputs[2:], 2):  # and the routing read beside it
                        if n in self.seq:
                            inputs[i] = self._collective(n, "all_gather", "tp", op.region,
                                                         op.count)
                else:  # Megatron's f: a copy forward, the gradient all-reduced backward
                    inputs[0] = self._collective(a, "identity", "tp", op.region, op.count)
        if (layout.ep > 1 and rules.shards_as(op.kind, "expert") and inputs[0] not in self.routed
                and ep in sympy.sympify(out.tensor(inputs[1]).shape[0]).free_symbols):
            inputs[0] = self._collective(inputs[0], "all_to_all", "ep", op.region, op.count,
                                         fanout=self._fanout(op, inputs))
        if layout.ep > 1 and rules.shards_as(op.kind, "combine") and inputs[0] in self.routed:
            inputs[0] = self._collective(inputs[0], "all_to_all", "ep", op.region, op.count)
        if self._a2a(op):
            for i in range(3):  # queries, keys, values
                inputs[i] = self._collective(inputs[i], "all_to_all", "cp", op.region, op.count,
                                             size=cp, **A2A_IN)
        elif layout.cp > 1:
            for i in rules.key_value_inputs(op):
                inputs[i] = self._collective(inputs[i], "all_gather", "cp", op.region, op.count)
        if self.seq and any(n in self.seq for n in inputs) and (
                any(self._is_split(n) for n in inputs) or self._splits_params(op)):
            # a sequence shard meets a head-split tensor of the full sequence: gather it
            for i, n in enumerate(inputs):
                if n in self.seq:
                    inputs[i] = self._collective(n, "all_gather", "tp", op.region, op.count)
        if self.seq and any(n in self.seq for n in inputs):  # a full-length replica meets a shard
            for i, n in enumerate(inputs):
                t = out.tensor(n)
                if (n not in self.seq and t.role is Role.ACTIVATION and len(t.shape) > SEQ_AXIS
                        and out.producer(n) is not None and not self._is_split(n)):
                    inputs[i] = self._local_slice(n, op)
        return inputs

    def _a2a(self, op: Op) -> bool:
        """Whether `op` is an attention that context parallelism's all-to-all wraps (`cp_comm`
        "a2a"); an error for a part of an unfused attention, which it cannot."""
        if self.layout.cp == 1 or self.layout.cp_comm != "a2a" or not rules.key_value_inputs(op):
            return False
        if rules.CP_GATHERS.get(op.kind) != (1, 2) or op.param("heads") is None:
            raise OpgraphError(f"--cp-comm a2a runs a fused attention on the whole sequence of a "
                               f"head shard, and {op.name} ({op.kind}) is part of an unfused "
                               "one; leave out --no-fused-attention, or give --cp-comm ring")
        return True

    def _fanout(self, op: Op, inputs: list[str]):
        """Copies of each token the dispatch sends: K when the input is [..., in] per token."""
        a, routing = self.out.tensor(inputs[0]), self.out.tensor(inputs[2])
        return routing.shape[-1] if len(a.shape) == len(routing.shape) else 1

    def _after(self, op: Op, inputs: list[str]) -> None:
        layout, out = self.layout, self.out
        outputs = op.outputs
        if any(n in self.routed for n in inputs[:1]):
            self.routed.update(outputs)
        if (layout.tp > 1 and rules.shards_as(op.kind, "contracting")
                and any(self._is_split(n) for n in inputs)
                and not any(self._is_split(n) for n in outputs)):
            (partial,) = outputs
            if layout.sequence_parallel:
                reduced = self._collective(partial, "reduce_scatter", "tp", op.region, op.count)
                self.seq.add(reduced)
            else:
                reduced = self._collective(partial, "all_reduce", "tp", op.region, op.count)
            self.name[partial] = reduced
            return
        if any(n in self.seq for n in inputs):  # still on this GPU's share of the sequence
            self.seq.update(n for n in outputs if self._on_shard(out.tensor(n)))
        if self._a2a(op):  # the output back to this GPU's sequence shard of every head
            self.name[outputs[0]] = self._collective(outputs[0], "all_to_all", "cp", op.region,
                                                     op.count, size=cp, **A2A_OUT)


