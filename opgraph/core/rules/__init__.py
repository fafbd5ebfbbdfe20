"""Per-kind rules for every op kind, one module per kind family, and the per-trait tables made
from them.

Each family module (`dense`, `attention`, `ssm`, `norm`, `pointwise`, `views`, `moe`, `loss`,
`optimizer`, `kernels`) declares its kinds with `base.kind(...)`, every trait of a kind in one
place: shape and FLOP rules, VJP, its backward kernel's rules, view, sharding roles, context-
parallel gathers, fusion class, recomputation, FP8 operands, efficiency class, eager kernels,
category, example. `register` writes a kind's rows into the tables below, which the passes, the
verifier and the cost model read; nothing else writes them (`kinds.define_kind` declares a
user's kind through the same `kind` and `register`), and a kind's record is `KINDS[name]`.

Forward kinds, their backward kernels (`matmul` as dX = dY W^T and dW = X^T dY, the
`*_backward` kinds, `flash_attention_backward`) and the optimizer's `adamw` all have a row in
SHAPE_RULES and FLOP_RULES. The builder uses them to make an op; the verifier re-runs
SHAPE_RULES on every op of every phase; the cost model (`opgraph.cost.costmodel`) counts an op's
FLOPs with FLOP_RULES. FLOP counts per element for the cheap ops are conventions, written beside
each rule; the plate's figures are dominated by the matrix multiplies, whose counts are exact (2
FLOPs per multiply-add).

A backward kernel that accumulates into gradients written earlier (a tensor read by several
ops) reads those partial gradients last; its `accumulate` parameter says how many. The rules
see the kernel without them (`infer_shapes` and `count_flops` strip them): each partial must
have the shape of one of the kernel's outputs and costs one add per element.

A one-kernel backward (`rmsnorm_backward`, ...) reads, in order, the gradients of its forward
op's outputs (`dys` of them), the forward inputs it saved (`saved_inputs`), the forward
outputs it saved (`saved_outputs`); it writes the gradients of the forward inputs at the
positions `wrt`. Its shape rule re-runs the forward kind's rule on the saved inputs.

VIEWS says which kinds can be a new look at their input's memory (reshape, broadcast, a
contiguous slice or split, an in-place concatenation) and when: the cost model charges such an
op no bytes.
"""

from __future__ import annotations

from collections.abc import Callable

import sympy

from ..ir import Graph, Op, Phase, Tensor
from . import attention, dense, kernels, loss, moe, norm, optimizer, pointwise, ssm, views
from .base import (FLOP_RULES, GROUPS, SAVES, SHAPE_RULES, Example, Kind, Shape, ShapeError,
                   _partials, backward_shape, count_flops, infer_shapes, kind, per_element,
                   per_input, same, scaled, scaled_flops, twice_forward)

# How parallelism splits a kind (`passes.shard`), by role (a kind's `shards`):
# - "column": a weight (its second input) split along its output makes the op column-parallel:
#   a replicated input first passes Megatron's f (an all-reduce of its gradient backward);
# - "contracting": its output sums over a dimension of its inputs, so split inputs and an
#   unsplit output leave partial sums, which Megatron's g (an all-reduce) adds;
# - "expert": its weight's first dimension holds the experts, which expert parallelism spreads
#   over GPUs; the tokens travel to them by all-to-all;
# - "combine": the routed tokens come back by all-to-all before it;
# - "local": it runs on the shards its inputs hold, no collective of its own (an element-wise
#   kind reading a split bias); a built-in kind with no row is so.
SHARD_ROLES = ("column", "contracting", "expert", "combine", "local")

# --- the per-trait tables: each row made by `register` from a kind's record ----------------------
KINDS: dict[str, Kind] = {}  # every kind's record, by name (backward kernels are their forward's)
VIEWS: dict[str, Callable[[list[Tensor], dict], bool]] = {}  # kind -> when an op is a view
VJP_RULES: dict[str, Callable] = {}  # forward or collective kind -> (ctx, op) -> backward kernels
BACKWARD_COST: dict[str, Callable] = {}  # forward kind -> its backward's convention
GEMM_GRIDS: dict[str, Callable] = {}  # kind -> (GEMMs, M, N) of one instance (`gemm_grid`)
ATTENTION_SCORES: dict[str, Callable] = {}  # attention kernel -> (scores, d_qk + d_v, rows)
ATTENTION_BACKWARD: set[str] = set()  # the attention kernels that are a backward
EFFICIENCY: dict[str, str] = {}  # kind -> its efficiency class where not "matmul"
EAGER_BYTES: dict[str, Callable] = {}  # kind -> bytes of its eager PyTorch kernels
EAGER_BACKWARD_BYTES: dict[str, Callable] = {}  # ... of their backward, where not twice those
EAGER_SAVED: dict[str, Callable] = {}  # kind -> what its eager autograd keeps more
EAGER_WORKSPACE: dict[str, Callable] = {}  # kind -> what its eager kernels hold while they run
EAGER_BACKWARD_WORKSPACE: dict[str, Callable] = {}  # ... backward
SHARDING: dict[str, tuple[str, ...]] = {}  # kind -> its SHARD_ROLES
CP_GATHERS: dict[str, tuple[int, ...]] = {}  # attention kind -> the inputs CP gathers (K, V)
FUSION_CLASSES: dict[str, str] = {}  # built-in kind -> its fusion class (`fusion.KIND_CLASSES`)
DEFINED_FUSION_CLASSES: dict[str, str] = {}  # a user's kind -> its class (`define_kind`)
KEPT: dict[str, bool] = {}  # the kinds torchtitan's per-op recomputation keeps (an ordered set)
# the kinds that carry state along the sequence (a causal convolution, a scan): context
# parallelism runs them on the whole sequence of a head shard (`passes.shard`; an ordered set)
ALONG_SEQUENCE: dict[str, bool] = {}
# backward kernel -> True where it reads its saved forward tensors for their shapes alone (a
# view's: reshape, slice, split, concat, broadcast); the memory model keeps nothing for it
SHAPE_ONLY_BACKWARD: dict[str, bool] = {}
OPERANDS: dict[str, int] = {}  # matrix multiply -> its leading operands (FP8 where all are)
ACTIVE_FRACTION: dict[str, Callable] = {}  # routed kind -> (tensor, op, weight) -> share read
FP8_KINDS: dict[str, int] = {}  # kind the FP8 recipe casts -> its weight's dimensions
FORWARD_KINDS: tuple[str, ...] = ()
BACKWARD_KINDS: tuple[str, ...] = ()  # `<kind>_backward` kernels (a matmul's are matmuls)
COLLECTIVE_KINDS: tuple[str, ...] = ()
PRECISION_KINDS: tuple[str, ...] = ()
PARALLEL_KINDS: tuple[str, ...] = ()  # compute kernels the parallel passes make

# trait -> the table it fills, for the traits that are one row keyed by the kind's name
_ROWS = (("grid", GEMM_GRIDS), ("scores", ATTENTION_SCORES), ("efficiency", EFFICIENCY),
         ("eager", EAGER_BYTES), ("eager_backward", EAGER_BACKWARD_BYTES),
         ("eager_saved", EAGER_SAVED), ("eager_workspace", EAGER_WORKSPACE),
         ("eager_backward_workspace", EAGER_BACKWARD_WORKSPACE), ("operands", OPERANDS),
         ("active_fraction", ACTIVE_FRACTION), ("fp8_weight_dims", FP8_KINDS))
# the same for the traits of its backward kernel, keyed by the backward's name
_BACKWARD_ROWS = (("backward_shape", SHAPE_RULES), ("backward_flops", FLOP_RULES),
                  ("backward_view", VIEWS), ("backward_scores", ATTENTION_SCORES),
                  ("backward_efficiency", EFFICIENCY))
_TUPLES = {"forward": "FORWARD_KINDS", "collective": "COLLECTIVE_KINDS",
           "precision": "PRECISION_KINDS", "parallel": "PARALLEL_KINDS"}


def register(k: Kind, *, builtin: bool = True) -> None:
    """Write kind `k`'s rows into every table it has a trait for (a user's kind: `builtin`
    False, its fusion class then read by the built-in policies as `DEFINED_FUSION_CLASSES`)."""
    global BACKWARD_KINDS
    KINDS[k.name] = k
    SHAPE_RULES[k.name], FLOP_RULES[k.name] = k.shape, k.flops
    if k.view is not None:
        VIEWS[k.name] = k.view
    if k.group in ("forward", "collective"):
        VJP_RULES[k.name] = k.vjp
    if k.group == "forward":
        BACKWARD_COST[k.name] = k.backward_cost
    for trait, table in _ROWS:
        if getattr(k, trait) is not None:
            table[k.name] = getattr(k, trait)
    if k.shards:
        SHARDING[k.name] = k.shards
    if k.cp_gathers:
        CP_GATHERS[k.name] = k.cp_gathers
    if k.kept:
        KEPT[k.name] = True
    if k.along_sequence:
        ALONG_SEQUENCE[k.name] = True
    classes = FUSION_CLASSES if builtin else DEFINED_FUSION_CLASSES
    if k.fusion_class is not None:
        classes[k.name] = k.fusion_class
    if k.group in _TUPLES:
        globals()[_TUPLES[k.group]] = (*globals()[_TUPLES[k.group]], k.name)
    if k.backward is None:
        return
    for trait, table in _BACKWARD_ROWS:
        if getattr(k, trait) is not None:
            table[k.backward] = getattr(k, trait)
    if k.backward_scores is not None:
        ATTENTION_BACKWARD.add(k.backward)
    if k.backward_reads_shapes:
        SHAPE_ONLY_BACKWARD[k.backward] = True
    if k.fusion_class is not None:  # its backward fuses as it does
        classes[k.backward] = k.fusion_class
    BACKWARD_KINDS = (*BACKWARD_KINDS, k.backward)


# Every per-kind table `register` writes rows into, keyed by a kind's (or its backward's) name.
TABLES = (SHAPE_RULES, FLOP_RULES, VIEWS, VJP_RULES, BACKWARD_COST, SHARDING, CP_GATHERS, KEPT,
          ALONG_SEQUENCE, SHAPE_ONLY_BACKWARD, FUSION_CLASSES, DEFINED_FUSION_CLASSES,
          *(t for _, t in _ROWS))


def unregister(name: str) -> None:
    """Take kind `name` and its backward kernel out of every table."""
    k = KINDS.pop(name)
    names = {name, k.backward} - {None}
    for table in TABLES:
        for n in names:
            table.pop(n, None)
    ATTENTION_BACKWARD.difference_update(names)
    for var in ("BACKWARD_KINDS", *_TUPLES.values()):
        globals()[var] = tuple(n for n in globals()[var] if n not in names)


# The families' kinds, in the order the reference table lists them.
for _family in (dense, norm, attention, ssm, pointwise, loss, moe, views, optimizer, kernels):
    for _kind in _family.KINDS:
        register(_kind)


def is_view(kind: str, ins: list[Tensor], params: dict) -> bool:
    """Whether an op of `kind` reading `ins` is a view (moves no bytes): VIEWS' rule, if any."""
    rule = VIEWS.get(kind)
    return rule is not None and bool(rule(ins, params))


def sequence_gather(op) -> bool:
    """Whether `op` (an `ir.Op`) is a forward all-gather over the tensor-parallel group:
    sequence parallelism's f, which `passes.shard` inserts to gather a sequence shard for a
    column-parallel matmul (`passes.precision` casts its shard, `passes.regather_inputs` runs it
    again in the backward)."""
    return (op.phase is Phase.FORWARD and op.kind == "all_gather"
            and op.param("group") == "tp")


def ring_gather(op) -> bool:
    """Whether `op` (an `ir.Op`) is a forward all-gather over the context-parallel group: ring
    attention's keys and values, which `passes.shard` gathers for an attention op
    (`passes.regather_inputs` runs it again in the backward)."""
    return (op.phase is Phase.FORWARD and op.kind == "all_gather"
            and op.param("group") == "cp")


def key_value_inputs(op) -> tuple[int, ...]:
    """The positions of the keys and values among attention op `op`'s inputs (an `ir.Op`):
    its kind's (`CP_GATHERS`: what context parallelism gathers), and for unfused attention's
    P.V matmul (a matmul with `heads`), its values; () for any other op."""
    if op.kind == "matmul" and op.param("heads") is not None:
        return (1,)
    return CP_GATHERS.get(op.kind, ())


def shards_as(kind: str, role: str) -> bool:
    """Whether parallelism splits `kind` in `role` (`SHARDING`)."""
    return role in SHARDING.get(kind, ())


def attention_scores(kind: str, ins: list[Tensor], outs: list[Tensor], params: dict) -> tuple:
    """`(scores, d_qk + d_v, query rows)` of one instance of an attention kernel of `kind`,
    sympy expressions; `()` for another kind."""
    rule = ATTENTION_SCORES.get(kind)
    if rule is None:
        return ()
    own, _ = _partials(ins, params)
    return tuple(sympy.sympify(e) for e in rule(own, outs, params))


def gemm_grid(kind: str, ins: list[Tensor], outs: list[Tensor], params: dict) -> tuple:
    """`(count, M, N)`: one instance of an op of `kind` as `count` GEMMs of an M x N output,
    sympy expressions of the dimensions; `()` for a kind that is not a matrix multiply.

        gemm_grid("matmul", [x, w], [y], {})  # x[B, S, D] @ w[D, F]: (1, B*S, F)
    """
    rule = GEMM_GRIDS.get(kind)
    if rule is None:
        return ()
    own, _ = _partials(ins, params)
    return tuple(sympy.sympify(e) for e in rule(own, outs, params))


def rule_flops(graph: Graph, op: Op) -> sympy.Expr:
    """FLOPs of one instance of `op` by its kind's FLOP rule."""
    ins = [graph.tensor(n) for n in op.inputs]
    outs = [graph.tensor(n) for n in op.outputs]
    return count_flops(op.kind, ins, outs, dict(op.params))


def eager_bytes(kind: str, ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
    """HBM bytes of one instance of an op of `kind` run as eager PyTorch's kernels
    (EAGER_BYTES); a kind without an eager decomposition is one kernel either way: None."""
    rule = EAGER_BYTES.get(kind)
    return None if rule is None else sympy.sympify(rule(ins, outs, params))


def eager_saved(kind: str, ins: list[Tensor], outs: list[Tensor], params: dict) -> tuple:
    """The `(name, shape, dtype)` of each tensor the autograd of an eager op of `kind` keeps
    for its backward beyond a fused kernel's (EAGER_SAVED); () for a kind without one."""
    rule = EAGER_SAVED.get(kind)
    return () if rule is None else rule(ins, outs, params)


def eager_workspace(kind: str, ins: list[Tensor], outs: list[Tensor], params: dict,
                    backward: bool = False) -> tuple:
    """The `(name, shape, dtype)` of each tensor the eager kernels of an op of `kind` (or, with
    `backward`, of its backward; `ins`/`outs` the forward's either way) hold while they run,
    besides the op's own tensors (EAGER_WORKSPACE, EAGER_BACKWARD_WORKSPACE); () for a kind
    without one."""
    rule = (EAGER_BACKWARD_WORKSPACE if backward else EAGER_WORKSPACE).get(kind)
    return () if rule is None else rule(ins, outs, params)


def eager_backward_bytes(kind: str, ins: list[Tensor], outs: list[Tensor],
                         params: dict) -> sympy.Expr | None:
    """HBM bytes of the backward of one eager op of `kind` (inputs and outputs its forward's),
    all its kernels together (EAGER_BACKWARD_BYTES); None: the cost model's convention."""
    rule = EAGER_BACKWARD_BYTES.get(kind)
    return None if rule is None else sympy.sympify(rule(ins, outs, params))

__all__ = ["ACTIVE_FRACTION", "ALONG_SEQUENCE", "ATTENTION_BACKWARD", "ATTENTION_SCORES",
           "BACKWARD_COST", "BACKWARD_KINDS", "COLLECTIVE_KINDS", "CP_GATHERS",
           "DEFINED_FUSION_CLASSES", "EAGER_BACKWARD_BYTES", "EAGER_BACKWARD_WORKSPACE",
           "EAGER_BYTES", "EAGER_SAVED", "EAGER_WORKSPACE", "EFFICIENCY", "FLOP_RULES",
           "FORWARD_KINDS", "FP8_KINDS", "FUSION_CLASSES", "GEMM_GRIDS", "GROUPS", "KEPT", "KINDS",
           "OPERANDS", "PARALLEL_KINDS", "PRECISION_KINDS", "SAVES", "SHAPE_ONLY_BACKWARD",
           "SHAPE_RULES", "SHARDING", "SHARD_ROLES", "TABLES", "VIEWS", "VJP_RULES",
           "Example", "Kind", "Shape", "ShapeError", "attention_scores", "backward_shape",
           "count_flops", "eager_backward_bytes", "eager_bytes", "eager_saved", "eager_workspace",
           "gemm_grid", "infer_shapes", "is_view", "kind", "per_element", "per_input", "register",
           "ring_gather", "rule_flops", "same", "scaled", "scaled_flops", "sequence_gather",
           "shards_as", "twice_forward", "unregister"]
