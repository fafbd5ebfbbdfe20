"""Collectives: the alpha-beta cost of each, as sympy formulas and as seconds on a cluster.

A collective runs over a group of `n` GPUs. `M` is the buffer each GPU holds, in bytes: the input
of an all-reduce, reduce-scatter or all-to-all, the gathered OUTPUT of an all-gather (as NCCL and
nccl-tests size it), the message of a send/recv. Each kind has one row in `COLLECTIVES`:

- `volume(n)`: the bytes each GPU sends (and receives) over its link, as a fraction of M, for the
  bandwidth-optimal algorithm NCCL uses on large buffers (ring; pairwise exchange for all-to-all);
- `steps(n)`: the latency steps of that algorithm, each costing the tier's alpha;
- `inter_steps(n, nodes)`: of those, the steps between nodes when the group spans `nodes`;
- `backward`: the kind its vector-Jacobian product runs, for `derive_backward`.

`time` is the plain formula, steps(n) * alpha + volume(n) * M / W, on one tier. `seconds` (and
`lines`, `on_cluster`) follow NCCL's own cost model (src/graph/tuning.cc, ncclTopoTuneModel):
a base latency per call, each step at the latency of the hop it takes (NVLink inside a node,
the network between nodes), an all-reduce the faster of NCCL's ring and tree, and W the
slowest tier's bandwidth per GPU per direction: NVLink inside a node; across nodes a GPU's
share of its node's NICs, pooled by a ring's members in each node (`_network_bandwidth`), or
a measured table's figure for the nodes spanned. Sources: Thakur, Rabenseifner & Gropp,
"Optimization of Collective Communication Operations in MPICH" (IJHPCA 2005) for the ring and
pairwise-exchange algorithms; NCCL's PERFORMANCE.md (nccl-tests) for the same factors as its
bus-bandwidth convention. docs/collectives.md has the derivations.

Backward pairing (Megatron-LM's f and g operators, Shoeybi et al. 2019, section 3):
- all-gather <-> reduce-scatter: the gradient of gathering shards is scattering the summed
  gradient back, and the other way round (Megatron's sequence-parallel g and f);
- all-reduce -> identity: Megatron's g (`reduce_from_tensor_model_parallel_region`) sums partial
  outputs in forward; its output is replicated, so its gradient passes through unchanged;
- identity -> all-reduce: Megatron's f (`copy_to_tensor_model_parallel_region`) is free in
  forward and all-reduces the input's gradient in backward;
- all-to-all -> all-to-all (the inverse exchange, the same volume for even splits);
- send-recv -> send-recv (the gradient travels back the other way).
Each pairing is an involution: backward of backward is the kind itself.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import sympy

from ..core.errors import OpgraphError
from .cluster import Cluster, Tier, members_per_node

n = sympy.Symbol("n", positive=True, integer=True)  # GPUs in the group
M = sympy.Symbol("M", positive=True)  # bytes of the buffer each GPU holds
alpha = sympy.Symbol("alpha", positive=True)  # seconds per latency step of the tier
W = sympy.Symbol("W", positive=True)  # bytes/s per GPU per direction of the tier


@attrs.frozen
class Collective:
    """One row of `COLLECTIVES`: the cost factors of a kind and the kind its backward runs."""

    kind: str
    volume: Callable[[sympy.Expr], sympy.Expr]  # bytes sent per GPU / M, as a function of n
    steps: Callable[[sympy.Expr], sympy.Expr]  # latency steps, as a function of n
    # of those steps, the ones that cross the network, as a function of n and the nodes spanned
    inter_steps: Callable[[sympy.Expr, sympy.Expr], sympy.Expr]
    backward: str
    algorithm: str  # what the factors assume, for docs and reports
    tree: bool = False  # NCCL may also run it as a double binary tree (`_tree_line`)
    # a ring that enters and leaves each node once, so a node's members share one crossing
    # (`_network_bandwidth`); pairwise exchange and point to point send each GPU's own bytes
    once_per_node: bool = False


def _ring_all_reduce_volume(n):
    # reduce-scatter then all-gather, each passing n-1 chunks of M/n around the ring
    return 2 * (n - 1) / n


def _ring_all_reduce_steps(n):
    return 2 * (n - 1)


def _ring_all_reduce_inter_steps(n, nodes):
    # NCCL's nInterSteps for a ring all-reduce: the ring enters and leaves each node once per
    # pass, two passes (reduce-scatter, all-gather)
    return 2 * (nodes - 1)


def _ring_half_volume(n):
    # reduce-scatter or all-gather: n-1 chunks of M/n each
    return (n - 1) / n


def _ring_half_steps(n):
    return n - 1


def _ring_half_inter_steps(n, nodes):
    return nodes - 1


def _pairwise_all_to_all_volume(n):
    # each GPU keeps its own 1/n of M and sends the other n-1 slices to their owners
    return (n - 1) / n


def _pairwise_all_to_all_steps(n):
    return n - 1


def _pairwise_all_to_all_inter_steps(n, nodes):
    # one step per peer: the n - n/nodes peers outside a GPU's node are reached over the network
    return n - n / nodes


def _send_recv_volume(n):
    return sympy.Integer(1)


def _send_recv_steps(n):
    return sympy.Integer(1)


def _send_recv_inter_steps(n, nodes):
    return nodes - 1  # the pair's one step crosses the network iff the pair spans two nodes


def _free(n, nodes=None):
    return sympy.Integer(0)


COLLECTIVES: dict[str, Collective] = {c.kind: c for c in (
    Collective("all-reduce", _ring_all_reduce_volume, _ring_all_reduce_steps,
               _ring_all_reduce_inter_steps, backward="identity",
               algorithm="ring (reduce-scatter + all-gather) or tree", tree=True,
               once_per_node=True),
    Collective("reduce-scatter", _ring_half_volume, _ring_half_steps, _ring_half_inter_steps,
               backward="all-gather", algorithm="ring", once_per_node=True),
    Collective("all-gather", _ring_half_volume, _ring_half_steps, _ring_half_inter_steps,
               backward="reduce-scatter", algorithm="ring", once_per_node=True),
    Collective("all-to-all", _pairwise_all_to_all_volume, _pairwise_all_to_all_steps,
               _pairwise_all_to_all_inter_steps, backward="all-to-all", algorithm="pairwise exchange"),
    Collective("send-recv", _send_recv_volume, _send_recv_steps, _send_recv_inter_steps,
               backward="send-recv", algorithm="point to point"),
    Collective("identity", _free, _free, _free,
               backward="all-reduce", algorithm="none (Megatron's f: a copy in forward)"),
)}
KINDS = tuple(COLLECTIVES)


def rule(kind: str) -> Collective:
    """The row of `COLLECTIVES` for a kind: `rule("all-gather").backward == "reduce-scatter"`."""
    try:
        return COLLECTIVES[kind]
    except KeyError:
        raise OpgraphError(f"unknown collective {kind!r}; choose one of: "
                           f"{', '.join(KINDS)}") from None


def _sym(value) -> sympy.Expr:
    """Numbers become sympy numbers (exact for integers); expressions pass through."""
    if isinstance(value, int):
        return sympy.Integer(value)
    if isinstance(value, float):
        return sympy.Float(value)
    return value


def bytes_per_gpu(kind: str, size=M, group=n) -> sympy.Expr:
    """Bytes each GPU sends (and receives): `bytes_per_gpu("all-reduce") == 2*(n-1)/n*M`."""
    return rule(kind).volume(_sym(group)) * _sym(size)


def steps(kind: str, group=n) -> sympy.Expr:
    """Latency steps of the algorithm: `steps("all-reduce") == 2*(n-1)`."""
    return rule(kind).steps(_sym(group))


def time(kind: str, size=M, group=n, latency=alpha, bandwidth=W) -> sympy.Expr:
    """Seconds as a formula: `time("all-gather") == (n-1)*alpha + (n-1)/n*M/W`.

    Pass numbers for any argument to fix it; the defaults are the symbols n, M, alpha and W.
    """
    return steps(kind, group) * _sym(latency) + bytes_per_gpu(kind, size, group) / _sym(bandwidth)


def backward(kind: str) -> str:
    """The collective a kind's backward runs: `backward("all-gather") == "reduce-scatter"`."""
    return rule(kind).backward


# NCCL's own cost model (NVIDIA/nccl src/graph/tuning.cc, ncclTopoTuneModel; NCCL 2.28): a
# collective costs baseLat once per call, then each step the latency of the hop it takes. The
# tiers' latency_us are its hwLat for the Ring algorithm and LL protocol (NVLink 0.6 us, PCI
# 1.0 us, NET 2.7 us), the protocol NCCL picks where latency matters; tree_latency_us its hwLat
# for Tree/LL (NET 5.0 us; NVLink and PCI as the ring's). NCCL's tuner also scales intraLat by
# 1.8 for LL across nodes and corrects trees at medium sizes; this model leaves those out.
BASE_LATENCY_S = {"ring": 6.6e-6, "tree": 6.8e-6}  # tuning.cc baseLat[Ring][LL], [Tree][LL]
# A tree all-reduce's bus bandwidth is 0.92 of the link's (`busBw*.92`), and its algorithm
# bandwidth half its bus bandwidth (`ratio = .5`): it moves 2M per GPU over 0.92 W.
TREE_BUS_EFFICIENCY = 0.92
TREE_ALGORITHM_RATIO = 0.5


def _log2i(x):
    """floor(log2 x), NCCL's log2i, for a whole number or a sympy expression."""
    if isinstance(x, int):
        return x.bit_length() - 1
    return sympy.floor(sympy.log(x, 2))


def _ring_line(row: Collective, group, nodes, node: Tier, network: Tier, bandwidth):
    """(seconds at no message, seconds per byte) of the kind's own algorithm (ring, pairwise
    exchange, point to point) over `group` GPUs in `nodes` nodes: NCCL's ring latency,
    baseLat + (nsteps - nInterSteps) x intraLat + nInterSteps x interLat, and the volume over
    `bandwidth`. Numbers or sympy expressions alike (`lines`, `on_cluster`)."""
    inter = row.inter_steps(group, nodes)
    latency = (BASE_LATENCY_S["ring"] + (row.steps(group) - inter) * node.latency_s
               + inter * network.latency_s)
    return latency, row.volume(group) / bandwidth


def _tree_line(group, nodes, node: Tier, network: Tier, bandwidth):
    """(seconds at no message, seconds per byte) of NCCL's tree all-reduce: a chain through
    each node's group/nodes GPUs and a double binary tree between nodes, up and down, so
    baseLat + 2 x ((group/nodes - 1) x intraLat + log2i(nodes) x interLat); it moves 2M per
    GPU at 0.92 of the link (tuning.cc: busBw*.92, algorithm bandwidth busBw x .5)."""
    latency = BASE_LATENCY_S["tree"] + 2 * ((group / nodes - 1) * node.tree_latency_s
                                            + _log2i(nodes) * network.tree_latency_s)
    return latency, 1 / (TREE_ALGORITHM_RATIO * TREE_BUS_EFFICIENCY * bandwidth)


def seconds_on(kind: str, size_bytes: float, group_size: int, tier: Tier) -> float:
    """Seconds on a given tier by the plain alpha-beta formula (`time`), no base latency:
    `seconds_on("send-recv", 1e9, 2, tier)`."""
    return float(time(kind, size_bytes, group_size, tier.latency_s, tier.bandwidth))


def _network_bandwidth(row: Collective, nodes, per_node, cluster: Cluster):
    """W of a group that spans `nodes` nodes with `per_node` members in each (numbers, or sympy
    expressions for `on_cluster`).

    A cluster whose network carries a measured table (`Tier.measured`, bus bandwidth against
    the nodes a group fills) takes the kind's figure for the group's nodes, interpolated
    log-log and clamped at the table's ends, times per_node / gpus_per_node. Otherwise:

    The network tier's bandwidth is a GPU's share of its node's NICs (nics_per_node x NIC
    bandwidth / gpus_per_node: every GPU of the node is in some group of the same dimension,
    all communicating at once). A ring enters and leaves each node once, so its crossing
    carries what one member sends, and the node's `per_node` members pool their shares: W =
    per_node x share, at most the node's own bandwidth for the ring's hops inside the node.
    With one member per node, or for pairwise exchange and point to point (each GPU sends its
    own bytes off the node), W is the share.
    """
    node, network = cluster.tiers
    if not row.once_per_node:
        return network.bandwidth
    if isinstance(nodes, int) and (table := network.measured_bandwidth(row.kind, nodes)):
        # measured over groups that fill whole nodes: a group with fewer members per node
        # gets their part of the node's NICs
        return table * per_node / cluster.gpus_per_node
    if network.measured and not isinstance(nodes, int):
        raise OpgraphError(f"cluster {cluster.id!r} carries a measured bandwidth table; give "
                           "the group size and stride as numbers")
    pooled = per_node * network.bandwidth
    inside = node.bandwidth * cluster.node_share(per_node)
    if isinstance(per_node, int):
        return network.bandwidth if per_node == 1 else float(min(pooled, inside))
    return sympy.Piecewise((network.bandwidth, sympy.Eq(per_node, 1)),
                           (sympy.Min(pooled, inside), True))


def on_cluster(kind: str, size, group, cluster: Cluster, stride=1) -> sympy.Expr:
    """Time on a cluster as a formula, by the rule `seconds` applies to numbers.

    With a symbolic group size or stride (a parallel degree a sweep varies) the answer is a
    Piecewise: 0 for a group of one, the node's latency and bandwidth while n*stride fits a
    node evenly, the network's bandwidth and NCCL's hierarchical latency otherwise; an
    all-reduce takes the Min of its ring and its tree.
    """
    row = rule(kind)
    if isinstance(group, int) and isinstance(stride, int):  # the size may still be a symbol
        return sympy.Min(*(sympy.Float(latency) + sympy.Float(per_byte) * _sym(size)
                           for latency, per_byte in lines(kind, group, cluster, stride)))
    if row.steps(n) == 0:
        return sympy.Integer(0)
    node, network = cluster.tiers
    g, s, m = _sym(group), _sym(stride), _sym(size)
    gpus = sympy.Integer(cluster.gpus_per_node)
    inside = (sympy.true if cluster.job_gpus is not None  # a job inside one node
              else sympy.And(g * s <= gpus, sympy.Eq(sympy.Mod(gpus, g * s), 0)))

    def fastest(nodes, bandwidth):
        found = [_ring_line(row, g, nodes, node, network, bandwidth)]
        if row.tree:
            found.append(_tree_line(g, nodes, node, network, bandwidth))
        return sympy.Min(*(latency + per_byte * m for latency, per_byte in found))

    per_node = members_per_node(cluster.gpus_per_node, g, s)
    return sympy.Piecewise(
        (0, sympy.Eq(g, 1)),  # a degree of 1 moves nothing, on any tier
        (fastest(sympy.Integer(1), node.bandwidth * cluster.node_share(g)), inside),
        (fastest(g / per_node, _network_bandwidth(row, g / per_node, per_node, cluster)), True))


def lines(kind: str, group_size: int, cluster: Cluster,
          stride: int = 1) -> tuple[tuple[float, float], ...]:
    """Each algorithm NCCL may run for one collective, as (seconds at no message, seconds per
    byte): the kind's own (ring, pairwise, point to point), and for an all-reduce the tree
    too. NCCL's tuner runs the fastest, so a collective takes the least of them (`seconds`);
    a search takes the same minimum over arrays of messages (`opgraph.parallel.search`)."""
    row = rule(kind)
    if group_size == 1 or row.steps(group_size) == 0:
        return ((0.0, 0.0),)  # a group of one, or Megatron's f, moves nothing
    nodes, per_node = cluster.placement(group_size, stride)
    node, network = cluster.tiers
    bandwidth = (_network_bandwidth(row, nodes, per_node, cluster) if nodes > 1
                 else cluster.tier_for(group_size, stride).bandwidth)
    found = [_ring_line(row, group_size, nodes, node, network, bandwidth)]
    if row.tree:
        found.append(_tree_line(group_size, nodes, node, network, bandwidth))
    return tuple((float(latency), float(per_byte)) for latency, per_byte in found)


def seconds(kind: str, size_bytes: float, group_size: int, cluster: Cluster,
            stride: int = 1) -> float:
    """Seconds of one collective on a cluster: the fastest of `lines`, NCCL's latencies and
    the slowest tier's bandwidth.

    `seconds("all-reduce", 2**30, 8, get("dgx-h100"))` is about 4.2 ms, the ring: 6.6 us, 14
    steps of 0.6 us and 1.75 GiB over 450 GB/s. `stride` is how many ranks apart the members
    are (`Cluster.tier_for`).
    """
    return min(latency + per_byte * float(size_bytes)
               for latency, per_byte in lines(kind, group_size, cluster, stride))


def bus_bandwidth(kind: str, algorithm_bandwidth, group=n):
    """NCCL's bus bandwidth from a measured algorithm bandwidth (M / time), as nccl-tests prints.

    The factor is the kind's volume: 2(n-1)/n for all-reduce, (n-1)/n for reduce-scatter,
    all-gather and all-to-all, 1 for send-recv (NCCL's PERFORMANCE.md; nccl-tests' alltoall and
    sendrecv). Bus bandwidth is then comparable with the link's W whatever the group size:
    `bus_bandwidth("all-reduce", 100e9, 8) == 175e9`.
    """
    factor = rule(kind).volume(_sym(group))
    if factor == 0:
        raise OpgraphError(f"{kind} moves no bytes, so it has no bus bandwidth")
    value = factor * _sym(algorithm_bandwidth)
    return float(value) if value.is_number else value
