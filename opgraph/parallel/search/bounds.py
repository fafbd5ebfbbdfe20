"""What the search knows of a layout before scheduling it: each structure compiled once into
formulas (`_compile_stage`), evaluated over all of its rows as numpy arrays (`_Program`,
`_evaluate`), the memory and the bounds of the step read from them, and the bound a row gets
before its structure is compiled (`compute_key`, `_compute_bound`)."""

from __future__ import annotations

import functools

import attrs
import numpy as np
import sympy

from ...core import contracts, pipeline
from ...core.ir import DTYPES, Graph, Phase
from ...core.symbols import B, cp, dp, edp, ep, pp, tp
from ...cost.costmodel import CostModel, beside_nccl_s
from ...cost.hardware import Hardware
from ...cost.lowered import Lowered, lower
from ...cost.memory import RESIDENT, Memory, liveness, reserved, resident_tensors, saved
from ...passes.evaluate import resolve
from ...passes.replicate import GROUPS, gather_phases
from ...passes.replicate import group_of as replicate_group
from ...passes.split_stages import FIRST as FIRST_END
from ...passes.split_stages import LAST as LAST_END
from ...passes.split_stages import STACK, ends, layer_stack, split_stages
from ..distributed import (Job, Stage, StageOp, chunks_of, held_activations, stage_in_flight,
                           unequal_chunks)
from ..frameworks import (DEFERRED_GROUPS, bucket_share, defers_grad_reduce, reduce_dtype,
                          sharding, traits)
from ..parallel import FRAMEWORK_FIELDS, SHARDED_FROM, LayoutFields, Parallel, stage_layers
from ..schedule import (Cycles, Waits, cycle_bound, cycles, once_per_step, plan, released_bound,
                        releases, sure_waits)
from .space import DEGREES, LAYERS, Row, structure

# --- structures ---------------------------------------------------------------------------------

FIRST, MIDDLE, LAST = ROLES = "first", "middle", "last"


def _roles(stages: int) -> list[tuple[str, int]]:
    """The distinct stages `distributed.prepare` evaluates, with their indices: the first, a
    middle one (standing for all of them), the last; one for a single stage."""
    if stages == 1:
        return [(FIRST, 0)]
    return [(FIRST, 0), *([(MIDDLE, 1)] if stages > 2 else []), (LAST, stages - 1)]


@attrs.frozen
class _StageFormulas:
    """One stage of a structure: its graph, its ops' fixed facts, and the formulas of every
    number that varies, over `DEGREES`."""

    graph: Graph | None  # None once written to the cache (`Searcher.stage_graph` remakes it)
    layers: int | None  # the model's (None: several stacks, one stage)
    names: tuple[str, ...]
    kinds: tuple[str, ...]
    categories: tuple[str, ...]
    phases: tuple[Phase, ...]
    computes: tuple[str | None, ...]  # each op's peak's name (`Cost.compute`)
    groups: tuple[str | None, ...]
    once: tuple[bool, ...]
    peaks: tuple[float, ...]
    efficiencies: tuple[str, ...]  # each op's (`Cost.efficiency`)
    exprs: tuple  # counts, FLOPs, bytes, messages per op; sizes, counts per life; resident,
    # buffers; grids; calls and launches per op
    tape: _Tape  # the exprs as one program over arrays
    n_ops: int
    n_lives: int
    # (ops, 2 x lives), int8 (`Liveness.copy_matrices`): `one`, 1 where a life counts once at
    # op i, -1 its count less one; beside it `many`, 1 where every copy of a life counts
    copies: np.ndarray
    saved: np.ndarray  # (lives,) bool: a saved activation (else transient)
    ends: np.ndarray  # (lives,) 0 in a layer stack, 1 before it, 2 after (`Liveness.ends`)
    moments: tuple[tuple[str, str], ...]  # each op's (name, phase), where a peak may happen
    resting_at: int | None  # the backward's start (`Liveness.backward_start`)
    busy_rows: tuple[int, ...]  # the compute ops of every micro-batch
    optimizer_rows: tuple[int, ...]  # the compute ops of the last one only (the optimizer)
    releases: tuple  # (plain, last): each one's `schedule.Releases`
    cycles: Cycles  # where the data-parallel stream holds a stack's trips back (plain)
    waits: tuple[Waits, ...]  # where the stream must wait for communication (`schedule.sure_waits`)
    plans: dict = attrs.field(factory=dict, eq=False)  # layers -> (plain, last)

    @property
    def one(self) -> np.ndarray:
        return self.copies[:, :self.n_lives]

    @property
    def many(self) -> np.ndarray:
        return self.copies[:, self.n_lives:]


def _compile_stage(graph: Graph, hardware: Hardware, cost: CostModel, values: dict,
                   zero: int, layers: int, step: Lowered, fixed_memo: dict,
                   program: _Program) -> _StageFormulas:
    low = lower(graph, cost, like=step)  # the stage's ops: the step's, and its sends
    fixed = _stage_fixed(graph, values, layers)
    ops, lowered = graph.ops(), low.ops
    collective = [o.group is not None for o in lowered]
    live = liveness(graph)
    formulas = ([o.count for o in lowered] + [o.flops for o in lowered]
                + [o.bytes for o in lowered]
                + [o.cost.message if c else 0 for o, c in zip(lowered, collective)]
                + _memory_formulas(live)
                + _grids(lowered)
                + [o.cost.calls if c else 1 for o, c in zip(lowered, collective)]
                + [o.cost.launches for o in lowered])
    exprs = tuple(_fixed(e, fixed, fixed_memo) for e in formulas)
    once = tuple(op.phase is Phase.OPTIMIZER or once_per_step(op, zero) for op in ops)
    # a gather of what nothing computes this micro-batch (a weight), read only by ops run once
    # a step (the cached FP8 casts): `simulate` starts it when its reader runs, so in no plain
    # micro-batch
    index = {op.name: i for i, op in enumerate(ops)}
    idle = tuple(collective[i] and not once[i]
                 and all(graph.producer(n) is None or once[index[graph.producer(n).name]]
                         for n in op.inputs)
                 and all(once[index[r.name]] for n in op.outputs for r in graph.consumers(n))
                 for i, op in enumerate(ops))
    plain_ops = [not (o or x) for o, x in zip(once, idle)]
    return _StageFormulas(
        graph, layers, tuple(o.name for o in lowered), tuple(o.kind for o in lowered),
        tuple(o.category for o in lowered), tuple(o.phase for o in lowered),
        tuple(o.cost.compute for o in lowered), tuple(o.group for o in lowered), once,
        tuple(cost.peak(hardware, o.cost.compute) for o in lowered),
        tuple(o.cost.efficiency for o in lowered), exprs,
        program.tape(exprs),
        len(ops),
        *_lives(live),
        tuple(i for i in range(len(ops)) if not collective[i] and not once[i]),
        tuple(i for i in range(len(ops)) if not collective[i] and once[i]),
        (releases(graph, ops, collective, plain_ops),
         releases(graph, ops, collective, [not x for x in idle])),
        cycles(graph, ops, collective, plain_ops),
        sure_waits(graph, ops, collective, once))


def _stage_fixed(graph: Graph, values: dict, layers: int | None) -> dict:
    """What a stage's formulas fix: the stack's count (L / pp) becomes the stage's layers
    (`LAYERS`), the other dimensions but the degrees numbers."""
    fixed = {s: v for s, v in resolve(graph, values).items() if s not in DEGREES and s != pp}
    fixed[pp] = sympy.Integer(layers or 1) / LAYERS
    return fixed


def _memory_formulas(live) -> list:
    """A stage's memory as formulas, in `_StageFormulas.exprs`' order: each life's bytes and
    count, then the resident parts and the optimizer's gather buffers (`Memory.buffers`)."""
    return ([life.tensor.nbytes for life in live.lives]
            + [life.tensor.count for life in live.lives]
            + [live.resident[name] for name in RESIDENT] + [live.buffers])


@attrs.frozen
class _MemoryFormulas:
    """One stage's memory alone (`Searcher.fitting` counts the layouts that fit without the
    rest of a structure): its lives as `_StageFormulas` holds them, and `_memory_formulas`
    as one program (sizes, counts, resident parts)."""

    tape: _Tape
    n_lives: int
    copies: np.ndarray
    saved: np.ndarray
    ends: np.ndarray
    moments: tuple[tuple[str, str], ...]
    resting_at: int | None


def _compile_memory(graph: Graph, values: dict, layers: int | None, fixed_memo: dict,
                    program: _Program) -> _MemoryFormulas:
    live = liveness(graph)
    fixed = _stage_fixed(graph, values, layers)
    exprs = [_fixed(e, fixed, fixed_memo) for e in _memory_formulas(live)]
    return _MemoryFormulas(program.tape(exprs), *_lives(live))


def _lives(live) -> tuple:
    """A stage's lives as `_StageFormulas` and `_MemoryFormulas` hold them: how many, their
    copy matrices side by side (`one`, `many`: int8), which are saved activations, where each
    is (`Liveness.ends`), where a peak may happen (each op's name and phase), and where the
    backward starts."""
    return (len(live.lives), np.hstack(live.copy_matrices()),
            np.array([life.saved for life in live.lives], dtype=bool),
            np.array(live.ends(), dtype=np.int8),
            tuple((op.name, op.phase.value) for op in live.ops), live.backward_start)


def _memory_numbers(f: _MemoryFormulas, env: dict, n: int) -> _Numbers:
    """`_numbers` of a stage's memory alone: its lives' sizes and counts and the resident
    parts (no op's)."""
    values = f.tape.run(env, n)
    m, none = f.n_lives, np.zeros((0, n))
    return _Numbers(none, none, none, none, np.rint(values[:m]), np.rint(values[m:2 * m]),
                    np.rint(values[2 * m:]), np.zeros((3, 0, n)), none, none)


def _memory_of(stages: dict, rows_: list[Row], layers: int | None) -> np.ndarray:
    """Each row's memory per GPU (its fullest stage's) from its stages' memory alone
    (`_compile_memory`), as `_evaluate` gives it."""
    d = _distinct(rows_, layers, EVALUATED_FIELDS)
    cols = d.cols
    peaks = {role: _peak(f, _memory_numbers(f, d.env | {LAYERS: cols.layers[role][d.firsts]},
                                            len(d.rows))).spread(d.spread)
             for role, f in stages.items()}
    return _fullest(peaks, _in_flight(d.fields, cols.m, layers, peaks))


def _fullest(peaks: dict, held: dict) -> np.ndarray:
    """Each row's memory per GPU as the filter reads it (`Memory.fits`: what is allocated at
    once): its fullest stage's, each stage's peak with the activations of its micro-batches in
    flight (`held`, `_in_flight`'s), or its resident parts and gather buffers."""
    totals = np.stack([reserved(pk.weights + pk.gradients + pk.optimizer
                                + np.floor(held_activations(pk.activations, pk.resting_parts,
                                                            held[role])) + pk.transient,
                                pk.weights + pk.gradients + pk.optimizer, pk.buffers, None)[0]
                       for role, pk in peaks.items()])
    return totals.max(axis=0)


def _in_flight(fields: _Fields, m, layers: int | None, roles) -> dict:
    """Each role's stage's micro-batches in flight over the rows (`fields`' columns, `m` their
    micro-batches), the layer stack's, the first chunk's and the last's (three arrays), as
    `distributed.stage_in_flight` gives them: once per distinct pipeline
    (`_pipeline_in_flight`), then spread over the rows."""
    c = fields.columns
    keys = list(zip(c["pp"], c["virtual_stages"], np.asarray(m, dtype=int).tolist(),
                    c["first_stage_layers"], c["last_stage_layers"]))
    firsts, at = _first_of_each(keys)
    found = [_pipeline_in_flight(layers, *keys[i]) for i in firsts]
    return {role: tuple(np.array([f[role][i] for f in found])[at] for i in range(3))
            for role in roles}


@functools.lru_cache(maxsize=4096)
def _pipeline_in_flight(layers: int | None, p: int, v: int, n: int, first, last) -> dict:
    """`_in_flight` of one pipeline, every role (read, not changed)."""
    chunks = None if layers is None else chunks_of(layers, Parallel(
        pp=p, virtual_stages=v, first_stage_layers=first, last_stage_layers=last))
    # not `_roles(p)`: a two-stage row of an odd stack is compiled with a middle stage
    # (`_representative`), which stands for its last there
    index = {FIRST: 0, MIDDLE: min(1, p - 1), LAST: p - 1}
    return {role: stage_in_flight(p, v, n, i, chunks and chunks[i])
            for role, i in index.items()}


def _grids(ops: list) -> list:
    """Each lowered op's matrix-multiply grid (`Cost.grid`: GEMMs, M, N), three rows of
    formulas: zeros for an op that is none."""
    grids = [o.cost.grid or (0, 0, 0) for o in ops]
    return [g[i] for i in range(3) for g in grids]


def _fixed(expr, fixed: dict, memo: dict):
    """`expr` with the fixed dimensions substituted, once per distinct formula (the
    structures share most of theirs; `fixed` is the same for all of a model's)."""
    if expr not in memo:
        memo[expr] = sympy.sympify(expr).xreplace(fixed)
    return memo[expr]


def _comm_times(f: _StageFormulas, nums: _Numbers, lines, copy_s: float
                ) -> dict[int, np.ndarray]:
    """Each collective's seconds per instance over the rows, as `distributed._times` gives
    them: each algorithm NCCL may run takes a time affine in the message, so `lines(kind,
    group)` gives their intercepts and slopes over the rows (`_over_rows`), and a collective
    takes the least of them over the rows' messages; the kernels its call runs beside NCCL's
    add `copy_s` each (`CostModel.comm_time`). The collectives of one kind and group are
    worked out at once."""
    alike: dict = {}  # (kind, group) -> its collectives
    for k in range(f.n_ops):
        if f.groups[k] is not None:
            alike.setdefault((f.kinds[k], f.groups[k]), []).append(k)
    out = {}
    for (kind, group), ks in alike.items():
        base, slope = lines(kind, group)  # (algorithms, rows)
        calls, messages = nums.calls[ks], nums.messages[ks]  # (collectives, rows)
        seconds = (base * calls[:, None] + slope * messages[:, None]).min(axis=1)
        seconds += beside_nccl_s(nums.launches[ks], calls, copy_s, np.maximum)
        out.update(zip(ks, seconds))
    return dict(sorted(out.items()))


def _comm_totals(times: dict, nums: _Numbers, like: np.ndarray) -> np.ndarray:
    """Each collective's time over all its instances (a row per op, 0 for the compute ops,
    shaped `like` the compute times), from `_comm_times`' seconds per instance."""
    comm = np.zeros_like(like)
    for k, t in times.items():
        comm[k] = nums.counts[k] * t
    return comm


def _over_rows(rows_: list, line):
    """`line` over the rows: `lines(kind, group)` gives each algorithm's intercept and slope
    (a row each) over the rows (a column each), each distinct layout's read once."""
    keys = [(r.tp, r.cp, r.ep, r.pp, r.dp, r.replicate, r.expert_tp) for r in rows_]
    firsts, where = _first_of_each(keys)

    @functools.cache
    def lines(kind: str, group: str) -> tuple[np.ndarray, np.ndarray]:
        found = [line(kind, group, keys[i]) for i in firsts]
        most = max(map(len, found))  # a group of one has one line: repeat it
        pairs = np.array([pairs + pairs[-1:] * (most - len(pairs)) for pairs in found])
        return pairs[where, :, 0].T, pairs[where, :, 1].T
    return lines


def _comm_line(cost: CostModel, cluster, hardware: Hardware):
    """`_comm_times`'s `line`: each algorithm's time at no message and seconds per byte
    (`CostModel.comm_lines`), over the group `group` names in the layout of `degrees` (tp,
    cp, ep, pp, dp, replicate, expert_tp), each distinct group size and stride read once."""

    @functools.cache
    def affine(kind: str, size: int, stride: int, gpus: int) -> tuple[tuple[float, float], ...]:
        return cost.comm_lines(kind, size, cluster.for_job(gpus), stride, hardware)

    @functools.cache
    def layout(degrees: tuple) -> Parallel:
        t, c, e, p, d, n, x = degrees
        # the groups' sizes and strides alone: replicas need some ZeRO stage to be a layout,
        # folded experts sequence parallelism
        return Parallel(tp=t, cp=c, ep=e, pp=p, dp=d, replicate=n, zero=1 if n > 1 else 0,
                        expert_tp=x, sequence_parallel=x == 1 and t > 1)

    def line(kind: str, group: str, degrees: tuple) -> tuple[tuple[float, float], ...]:
        lay = layout(degrees)
        return affine(kind, lay.size(group), lay.stride(group), lay.world)
    return line


def _waited_time(f: _StageFormulas | _ComputeFormulas, nums: _Numbers, times: dict,
                 compute: np.ndarray, group: list) -> np.ndarray:
    """Each row's time the stage surely waits on communication per micro-batch
    (`schedule.sure_waits`): in each run, the longest path through one instance of its ops
    (each op after the one before it, a chain's reader after the chain's writer and the
    chain), less the ops' own time, times the instances."""
    total = np.zeros(nums.flops.shape[1])
    if not f.waits:
        return total
    overlapped_tp = np.array([r.async_tp for r in group])
    overlapping = overlapped_tp.any()
    for run in f.waits:
        instances = nums.counts[run.ops[0]]
        ends = np.cumsum(compute[list(run.ops)], axis=0) / np.maximum(instances, 1)
        idle = np.zeros_like(total)  # the stream's idle time before the reader, one instance
        before: list[np.ndarray] = []  # that of each reader
        for j, chains in run.targets:
            start = idle
            for first, chain, last in chains:
                t = sum(times[c] for c in chain)
                if overlapping and any(f.groups[c] == "tp" for c in chain):
                    t = np.where(overlapped_tp, 0.0, t)
                path = (before[last] if last >= 0 else 0.0) + t
                if first < j - 1:  # the ops between run meanwhile
                    path = path - (ends[j - 1] - ends[first])
                start = np.maximum(start, path)
            idle = start
            before.append(idle)
        total += instances * idle
    return total * (1 - 1e-6)


@attrs.frozen
class _Structure:
    key: tuple
    stages: dict  # role -> _StageFormulas


def _representative(r: Row, layers: int) -> Parallel:
    """A layout of `r`'s structure with an even pipeline split (its stages' graphs count L /
    pp layers, which `LAYERS` replaces): any split of the same stage count reads the same.
    Where two stages cannot split the stack evenly (Gemma 2's 13 pairs of layers), more
    stages stand in for them: the first and last stage read alike, the middle one unread."""
    stages = r.pp
    if r.pp > 2 or (r.pp == 2 and layers % 2):
        stages = next((p for p in range(3, layers + 1) if layers % p == 0), r.pp)
    return Parallel(tp=r.tp, cp=r.cp, ep=r.ep, pp=stages, dp=r.dp,
                    sequence_parallel=r.sequence_parallel, zero=r.zero, replicate=r.replicate,
                    async_tp=r.async_tp, **{name: getattr(r, name) for name in FRAMEWORK_FIELDS})


def _step(forward: Graph, r: Row, layout: Parallel, memo: dict, replicated: bool = True
          ) -> Graph:
    """`distributed.compile_parallel`'s step for `r`'s structure, each pass's result kept in
    `memo` for the structures that share the passes before it (passes are pure functions);
    the checks ran when the row was enumerated, the verifier when `profile` compiles it.
    Not `replicated`: the passes before `replicate` (a compute key's ops, `compute_key`)."""
    graph, key = forward, ()
    for run in _passes(r, layout, replicated):
        key += (pipeline.pass_key(run),)  # the pipeline's own declaration of what it reads
        if key not in memo:
            contracts.check(run, graph)  # as `pipeline.run_passes` drives them
            memo[key] = run(graph)
        graph = memo[key]
    return graph


def _passes(r: Row, layout: Parallel, replicated: bool = True) -> list:
    """`distributed.compile_parallel`'s passes for `r`'s structure (`pipeline.step_passes`)."""
    return pipeline.step_passes(recompute=r.recompute, precision=r.precision, layout=layout,
                                replicated=replicated)


def _stage_graphs(forward: Graph, r: Row, layers: int | None, passes: dict,
                  roles: tuple[str, ...] = ROLES) -> tuple[Graph, dict[str, Graph]]:
    """The step of `r`'s structure (`_step`) and the graph of each of its stages named in
    `roles` (its first, middle and last: `_roles`), cut by `split_stages`."""
    layout = _representative(r, layers)
    step = _step(forward, r, layout, passes)
    return step, {role: split_stages(step, layout, i) for role, i in _roles(layout.pp)
                  if role in roles}


def _compile_structure(forward: Graph, layers: int | None, hardware: Hardware, r: Row,
                       values: dict, cost: CostModel, passes: dict, formulas: dict,
                       program: _Program) -> _Structure:
    step, graphs = _stage_graphs(forward, r, layers, passes)
    low = lower(step, cost)
    return _Structure(structure(r), {
        role: _compile_stage(graph, hardware, cost, values, sharding(r), layers, low, formulas,
                             program)
        for role, graph in graphs.items()})


# --- the bound before compiling -----------------------------------------------------------------

def compute_key(r: Row, layers: int | None) -> tuple:
    """What decides a row's compute ops: the passes before `replicate` for its structure, each
    by what its placement declares decides its ops (`pipeline.pass_key`), so a pass added to
    the pipeline is in the key with no word here; and what the bound reads of the framework
    beside them (`_moved`: re-gathers in the recomputation, bucketed reductions, the dtype
    they are reduced in). Data parallelism, the ZeRO stage and the pipeline stages are not in
    it: they add collectives, shard the optimizer and the resident memory, and cut the same
    ops apart. Rows of one `structure` share it (`Searcher` computes it once a structure)."""
    passes = _passes(r, _representative(r, layers), replicated=False)
    return (*map(pipeline.pass_key, passes), traits(r).regather_in_recompute,
            traits(r).buckets_grads, reduce_dtype(r))


@attrs.frozen
class _ComputeFormulas:
    """A compute key's forward and backward ops over `DEGREES`, before the step is split into
    stages or replicated: the compute ops and the collectives `schedule.sure_waits` pairs with
    them (in `_StageFormulas`' layout: counts, FLOPs, bytes, messages), and where each op
    runs: a stack op on every stage, `LAYERS` times; an end op on the first or the last stage
    (or both).
    After them the bytes `_held` gives: what one layer of the stack holds, then the ends."""

    kinds: tuple[str, ...]
    groups: tuple[str | None, ...]
    peaks: tuple[float, ...]
    efficiencies: tuple[str, ...]  # each op's (`Cost.efficiency`)
    tape: _Tape
    n_ops: int
    places: tuple[np.ndarray, ...]  # the stack, the first end, the last: (ops,) 1 where it runs
    waits: tuple[Waits, ...]  # `schedule.sure_waits` of the stack's ops


def _compile_compute(graph: Graph, hardware: Hardware, cost: CostModel, values: dict,
                     layers: int | None, fixed_memo: dict, program: _Program, r: Row
                     ) -> _ComputeFormulas:
    """`graph` is a compute key's step before `replicate` (`r` one of its rows); `fixed_memo`
    is kept apart from the stages' (here the stack's count, not its share per stage, becomes
    `LAYERS`)."""
    fixed = {s: v for s, v in resolve(graph, values).items() if s not in DEGREES}
    side = stack = None
    if layers is not None:
        # the stack's count as `LAYERS`, through the one dimension it counts: L = LAYERS, or
        # for Gemma 2's L / 2 pairs L = 2 LAYERS. (Replacing the count itself missed every
        # formula sympy had multiplied out: L x FLOPs / 2 kept L, thirteen pairs' FLOPs for one.)
        count = sympy.sympify(layer_stack(graph).count)
        (stack,) = count.free_symbols  # `space._layers`: a count of one dimension
        fixed[stack] = sympy.solve(sympy.Eq(count, LAYERS), stack)[0]
        side = ends(graph)
    low = lower(graph, cost)
    # a micro-batch's ops: not the optimizer's, nor the FP8 weight casts run once a step
    # (`passes.cache_fp8_weights`), which a bound may leave out
    ops = [op for op in graph.ops() if op.phase is not Phase.OPTIMIZER
           and not op.param("cached")]
    lowered = [low.op(op.name) for op in ops]
    collective = [o.group is not None for o in lowered]
    once = (False,) * len(ops)
    waits = sure_waits(graph, ops, collective, once)
    if side is not None:  # a run counts on every stage only where all its ops are the stack's
        waits = tuple(w for w in waits if all(side[ops[k].name] == {STACK} for k in w.ops))
    formulas = ([o.count for o in lowered] + [o.flops for o in lowered]
                + [o.bytes for o in lowered]
                + [o.cost.message if c else 0 for o, c in zip(lowered, collective)])
    # where each op runs; with no one stack, all on the one stage (a compute op's time and a
    # collective's are apart: `_op_times` gives the collectives none)
    runs = [side[op.name] if side is not None else {FIRST_END} for op in ops]
    places = tuple(np.array([place in where for where in runs], dtype=float)
                   for place in (STACK, FIRST_END, LAST_END))
    formulas += (_held(graph, stack) + _moved(graph, stack, traits(r).regather_in_recompute,
                                              traits(r).buckets_grads,
                                              DTYPES[reduce_dtype(r)].itemsize)
                 + _grids(lowered)
                 + [o.cost.launches for o in lowered])
    exprs = tuple(_fixed(e, fixed, fixed_memo) for e in formulas)
    return _ComputeFormulas(
        tuple(o.kind for o in lowered), tuple(o.group for o in lowered),
        tuple(cost.peak(hardware, o.cost.compute) for o in lowered),
        tuple(o.cost.efficiency for o in lowered),
        program.tape(exprs), len(ops), places, waits)


def _held(graph: Graph, stack) -> list:
    """The bytes a stage surely holds, as formulas: for the layer stack (the tensors whose
    count holds `stack`, the dimension the stack's trip count counts, here one layer) and then
    for the ends, each resident part's tensors (`memory.resident_tensors`) whose copies the
    data-parallel group and the expert data-parallel group hold (`replicate.group_of`), and the
    saved activations (`memory.saved`: all live at the backward's first op), but the carried
    ones."""
    parts = resident_tensors(graph)
    # a tensor a stack carries from layer to layer is one buffer handed on, not a copy per
    # layer, and a stage sends its last one on: left out
    carried = {n for r in graph.regions() for pair in r.carries for n in pair}
    chosen = [[t for t in parts[name] if replicate_group(t) == group]
              for name in RESIDENT for group in ("dp", "edp")]
    # nor the FP8 casts of weights cast once a step (`passes.cache_fp8_weights`), which the
    # stage's liveness does not count among the saved activations
    chosen.append([t for t in saved(graph) if t.name not in carried
                   and not (graph.producer(t.name) is not None
                            and graph.producer(t.name).param("cached"))])
    out = []
    for in_stack in (True, False):
        for tensors in chosen:
            out.append(sympy.Add(*(t.nbytes * t.count for t in tensors
                                   if (stack in t.count.free_symbols) == in_stack)))
    return out


def _moved(graph: Graph, stack, regather: bool = True, buckets: bool = False,
           wire: int = 4) -> list:
    """What ZeRO-3 and ZeRO-2 move every micro-batch, as formulas (`replicate`): for the layer
    stack (one layer) and then the ends, per group (data-parallel, expert data-parallel), the
    all-gathers of each weight, one per phase that reads it (the recomputation's served by the
    backward's unless the framework `regather`s; gathered bytes, collectives), then the
    reduce-scatters of each gradient the update reads, `wire` bytes an element (bytes,
    collectives: each its share of a bucket's call where the framework `buckets` them,
    `frameworks.bucket_share`, as `replicate` charges it)."""
    out = []
    for in_stack in (True, False):
        for group in ("dp", "edp"):
            gathered, gathers, reduced, reductions = [], [], [], []
            for update in graph.ops():
                if update.kind != "adamw":
                    continue
                grad = graph.tensor(update.inputs[0])
                w = graph.tensor(grad.grad_of)
                if replicate_group(w) != group or (stack in w.count.free_symbols) != in_stack:
                    continue
                # the phases that read it every micro-batch (a cast cached once a step: not)
                read = {op.phase for op in graph.consumers(w.name) if not op.param("cached")}
                phases = sum(1 for served in gather_phases(regather).values()
                             if read & set(served))
                gathered.append(w.nbytes * w.count * phases)
                gathers.append(w.count * phases)
                reduced.append(grad.numel * wire * update.count)
                reductions.append(update.count * (bucket_share(grad.numel, GROUPS[group])
                                                  if buckets else 1))
            out += [sympy.Add(*terms) for terms in (gathered, gathers, reduced, reductions)]
    return out


def _moving(moved: np.ndarray, zero: np.ndarray, lines, deferred: np.ndarray) -> np.ndarray:
    """The seconds each data-parallel stream (a row each: dp, edp) takes per micro-batch for
    `_moved`'s part (a row per formula, over the layouts): the all-gathers under ZeRO-3, the
    reduce-scatters under ZeRO-2 and 3; `lines(kind, group)` gives each algorithm's intercept
    and slope over the layouts. Each collective takes at least the least intercept plus the
    least slope times its message, so their sum is a bound whatever algorithm each runs.
    A `deferred` layout's reductions wait for their reader (`frameworks.defers_grad_reduce`):
    not every micro-batch's."""
    out = np.zeros((2, len(zero)))
    for j, group in enumerate(("dp", "edp")):
        gathered, gathers, reduced, reductions = moved[4 * j:4 * j + 4]
        for kind, size, count, least in (
                ("all_gather", gathered, gathers, SHARDED_FROM["weights"]),
                ("reduce_scatter", reduced, reductions, SHARDED_FROM["gradients"])):
            if count.any():
                base, slope = (part.min(axis=0) for part in lines(kind, group))
                moves = zero >= least
                if kind == "reduce_scatter":
                    moves = moves & ~deferred
                out[j] += np.where(moves, count * base + slope * size, 0.0)
    return out * (1 - 2e-6)  # below `schedule.released_bound`'s, the same sums in another order


def _held_bytes(held: np.ndarray, cols: _Columns) -> np.ndarray:
    """`_held`'s parts (a row each, over the layouts) summed as the ZeRO stage shards them over
    each group (`parallel.SHARDED_FROM`, which `replicate` follows)."""
    zero, groups = cols.zero, (cols.env[dp], cols.env[edp])
    total = held[-1].copy()
    for i, part in enumerate(RESIDENT):
        for j, size in enumerate(groups):
            total += held[2 * i + j] / np.where(zero >= SHARDED_FROM[part], size, 1.0)
    return total


# What a compute key's numbers and times read of a row (`_compute_bound`): the degrees (which
# decide the groups' sizes and strides), the micro-batch and whether TP overlaps its matmuls.
DEGREE_FIELDS = ("tp", "cp", "ep", "pp", "dp", "replicate", "gpus", "micro_batch", "async_tp")


def _compute_bound(f: _ComputeFormulas, rows_: list[Row], layers: int | None,
                   hardware: Hardware, cost: CostModel, line) -> tuple[np.ndarray, np.ndarray]:
    """Lower bounds of each row's step and memory from its compute key alone. Each stage's
    micro-batch takes at least its stack's ops, `LAYERS` times, its ends' ops and the stack's
    surely-waited collectives, and at least its ZeRO-2/3 collectives on one stream
    (`_moving`); `_step_bound` combines them (with no optimizer: the last micro-batch at least
    a plain one). It reads a subset of the ops, waits and streams `_evaluate`'s bound reads,
    so it is at most that bound. The fullest stage holds at least what its layers hold
    (`_held`), their saved activations once per micro-batch in flight (the ends too where one
    stage holds all). Neither needs a stage compiled."""
    # the ops' numbers and times depend on the degrees and the micro-batch alone: worked out
    # once for each distinct set of them (a tenth of the rows), then spread over the rows
    d = _distinct(rows_, layers, DEGREE_FIELDS)
    cols, spread, distinct = d.cols, d.spread, d.rows
    p, n = cols.p, len(distinct)
    values = f.tape.run(d.env | {LAYERS: np.ones(n)}, n)  # every count at one layer
    k = f.n_ops
    grids = values[len(values) - 4 * k:len(values) - k].reshape(3, k, n)
    # before `replicate` no collective shares a call (`Cost.calls`): the data-parallel ones
    # that do are not there yet
    nums = _Numbers(np.rint(values[:k]), values[k:2 * k], values[2 * k:3 * k],
                    values[3 * k:4 * k], *(np.zeros((0, n)),) * 3, grids, np.ones((k, n)),
                    values[len(values) - k:])
    held = values[4 * k:4 * k + 14][:, spread]
    moved = values[4 * k + 14:len(values) - 4 * k][:, spread]
    parts = len(held) // 2
    distinct_lines = _over_rows(distinct, line)
    times = _comm_times(f, nums, distinct_lines, cost.copy_s(hardware))
    compute = _op_times(f, nums, hardware, cost)
    comm = _comm_totals(times, nums, compute)
    stack, first, last = (place @ compute for place in f.places)
    busy = [part[spread] for part in (stack, first, last)]  # compute alone, for `_slowed`
    sent = [(place @ comm)[spread] for place in f.places]
    stack = stack + _waited_time(f, nums, times, compute, distinct)
    stack, first, last = stack[spread], first[spread], last[spread]
    plain = {role: stack * cols.layers[role] for role in ROLES}
    plain[FIRST] = plain[FIRST] + first + np.where(p == 1, last, 0.0)
    plain[LAST] = np.where(p > 1, plain[LAST] + last, 0.0)
    plain[MIDDLE] = np.where(p > 2, plain[MIDDLE], 0.0)
    # ZeRO-2/3's collectives of a micro-batch run one after another on their stream, which
    # ends no earlier than the last of them: its layers' (and where one stage holds all, the
    # ends')
    def lines(kind: str, group: str) -> tuple[np.ndarray, np.ndarray]:
        return tuple(part[:, spread] for part in distinct_lines(kind, group))
    per_layer = _moving(moved[:8], cols.zero, lines, cols.deferred)
    ends_ = _moving(moved[8:], cols.zero, lines, cols.deferred)
    for role in ROLES:
        streams = cols.layers[role] * per_layer + np.where(p == 1, ends_, 0.0)  # each its own
        plain[role] = np.maximum(plain[role], np.where(plain[role] > 0, streams.max(axis=0),
                                                       0.0))
    # each stage holds its layers' resident parts and, at its backward's first op, the saved
    # activations of every micro-batch in flight there (`distributed.stage_in_flight`, as
    # `_fullest` counts them: the running one's and each waiting one's)
    layer = _held_bytes(held[:parts], cols)
    saved_ = held[parts - 1]
    in_flight = _in_flight(d.fields, cols.m, layers, ROLES)
    memory = np.max(np.stack([cols.layers[role] * (layer + (in_flight[role][0] - 1) * saved_)
                              for role in ROLES]), axis=0) + np.where(
        p == 1, _held_bytes(held[parts:], cols), 0.0)
    # the first stage's compute and communication over the step, at least (no optimizer, no
    # data-parallel reduction run once a step, no pipeline send), for the overlap slowdown
    on_first = cols.layers[FIRST]
    computed, communicated = (
        cols.m * (stack_ * on_first + first_ + np.where(p == 1, last_, 0.0))
        for stack_, first_, last_ in (busy, sent))
    communicated = communicated + cols.m * (on_first * per_layer
                                            + np.where(p == 1, ends_, 0.0)).sum(axis=0)
    bound = _slowed(_step_bound(plain, plain, p, cols.m, cols.v, cols.chunked), computed,
                    communicated, cost.slowdown(hardware))
    return bound * (1 - 1e-9), memory * (1 - 1e-9)


def _plans(f: _StageFormulas, layers: int, zero: int, values: dict, graph: Graph | None = None):
    """The schedule's plans of the stage holding `layers` layers; `graph`, the stage's graph
    where `f` holds none (read from the cache, `Searcher.stage_graph`)."""
    if layers not in f.plans:
        graph = f.graph if graph is None else graph
        subs = resolve(graph, values)
        if f.layers is not None:  # the stack's L / pp is this stage's layers
            subs[pp] = sympy.Rational(f.layers, layers)
        ordered = graph.ops()
        per_micro = [op for op in ordered if op.phase is not Phase.OPTIMIZER
                     and not once_per_step(op, zero)]
        f.plans[layers] = (plan(graph, per_micro, subs), plan(graph, ordered, subs))
    return f.plans[layers]


# --- the arrays ---------------------------------------------------------------------------------

_CONST, _SYMBOL, _ADD, _MUL, _POW, _CALL = range(6)


class _Program:
    """Formulas flattened into steps over numpy arrays, each distinct subexpression one step:
    sums, products and integer powers on numpy, anything else (a ceiling, a maximum) numpy's
    own through sympy. A searcher keeps one, its structures' formulas sharing their steps; a
    step's number is above its operands', so steps in numbered order run operands first."""

    def __init__(self):
        self.number: dict = {}  # subexpression -> its step
        self.steps: list[tuple] = []  # (code, operands or value)

    def step(self, expr) -> int:
        found = self.number.get(expr)
        if found is not None:
            return found
        if expr.is_Number:
            step = (_CONST, float(expr))
        elif expr.is_Symbol:
            step = (_SYMBOL, expr)
        elif expr.is_Add:
            step = (_ADD, tuple(self.step(a) for a in expr.args))
        elif expr.is_Mul:
            step = (_MUL, tuple(self.step(a) for a in expr.args))
        elif expr.is_Pow and expr.exp.is_Integer:
            step = (_POW, (self.step(expr.base), int(expr.exp)))
        else:
            step = (_CALL, sympy.lambdify(DEGREES, expr, "numpy"))
        self.steps.append(step)
        self.number[expr] = len(self.steps) - 1
        return self.number[expr]

    def tape(self, exprs) -> _Tape:
        """The steps `exprs` need, renumbered from 0, and which step gives each."""
        roots = [self.step(e) for e in exprs]
        needed, todo = set(), list(roots)
        while todo:
            i = todo.pop()
            if i in needed:
                continue
            needed.add(i)
            code, arg = self.steps[i]
            if code in (_ADD, _MUL):
                todo.extend(arg)
            elif code == _POW:
                todo.append(arg[0])
        order = sorted(needed)
        local = {g: k for k, g in enumerate(order)}
        steps = []
        for g in order:
            code, arg = self.steps[g]
            if code in (_ADD, _MUL):
                arg = tuple(local[a] for a in arg)
            elif code == _POW:
                arg = (local[arg[0]], arg[1])
            steps.append((code, arg))
        return _Tape(tuple(steps), tuple(local[r] for r in roots))


@attrs.frozen
class _Tape:
    steps: tuple
    roots: tuple[int, ...]

    def run(self, env: dict, n: int) -> np.ndarray:
        """Every formula at the arrays `env` gives the symbols: a row per formula."""
        values: list = []
        for code, arg in self.steps:
            if code == _CONST or code == _SYMBOL:
                values.append(arg if code == _CONST else env[arg])
            elif code == _ADD:
                values.append(functools.reduce(np.add, [values[a] for a in arg]))
            elif code == _MUL:
                values.append(functools.reduce(np.multiply, [values[a] for a in arg]))
            elif code == _POW:
                base, exp = values[arg[0]], arg[1]
                values.append(base ** exp if exp > 0 else 1.0 / base ** -exp)
            else:
                values.append(arg(*(env[s] for s in DEGREES)))
        out = np.empty((len(self.roots), n))
        for i, r in enumerate(self.roots):
            out[i] = values[r]
        return out


@attrs.frozen
class _Columns:
    """Rows' numbers as arrays, a column per layout: the degrees (`DEGREES` but `LAYERS`),
    the stages, micro-batches, virtual stages and ZeRO stage, each role's stage's layers."""

    env: dict
    p: np.ndarray
    m: np.ndarray
    v: np.ndarray
    zero: np.ndarray
    layers: dict  # role -> layers (0 where the row has no such stage)
    # 1 where interleaved chunks differ in size (uneven ends, `distributed.interleaved_span`)
    chunked: np.ndarray
    # whether the gradient reductions wait for their reader (`frameworks.defers_grad_reduce`)
    deferred: np.ndarray


def _columns(rows_: list[Row], layers: int | None, fields: _Fields | None = None) -> _Columns:
    """The rows' numbers as columns: their fields read once into an array (`_Fields`), the
    layout's own rules (`LayoutFields`: group sizes, micro-batches) applied to whole columns,
    and each rule of a few fields (the ZeRO stage the framework runs, each role's layers) once
    per distinct value of those fields."""
    f = _Fields(rows_) if fields is None else fields
    env = dict(zip((tp, cp, ep, dp, edp, B), (
        f.tp, f.cp, f.ep, f.size("dp"), f.size("edp"), f.micro_batch)))
    # the fields each rule reads: the ZeRO stage, the stages and the framework (`sharding`),
    # the stages and their split (`_stage_layers`); below, with whether the reduction overlaps
    # the backward (`defers_grad_reduce`)
    found, at = f.per_distinct(("zero", "pp", "first_stage_layers", "last_stage_layers",
                                *FRAMEWORK_FIELDS),
                               lambda r: (sharding(r), _stage_layers(r, layers)))
    chunked = (f.virtual_stages > 1) & ((f.column("first_stage_layers") != None)  # noqa: E711
                                        | (f.column("last_stage_layers") != None))  # noqa: E711
    deferred, at_deferred = f.per_distinct(("zero", "pp", "overlap_grad_reduce",
                                            *FRAMEWORK_FIELDS), defers_grad_reduce)
    return _Columns({k: v.astype(float) for k, v in env.items()}, f.pp.astype(float),
                    f.micro_batches.astype(float), f.virtual_stages.astype(float),
                    np.array([zero for zero, _ in found], dtype=float)[at],
                    {role: np.array([x.get(role, 0) for _, x in found], dtype=float)[at]
                     for role in ROLES},
                    chunked.astype(float), np.array(deferred)[at_deferred])


class _Fields(LayoutFields):
    """Rows' fields as columns (`LAYOUT_FIELDS` and the options, each an array over the rows;
    the global batch, one for all of them, a number), so that `LayoutFields`' rules (`size`,
    `micro_batches`) give whole columns."""

    NUMBERS = ("tp", "cp", "ep", "pp", "dp", "replicate", "micro_batch", "virtual_stages", "zero")

    def __init__(self, rows_: list[Row]):
        self.rows = rows_
        self.columns = dict(zip(Row._fields, zip(*rows_)))  # name -> the rows' values
        for name in self.NUMBERS:
            setattr(self, name, np.array(self.columns[name], dtype=np.int64))
        batches = set(self.columns["global_batch"])
        if len(batches) != 1 or None in batches:  # rows of one space share it
            raise ValueError("rows of more than one global batch")
        self.global_batch = batches.pop()
        # each row's (`plan --expert-tp both` has both), which `LayoutFields` reads as a column
        self.expert_tp = np.array(self.columns["expert_tp"], dtype=object)

    def column(self, name: str) -> np.ndarray:
        return np.array(self.columns[name], dtype=object)

    def per_distinct(self, names: tuple[str, ...], rule) -> tuple[list, np.ndarray]:
        """`rule(row)` once per distinct value of `names`' fields, in first-row order, and
        each row's index into them."""
        firsts, at = _first_of_each(zip(*(self.columns[n] for n in names)))
        return [rule(self.rows[i]) for i in firsts], at


@attrs.frozen
class _Numbers:
    """A stage's numbers over a structure's rows: a row per op (or life), a column per
    layout."""

    counts: np.ndarray
    flops: np.ndarray
    bytes: np.ndarray
    messages: np.ndarray
    sizes: np.ndarray
    life_counts: np.ndarray
    resident: np.ndarray  # (4, candidates): weights, gradients, optimizer, gather buffers
    grids: np.ndarray  # (3, ops, candidates): each op's GEMMs, M, N (`Cost.grid`; 0: none)
    calls: np.ndarray  # each collective's share of one NCCL call (`Cost.calls`; 1: its own)
    launches: np.ndarray  # the kernels one instance of each op launches (`Cost.launches`)


def _numbers(f: _StageFormulas, env: dict, n: int) -> _Numbers:
    values = f.tape.run(env, n)
    k, m = f.n_ops, f.n_lives
    # counts and sizes are whole numbers: rounded, their sums carry no rounding error; the
    # resident parts may not be (a ZeRO shard is 1/dp of a buffer), and for the memory filter
    # a byte either way does not matter (the layouts returned are made whole exactly)
    def whole(rows):  # in place: `values` is this call's own array
        return np.rint(rows, out=rows)

    end = 4 * k + 2 * m + len(RESIDENT) + 1  # and the buffers
    return _Numbers(whole(values[:k]), values[k:2 * k], values[2 * k:3 * k],
                    values[3 * k:4 * k], whole(values[4 * k:4 * k + m]),
                    whole(values[4 * k + m:4 * k + 2 * m]), whole(values[4 * k + 2 * m:end]),
                    values[end:end + 3 * k].reshape(3, k, n), values[end + 3 * k:end + 4 * k],
                    values[end + 4 * k:])


@attrs.frozen
class _Peak:
    """A stage's liveness peak over a structure's rows (`memory.peak`, `figures`): the op it
    happens at, and each part."""

    at: np.ndarray
    weights: np.ndarray
    gradients: np.ndarray
    optimizer: np.ndarray
    activations: np.ndarray  # for one micro-batch
    transient: np.ndarray
    # the saved activations at the backward's start (`Memory.resting`): in the stack, before
    # it, after it
    resting: np.ndarray
    resting_before: np.ndarray
    resting_after: np.ndarray
    buffers: np.ndarray  # the optimizer's gather buffers (`Memory.buffers`)

    @property
    def resting_parts(self) -> tuple[np.ndarray, ...]:
        return self.resting, self.resting_before, self.resting_after

    def spread(self, spread: np.ndarray) -> _Peak:
        """The peak over rows from the peak over their distinct columns (`_distinct`)."""
        return _Peak(*(getattr(self, a.name)[spread] for a in attrs.fields(_Peak)))

    def memory(self, f: _StageFormulas, col: int, degrees: dict, held: tuple[float, ...],
               capacity) -> Memory:
        """Column `col`'s peak as `figures` gives it: each part summed exactly (its formulas
        at `degrees`), then made whole, at the op the arrays found."""
        at = int(self.at[col])
        k, m = f.n_ops, f.n_lives

        values: dict = {}  # formula index -> its value at `degrees`, once

        def exact(index: int):
            if index not in values:
                values[index] = sympy.sympify(f.exprs[index]).xreplace(degrees)
            return values[index]

        def live_at(i: int, by, keys, among=None) -> list[int]:
            """The bytes live at op i of the lives `among` (a mask; None: all), one sum for
            each of `keys`, by `by` (each life's key): saved or transient, where it is."""
            parts: dict = {key: [] for key in keys}
            live = (f.one[i] != 0) | (f.many[i] != 0)
            for j in np.flatnonzero(live if among is None else live & among):
                size = exact(4 * k + j)
                count = exact(4 * k + m + j) if f.many[i, j] else 0
                parts[by[j]].append(int(f.one[i, j]) * size + count * size)
            return [int(sympy.Add(*parts[key])) for key in keys]

        saved, transient = (live_at(at, f.saved, (True, False)) if f.moments else (0, 0))
        resting = [0, 0, 0]  # in the layer stack, before it, after it
        if f.resting_at is not None:
            resting = live_at(f.resting_at, f.ends, (0, 1, 2), f.saved)
        w, g, o, b = (int(exact(4 * k + 2 * m + i)) for i in range(len(RESIDENT) + 1))
        name, phase = f.moments[at] if f.moments else ("", "")
        return Memory(name, phase, w, g, o, int(held_activations(saved, resting, held)),
                      transient, capacity=int(capacity) if capacity else None,
                      **dict(zip(("resting", "resting_before", "resting_after"), resting)),
                      buffers=b)


def _peak(f: _StageFormulas | _MemoryFormulas, nums: _Numbers) -> _Peak:
    n = nums.sizes.shape[1]
    w, g, o, b = nums.resident
    zero = np.zeros(n)
    if not f.moments:
        return _Peak(np.zeros(n, dtype=int), w, g, o, zero, zero, zero, zero, zero, b)
    sizes, counted = nums.sizes, nums.sizes * nums.life_counts
    live = f.copies.astype(float) @ np.vstack([sizes, counted])  # (ops, rows)
    at = np.argmax(live, axis=0)  # the first op where the most is live

    def parts(copies):  # (rows, 2 x lives) -> each life's bytes then: (rows, lives)
        return copies[:, :f.n_lives] * sizes.T + copies[:, f.n_lives:] * counted.T
    each = parts(f.copies[at])
    resting = (zero, zero, zero)  # in the layer stack, before it, after it
    if f.resting_at is not None:
        rest = parts(f.copies[[f.resting_at]])
        resting = tuple(rest[:, f.saved & (f.ends == where)].sum(axis=1) for where in (0, 1, 2))
    return _Peak(at, w, g, o, each[:, f.saved].sum(axis=1), each[:, ~f.saved].sum(axis=1),
                 *resting, b)


def _op_times(f: _StageFormulas, nums: _Numbers, hardware: Hardware, cost: CostModel
              ) -> np.ndarray:
    """Each compute op's time on the stage under `cost`, every instance (a row per op, 0 for
    the collectives), over the rows."""
    rows_ = [i for i in range(f.n_ops) if f.groups[i] is None]
    out = np.zeros_like(nums.flops)
    if not rows_:
        return out
    peaks = np.array([f.peaks[i] for i in rows_])[:, None]
    out[rows_] = cost.op_times(hardware, [f.kinds[i] for i in rows_], nums.flops[rows_],
                               nums.bytes[rows_], nums.counts[rows_], peaks,
                               nums.grids[:, rows_], nums.launches[rows_],
                               [f.efficiencies[i] for i in rows_])
    return out


def _grid(values: np.ndarray) -> tuple:
    """An op's grid as `distributed.StageOp` holds it: () for none (zeros)."""
    return tuple(float(v) for v in values) if values.any() else ()


def _stage_layers(r: Row, layers: int) -> dict[str, int]:
    """The layers on each role's stage."""
    return _split_layers(layers, r.pp, r.first_stage_layers, r.last_stage_layers)


@functools.lru_cache(maxsize=4096)
def _split_layers(layers: int, stages: int, first, last) -> dict[str, int]:  # read, not changed
    if stages == 1:
        return {FIRST: layers or 1}  # the whole stack (its count is no symbol then)
    each = stage_layers(layers, Parallel(pp=stages, first_stage_layers=first,
                                         last_stage_layers=last))
    return {FIRST: each[0], MIDDLE: each[1], LAST: each[-1]}


@attrs.frozen
class _Group:
    """A structure's rows evaluated as arrays."""

    structure: _Structure
    rows: list
    numbers: dict  # role -> _Numbers
    peaks: dict  # role -> _Peak
    held: dict  # role -> in-flight micro-batches per row (`_in_flight`)
    bound: np.ndarray  # a lower bound of each row's step time
    upper: np.ndarray  # an upper bound of it (`_step_upper`)
    fullest: np.ndarray  # each row's memory per GPU (its fullest stage's)
    spread: np.ndarray  # each row's column in `numbers` (rows alike in them share one)


def _evaluate(s: _Structure, group: list[Row], layers: int, hardware: Hardware,
              cost: CostModel, line) -> _Group:
    # each stage's numbers and times depend on the degrees, the micro-batch, the stages' split
    # and whether the reductions are deferred, not on the micro-batches or the virtual stages:
    # worked out once per distinct set of those fields (`_distinct`), then spread over the rows
    d = _distinct(group, layers, EVALUATED_FIELDS)
    cols, spread, distinct = d.cols, d.spread, d.rows
    p, m, v, n = cols.p, cols.m, cols.v, len(distinct)
    numbers, plain, last, serial, serial_last = {}, {}, {}, {}, {}
    communicated = np.zeros(len(group))  # the first stage's communication over the step
    deferred = cols.deferred[d.firsts]
    lines = _over_rows(distinct, line)  # the roles' stages share the groups
    for role, f in s.stages.items():
        nums = numbers[role] = _numbers(f, d.env | {LAYERS: cols.layers[role][d.firsts]}, n)
        times = _comm_times(f, nums, lines, cost.copy_s(hardware))
        compute = _op_times(f, nums, hardware, cost)
        comm = _comm_totals(times, nums, compute)
        busy = compute[list(f.busy_rows)].sum(axis=0) + _waited_time(f, nums, times, compute,
                                                                     distinct)
        # a micro-batch takes at least its compute and surely-waited communication, and at
        # least what its streams run after the compute that releases it; the last one adds
        # the optimizer and what runs once per step
        # and at least its compute with each stack's trips as long as its data-parallel
        # stream lets them be (`schedule.cycles`), where each trip's reductions start when
        # their gradients are written (not deferred to the backward's end)
        held = np.where(deferred, 0.0, cycle_bound(f.cycles, compute, comm, nums.counts))
        # (a layout that defers its gradient reductions to their reader runs none in a plain
        # micro-batch: `distributed._schedule`'s `deferred`)
        released = np.where(deferred, released_bound(f.releases[0], compute, comm, DEFERRED_GROUPS),
                            released_bound(f.releases[0], compute, comm))
        plain[role] = np.maximum.reduce([busy, held, released])[spread]
        last[role] = np.maximum.reduce([busy + compute[list(f.optimizer_rows)].sum(axis=0),
                                        held, released_bound(f.releases[1], compute, comm)]
                                       )[spread]
        once = np.array(f.once)
        serial[role] = (compute + comm)[~once].sum(axis=0)[spread]
        serial_last[role] = serial[role] + (compute + comm)[once].sum(axis=0)[spread]
        if role == FIRST:  # once-a-step collectives once, the others each micro-batch
            communicated = comm[once].sum(axis=0)[spread] + m * comm[~once].sum(axis=0)[spread]
            computed = (m * compute[list(f.busy_rows)].sum(axis=0)[spread]
                        + compute[list(f.optimizer_rows)].sum(axis=0)[spread])
    bound = _slowed(_step_bound(plain, last, p, m, v, cols.chunked), computed, communicated,
                    cost.slowdown(hardware))
    upper = (_step_upper(serial, serial_last, plain, p, m, v, cols.chunked)
             + cost.slowdown(hardware) * communicated)
    peaks = {role: _peak(f, numbers[role]).spread(spread) for role, f in s.stages.items()}
    held = _in_flight(d.fields, m, layers, peaks)
    fullest = _fullest(peaks, held)
    return _Group(s, group, numbers, peaks, held, bound * (1 - 1e-9), upper * (1 + 1e-9),
                  fullest, spread)


def _slowed(bound: np.ndarray, computed: np.ndarray, communicated: np.ndarray,
            slowdown: float) -> np.ndarray:
    """A step bound with the overlap slowdown's least share added. The exact step
    (`distributed._schedule`) is the first stage's span S plus `slowdown` x its hidden
    communication H. S is at least `bound`, and at least its compute C plus every wait W the
    compute stream made (each micro-batch's span is its ops' time and the waits charged to
    its collectives); H, the collectives' time T less what was waited through, is at least
    T - W, and at least 0. So the step is at least max(bound, C + W) + slowdown x max(0, T - W)
    for some W >= 0, which is least at W = bound - C: the bound plus slowdown x max(0, T -
    (bound - C)). `computed` is C over the step (m micro-batches' compute and the optimizer),
    `communicated` T (once-a-step collectives once, the others m times, as
    `distributed._transfers` counts them)."""
    if not slowdown:
        return bound
    floor = np.maximum(bound, computed)
    return floor + slowdown * np.maximum(0.0, communicated - (floor - computed))


# What a structure's arrays read of a row besides its micro-batches and virtual stages
# (`_evaluate`): the degrees and micro-batch, the stages' split, and what decides whether its
# gradient reductions are deferred.
EVALUATED_FIELDS = ("tp", "cp", "ep", "pp", "dp", "replicate", "gpus", "micro_batch", "async_tp",
                    "first_stage_layers", "last_stage_layers", "zero", "overlap_grad_reduce",
                    *FRAMEWORK_FIELDS)


@attrs.frozen
class _Distinct:
    """Rows' columns (`_columns`) and their distinct sets of some fields: the first row of
    each set (`firsts`, `rows`), each row's set (`spread`: an index into them), and the degrees
    at the sets (`env`), for the arrays that read those fields alone."""

    cols: _Columns
    firsts: np.ndarray
    spread: np.ndarray
    rows: list
    env: dict
    fields: _Fields  # the rows' fields as columns


def _distinct(rows_: list[Row], layers: int | None, names: tuple[str, ...]) -> _Distinct:
    """`rows_`' columns and their distinct sets of `names`' fields (see `_Distinct`)."""
    fields = _Fields(rows_)
    cols = _columns(rows_, layers, fields)
    firsts, at = _first_of_each(zip(*(fields.columns[name] for name in names)))
    return _Distinct(cols, firsts, at, [rows_[i] for i in firsts],
                     {symbol: column[firsts] for symbol, column in cols.env.items()}, fields)


def _first_of_each(keys) -> tuple[np.ndarray, np.ndarray]:
    """The first position of each distinct key, in the order they first appear, and each
    key's index into them (the passes over every key run in C, `dict.fromkeys` and `map`;
    Python loops over the distinct keys alone)."""
    keys = list(keys)
    index = dict.fromkeys(keys)
    for i, key in enumerate(index):
        index[key] = i
    at = np.fromiter(map(index.__getitem__, keys), dtype=np.intp, count=len(keys))
    return np.unique(at, return_index=True)[1], at


def _step_bound(plain: dict, last: dict, p, m, v, chunked) -> np.ndarray:
    """A lower bound of the step from lower bounds of each role's plain and last
    micro-batch (`distributed._schedule`: the pipeline span of the plain micro-batches plus
    the longest tail, last less plain). The span `m x max + (sum - max) / v` is at least
    `m x T_j + (sum - T_j) / v` for every stage j (m >= 1 >= 1 / v), and the tail at least
    stage j's; so the step is at least `(m - 1) x T_j + last_j + (sum - T_j) / v` for each j,
    every term growing with the times it reads. Where interleaved chunks differ in size
    (`chunked`: the schedule is simulated, `schedule.interleaved_span`, which the formula can
    overstate) the bubble term is the fill and drain through chunk 0 instead: stage j's first
    forward waits for micro-batch 0's through chunk 0 of every stage before it, and after its
    last backward (chunk 0's, the chunks running backward in reverse) the stages before it run
    chunk 0's backward of that micro-batch; a middle stage's chunk is T_middle / v, the first
    stage's chunk 0 (the embedding's) taken as nothing. So the span is at least m x T_j plus
    (j - 1) middle chunks: (p - 3) before the last middle stage, (p - 2) before the last."""
    total = plain[FIRST] + plain.get(LAST, 0.0) + (p - 2) * plain.get(MIDDLE, 0.0)
    middle_chunk = plain.get(MIDDLE, 0.0) / v
    before = {FIRST: 0.0, MIDDLE: np.maximum(p - 3, 0) * middle_chunk,
              LAST: np.maximum(p - 2, 0) * middle_chunk}
    return np.max(np.stack([(m - 1) * plain[role] + last[role]
                            + np.where(chunked, before[role], (total - plain[role]) / v)
                            for role in plain]), axis=0)


def _step_upper(serial: dict, serial_last: dict, plain: dict, p, m, v, chunked) -> np.ndarray:
    """An upper bound of the step (`distributed._schedule`) from each role's micro-batches
    run one op at a time, `serial` and `serial_last` (`simulate` never leaves every stream
    idle while an op is left: each waits only for what runs), and the lower bounds of the
    plain ones (the tail is last less plain): the pipeline span grows with every stage's
    time. Where interleaved chunks differ in size (`chunked`) the span is taken as 1F1B's
    without interleaving, `m x max + (sum - max)`: the simulated interleaved schedule
    (`schedule.interleaved_span`) came out at most that in every one of 7,200 random trials
    (stage times, Llama 3's and other uneven splits, 1 to 4 micro-batches per stage; the
    largest ratio 1 + 4e-15), where the interleaved formula can overstate it by 12%. The caller
    adds what the overlap slowdown can add (all the communication)."""
    total = serial[FIRST] + serial.get(LAST, 0.0) + (p - 2) * serial.get(MIDDLE, 0.0)
    slowest = np.max(np.stack(list(serial.values())), axis=0)
    tail = np.max(np.stack([serial_last[role] - plain[role] for role in serial]), axis=0)
    return m * slowest + (total - slowest) / np.where(chunked, 1.0, v) + tail


def _job(g: _Group, col: int, forward: Graph, hardware: Hardware, cluster, tokens: int,
         n_mfu: int, values: dict, layers: int, graph_of=None) -> Job:
    """Row `col` of a group as `distributed.prepare` compiles it, from the arrays' numbers;
    `graph_of(role)`, a stage's graph where the structure holds none (`_plans`)."""
    r = g.rows[col]
    layout = r.layout()
    capacity = hardware.memory_bytes
    counts = _stage_layers(r, layers)
    stages = []
    for role, index in _roles(r.pp):
        f, nums, d = g.structure.stages[role], g.numbers[role], g.spread[col]
        ops = tuple(StageOp(f.names[k], f.kinds[k], f.categories[k], f.phases[k],
                            int(nums.counts[k, d]), float(nums.flops[k, d]),
                            float(nums.bytes[k, d]), f.computes[k], f.efficiencies[k],
                            _grid(nums.grids[:, k, d]), float(nums.launches[k, d]),
                            f.groups[k], float(nums.messages[k, d]),
                            float(nums.calls[k, d]), f.peaks[k], f.once[k])
                    for k in range(f.n_ops))
        plain, last = _plans(f, counts[role], sharding(r), values,
                             None if f.graph is not None or counts[role] in f.plans
                             else graph_of(role))
        degrees = dict(zip(DEGREES, map(sympy.Integer, (
            r.tp, r.cp, r.ep, r.size("dp"), r.size("edp"), counts[role], r.micro_batch))))
        memory = g.peaks[role].memory(f, col, degrees,
                                      tuple(float(h[col]) for h in g.held[role]), capacity)
        stages.append(Stage(None, ops, plain, last, None, memory, index))
    distinct = [index for _, index in _roles(r.pp)]
    kinds = [min(i, 1) if i < r.pp - 1 else i for i in range(r.pp)]
    return Job(forward, hardware, cluster.for_job(layout.world), layout, tuple(stages),
               tuple(distinct.index(k) for k in kinds), tokens, n_mfu,
               unequal_chunks(forward, layout))
