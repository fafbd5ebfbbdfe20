"""Branch and bound over the layouts of a space (`Searcher`, `search`): structures compiled as
their bounds come up, rows scheduled exactly best first."""

from __future__ import annotations

import heapq
import time
from pathlib import Path

import attrs
import numpy as np

from ...core.collector import fewer_collections
from ...core.errors import OpgraphError
from ...core.ir import Graph
from ...core.limits import MAX_MICRO_BATCHES
from ...core.parameters import mfu_parameters
from ...cost.costmodel import DEFAULT, CostModel
from ...cost.hardware import Hardware
from ...io.outputs.progress import progress, progressed
from ...passes.evaluate import resolve
from .. import cluster as clusters
from ..distributed import Job, step_figures
from . import cache
from .bounds import (
    _comm_line,
    _compile_compute,
    _compile_memory,
    _compile_structure,
    _compute_bound,
    _ComputeFormulas,
    _evaluate,
    _Group,
    _job,
    _memory_of,
    _Program,
    _representative,
    _stage_graphs,
    _step,
    _Structure,
    compute_key,
)
from .space import Candidate, Found, Ranked, Row, Space, _layers, row_of, rows, structure

# --- the search ---------------------------------------------------------------------------------

@attrs.define
class _Pending:
    """A space under search: its rows, each structure's (indices into them), each row's
    compute bound, and the structures evaluated so far (index -> `_Group`)."""

    space: Space
    rows: list[Row]
    members: list[np.ndarray]
    floor: np.ndarray
    groups: dict = attrs.field(factory=dict)


class Searcher:
    """One model on one part and cluster under one cost model, its structures compiled as
    the searches need them and kept (a scaling curve's sizes share them)."""

    def __init__(self, forward: Graph, hardware: Hardware, *, seq_len: int | None = None,
                 cluster: clusters.Cluster | None = None, cost: CostModel = DEFAULT,
                 cache: Path | None = None):
        """`cache`: a folder whose file for this search's context (`cache.context`) gives
        the structures compiled by an earlier run, and which `save` writes (`opgraph plan`
        passes `cache.folder()`); None compiles everything and writes nothing."""
        self.forward, self.hardware, self.cost = forward, hardware, cost
        self.seq = seq_len or forward.seq_len
        if self.seq is None:
            raise OpgraphError(f"{forward.name} has no default sequence length; give --seq-len")
        self.cluster = cluster or clusters.for_hardware(hardware)
        self._line = _comm_line(cost, self.cluster, hardware)
        self.values = {"S": self.seq}
        self.layers = _layers(forward)
        self.structures: dict[tuple, _Structure] = {}
        self.computes: dict[tuple, _ComputeFormulas] = {}
        self.compute_keys: dict[tuple, tuple] = {}  # structure -> compute key
        self.compute_formulas: dict = {}  # as `formulas`, for `_compile_compute`
        self.passes: dict = {}  # pass prefixes -> graphs
        self.formulas: dict = {}  # formulas -> with the fixed dimensions substituted
        self.program = _Program()  # the formulas' steps over arrays, shared by the structures
        self._last: _Pending | None = None  # the last space searched
        self.n_mfu = int(mfu_parameters(forward).xreplace(resolve(forward, self.values)))
        self._runs: dict = {}  # the micro-batches `exact` simulated (`step_figures`' `runs`)
        self.compile_s = 0.0
        self.compiled = self.read = 0  # structures and compute keys compiled, read from the cache
        self._cache = cache
        self._stored: dict | None = None  # the cache's file, once read
        self._graphs: dict = {}  # (structure, role) -> a stage graph the cache's file lacks
        self.fit_counts: dict = {}  # (structure, its rows) -> how many fit (`fitting`)

    def compute(self, r: Row) -> _ComputeFormulas:
        """The compute formulas of `r`'s compute key (`compute_key`), compiled once."""
        key = self.compute_key(r)
        if key not in self.computes:
            t0 = time.perf_counter()
            found = self._stored_entry("computes", key)
            if found is None:
                graph = _step(self.forward, r, _representative(r, self.layers), self.passes,
                              replicated=False)
                found = _compile_compute(graph, self.hardware, self.cost, self.values,
                                         self.layers, self.compute_formulas, self.program, r)
            self.computes[key] = found
            self.compile_s += time.perf_counter() - t0
        return self.computes[key]

    def compute_key(self, r: Row, key: tuple | None = None) -> tuple:
        """`compute_key(r)`, once a structure (rows of one share it); `key` is `r`'s
        structure where the caller has it."""
        key = structure(r) if key is None else key
        if key not in self.compute_keys:
            self.compute_keys[key] = compute_key(r, self.layers)
        return self.compute_keys[key]

    def structure(self, r: Row) -> _Structure:
        key = structure(r)
        if key not in self.structures:
            t0 = time.perf_counter()
            found = self._stored_entry("structures", key)
            if found is None:
                found = _compile_structure(self.forward, self.layers, self.hardware, r,
                                           self.values, self.cost, self.passes, self.formulas,
                                           self.program)
            self.structures[key] = found
            self.compile_s += time.perf_counter() - t0
        return self.structures[key]

    def _stored_entry(self, kind: str, key: tuple, counted: bool = True):
        """The cache file's `kind` ("structures", "computes" or "fits") entry for `key`,
        `counted` as read; else None, counted as compiled (the caller compiles it)."""
        if self._cache is not None and self._stored is None:
            self._stored = cache.load(self._cache, self._context()) or {}
        found = (self._stored or {}).get(kind, {}).get(key)
        if counted:
            if found is None:
                self.compiled += 1
            else:
                self.read += 1
        return found

    def _context(self) -> str:
        return cache.context(self.forward, self.hardware, self.cost, self.values, self.layers)

    def save(self) -> bool:
        """Write what this searcher holds compiled to its cache's file, with the file's
        other entries (`opgraph.parallel.search.cache`), where it compiled something the file
        lacked; True if written."""
        stored = self._stored or {}
        counted = any(key not in stored.get("fits", {}) for key in self.fit_counts)
        if self._cache is None or not (self.compiled or counted):
            return False
        # without their stages' graphs, which are most of the file and of the time to read it
        # back; with the schedule's plans made from them (`bounds._plans`), so the layouts
        # scheduled this run need no graph the next (`stage_graph` makes one again for any
        # other)
        light = {key: attrs.evolve(s, stages={role: attrs.evolve(f, graph=None)
                                              for role, f in s.stages.items()})
                 for key, s in self.structures.items()}
        return cache.save(self._cache, self._context(),
                          {**stored.get("structures", {}), **light},
                          {**stored.get("computes", {}), **self.computes},
                          {**stored.get("fits", {}), **self.fit_counts})

    def forget(self) -> None:
        """Drop the last space's arrays (`_space`) and the micro-batches its exact schedules
        ran, keeping the compiled structures."""
        self._last = None
        self._runs = {}

    def evaluate(self, group: list[Row]) -> _Group:
        """A structure's rows as arrays (they must share one structure)."""
        return _evaluate(self.structure(group[0]), group, self.layers, self.hardware, self.cost,
                         self._line)

    def exact(self, g: _Group, col: int) -> Ranked:
        """Row `col` of a group, scheduled as `profile` schedules it."""
        return Ranked(g.rows[col].candidate(),
                      step_figures(self._job_of(g, col), self.cost, self._runs))

    def _job_of(self, g: _Group, col: int) -> Job:
        return _job(g, col, self.forward, self.hardware, self.cluster,
                    g.rows[col].batch * self.seq, self.n_mfu, self.values, self.layers,
                    lambda role: self.stage_graph(g.structure, g.rows[col], role))

    def stage_graph(self, s: _Structure, r: Row, role: str) -> Graph:
        """The graph of `s`'s stage `role` (its first, middle or last stage), made again by
        the passes and `split_stages` where `s` came from the cache without it. Its ops must
        be the ones the cached formulas name (the passes are deterministic, so they are); a
        graph that is not is never scheduled: the file is removed and the search stops,
        saying so."""
        f = s.stages[role]
        if f.graph is not None:
            return f.graph
        key = (s.key, role)
        if key not in self._graphs:
            t0 = time.perf_counter()
            graph = _stage_graphs(self.forward, r, self.layers, self.passes, (role,))[1][role]
            if tuple(op.name for op in graph.ops()) != f.names:  # not the cached structure
                where = cache.remove(self._cache, self._context())
                raise OpgraphError(f"the plan cache {where} does not match the structures "
                                   "this code compiles; it is removed: run the command again "
                                   "(or with --no-cache)")
            self._graphs[key] = graph
            self.compile_s += time.perf_counter() - t0
        return self._graphs[key]

    def job(self, candidate: Candidate) -> Job:
        """The job `exact` schedules for `candidate`: `distributed.step_figures(job, cost)`
        schedules it under another cost model of the same backward convention without
        compiling again (`opgraph.analysis.explain.sensitivity`)."""
        return self._job_of(self.evaluate([row_of(candidate)]), 0)

    def one(self, candidate: Candidate) -> Ranked:
        """One candidate by the search's path, fit or not: what a test compares with
        `profile`."""
        return self.exact(self.evaluate([row_of(candidate)]), 0)

    def _space(self, space: Space) -> _Pending:
        """`space`'s rows, grouped by structure, with each row's compute bound; the last
        space's are kept, with the structures evaluated so far (`faster_than` after `search`
        of one space evaluates each once)."""
        if self._last is not None and self._last.space == space:
            return self._last
        by_key: dict[tuple, list[int]] = {}  # each structure's rows
        found = rows(self.forward, self.hardware, space, self.seq, self.cluster, by_key)
        if not found:
            raise OpgraphError(f"no layout of {self.forward.name} divides {space.gpus:,} GPUs "
                               f"and {space.batch:,} sequences per step within the "
                               f"constraints (at most {MAX_MICRO_BATCHES:,} micro-batches per "
                               "rank); change --gpus, the batch or the constraints")
        by_compute: dict[tuple, list[int]] = {}  # the rows of each compute key
        for key, members in by_key.items():
            by_compute.setdefault(self.compute_key(found[members[0]], key), []).extend(members)
        floor = np.empty(len(found))
        capacity = self.hardware.memory_bytes
        for members in progressed(list(by_compute.values()), "plan: bounding layouts",
                                  unit="key"):
            group = [found[i] for i in members]
            step, memory = _compute_bound(self.compute(group[0]), group, self.layers,
                                          self.hardware, self.cost, self._line)
            # a row that surely does not fit cannot be among the best
            floor[members] = np.where(memory > capacity, np.inf, step) if capacity else step
        self._last = _Pending(space, found, [np.array(m) for m in by_key.values()], floor)
        return self._last

    def _group(self, pending: _Pending, si: int) -> _Group:
        if si not in pending.groups:
            pending.groups[si] = self.evaluate([pending.rows[i] for i in pending.members[si]])
        return pending.groups[si]

    def _fits(self, g: _Group) -> np.ndarray:
        capacity = self.hardware.memory_bytes
        return np.flatnonzero(g.fullest <= capacity) if capacity else np.arange(len(g.rows))

    def search(self, space: Space, top: int = 10) -> Found:
        """The `top` fastest layouts of `space` (see the module), with the search's counts
        (the garbage collector running less often meanwhile: `core.collector`)."""
        if top < 1:
            raise OpgraphError("--top must be 1 or more")
        with fewer_collections():
            return self._search(space, top)

    def _search(self, space: Space, top: int) -> Found:
        t0, compiled, counts = time.perf_counter(), self.compile_s, (self.compiled, self.read)
        pending = self._space(space)
        # best first over two kinds of entry: a structure not yet evaluated, at its rows' least
        # compute bound (col -1), and a fitting row of one evaluated, at its bound
        heap = [(float(pending.floor[m].min()), si, -1) for si, m in enumerate(pending.members)]
        heapq.heapify(heap)
        best: list[tuple[float, int, Ranked]] = []
        scheduled = 0
        bar = progress("plan: structures compiled", total=len(pending.members),
                       unit="structure")
        while heap:
            bound, si, col = heapq.heappop(heap)
            if len(best) >= top and bound >= best[-1][0]:
                break  # nothing left can beat the K-th best
            g = self._group(pending, si)
            if col < 0:
                members = pending.members[si]
                for c in self._fits(g):
                    heapq.heappush(heap, (max(float(g.bound[c]),
                                              float(pending.floor[members[c]])), si, int(c)))
                bar.update()
                continue
            ranked = self.exact(g, col)
            scheduled += 1
            bar.set_postfix_str(f"{scheduled:,} layouts scheduled", refresh=False)
            best.append((ranked.step_time_s, int(pending.members[si][col]), ranked))
            best.sort(key=lambda item: item[:2])  # ties: in the order the space lists them
            del best[top:]
        bar.close()
        elapsed = time.perf_counter() - t0
        spent = self.compile_s - compiled
        groups = pending.groups.values()
        return Found(tuple(r for _, _, r in best), len(pending.rows),
                     sum(len(self._fits(g)) for g in groups), scheduled,
                     len(pending.members), len(pending.groups), spent, elapsed - spent,
                     min(float(g.fullest.min()) for g in groups),
                     self.compiled - counts[0], self.read - counts[1])

    def _fitting(self, group: list[Row]) -> int:
        """How many of a structure's rows fit: from the structure where one is compiled, else
        from its stages' memory alone (`bounds._compile_memory`: the passes, the stage cuts
        and the liveness, none of the rest), compiled for the count and not kept."""
        key = structure(group[0])
        if key in self.structures or self._stored_entry("structures", key,
                                                        counted=False) is not None:
            return len(self._fits(self.evaluate(group)))
        t0 = time.perf_counter()
        stages = {role: _compile_memory(graph, self.values, self.layers, self.formulas,
                                        self.program)
                  for role, graph in _stage_graphs(self.forward, group[0], self.layers,
                                                   self.passes)[1].items()}
        self.compiled += 1
        self.compile_s += time.perf_counter() - t0
        fullest = _memory_of(stages, group, self.layers)
        capacity = self.hardware.memory_bytes
        return int((fullest <= capacity).sum()) if capacity else len(group)

    def faster_than(self, space: Space, step_time_s: float) -> int:
        """How many layouts of `space` that fit run a step faster than `step_time_s` (where a
        layout of one's own ranks): each whose upper bound is below it surely does; each other
        whose bounds are below it is scheduled exactly."""
        pending = self._space(space)
        faster = 0
        for si, members in progressed(list(enumerate(pending.members)), "plan: ranking",
                                      unit="structure"):
            if pending.floor[members].min() >= step_time_s:
                continue
            g = self._group(pending, si)
            for col in self._fits(g):
                if g.upper[col] < step_time_s:
                    faster += 1  # surely
                elif max(g.bound[col], pending.floor[members[col]]) < step_time_s:
                    faster += self.exact(g, col).step_time_s < step_time_s
        return faster

    def fitting(self, space: Space) -> int:
        """How many layouts of `space` fit in memory: every structure evaluated that has a
        layout whose memory floor fits (a search evaluates only those its bounds cannot rule
        out). For a structure that no search has needed, only its stages' memory is compiled,
        for its count alone, and not kept (`_fitting`): a lifted space has a thousand. What it
        counted is kept instead, by the structure and its rows, and goes to the cache's file
        (`save`) for the next run of the same context."""
        pending = self._space(space)
        count = 0
        for si, members in progressed(list(enumerate(pending.members)),
                                      "plan: counting the layouts that fit", unit="structure"):
            if not np.isfinite(pending.floor[members]).any():
                continue
            group = pending.groups.get(si)
            if group is not None:
                count += len(self._fits(group))
                continue
            rows_ = tuple(pending.rows[i] for i in members)
            key = structure(rows_[0])
            if (key, rows_) not in self.fit_counts:
                stored = self._stored_entry("fits", (key, rows_), counted=False)
                if stored is None:
                    stored = self._fitting(list(rows_))
                self.fit_counts[(key, rows_)] = stored
            count += self.fit_counts[(key, rows_)]
        return count


def search(forward: Graph, hardware: Hardware, space: Space, *, top: int = 10,
           **options) -> Found:
    """The `top` fastest layouts of `space` (see the module); `options` are `Searcher`'s."""
    return Searcher(forward, hardware, **options).search(space, top)
