"""The cost model: one record that turns an op into its FLOPs, its HBM bytes and its time.

    cost = CostModel()                                  # the plate's conventions
    cost.op_costs(step)["layers.q_proj"]                # Cost(flops=2*B*D*H*S*d_h, bytes=...)
    cost.time(flops, nbytes, peak, bandwidth)           # max(flops / peak, bytes / bandwidth)

Nothing is stored on an op: FLOPs come from its kind's FLOP rule (`opgraph.core.rules`), bytes from
the tensors it reads and writes, each once (`Graph.op_bytes`); a view (`rules.VIEWS`: a
reshape, a broadcast, a contiguous slice) moves none. An op's time is
`count x max(flops / peak, bytes / bandwidth)` (XLA's HloCostAnalysis roofline); ops do not
overlap, so a step's time is their sum. `time` takes the maximum as an argument, so the same rule
serves sympy (`sympy.Max`, `opgraph.cost.formula`, `opgraph.analysis.solve`), plain floats
(`evaluate`) and numpy arrays (`np.maximum`, `opgraph.analysis.sweep`).

A backward kernel is costed by the convention `backward` names:

- "plate" (the default, PLATE.md): each backward kernel costs `factor` (2) x its forward op's
  FLOPs and bytes, split evenly over that op's backward kernels (found through the kernel's
  `forward` link), except where BACKWARD_COST says otherwise: FlashAttention's backward and the
  views' (`rules.VIEWS`) take the convention's FLOPs but the bytes of their own tensors;
- "tensors": FLOPs by the convention, bytes from each kernel's own tensors;
- "derived": each kernel's own FLOP rule and tensors (FlashAttention's backward then costs
  2.5x its forward: it recomputes QK^T).

The utilisation conventions are here too: MFU = 6 N tokens / (step x peak), N the parameters
other than the input embedding (a token's share of them for a mixture of experts), against the
BF16 peak whatever the precision (torchtitan's convention: an FP8 step's MFU can pass 100%);
HFU = every counted FLOP, re-run ones included, / (step x peak), FP8 FLOPs weighted by
peak / FP8 peak, never above 1.

Each op runs at the peak of its compute dtype (`compute_dtype`: a matmul whose operands are FP8
runs at the part's dense FP8 peak, `peak`); MFU and HFU stay against the BF16 peak.

Later work plugs in here (efficiencies, communication): a subclass or an
`attrs.evolve` of the record reaches `evaluate`, `formula`, `solve` and `sweep` alike.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import attrs
import sympy

from ..core import rules
from ..core.choices import BACKWARD_MODES, COST_MODELS
from ..core.errors import OpgraphError
from ..core.ir import DTYPES, Graph, Op, Phase
from ..core.rules import rule_flops


@attrs.frozen
class Cost:
    """One instance of an op: FLOPs and HBM bytes, sympy expressions of the dimensions, and the
    dtype whose peak its arithmetic runs at (`compute`: None for the part's dense BF16 peak)."""

    flops: sympy.Expr
    bytes: sympy.Expr
    compute: str | None = None
    message: sympy.Expr = sympy.S.Zero  # a collective's buffer per GPU (`collectives`' M)
    # a collective's share of one NCCL call: 1 for a call of its own; a framework that reduces
    # gradients in buckets (`frameworks.reduces_in_buckets`), or gathers an FSDP module's
    # weights together (`frameworks.groups_by_module`), issues one call for many weights, each
    # paying its share of the call's latency (the op's `calls` parameter)
    calls: sympy.Expr = sympy.S.One
    # the shape the calibrated model's kernel efficiency reads, per instance: a matrix
    # multiply's (GEMMs, M, N) (`rules.gemm_grid`), which its waves tile; an attention kernel's
    # (scores, d_qk + d_v, 0) (`rules.attention_scores`), its exponentials; () otherwise
    grid: tuple = attrs.field(default=(), converter=tuple)
    # the kernels one instance launches, each costing the host `host_s` (`host_floor`): 1, or
    # the op's `launches` parameter (a grouped GEMM its framework issues as one GEMM per expert,
    # `passes/unroll_expert_gemms.py`); a collective's, the kernels its call runs on its stream
    # (`frameworks.Traits.list_collectives`: its NCCL kernel and a copy per rank)
    launches: sympy.Expr = sympy.S.One
    # the efficiency of its generation its arithmetic runs at (`CalibratedCostModel`): its
    # kind's (`EFFICIENCY`: `attention` for FlashAttention's kernels, else `matmul`), or the
    # op's `efficiency` parameter (a framework's fused attention library,
    # `passes/pick_attention_kernel.py`)
    efficiency: str = "matmul"


# --- the peak an op runs at: a matrix multiply whose operands are all FP8 runs at the part's
# dense FP8 peak (the precision pass's casts make them so); everything else at the BF16 peak ----

OPERANDS: dict[str, int] = rules.OPERANDS  # kind -> its leading operands (a kind's `operands`)
PEAKS: dict[str, str] = {"fp8": "fp8_flops"}  # dtype -> the Hardware field of its dense peak
# (efficiency, dtype) -> the efficiency an op of that class runs at that dtype's peak, where it
# is not its class's own: an FP8 matrix multiply reaches a smaller share of the FP8 peak than a
# BF16 one of the BF16 peak (`Efficiencies.fp8_ratio`)
DTYPE_RATES: dict[tuple[str, str], str] = {("matmul", "fp8"): "matmul_fp8"}


def compute_dtype(graph: Graph, op: Op) -> str | None:
    """The dtype of PEAKS `op`'s arithmetic runs in: its operands' when they all share one of
    them (a bias or an accumulated partial gradient does not count); None otherwise. A fused
    kernel computes in its matrix multiply's dtype (an FP8 GEMM with its epilogue still runs at
    the FP8 peak)."""
    if op.kind == "fused":
        params = dict(op.params)
        known = {t.name: t for t in params["inner"]}
        dtypes = {_operands_dtype([known.get(n) or graph.tensor(n) for n in m.inputs], m.kind)
                  for m in params["body"] if m.kind in OPERANDS}
        return dtypes.pop() if len(dtypes) == 1 else None
    return _operands_dtype([graph.tensor(n) for n in op.inputs], op.kind)


def _operands_dtype(inputs: list, kind: str) -> str | None:
    n = OPERANDS.get(kind)
    if n is None:
        return None
    names = {t.dtype.name for t in inputs[:n]}
    return names.pop() if len(names) == 1 and names <= set(PEAKS) else None


# --- the plate's backward convention, per forward kind: (scaled FLOPs, scaled bytes, the
# kernel's own bytes) -> the kernel's (FLOPs, bytes) -----------------------------------------------

scaled, scaled_flops = rules.scaled, rules.scaled_flops  # the two conventions a kind picks from
# forward kind -> its backward's convention (a kind's `backward_cost`: `scaled_flops` for
# FlashAttention and the views, whose backward moves its own tensors)
BACKWARD_COST: dict[str, Callable] = rules.BACKWARD_COST


def own_bytes(graph: Graph, op: Op) -> sympy.Expr:
    """HBM bytes of one instance of `op` from its own tensors: none for a view (a kind in
    `rules.VIEWS` whose rule says its output is a view of its input); an op marked `eager`
    (`passes.decompose`) its eager kernels' (`rules.eager_bytes`); else `Graph.op_bytes`."""
    if op.kind in rules.VIEWS and rules.is_view(op.kind, [graph.tensor(n) for n in op.inputs],
                                                dict(op.params)):
        return sympy.Integer(0)
    if op.param("eager"):
        eager = rules.eager_bytes(op.kind, [graph.tensor(n) for n in op.inputs],
                                  [graph.tensor(n) for n in op.outputs], dict(op.params))
        if eager is not None:
            return eager
    return graph.op_bytes(op)


def _eager_backward(graph: Graph, fwd: Op) -> sympy.Expr | None:
    """The bytes of eager forward op `fwd`'s backward kernels together, where its kind's
    autograd backward has its own rule (`rules.eager_backward_bytes`); else None."""
    if not fwd.param("eager"):
        return None
    return rules.eager_backward_bytes(fwd.kind, [graph.tensor(n) for n in fwd.inputs],
                                      [graph.tensor(n) for n in fwd.outputs], dict(fwd.params))


def message_bytes(graph: Graph, op: Op) -> sympy.Expr:
    """A collective's buffer per GPU, as `opgraph.parallel.collectives` sizes it (NCCL's
    convention): the gathered output of an all-gather, else the input (a dispatch's K copies of each
    token: `fanout`); 0 for Megatron's f, a copy in forward."""
    if op.kind == "identity":
        return sympy.Integer(0)
    t = graph.tensor(op.outputs[0] if op.kind == "all_gather" else op.inputs[0])
    wire = op.param("dtype")  # a message cast for the wire (a gradient reduced in BF16)
    size = t.nbytes if wire is None else t.numel * DTYPES[wire].itemsize
    return size * sympy.sympify(op.param("fanout", 1))


def _own(graph: Graph, op: Op) -> Cost:
    """`op`'s cost by its own rule and tensors; a collective's by its message, on the network
    (it moves no HBM bytes on the compute stream). A fused op's depends on its members too, so
    it is costed each time; any other's is a function of the op and its tensors alone
    (`_own_of`), which recur across a search's graphs."""
    if op.kind == "fused":
        return _own_cost(graph, op)
    return _own_of(op, tuple(graph.tensor(n) for n in dict.fromkeys((*op.inputs, *op.outputs))))


@functools.lru_cache(maxsize=200_000)  # bounded: a search's distinct ops fit many times over
def _own_of(op: Op, tensors: tuple) -> Cost:
    """`_own_cost` of `op` as a pure function of the op and its tensors (hashable, frozen), so
    that a cache of it holds no graph and cannot go stale."""
    return _own_cost(_Tensors({t.name: t for t in tensors}), op)


@attrs.frozen
class _Tensors:
    """The part of a Graph the cost of one op reads: its tensors by name, and `op_bytes`."""

    by_name: dict

    def tensor(self, name: str):
        return self.by_name[name]

    op_bytes = Graph.op_bytes


def _whole_expr(value) -> sympy.Expr:
    """An op parameter that counts (`launches`): a whole number or a sympy expression, never
    text (`verify` says so first)."""
    return sympy.Integer(value) if isinstance(value, int) else value


def _own_cost(graph: Graph, op: Op) -> Cost:
    if op.kind in rules.COLLECTIVE_KINDS:
        return Cost(sympy.Integer(0), sympy.Integer(0), None, message_bytes(graph, op),
                    calls=sympy.sympify(op.param("calls", 1)),
                    launches=_whole_expr(op.param("launches", 1)))
    ins = [graph.tensor(n) for n in op.inputs]
    outs = [graph.tensor(n) for n in op.outputs]
    params = dict(op.params)
    compute = compute_dtype(graph, op)
    efficiency = op.param("efficiency", EFFICIENCY.get(op.kind, "matmul"))
    return Cost(rule_flops(graph, op), own_bytes(graph, op), compute,
                grid=(rules.gemm_grid(op.kind, ins, outs, params)
                      or rules.attention_scores(op.kind, ins, outs, params)),
                launches=_whole_expr(op.param("launches", 1)),
                efficiency=DTYPE_RATES.get((efficiency, compute), efficiency))


# A fused forward kernel (`opgraph.passes.fuse_elementwise`, kind `fused`, not a forward kind of
# the tables) takes the plate's own rule: its backward kernels, linked to it, cost twice its FLOPs
# and bytes between them. Its FLOPs are its members', so the step's backward FLOPs are kept; its
# bytes are its boundary's, so the plate's backward saves twice what the forward fusion saves.
# A backward kernel that names the members it differentiates (its `of` parameter) keeps their
# share (`CostModel._member_share`); one that does not gets an even share.
FUSED_BACKWARD_COST: Callable = scaled


def members_of(op: Op) -> tuple[str, ...]:
    """The members of its fused forward op a backward kernel differentiates (`of`), if it says."""
    of = op.param("of")
    return () if of is None else ((of,) if isinstance(of, str) else tuple(of))


def _kernel_counts(ops: list[Op]) -> dict:
    """Backward kernels per forward op (by name), and per (fused op, member) for the kernels
    that name the member they differentiate."""
    counts: dict = {}
    for op in ops:
        if op.phase is Phase.BACKWARD and op.forward is not None:
            for key in (op.forward, *((op.forward, m) for m in members_of(op))):
                counts[key] = counts.get(key, 0) + 1
    return counts


def fused_members(graph: Graph, op: Op) -> dict[str, Cost]:
    """Each member of fused kernel `op` costed alone, as it was before the fusion: its kind's
    FLOP rule and the bytes of the tensors it reads and writes."""
    params = dict(op.params)
    known = {t.name: t for t in (*map(graph.tensor, op.inputs), *params["inner"],
                                 *map(graph.tensor, op.outputs))}
    members = {}
    for m in params["body"]:
        ins, outs = [known[n] for n in m.inputs], [known[n] for n in m.outputs]
        nbytes = sympy.Add(*(known[n].nbytes for n in dict.fromkeys((*m.inputs, *m.outputs))))
        members[m.name] = Cost(rules.count_flops(m.kind, ins, outs, dict(m.params)), nbytes)
    return members


def _number_max(a, b):
    return max(a, b)


def _number_min(a, b):
    return min(a, b)


def _positive(x):
    """Whether a count of FLOPs or bytes is above zero: a bool for a number, a bool array for an
    array (`scaled_time`'s default; a formula's is structural, `formula._nonzero`)."""
    return x > 0


@attrs.frozen
class CostModel:
    """How an op costs: the backward convention (`backward`, one of BACKWARD_MODES), the
    backward-over-forward ratio it uses (`factor`, the plate's 2), and how much communication
    beside compute slows it (`overlap_slowdown`, `opgraph.parallel.schedule`)."""

    backward: str = attrs.field(default="plate", validator=attrs.validators.in_(BACKWARD_MODES))
    factor: sympy.Expr = attrs.field(default=2, converter=sympy.sympify)
    # The share of its own time a collective that runs beside compute adds to it (NCCL's
    # kernels take SMs and HBM bandwidth from the compute stream; Calculon's
    # `processor_usage`). 0 for the roofline, a ceiling.
    overlap_slowdown: float = 0.0

    # --- FLOPs and bytes ------------------------------------------------------------------------
    def op_costs(self, graph: Graph) -> dict[str, Cost]:
        """Every op's per-instance cost, by name, in the graph's op order."""
        ops = graph.ops()
        kernels = _kernel_counts(ops)
        own = {op.name: _own(graph, op) for op in ops}
        return {op.name: self._cost(graph, op, own, kernels) for op in ops}

    def op_cost(self, graph: Graph, op: Op) -> Cost:
        """One op's per-instance cost (`op_costs` for many: it indexes the graph once)."""
        own = {op.name: _own(graph, op)}
        kernels = {}
        if self._conventional(graph, op):
            fwd = graph.op(op.forward)
            own[fwd.name] = _own(graph, fwd)
            kernels = _kernel_counts([o for o in graph.ops() if o.forward == fwd.name])
        return self._cost(graph, op, own, kernels)

    def _conventional(self, graph: Graph, op: Op) -> bool:
        """Whether `op` is costed from its forward op (a backward kernel, not "derived")."""
        return (self.backward != "derived" and op.phase is Phase.BACKWARD
                and op.forward is not None and graph.has_op(op.forward)
                and op.kind not in rules.COLLECTIVE_KINDS)

    def _cost(self, graph: Graph, op: Op, own: dict, kernels: dict) -> Cost:
        mine = own[op.name]
        if not self._conventional(graph, op):
            return mine
        fwd = graph.op(op.forward)
        if fwd.kind == "fused" and members_of(op):
            return self._member_share(graph, op, fwd, own, kernels)
        n = kernels[fwd.name]
        flops = self.factor * own[fwd.name].flops / n
        nbytes = self.factor * own[fwd.name].bytes / n
        rule = FUSED_BACKWARD_COST if fwd.kind == "fused" else BACKWARD_COST[fwd.kind]
        flops, nbytes = rule(flops, nbytes, mine.bytes)
        eager = _eager_backward(graph, fwd)
        if eager is not None:  # autograd's own kernels, not the convention's
            nbytes = eager / n
        return attrs.evolve(mine, flops=flops,
                            bytes=nbytes if self.backward == "plate" else mine.bytes)

    def _member_share(self, graph: Graph, op: Op, fwd: Op, own: dict, kernels: dict) -> Cost:
        """A backward kernel of fused op `fwd` that names the members it differentiates: the
        FLOPs and bytes those members' backward had before the fusion (the plate: `factor` x
        each member's, split over its kernels), less an even share of `factor` x the bytes the
        fusion saved; so `fwd`'s kernels together cost `factor` x `fwd`, and a fusion moves no
        FLOP from one backward kernel to another."""
        members = fused_members(graph, fwd)
        flops = sympy.Add(*(self.factor * members[m].flops / kernels[(fwd.name, m)]
                            for m in members_of(op)))
        if self.backward != "plate":
            return attrs.evolve(own[op.name], flops=flops)
        saved = sympy.Add(*(c.bytes for c in members.values())) - own[fwd.name].bytes
        nbytes = sympy.Add(*(self.factor * members[m].bytes / kernels[(fwd.name, m)]
                             for m in members_of(op)))
        return attrs.evolve(own[op.name], flops=flops,
                            bytes=nbytes - self.factor * saved / kernels[fwd.name])

    # --- time and utilisation ---------------------------------------------------------------
    def peak(self, hardware, compute: str | None = None) -> float:
        """The part's dense peak for arithmetic in `compute` (a Cost's): the BF16 peak for
        None, else the field PEAKS names (`fp8_flops`); an error if the part has none.

            DEFAULT.peak(h100, "fp8")  # 1.979e15, the H100 SXM's dense FP8 peak
        """
        if compute is None:
            return hardware.peak_flops
        value = getattr(hardware, PEAKS[compute])
        if value is None:
            raise OpgraphError(f"hardware {hardware.id} has no dense {compute.upper()} peak "
                               f"({PEAKS[compute].removesuffix('_flops')}_tflops in its TOML); "
                               "give a part that has one, or --precision bf16")
        return value

    def time(self, flops, nbytes, peak, bandwidth, maximum: Callable = _number_max):
        """One instance's time: `maximum(flops / peak, bytes / bandwidth)`, the roofline.
        `maximum` is `max` for numbers, `sympy.Max` for formulas, `np.maximum` for arrays.

            >>> DEFAULT.time(2e12, 1e12, peak=1e12, bandwidth=1e12)
            2.0
        """
        return maximum(flops / peak, nbytes / bandwidth)

    name = "roofline"

    def op_time(self, hardware, kind: str, flops: float, nbytes: float, count: int,
                peak: float, grid: tuple = (), launches: float = 1.0,
                efficiency: str | None = None) -> float:
        """Seconds of `count` instances of an op of `kind` doing `flops` and moving `nbytes`
        between them, its arithmetic at `peak`: the roofline, `time(flops, nbytes, peak,
        hardware.bandwidth)`. The calibrated model scales it (`CalibratedCostModel`), and
        reads `grid`, a matrix multiply's (GEMMs, M, N) per instance as numbers (`Cost.grid`
        evaluated), `launches`, the kernels an instance launches (`Cost.launches`), and
        `efficiency`, the efficiency its arithmetic runs at (`Cost.efficiency`; None: its
        kind's); the roofline does not. One op of `op_time_list`."""
        return self.op_time_list(hardware, [kind], [flops], [nbytes], [count], [peak], [grid],
                                 [launches], [efficiency])[0]

    def op_time_list(self, hardware, kinds, flops, nbytes, counts, peaks, grids, launches,
                     efficiencies) -> list[float]:
        """`op_time` of many ops at once, as floats (`evaluate`'s rows; a stage's ops in the
        schedule): the roofline's `time` of each, in plain floats (numpy is not loaded for
        it); `CalibratedCostModel` runs one column of `op_times`."""
        return [self.time(f, b, p, hardware.bandwidth) for f, b, p in zip(flops, nbytes, peaks)]

    # whether its time reads each kernel's shape (its count, grid, efficiency and launches),
    # which `opgraph.analysis.sweep` then compiles beside the FLOPs and bytes
    shapes = False

    def figures(self, hardware) -> dict[str, float]:
        """What its time reads of a part besides the peak and the bandwidth: nothing for the
        roofline (`CalibratedCostModel.figures`: the generation's efficiencies)."""
        return {}

    def op_times(self, hardware, kinds, flops, nbytes, counts, peaks, grids=None,
                 launches=None, efficiencies=None):
        """`op_time` over numpy arrays: a row per op (of `kinds`, at the column `peaks`), a
        column per case (`opgraph.parallel.search`'s layouts); `grids` (3, ops, cases), each op's
        `grid` (zeros for an op without one), or None; `launches` (ops, cases), each op's
        `Cost.launches`, or None (one each); `efficiencies`, each op's `Cost.efficiency`, or
        None (its kind's). `kernel_times` with the part's `figures`."""
        import numpy as np

        hosts = np.array([host_floor(kind, 1.0) for kind in kinds], dtype=float)[:, None]
        return self.kernel_times(
            self.figures(hardware), [attention_role(kind) for kind in kinds], flops, nbytes,
            counts, peaks, hardware.bandwidth, grids,
            hosts if launches is None else hosts * launches,
            efficiencies or [EFFICIENCY.get(kind, "matmul") for kind in kinds])

    def kernel_times(self, figures: dict, attention, flops, nbytes, counts, peaks, bandwidth,
                     grids=None, hosts=None, rates=None):
        """The time of each row of kernels over numpy arrays (a row per op or term, a column
        per case or point), the one array entry point `op_times` (the planner) and
        `opgraph.analysis.sweep` share: `figures` as `figures` gives them, each a number or
        an array over the columns; `attention` each row's `attention_role`; `grids` (3, rows,
        columns) or None; `hosts` the kernels each row's instance launches that pay the host's
        time (`host_floor`); `rates` each row's efficiency's name. The roofline reads only the
        FLOPs, bytes, peaks and bandwidth: `time` with `np.maximum`."""
        import numpy as np

        return self.time(flops, nbytes, peaks, bandwidth, np.maximum)

    def comm_lines(self, kind: str, group: int, cluster, stride: int = 1,
                   hardware=None) -> tuple[tuple[float, float], ...]:
        """The lines one collective of `kind` (an op kind: "all_reduce") over a group of
        `group` GPUs `stride` ranks apart is costed by, each (seconds at no message, seconds per
        byte); it takes the least of them (`comm_time`). The roofline's is one line, the
        envelope of those NCCL may run (`nccl_lines`): the least latency any of them pays (LL's)
        with the least time per byte (Simple's, the tiers' full bandwidth). No protocol has
        both, so no run of the collective beats it: a ceiling, as the rest of the roofline is,
        where NCCL's own Simple line charges each ring step across nodes 14 us beside its
        bandwidth (its tuner's estimate, not a floor). Its bandwidths are the tiers' datasheet
        figures, not a cluster's measured table (`_datasheet`): a median of measured runs is
        not a ceiling either."""
        found = nccl_lines(kind, group, _datasheet(cluster), stride)
        return ((min(latency for latency, _ in found), min(per_byte for _, per_byte in found)),)

    def comm_time(self, kind: str, message, group: int, cluster, stride: int = 1,
                  hardware=None, calls: float = 1.0, launches: float = 1.0) -> float:
        """Seconds of one collective of `kind` moving `message` bytes per GPU: the fastest of
        its `comm_lines`, as NCCL's tuner picks (`opgraph.parallel.collectives.seconds`), its
        latency paid `calls` times (`Cost.calls`: a weight's share of a bucket's or a module's
        one call); and the `launches` - 1 kernels its call runs beside NCCL's
        (`Cost.launches`) at `copy_s` each, `calls` times too."""
        extra = beside_nccl_s(launches, calls, self.copy_s(hardware))
        return extra + min(latency * calls + per_byte * float(message) for latency, per_byte
                           in self.comm_lines(kind, group, cluster, stride, hardware))

    def copy_s(self, hardware) -> float:
        """Seconds each kernel a collective's call runs beside NCCL's adds to it (a list-form
        call's copy per rank, `Cost.launches`): none on the roofline, whose kernels cost only
        their bytes (a rank's piece, negligible beside the message)."""
        return 0.0

    def slowdown(self, hardware) -> float:
        """The share of hidden communication time added to the compute beside it."""
        return self.overlap_slowdown

    def bound(self, flops, nbytes, peak, bandwidth) -> str:
        """"compute" or "memory": which of the two terms of `time` is the larger."""
        compute = self.time(flops, 0, peak, bandwidth)
        return "compute" if compute >= self.time(0, nbytes, peak, bandwidth) else "memory"

    def mfu(self, parameters, tokens, step_time, peak):
        """Model FLOPs utilisation: 6 x N x tokens / (step time x peak)."""
        return 6 * parameters * tokens / (step_time * peak)

    def hfu(self, flops, step_time, peak, minimum: Callable = _number_min):
        """Hardware FLOPs utilisation: counted FLOPs / (step time x peak), every FLOP run
        (a re-run op's, `passes.recompute`, and FlashAttention's recomputed QK^T under the
        "derived" convention included). FP8 FLOPs come in weighted by peak / FP8 peak (the
        caller's `flops`, a sum of `busy_flops`), so this is the share of the step the
        arithmetic units are busy. The step is at least its FLOPs over the peak, so this is at
        most 1; `minimum` keeps rounding from saying more (`min` for numbers, `np.minimum` for
        arrays)."""
        return minimum(flops / (step_time * peak), 1.0)

    @staticmethod
    def busy_flops(flops, op_peak, peak):
        """`flops` run at `op_peak` as `hfu` counts them: as the FLOPs that would keep the
        arithmetic units busy as long at `peak` (the BF16 peak), i.e. times `peak / op_peak`.
        One FP8 FLOP on an H100 counts as 989 / 1979 of a BF16 one; a BF16 FLOP as itself,
        exactly. Numbers or numpy arrays alike (`opgraph.analysis.sweep`).

            >>> CostModel.busy_flops(2e12, op_peak=2e15, peak=1e15)
            1000000000000.0
        """
        return flops * (peak / op_peak)


DEFAULT = CostModel()

# Which efficiency of a generation a kind's arithmetic runs at (`opgraph.cost.calibration`); any
# other kind runs at `matmul`'s (its compute term rarely binds: it is memory-bound).
EFFICIENCY: dict[str, str] = rules.EFFICIENCY  # kind -> its class (`efficiency`), else "matmul"
# How much slower than FlashAttention-2 an earlier attention kernel runs, forward and backward
# (Dao 2023, FlashAttention-2, section 4.1, measured on A100s; taken to hold on every generation,
# the kernels using the same mma instructions as FlashAttention-2):
# - "triton", flash-attn's Triton FlashAttention (`flash_attn_triton.py`): "FlashAttention-2 is
#   around 1.3-1.5x faster than FlashAttention in Triton in the forward pass and around 2x faster
#   in the backward pass" (the forward: the middle of the range);
# - "flash1", FlashAttention (flash-attn 1.x): "FlashAttention-2 is around 2x faster than
#   FlashAttention".
SLOWER_THAN_FLASH2 = {"triton": (1.4, 2.0), "flash1": (2.0, 2.0)}
# Every efficiency an op's arithmetic may run at (`Cost.efficiency`, an op's `efficiency`
# parameter): the generation's `matmul` (`matmul_fp8` at the FP8 peak, `DTYPE_RATES`),
# `attention` and `attention_fused`, the last two in
# FlashAttention's backward's charged FLOPs, and each earlier kernel's forward and backward
# (`CalibratedCostModel._rates`).
RATES = ("matmul", *DTYPE_RATES.values(), "attention", "attention_backward", "attention_fused",
         "attention_fused_backward",
         *(f"attention_{kernel}{part}" for kernel in SLOWER_THAN_FLASH2
           for part in ("", "_backward")))
# The FLOPs of FlashAttention's backward that its efficiency's sources count: 2.5 x its forward's
# (it recomputes QK^T: five products to the forward's two; Dao 2023, FlashAttention-2, and Shah
# et al. 2024, FlashAttention-3, report their backward TFLOP/s so, and so does
# benchmarks/device/measure_gpu.py). A convention that charges the backward `factor` x its
# forward (the plate's 2) runs it at `attention` x factor / 2.5 in those FLOPs
# (`CalibratedCostModel.figures`' `attention_backward`); "derived" charges the 2.5 itself.
ATTENTION_BACKWARD_FLOPS = 2.5


def runs_per_charged(kind: str, model: CostModel) -> float:
    """The FLOPs a kernel of `kind` runs per FLOP `model`'s convention charges it: 2.5 / factor
    for FlashAttention's backward under "plate" and "tensors" (ATTENTION_BACKWARD_FLOPS), 1 for
    any other kind or under "derived". Its efficiency divides the time of those it runs."""
    if kind != "flash_attention_backward" or model.backward == "derived":
        return 1.0
    return ATTENTION_BACKWARD_FLOPS / float(model.factor)


# Kinds whose ops the frameworks issue many at a time, one multi-tensor kernel launch for a list
# of tensors (Megatron-LM's and DeepSpeed's FusedAdam, apex or Transformer Engine's
# multi_tensor_apply; torch.optim.AdamW's fused and foreach forms, which torchtitan and nanotron
# run): no one op of them waits on the host's `host_s`.
BATCHED = frozenset({"adamw"})


def beside_nccl_s(launches, calls, copy_s, maximum=max):
    """The time the `launches` - 1 kernels a collective's call runs beside NCCL's add to it,
    `copy_s` each, `calls` times (`Cost.launches`, `CostModel.comm_time`): numbers, or numpy
    arrays with `np.maximum` (`opgraph.parallel.search`'s rows)."""
    return maximum(launches - 1, 0) * calls * copy_s


def host_floor(kind: str, host_s, launches=1):
    """The host's time to issue one instance of an op of `kind` that launches `launches`
    kernels (`Cost.launches`): `host_s` each, or 0 for a kind issued in batches (`BATCHED`).
    Every number system reads it here (`op_time`, `op_times`, `formula`, `sweep`)."""
    return 0.0 if kind in BATCHED else host_s * launches


def _shipped_efficiencies() -> dict:
    from . import calibration

    return calibration.catalog()


@attrs.frozen
class CalibratedCostModel(CostModel):
    """The roofline scaled by each hardware generation's efficiencies (`opgraph.cost.calibration`):
    per kernel `max(host_s, launch_s + max((FLOPs x waves + matmul_half_flops) / (efficiency x
    clock x peak), bytes / (bandwidth x HBM bandwidth)))` (`host_s` the host's time to issue
    it), `clock` the part's sustained clock over its
    peak's (`Hardware.clock_ratio`: (P / TDP)^(1/3) power-capped at P, else 1), `waves` a
    matrix multiply's wave quantisation (`wave_quantum` of its `Cost.grid`) times its K
    overhead (`k_overhead`) and, where its N is `unaligned`, over `matmul_unaligned`; each
    collective at the tier's bandwidth times `node` or `network`; `overlap_slowdown` for compute
    beside communication."""

    table: dict = attrs.field(factory=_shipped_efficiencies, eq=False)  # generation -> them
    name = "calibrated"

    def efficiencies(self, hardware):
        from . import calibration

        return calibration.for_hardware(hardware, self.table)

    def figures(self, hardware) -> dict[str, float]:
        """What the calibrated time of an op on `hardware` reads besides the op: its
        generation's efficiencies (`Efficiencies.values`), and the part's `clock` (its
        sustained clock over its peak's, `Hardware.clock_ratio`: below 1 when power-capped)
        and `sms` (0 where unknown). `opgraph.analysis.sweep` takes them as arrays, a part per
        point."""
        return self._rates(self.efficiencies(hardware)) | {"clock": hardware.clock_ratio,
                                                            "sms": float(hardware.sms or 0)}

    def _rates(self, e) -> dict[str, float]:
        """`e`'s efficiencies by name; `matmul_fp8`, an FP8 matrix multiply's (`matmul` x
        `fp8_ratio`); `attention_fused` (`attention` where the generation has
        none); `attention_backward` and `attention_fused_backward`: those in this model's
        FLOPs of FlashAttention's backward (`runs_per_charged`); and each earlier kernel's
        forward and backward, FlashAttention-2's over its `SLOWER_THAN_FLASH2`."""
        fused = e.attention_fused or e.attention
        per_charged = runs_per_charged("flash_attention_backward", self)
        older = {}
        for kernel, (forward, backward) in SLOWER_THAN_FLASH2.items():
            older[f"attention_{kernel}"] = e.attention / forward
            older[f"attention_{kernel}_backward"] = e.attention / per_charged / backward
        return e.values() | older | {"matmul_fp8": e.matmul * e.fp8_ratio,
                                     "attention_fused": fused,
                                     "attention_backward": e.attention / per_charged,
                                     "attention_fused_backward": fused / per_charged}

    shapes = True

    def op_time_list(self, hardware, kinds, flops, nbytes, counts, peaks, grids, launches,
                     efficiencies) -> list[float]:
        """One column of `op_times` (an efficiency None is its kind's)."""
        import numpy as np

        if not kinds:
            return []

        def column(values):
            return np.asarray(values, dtype=float)[:, None]

        return self.op_times(
            hardware, kinds, column(flops), column(nbytes), column(counts), column(peaks),
            np.array([g or (0.0, 0.0, 0.0) for g in grids], dtype=float).T[:, :, None],
            column(launches),
            [e or EFFICIENCY.get(k, "matmul") for k, e in zip(kinds, efficiencies)])[:, 0].tolist()

    def kernel_times(self, figures: dict, attention, flops, nbytes, counts, peaks, bandwidth,
                     grids=None, hosts=None, rates=None):
        import numpy as np

        f = figures
        columns = np.shape(flops)[1:]
        # each op's efficiency by its name: the few distinct names' values, then one row each
        names = {name: i for i, name in enumerate(dict.fromkeys(rates))}
        rate = np.stack([np.broadcast_to(np.asarray(f[name], dtype=float), columns)
                         for name in names])[[names[name] for name in rates]]
        with np.errstate(divide="ignore", invalid="ignore"):  # no instances: no time
            quantum = 1.0 if grids is None else self._quanta(f, attention, grids, flops / counts)
            t = self.scaled_time(flops, nbytes, counts, peaks * f["clock"], bandwidth,
                                 rate=rate, half=f["matmul_half_flops"],
                                 bandwidth_share=f["bandwidth"], launch=f["launch_s"],
                                 quantum=quantum, host=(1.0 if hosts is None else hosts)
                                 * f["host_s"], maximum=np.maximum)
        return np.where(counts > 0, t, 0.0)

    @staticmethod
    def _quanta(f: dict, attention, grids, flops):
        """Each row's `shape_factors` (1 for a row with no grid in any column), worked out for
        the rows with a grid alone (a step's matrix multiplies and attention kernels)."""
        import numpy as np

        grids = np.asarray(grids, dtype=float)
        shaped = np.flatnonzero(grids.any(axis=(0, 2)))
        quantum = np.ones(np.broadcast_shapes(np.shape(flops), grids.shape[1:]))
        if len(shaped):
            quantum[shaped] = shape_factors(
                np.asarray(attention)[shaped], grids[:, shaped],
                np.broadcast_to(flops, quantum.shape)[shaped], f["sms"], f["matmul_tile_m"],
                f["matmul_tile_n"], f["attention_exp_ratio"], f["matmul_k_overhead"],
                f["matmul_unaligned"],
                (f["attention_kv_overhead"], f["attention_backward_kv_overhead"]))
        return quantum

    @staticmethod
    def scaled_time(flops, nbytes, count, peak, bandwidth, *, rate, half, bandwidth_share,
                    launch, quantum=1.0, host=0.0, maximum: Callable = _number_max,
                    nonzero: Callable = _positive):
        """`count` kernels doing `flops` and moving `nbytes` between them: each `maximum(host,
        launch + maximum((FLOPs x quantum + half) / (rate x peak), bytes / (bandwidth_share x
        bandwidth)))`, a kernel without arithmetic paying no `half`, one doing no work (a view)
        no `host`; `quantum` its shape's factor (`shape_factor`: a GEMM's waves, an attention
        kernel's exponentials; else 1); `host` the host's time to issue one kernel, which a
        stream of shorter kernels runs at. Every number system spells it here: numbers, numpy
        arrays (`sweep`, the search) and sympy formulas (`formula.calibrated_time`), each with
        its `maximum` and its test of a count being above zero (`nonzero`).

            >>> CalibratedCostModel.scaled_time(2e12, 0, 2, 1e12, 1e12, rate=0.5, half=1e12,
            ...                                  bandwidth_share=1, launch=0)  # 2 x (1 + 1) / 0.5
            8.0
            >>> CalibratedCostModel.scaled_time(2e6, 0, 2, 1e12, 1e12, rate=0.5, half=0,
            ...                                  bandwidth_share=1, launch=0, host=3e-5)  # 2 x 30 us
            6e-05
        """
        compute = (flops / count * quantum + half * nonzero(flops)) / (rate * peak)
        kernel = launch + maximum(compute, nbytes / count / (bandwidth_share * bandwidth))
        return count * maximum(host * nonzero(flops + nbytes), kernel)

    def comm_lines(self, kind: str, group: int, cluster, stride: int = 1,
                   hardware=None) -> tuple[tuple[float, float], ...]:
        if group == 1 or kind == "identity":
            return ((0.0, 0.0),)
        e = self.efficiencies(hardware)
        return tuple((latency + e.launch_s, per_byte) for latency, per_byte in nccl_lines(
            kind, group, _achieved(cluster, e.node, e.network), stride))

    def slowdown(self, hardware) -> float:
        return self.efficiencies(hardware).overlap_slowdown

    def copy_s(self, hardware) -> float:
        """`launch_s`: the gap a kernel adds on its stream."""
        return self.efficiencies(hardware).launch_s


def split_k(count, m, n, sms, tile_m, tile_n, ceil: Callable = math.ceil,
            floor: Callable = math.floor, sign: Callable = lambda x: int(x > 0)):
    """The slices a GEMM's K is split into so that every SM has work: where its output has
    fewer tiles than the part has SMs (a weight gradient of a narrow model: a small M x N and
    a K of every token), the library splits K among as many tiles' worth of thread blocks as
    fill one wave, floor(sms / tiles), and adds their partial sums (cuBLASLt's split-K,
    CUBLASLT_ALGO_CONFIG_SPLITK_NUM; CUTLASS's split-K GEMMs); 1 where the tiles fill a wave or
    more. With f = floor(sms / tiles) that is f + 1 - sign(f): written without a maximum, so
    that the formula has no branch to divide by zero in. `floor` and `sign` as `ceil`, for
    arrays (`np.floor`, `np.sign`) and formulas (`sympy.floor`, `sympy.sign`).

        >>> split_k(1, 1024, 1024, 108, 256, 128)  # 32 tiles on 108 SMs: K in 3
        3
        >>> split_k(1, 8192, 8192, 132, 128, 256)  # 2,048 tiles: no split
        1
    """
    fill = floor(sms / (count * ceil(m / tile_m) * ceil(n / tile_n)))
    return fill + 1 - sign(fill)


def wave_quantum(count, m, n, sms, tile_m, tile_n, ceil: Callable = math.ceil, split=1):
    """How much longer `count` GEMMs of an M x N output take than their FLOPs at the sustained
    per-SM rate say, by wave quantisation: the kernel cuts each output into tiles of tile_m x
    tile_n, each tile's K loop into `split` slices (`split_k`), one slice per SM at a time, so
    it runs `waves = ceil(tiles x split / sms)` waves, each as long as a full one; the slots it
    pays for over the ones it fills,

        waves x sms x tile_m x tile_n / (count x M x N x split)  >= 1.

    `ceil` is `math.ceil` for numbers, `np.ceil` for arrays, `sympy.ceiling` for formulas.

        >>> wave_quantum(1, 8192, 8192, 132, 128, 256)  # 2,048 tiles: 16 waves of 132
        1.03125
        >>> wave_quantum(1, 1024, 1024, 108, 256, 128, split=3)  # 96 slices in one wave of 108
        1.125
    """
    tiles = count * ceil(m / tile_m) * ceil(n / tile_n) * split
    return ceil(tiles / sms) * sms * tile_m * tile_n / (count * m * n * split)


# The head dims the published attention efficiencies are measured at (d_qk + d_v = 128 + 128):
# `attention` is FlashAttention's fraction of the peak there.
REFERENCE_HEAD_DIMS = 256
ATTENTION_KINDS = rules.ATTENTION_SCORES  # the attention kernels (a kind's `scores`), by kind


def exp_factor(flops, scores, head_dims, ratio):
    """How much longer an attention kernel doing `flops` over `scores` softmax scores (one
    exponential each) takes than one with the same FLOPs per head dim at head dims 128 + 128.
    An exponential takes `ratio` tensor-core FLOPs' time (the dense peak over the special-
    function rate: on an H100 SXM 989 over 3.9 TFLOP/s, 16 per SM per clock; Shah et al. 2024,
    FlashAttention-3, section 3.2, where at head dim 128 the exponentials take 50% of the
    matmuls' cycles), run beside the matmuls, not under them (FlashAttention-2):

        (1 + ratio / F) / (1 + ratio x head_dims / (256 x F)),  F = flops / scores,

    the second the same kernel's FLOPs per score at 128 + 128 (F x 256 / head_dims).

    1 at head dims 128 + 128 or `ratio` 0; a smaller head dim has fewer FLOPs per exponential.

        >>> exp_factor(256 * 100, 100, 128, 256)  # head dim 64, forward (4 d per score): 4/3
        1.3333333333333333
    """
    per_score = flops / scores
    return (1 + ratio / per_score) / (1 + ratio * head_dims / (REFERENCE_HEAD_DIMS * per_score))


def attention_role(kind: str) -> int:
    """0 for a kernel that is not attention, 1 for an attention forward, 2 for a backward
    (`shape_factors`)."""
    return 0 if kind not in ATTENTION_KINDS else 2 if kind in rules.ATTENTION_BACKWARD else 1


def row_factor(scores, rows, overhead):
    """How much longer an attention kernel takes than its FLOPs at the rate say when each of
    its `rows` query rows spends the time of `overhead` more keys outside its loop over the
    keys it sees (`scores` / `rows` of them on average): 1 + overhead x rows / scores, so
    (L + overhead) / L for a row of L keys. A causal row of S tokens sees S/2 keys on average:
    at 1,024 tokens and an overhead of 128 keys, 1.25. Numbers, arrays or formulas alike.

        >>> row_factor(4 * 1024 * 1024 / 2, 4 * 1024, 128)
        1.25
    """
    return 1 + overhead * rows / scores


def shape_factor(kind: str, grid: tuple, flops: float, hardware, e) -> float:
    """The factor on one instance's FLOPs (`flops`) its shape gives (see `scaled_time`): an
    attention kernel's `exp_factor` and `row_factor`, a matrix multiply's waves and K
    overhead; 1 without a grid. `shape_factors` for one op and one case: the rule is written
    once, for arrays."""
    return _one_shape(attention_role(kind), tuple(grid) or (0.0, 0.0, 0.0), float(flops),
                      hardware.sms or 0, e.matmul_tile_m, e.matmul_tile_n, e.attention_exp_ratio,
                      e.matmul_k_overhead, e.matmul_unaligned,
                      (e.attention_kv_overhead, e.attention_backward_kv_overhead))


@functools.lru_cache(maxsize=100_000)  # a fit costs the same ops again at every step
def _one_shape(attention: int, grid: tuple, flops: float, *figures) -> float:
    import numpy as np

    grids = np.array(grid, dtype=float).reshape(3, 1, 1)
    return float(shape_factors([attention], grids, np.array([[flops]]), *figures)[0, 0])


def shape_factors(attention, grids, flops, sms, tile_m, tile_n, ratio, k0=0.0,
                  unaligned_rate=1.0, kv_overheads=(0.0, 0.0)):
    """`shape_factor` over numpy arrays: `attention` (ops,) each row's `attention_role`,
    `grids` (3, ops, cases), `flops` (ops, cases) per instance, `k0` the generation's
    `matmul_k_overhead`, `unaligned_rate` its `matmul_unaligned`, `kv_overheads` its
    `attention_kv_overhead` and `attention_backward_kv_overhead`."""
    import numpy as np

    role = np.asarray(attention, dtype=int)
    scores, widths = np.asarray(grids[0], dtype=float), np.asarray(grids[1], dtype=float)
    rows = np.asarray(grids[2], dtype=float)
    ok = scores > 0
    exps = np.where(ok, exp_factor(np.where(ok, flops, 1.0), np.where(ok, scores, 1.0),
                                   np.where(ok, widths, 1.0), ratio), 1.0)
    overhead = np.where((role == 2)[:, None], kv_overheads[1], kv_overheads[0])
    exps = exps * np.where(ok, row_factor(np.where(ok, scores, 1.0), rows, overhead), 1.0)
    # a GEMM's (count, M, N); an attention kernel's grid is not one, so it gets none
    gemm = np.where((role > 0)[None, :, None], 0.0, np.asarray(grids, dtype=float))
    count, m, n = gemm
    waves, split = wave_quanta(gemm, sms, tile_m, tile_n)
    has_k = (count * m * n > 0) & (flops > 0) & (np.asarray(k0) > 0)
    # each slice of a split K loop pays the prologue and epilogue: K / split deep
    ks = np.where(has_k, k_overhead(np.where(has_k, flops, 1.0), count * split, m, n, k0), 1.0)
    off = (count * m * n > 0) & unaligned(n)
    ks = np.where(off, ks / np.asarray(unaligned_rate, dtype=float), ks)
    return np.where((role > 0)[:, None], exps, ks * waves)


def k_overhead(flops, count, m, n, k0):
    """How much longer a GEMM of inner dimension K takes than its FLOPs say when each output
    tile spends the time of `k0` more steps of its K loop outside it (the prologue that fills
    the pipeline, the epilogue that writes the tile): (K + k0) / K, with K read back from the
    FLOPs, `flops` = 2 x count x M x N x K. Numbers, numpy arrays or sympy expressions alike.

        >>> k_overhead(2 * 8192 * 8192 * 256, 1, 8192, 8192, 128)  # K = 256: 384 / 256
        1.5
    """
    return 1 + k0 * 2 * count * m * n / flops


# A GEMM's output rows must start on 16-byte boundaries (N a multiple of 8 BF16 elements) for
# cuBLAS's vectorised kernels (Hopper's TMA needs 16-byte strides); otherwise it runs align-1
# kernels at `matmul_unaligned` of the rate. N is the one stride a grid (GEMMs, M, N) holds: an
# unaligned K (a GEMM contracting over GPT-2's 50,257-token vocabulary, the head's input
# gradient) is not seen, since K read back from FLOPs cannot tell a fused bias (2 x M x N more)
# from an odd K.
ALIGN = 8


def unaligned(n):
    """Whether a GEMM's N is not a multiple of ALIGN: a bool for a number, a bool array for a
    numpy array (`shape_factors`); `formula` takes a symbolic N's condition itself.

        >>> unaligned(50257), unaligned(128256)  # GPT-2's vocabulary; Llama 3's
        (True, False)
    """
    return n % ALIGN != 0


def waves_of(grid: tuple, hardware, e, flops: float = 0.0) -> float:
    """A matrix multiply's `shape_factor`: the `wave_quantum` of its `grid` (GEMMs, M, N, as
    numbers) on `hardware` with the tiles of its efficiencies `e`, times its `k_overhead` where
    `e.matmul_k_overhead` and one instance's `flops` are known, over `e.matmul_unaligned` where
    its N is `unaligned`; 1 for an op without a grid, a part without an SM count, or a
    generation without tiles."""
    return shape_factor("matmul", grid, flops, hardware, e)


def wave_quanta(grids, sms, tile_m, tile_n):
    """`wave_quantum` and `split_k` over numpy arrays: `grids` (3, ops, cases) of (GEMMs, M,
    N); each 1 where an op has no grid (zeros) or the part no SM count or the generation no
    tile (0)."""
    import numpy as np

    count, m, n = (np.asarray(g, dtype=float) for g in grids)
    ok = (count * m * n > 0) & (np.asarray(sms) > 0) & (np.asarray(tile_m) > 0) & (
        np.asarray(tile_n) > 0)
    one = [np.where(ok, x, 1.0) for x in (count, m, n, sms, tile_m, tile_n)]
    split = np.where(ok, split_k(*one, ceil=np.ceil, floor=np.floor, sign=np.sign), 1.0)
    return np.where(ok, wave_quantum(*one, ceil=np.ceil, split=split), 1.0), split


@functools.lru_cache(maxsize=64)
def _datasheet(cluster):
    """`cluster` with its network at its datasheet bandwidth: without the measured table of
    bus bandwidth against node count a cluster may carry (`Tier.measured`)."""
    node, network = cluster.tiers
    if not network.measured:
        return cluster
    return attrs.evolve(cluster, tiers=(node, attrs.evolve(network, measured=(),
                                                           measured_source="")))


def nccl_lines(kind: str, group: int, cluster, stride: int = 1
               ) -> tuple[tuple[float, float], ...]:
    """Each algorithm and protocol NCCL's tuner weighs for one collective of `kind` (an op
    kind: "all_reduce") over `group` GPUs `stride` ranks apart, as (seconds at no message,
    seconds per byte): its latencies and the tiers' bandwidths
    (`opgraph.parallel.collectives.lines`); none for a group of one or Megatron's f."""
    from ..parallel import collectives

    if group == 1 or kind == "identity":
        return ((0.0, 0.0),)
    return collectives.lines(kind.replace("_", "-"), group, cluster, stride)


@functools.lru_cache(maxsize=64)
def _achieved(cluster, node: float, network: float):
    """`cluster` with each tier at its achieved bandwidth: the first (within a node) at `node`
    of its own, the others at `network`."""
    return attrs.evolve(cluster, tiers=tuple(
        attrs.evolve(t, bandwidth=t.bandwidth * (node if i == 0 else network))
        for i, t in enumerate(cluster.tiers)))


def cost_model(name: str, backward: str = "plate", table: dict | None = None) -> CostModel:
    """The cost model `--cost` names: "roofline" (the ceiling) or "calibrated" (the shipped
    efficiencies, or `table`'s)."""
    if name == "roofline":
        return CostModel(backward=backward)
    if name == "calibrated":
        return CalibratedCostModel(backward=backward, table=table or _shipped_efficiencies())
    raise OpgraphError(f"unknown cost model {name!r}; choose roofline or calibrated")


__all__ = [
    "ALIGN",
    "ATTENTION_KINDS",
    "BACKWARD_COST",
    "BACKWARD_MODES",
    "BATCHED",
    "COST_MODELS",
    "DEFAULT",
    "EFFICIENCY",
    "FUSED_BACKWARD_COST",
    "OPERANDS",
    "PEAKS",
    "CalibratedCostModel",
    "Cost",
    "CostModel",
    "attention_role",
    "beside_nccl_s",
    "compute_dtype",
    "cost_model",
    "exp_factor",
    "fused_members",
    "host_floor",
    "k_overhead",
    "members_of",
    "message_bytes",
    "own_bytes",
    "row_factor",
    "rule_flops",
    "scaled",
    "scaled_flops",
    "shape_factor",
    "shape_factors",
    "split_k",
    "unaligned",
    "wave_quanta",
    "wave_quantum",
    "waves_of",
]
