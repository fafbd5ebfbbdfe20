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
the network between nodes), an all-reduce the faster of NCCL's ring and tree, each under the
fastest of NCCL's protocols (LL, LL128, Simple) where the tiers name their link class, and W the
slowest tier's bandwidth per GPU per direction: NVLink inside a node; across nodes a GPU's
share of its node's NICs, pooled by a ring's members in each node (`_network_bandwidth`), or
a measured table's figure for the nodes spanned; an all-to-all across nodes sends only its
slices for other nodes' GPUs at that W, the rest over the node's links beside them. Sources:
Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in MPICH"
(IJHPCA 2005) for the ring and pairwise-exchange algorithms; NCCL's PERFORMANCE.md
(nccl-tests) for the same factors as its bus-bandwidth convention. docs/collectives.md has the
derivations.

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

import functools

from collections.abc import Callable

import attrs
import sympy

from ..core.errors import OpgraphError
from .cluster import PROTOCOLS, Cluster, Tier, members_per_node

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
    # of the volume, the part that leaves the node, as a function of n and the members per
    # node, where the rest goes to peers in the node over its own links at the same time
    # (`_ring_line`); None: all of it takes the slowest tier
    off_node_volume: Callable[[sympy.Expr, sympy.Expr], sympy.Expr] | None = None


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


def _pairwise_all_to_all_off_node(n, per_node):
    # the slices for the n - per_node peers outside the node; the per_node - 1 others stay in it
    return (n - per_node) / n


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
               _pairwise_all_to_all_inter_steps, backward="all-to-all",
               algorithm="pairwise exchange", off_node_volume=_pairwise_all_to_all_off_node),
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


# NCCL's own cost model (NVIDIA/nccl src/graph/tuning.cc, ncclTopoTuneModel and
# ncclTopoGetAlgoTime; NCCL 2.30.7, commit 5067397): each algorithm and protocol is a line,
# baseLat once per call plus each step at the latency of the hop it takes, then the bytes at
# the protocol's share of the bus bandwidth; the tuner runs the fastest line. Where a cluster's
# tiers name NCCL's class of their hops (`Tier.link`), every protocol is a line of its own:
# LL (lowest latency, half the bandwidth), LL128 and Simple (the full bandwidth, the highest
# latency). A cluster without them has one line per algorithm, its tiers' own latencies at the
# full bandwidth. Left out: NCCL's in-node cap on LL's bandwidth (by GPU generation), the
# per-channel caps on LL128 and tree bandwidth (they need the channel count), its correction of
# trees at medium sizes, and NVLS/CollNet/PAT; point to point (all-to-all, send-recv) is not
# tuned there and keeps one line.
BASE_LATENCY_S = {"ring": (6.6e-6, 14.0e-6, 8.4e-6),  # baseLat[Ring][LL, LL128, Simple]
                  "tree": (6.8e-6, 14.0e-6, 8.4e-6)}  # baseLat[Tree][...]
# a ring's bus bandwidth under each protocol (`busBw * .5` for LL, `* 0.92` for LL128)
RING_SHARE = (0.5, 0.92, 1.0)
# a tree's: 0.92 of the link for all-reduce, then LL x 1/3.8, LL128 x 7/9 in one node and
# 120/128 across nodes; its algorithm bandwidth is half its bus bandwidth (`ratio = .5`), so
# it moves 2M per GPU
TREE_BUS_EFFICIENCY = 0.92
TREE_ALGORITHM_RATIO = 0.5
TREE_SHARE = {False: (1 / 3.8, 7 / 9, 1.0), True: (1 / 3.8, 120 / 128, 1.0)}  # by spanning nodes
# across nodes LL's bus bandwidth is at most llMaxBw: 39 GB/s over two nodes, 20.4 over more
# (x86 Intel hosts; AMD hosts 22.5 and 19.0)
LL_MAX_BANDWIDTH = {2: 39.0e9, 3: 20.4e9}
# across nodes every ring step launches network work: its intra-node latency is at least
# getNetOverhead, 1 us (x86 Intel; 2 us AMD), three times that for Simple
NET_OVERHEAD_S = (1.0e-6, 1.0e-6, 3.0e-6)
# a ring all-reduce across nodes under Simple: latency x 1.4 ("plateau effect of ring",
# compute capability 8.0 and later; 1.9 before)
RING_SIMPLE_PLATEAU = 1.4
SINGLE = "one"  # the protocol of a cluster whose tiers name no link: their own latencies


def _log2i(x):
    """floor(log2 x), NCCL's log2i, for a whole number or a sympy expression."""
    if isinstance(x, int):
        return x.bit_length() - 1
    return sympy.floor(sympy.log(x, 2))


def _index(protocol: str) -> int:
    return 0 if protocol == SINGLE else PROTOCOLS.index(protocol)


def _hop(tier: Tier, algorithm: str, protocol: str):
    return tier.hop_latency(algorithm, "LL" if protocol == SINGLE else protocol)


def _protocols(row: Collective, cluster: Cluster) -> tuple[str, ...]:
    """The protocols NCCL's tuner chooses among for `row` on `cluster` (see above)."""
    if row.once_per_node and all(t.link for t in cluster.tiers):
        return PROTOCOLS
    return (SINGLE,)


def _least(a, b):
    """The smaller of two bandwidths, numbers or sympy expressions."""
    if isinstance(a, sympy.Basic) or isinstance(b, sympy.Basic):
        return sympy.Min(a, b)
    return min(a, b)


def _most(a, b):
    """The larger of two values, numbers or sympy expressions."""
    if isinstance(a, sympy.Basic) or isinstance(b, sympy.Basic):
        return sympy.Max(a, b)
    return max(a, b)


def _one_member(per_node, lone, otherwise):
    """`lone` where a node holds one member of the group, else `otherwise` (`per_node` a
    number or a sympy expression)."""
    if isinstance(per_node, sympy.Basic):
        return sympy.Piecewise((lone, sympy.Eq(per_node, 1)), (otherwise, True))
    return lone if per_node == 1 else otherwise


def _ll_cap(nodes):
    """LL's bus bandwidth across `nodes` nodes (2 or more), NCCL's llMaxBw."""
    if isinstance(nodes, int):
        return LL_MAX_BANDWIDTH[min(nodes, 3)]
    return sympy.Piecewise((LL_MAX_BANDWIDTH[2], sympy.Le(nodes, 2)), (LL_MAX_BANDWIDTH[3], True))


def _ring_line(row: Collective, group, nodes, per_node, node: Tier, network: Tier, bandwidth,
               protocol: str, spans: bool, inside):
    """(seconds at no message, seconds per byte) of the kind's own algorithm (ring, pairwise
    exchange, point to point) under `protocol` over `group` GPUs in `nodes` nodes, `per_node`
    in each (`spans`: more than one node): NCCL's ring latency,
    baseLat + (nsteps - nInterSteps) x intraLat + nInterSteps x interLat, intraLat at least
    the network's launch overhead and interLat the tree's network hop where a node holds one
    member; and the volume over `bandwidth` at the protocol's share. Where the kind sends part
    of its volume to peers in the node (`Collective.off_node_volume`: the pairwise all-to-all,
    NCCL's grouped sends and receives, each over its peer's transport), that part takes the
    node's links at `inside` beside the rest on the network, and the slower of the two sets
    the time. Numbers or sympy expressions alike (`lines`, `on_cluster`)."""
    p = _index(protocol)
    inter = row.inter_steps(group, nodes)
    intra = _hop(node, "ring", protocol)
    crossing = _hop(network, "ring", protocol)
    share = 1.0
    if protocol != SINGLE:
        share = RING_SHARE[p]
        if spans:
            intra = max(intra, NET_OVERHEAD_S[p])
            crossing = _one_member(per_node, _hop(network, "tree", protocol), crossing)
    latency = BASE_LATENCY_S["ring"][p] + (row.steps(group) - inter) * intra + inter * crossing
    if protocol == "Simple" and spans and row.kind == "all-reduce":
        latency = latency * RING_SIMPLE_PLATEAU
    achieved = bandwidth * share
    if protocol == "LL" and spans:
        achieved = _least(achieved, _ll_cap(nodes))
    if spans and row.off_node_volume is not None:
        off = row.off_node_volume(group, per_node)
        return latency, _most(off / achieved, (row.volume(group) - off) / inside)
    return latency, row.volume(group) / achieved


def _tree_line(group, nodes, node: Tier, network: Tier, bandwidth, protocol: str, spans: bool):
    """(seconds at no message, seconds per byte) of NCCL's tree all-reduce under `protocol`: a
    chain through each node's group/nodes GPUs and a double binary tree between nodes, up and
    down, so baseLat + 2 x ((group/nodes - 1) x intraLat + log2i(nodes) x interLat); it moves
    2M per GPU at the protocol's share of 0.92 of the link."""
    p = _index(protocol)
    latency = BASE_LATENCY_S["tree"][p] + 2 * ((group / nodes - 1) * _hop(node, "tree", protocol)
                                               + _log2i(nodes) * _hop(network, "tree", protocol))
    achieved = TREE_ALGORITHM_RATIO * TREE_BUS_EFFICIENCY * bandwidth
    if protocol != SINGLE:
        achieved = achieved * TREE_SHARE[spans][p]
        if protocol == "LL" and spans:
            achieved = _least(achieved, TREE_ALGORITHM_RATIO * _ll_cap(nodes))
    return latency, 1 / achieved


def _lines(row: Collective, group, nodes, per_node, cluster: Cluster, bandwidth, spans: bool):
    """Every (algorithm, protocol) line NCCL's tuner weighs for one collective."""
    node, network = cluster.tiers
    # to the node's other members; a lone member sends nothing there, so any rate serves it
    # (on a mesh its share, of no links, would be 0: 0 bytes over 0 bytes/s)
    inside = node.bandwidth * cluster.node_share(_most(per_node, 2))
    found = []
    for protocol in _protocols(row, cluster):
        found.append(_ring_line(row, group, nodes, per_node, node, network, bandwidth, protocol,
                                spans, inside))
        if row.tree:
            found.append(_tree_line(group, nodes, node, network, bandwidth, protocol, spans))
    return found


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
    node = cluster.tiers[0]
    g, s, m = _sym(group), _sym(stride), _sym(size)
    gpus = sympy.Integer(cluster.gpus_per_node)
    inside = (sympy.true if cluster.job_gpus is not None  # a job inside one node
              else sympy.And(g * s <= gpus, sympy.Eq(sympy.Mod(gpus, g * s), 0)))

    def fastest(nodes, per_node, bandwidth, spans):
        found = _lines(row, g, nodes, per_node, cluster, bandwidth, spans)
        return sympy.Min(*(latency + per_byte * m for latency, per_byte in found))

    per_node = members_per_node(cluster.gpus_per_node, g, s)
    return sympy.Piecewise(
        (0, sympy.Eq(g, 1)),  # a degree of 1 moves nothing, on any tier
        (fastest(sympy.Integer(1), g, node.bandwidth * cluster.node_share(g), False), inside),
        (fastest(g / per_node, per_node,
                 _network_bandwidth(row, g / per_node, per_node, cluster), True), True))


@functools.lru_cache(maxsize=4096)  # a step asks it of every collective: a few distinct
def lines(kind: str, group_size: int, cluster: Cluster,
          stride: int = 1) -> tuple[tuple[float, float], ...]:
    """Each algorithm and protocol NCCL may run for one collective, as (seconds at no message,
    seconds per byte): the kind's own (ring, pairwise, point to point), and for an all-reduce
    the tree too, each under LL, LL128 and Simple where the cluster's tiers name their link
    class (`_protocols`). NCCL's tuner runs the fastest, so a collective takes the least of
    them (`seconds`); a search takes the same minimum over arrays of messages
    (`opgraph.parallel.search`)."""
    row = rule(kind)
    if group_size == 1 or row.steps(group_size) == 0:
        return ((0.0, 0.0),)  # a group of one, or Megatron's f, moves nothing
    nodes, per_node = cluster.placement(group_size, stride)
    bandwidth = (_network_bandwidth(row, nodes, per_node, cluster) if nodes > 1
                 else cluster.tier_for(group_size, stride).bandwidth)
    found = _lines(row, group_size, nodes, per_node, cluster, bandwidth, nodes > 1)
    return tuple((float(latency), float(per_byte)) for latency, per_byte in found)


def seconds(kind: str, size_bytes: float, group_size: int, cluster: Cluster,
            stride: int = 1) -> float:
    """Seconds of one collective on a cluster: the fastest of `lines`, NCCL's latencies and
    the slowest tier's bandwidth.

    `seconds("all-reduce", 2**30, 8, get("dgx-h100"))` is about 4.2 ms, the ring under Simple:
    8.4 us, 14 steps of 3.4 us and 1.75 GiB over 450 GB/s. `stride` is how many ranks apart the
    members are (`Cluster.tier_for`).
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
