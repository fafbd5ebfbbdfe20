"""Collectives: the alpha-beta cost of each, as sympy formulas and as seconds on a cluster.

A collective runs over a group of `n` GPUs. `M` is the buffer each GPU holds, in bytes: the input
of an all-reduce, reduce-scatter or all-to-all, the gathered OUTPUT of an all-gather (as NCCL and
nccl-tests size it), the message of a send/recv. Each kind has one row in `COLLECTIVES`:

- `volume(n)`: the bytes each GPU sends (and receives) over its link, as a fraction of M, for the
  bandwidth-optimal algorithm NCCL uses on large buffers (ring; pairwise exchange for all-to-all);
- `steps(n)`: the latency steps of that algorithm, each costing the tier's alpha;
- `backward`: the kind its vector-Jacobian product runs, for `derive_backward`.

Time = steps(n) * alpha + volume(n) * M / W, with alpha (s per step) and W (bytes/s per GPU per
direction) from the slowest tier the group spans (`Cluster.tier_for`). Sources: Thakur,
Rabenseifner & Gropp, "Optimization of Collective Communication Operations in MPICH" (IJHPCA
2005) for the ring and pairwise-exchange algorithms; NCCL's PERFORMANCE.md (nccl-tests) for the
same factors as its bus-bandwidth convention. docs/collectives.md has the derivations.

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

from .cluster import Cluster, Tier
from .errors import OpgraphError

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
    backward: str
    algorithm: str  # what the factors assume, for docs and reports


def _ring_all_reduce_volume(n):
    # reduce-scatter then all-gather, each passing n-1 chunks of M/n around the ring
    return 2 * (n - 1) / n


def _ring_all_reduce_steps(n):
    return 2 * (n - 1)


def _ring_half_volume(n):
    # reduce-scatter or all-gather: n-1 chunks of M/n each
    return (n - 1) / n


def _ring_half_steps(n):
    return n - 1


def _pairwise_all_to_all_volume(n):
    # each GPU keeps its own 1/n of M and sends the other n-1 slices to their owners
    return (n - 1) / n


def _pairwise_all_to_all_steps(n):
    return n - 1


def _send_recv_volume(n):
    return sympy.Integer(1)


def _send_recv_steps(n):
    return sympy.Integer(1)


def _free(n):
    return sympy.Integer(0)


COLLECTIVES: dict[str, Collective] = {c.kind: c for c in (
    Collective("all-reduce", _ring_all_reduce_volume, _ring_all_reduce_steps,
               backward="identity", algorithm="ring (reduce-scatter + all-gather)"),
    Collective("reduce-scatter", _ring_half_volume, _ring_half_steps,
               backward="all-gather", algorithm="ring"),
    Collective("all-gather", _ring_half_volume, _ring_half_steps,
               backward="reduce-scatter", algorithm="ring"),
    Collective("all-to-all", _pairwise_all_to_all_volume, _pairwise_all_to_all_steps,
               backward="all-to-all", algorithm="pairwise exchange"),
    Collective("send-recv", _send_recv_volume, _send_recv_steps,
               backward="send-recv", algorithm="point to point"),
    Collective("identity", _free, _free,
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


def seconds_on(kind: str, size_bytes: float, group_size: int, tier: Tier) -> float:
    """Seconds on a given tier: `seconds_on("send-recv", 1e9, 2, tier)`."""
    return float(time(kind, size_bytes, group_size, tier.latency_s, tier.bandwidth))


def on_cluster(kind: str, size, group, cluster: Cluster, stride=1) -> sympy.Expr:
    """Time on a cluster as a formula, the tier chosen by `Cluster.tier_for`'s rule.

    With a symbolic group size or stride (a parallel degree a sweep varies) the answer is a
    Piecewise: 0 for a group of one, the node's alpha and bandwidth while n*stride fits a node
    evenly, the network's otherwise. `on_cluster("all-gather", M, t, get("dgx-h100"))` is
    NVLink's (t-1)*0.6e-6 + (t-1)/t*M/450e9 where (t <= 8) & Eq(Mod(8, t), 0), then the
    network's.
    """
    if isinstance(group, int) and isinstance(stride, int):
        tier = cluster.tier_for(group, stride)
        return time(kind, size, group, tier.latency_s, tier.bandwidth)
    node, network = cluster.tiers
    span = _sym(group) * _sym(stride)
    gpus = sympy.Integer(cluster.gpus_per_node)
    inside = sympy.And(span <= gpus, sympy.Eq(sympy.Mod(gpus, span), 0))
    node_bandwidth = node.bandwidth * cluster.node_share(_sym(group))
    return sympy.Piecewise(
        (0, sympy.Eq(_sym(group), 1)),  # a degree of 1 moves nothing, on any tier
        (time(kind, size, group, node.latency_s, node_bandwidth), inside),
        (time(kind, size, group, network.latency_s, network.bandwidth), True))


def seconds(kind: str, size_bytes: float, group_size: int, cluster: Cluster,
            stride: int = 1) -> float:
    """Seconds of one collective on a cluster, limited by the slowest tier the group spans.

    `seconds("all-reduce", 2**30, 8, get("dgx-h100"))` is about 4.2 ms: 14 steps of 0.6 us and
    1.75 GiB over 450 GB/s. `stride` is how many ranks apart the members are (`Cluster.tier_for`).
    """
    if group_size == 1:
        return 0.0  # a group of one moves nothing
    row, tier = rule(kind), cluster.tier_for(group_size, stride)  # numbers: no sympy here
    return (float(row.steps(group_size)) * tier.latency_s
            + float(row.volume(group_size)) * float(size_bytes) / tier.bandwidth)


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
