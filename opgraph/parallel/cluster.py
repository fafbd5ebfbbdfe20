"""Clusters as data: how many GPUs share a node and how fast the two tiers between them are.

The catalog is `cluster.toml` beside this file; a user's own cluster is a TOML file of the same
form. A cluster has two tiers, each with a bandwidth per GPU per direction and a per-step latency:

- tier 0, `node`: the intra-node fabric (NVLink through NVSwitch, Infinity Fabric, PCIe);
- tier 1, `network`: the scale-out network, `nics_per_node` NICs of the given bandwidth each (one
  NIC per GPU on the DGX machines); its bandwidth per GPU is the node's NICs shared by its GPUs,
  nics_per_node x NIC bandwidth / gpus_per_node, since every GPU of a node is in some group of a
  parallel dimension and those groups communicate at once.

Which tier a group of GPUs talks over follows from where its members sit in rank order. As
Megatron-LM orders ranks, tensor parallelism is innermost (its groups are consecutive ranks), then
context parallelism, then pipeline and data parallelism: a group of `n` GPUs whose members are
`stride` ranks apart (stride = the product of the degrees inside it) covers `n * stride`
consecutive ranks. It stays inside a node iff `n * stride <= gpus_per_node` and the node holds a
whole number of such spans (otherwise some groups straddle two nodes, and a collective is as slow
as its slowest group); any other group crosses the network, the slowest tier it spans. A job
smaller than a node (`Cluster.for_job`) sits in one node, every group inside it. Where a node is
an NVLink domain of hosts (`gpus_per_tray`: a GB200 NVL72 rack of 18 compute trays of 4 GPUs), a
larger job is placed in segments of whole trays, the most trays of one domain that divide the
job's (`Cluster.for_job`): each segment is the node its groups see.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import attrs
import sympy

from ..core.datafile import check_keys, load_tables, pick
from ..core.errors import OpgraphError

CATALOG = Path(__file__).parents[1] / "cluster.toml"
MAX_GPUS_PER_NODE = 1024  # an NVL576 rack is the largest NVLink domain sold
MAX_GBYTES_PER_S = 1e5  # 100 TB/s per GPU per direction: 50x NVLink 5
MAX_LATENCY_US = 1e4  # 10 ms per step would be a broken network, not a slow one

_CLUSTER_KEYS = {"name", "gpus_per_node", "gpus_per_tray", "source", "node", "network"}
_TIER_KEYS = {"name", "gbytes_per_s", "gbits_per_s", "latency_us", "tree_latency_us", "link",
              "topology", "source"}
# NCCL's protocols: LL (8-byte stores, each with its flag), LL128 (128-byte lines, 120 bytes of
# data), Simple (bulk copies behind a fence); and the latency of one hop of each, by NCCL's class
# of the hop (NCCL_HW_NVLINK, NCCL_HW_PCI, NCCL_HW_NET) and algorithm: tuning.cc's hwLatencies,
# NVIDIA/nccl src/graph/tuning.cc, NCCL 2.30.7 (commit 5067397; the same figures since 2.19)
PROTOCOLS = ("LL", "LL128", "Simple")
HOP_LATENCY_S = {
    ("nvlink", "ring"): (0.6e-6, 1.9e-6, 3.4e-6),
    ("nvlink", "tree"): (0.6e-6, 1.25e-6, 4.0e-6),
    ("pci", "ring"): (1.0e-6, 2.5e-6, 5.7e-6),
    ("pci", "tree"): (1.0e-6, 1.9e-6, 4.0e-6),
    ("net", "ring"): (2.7e-6, 4.0e-6, 14.0e-6),
    ("net", "tree"): (5.0e-6, 8.5e-6, 14.0e-6),
}
LINKS = tuple(dict.fromkeys(link for link, _ in HOP_LATENCY_S))
MAX_NICS_PER_NODE = 1024  # an AWS p5 node has 32 EFA NICs; a GB200 NVL72 domain 72
MEASURED_KINDS = ("all-reduce", "all-gather", "reduce-scatter")  # the ring kinds nccl-tests times
MAX_NODES = 1 << 20
TIER_NAMES = ("node", "network")  # tier 0, tier 1
TOPOLOGIES = ("switch", "mesh")


@attrs.frozen
class Tier:
    """One level of the fabric: `Tier("NVLink 4", bandwidth=450e9, latency_s=0.6e-6)`.

    `bandwidth` is bytes/s per GPU per direction; `latency_s` is the alpha of one ring step.
    `topology` is "switch" (every GPU reaches any other at the full bandwidth) or "mesh" (each
    GPU has one direct link to every other in the node, so a group of k GPUs uses k-1 of them).
    `link` is NCCL's class of the hop ("nvlink", "pci", "net"): where both tiers of a cluster
    name one, a collective runs the fastest of NCCL's protocols, each at its own latency from
    NCCL's table (`opgraph.parallel.collectives`), and `latency_s` is that table's ring/LL
    figure; a tier without one has its own latency_s for every protocol.
    """

    name: str
    bandwidth: float
    latency_s: float
    source: str = ""
    topology: str = "switch"
    # NCCL's per-hop latency for its tree algorithm (tuning.cc hwLat, Tree/LL); the ring's
    # latency_s where a file gives none
    tree_latency: float | None = None
    # measured bus bandwidth (bytes/s per GPU per direction) against the nodes a group fills,
    # per collective kind: ((kind, ((nodes, bandwidth), ...)), ...), nodes ascending (`measured`)
    measured: tuple = ()
    measured_source: str = ""
    link: str | None = attrs.field(default=None,
                                   validator=attrs.validators.optional(attrs.validators.in_(LINKS)))

    @property
    def tree_latency_s(self) -> float:
        return self.latency_s if self.tree_latency is None else self.tree_latency

    def hop_latency(self, algorithm: str, protocol: str) -> float:
        """Seconds one hop of `algorithm` ("ring", "tree") takes under NCCL's `protocol`:
        NCCL's figure for the tier's `link`, or the tier's own latency where it names none.

        `Tier("IB", 50e9, 2.7e-6, link="net").hop_latency("ring", "Simple") == 14e-6`
        """
        if self.link is None:
            return self.latency_s if algorithm == "ring" else self.tree_latency_s
        return HOP_LATENCY_S[self.link, algorithm][PROTOCOLS.index(protocol)]

    def measured_bandwidth(self, kind: str, nodes: int) -> float | None:
        """The measured bus bandwidth of `kind` over `nodes` whole nodes, interpolated in
        log-log between the table's points and clamped at its ends; None without a row.

        With all-reduce measured at 2 and 4 nodes, 3 nodes get 2's x (4's / 2's)^log2(1.5).
        """
        points = dict(self.measured).get(kind)
        if not points:
            return None
        if nodes <= points[0][0]:
            return points[0][1]
        for (n0, w0), (n1, w1) in zip(points, points[1:]):
            if nodes <= n1:
                share = math.log(nodes / n0) / math.log(n1 / n0)
                return w0 * (w1 / w0) ** share
        return points[-1][1]


@attrs.frozen
class Cluster:
    """GPUs per node and the tiers that link them, tier 0 first.

    `get("dgx-h100").tier_for(8, 1).bandwidth == 450e9`
    """

    id: str
    name: str
    gpus_per_node: int
    tiers: tuple[Tier, ...] = attrs.field(converter=tuple)
    source: str = ""
    nics_per_node: int | None = None  # None: one NIC per GPU
    # the GPUs of a job smaller than one node (`for_job`): all of it sits in one node
    job_gpus: int | None = None
    # the GPUs of one host where a node is an NVLink domain of several (None: the node is one)
    gpus_per_tray: int | None = None

    def for_job(self, gpus: int) -> Cluster:
        """The cluster as a job of `gpus` GPUs sees it: one that fits in a node runs in one
        node, every group inside it (64 GPUs of a 72-GPU NVLink domain talk over NVLink, though
        64 does not divide 72); a larger job is placed in whole nodes, as the module says.

        Where a node is a domain of trays (`gpus_per_tray`), a larger job takes segments of
        whole trays: the most trays of one domain that divide the job's, as Slurm's
        `--segment` places a job on NVL72 racks and Megatron-Bridge's launcher asks for it
        (`scripts/performance/utils/executors.py`: with 4 GPUs a node, the largest segment of
        at most 18 nodes that divides the job's). Each segment is then a node of the job:
        256 GB200s are 64 trays, in segments of 16, so 64 GPUs share an NVLink domain.

            >>> get("gb200-nvl72").for_job(256).gpus_per_node
            64
        """
        if gpus < self.gpus_per_node:
            return attrs.evolve(self, job_gpus=gpus)
        tray = self.gpus_per_tray
        if tray is None or gpus % tray:
            return self
        trays, most = gpus // tray, self.gpus_per_node // tray
        segment = max(n for n in range(1, most + 1) if trays % n == 0)
        if segment == most:
            return self
        nics = self.nics_per_node
        return attrs.evolve(self, gpus_per_node=segment * tray,
                            nics_per_node=None if nics is None else nics * segment // most)

    @property
    def nics(self) -> int:
        """The NICs in a node: `nics_per_node`, one per GPU where a file gives none."""
        return self.gpus_per_node if self.nics_per_node is None else self.nics_per_node

    def spans_nodes(self, group_size: int, stride: int = 1) -> bool:
        """Whether a group of `group_size` GPUs, `stride` ranks apart, leaves a node."""
        _check_group(group_size, stride)
        if group_size == 1 or self.job_gpus is not None:
            return False
        span = group_size * stride
        return span > self.gpus_per_node or self.gpus_per_node % span != 0

    def placement(self, group_size: int, stride: int = 1) -> tuple[int, int]:
        """(nodes, members per node) of a group of `group_size` GPUs `stride` ranks apart.

        `get("dgx-h100").placement(16, 1) == (2, 8)`: DP 16 with no TP fills two nodes;
        `placement(4, 8) == (4, 1)`: DP 4 outside TP 8 has one member in each of four nodes.
        A group whose members do not fill its nodes evenly (groups of 3 in nodes of 8, ranks 6,
        7, 8) counts as one member per node: its slowest placement.
        """
        if not self.spans_nodes(group_size, stride):
            return 1, group_size
        per_node = members_per_node(self.gpus_per_node, group_size, stride)
        return group_size // per_node, per_node

    def tier_for(self, group_size: int, stride: int = 1) -> Tier:
        """The slowest tier a group spans, with the bandwidth the group can use of it.

        `get("dgx-h100").tier_for(2, 8)` is the network: two GPUs eight ranks apart sit in two
        nodes. On a mesh node a group of k GPUs has k-1 of the node's gpus_per_node-1 links.
        """
        if self.spans_nodes(group_size, stride):
            return self.tiers[1]
        tier = self.tiers[0]
        if tier.topology == "mesh" and group_size > 1:
            return attrs.evolve(tier, bandwidth=float(tier.bandwidth * self.node_share(group_size)),
                                name=f"{tier.name}: {group_size - 1} of "
                                     f"{self.gpus_per_node - 1} links")
        return tier

    def node_share(self, group_size):
        """The fraction of tier 0's bandwidth a group of that many GPUs in one node can use.

        1 through a switch; (k-1)/(gpus_per_node-1) on a mesh, where each GPU has one link to
        each other GPU of the node and a group of k reaches only k-1 of them. `group_size` may
        be a sympy expression: `get("mi300x").node_share(t) == (t - 1)/7`.
        """
        if self.tiers[0].topology != "mesh":
            return 1
        return (group_size - 1) / sympy.Integer(self.gpus_per_node - 1)

    def describe(self) -> str:
        node, net = self.tiers
        return (f"{self.name}: {self.gpus_per_node} GPUs per node, "
                f"{node.bandwidth / 1e9:g} GB/s per GPU per direction in a node, "
                f"{net.bandwidth / 1e9:g} GB/s across nodes")


def members_per_node(gpus_per_node: int, group_size, stride):
    """Members of a group that spans nodes in each of its nodes: `gpus_per_node / stride` where
    the stride divides the node and that many members divide the group, else 1. Numbers give
    an int; a symbolic group size or stride gives a Piecewise (`collectives.on_cluster`)."""
    if isinstance(group_size, int) and isinstance(stride, int):
        fits = stride < gpus_per_node and gpus_per_node % stride == 0 and group_size % (
            gpus_per_node // stride) == 0
        return gpus_per_node // stride if fits else 1
    gpus, n, s = sympy.Integer(gpus_per_node), sympy.sympify(group_size), sympy.sympify(stride)
    fits = sympy.And(s < gpus, sympy.Eq(sympy.Mod(gpus, s), 0),
                     sympy.Eq(sympy.Mod(n, gpus / s), 0))
    return sympy.Piecewise((gpus / s, fits), (1, True))


def _check_group(group_size: int, stride: int) -> None:
    for label, value in (("group size", group_size), ("stride", stride)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise OpgraphError(f"{label} {value!r} must be a whole number of GPUs, 1 or more")


def _positive(table: dict, key: str, where: str, top: float) -> float:
    value = table[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and 0 < value <= top):
        raise OpgraphError(f"{where}: {key} = {value!r} must be a number above 0 and at most "
                           f"{top:g}")
    return float(value)


def _text(table: dict, key: str, where: str, default: str) -> str:
    value = table.get(key, default)
    if not isinstance(value, str):
        raise OpgraphError(f"{where}: {key} = {value!r} must be a quoted string")
    return value


def _parse_tier(table: object, where: str, role: str) -> Tier:
    if not isinstance(table, dict):
        raise OpgraphError(f"{where} must be a table with gbytes_per_s (or gbits_per_s) and "
                           "latency_us")
    check_keys(table, _TIER_KEYS, where)
    given = [k for k in ("gbytes_per_s", "gbits_per_s") if k in table]
    if len(given) != 1:
        raise OpgraphError(f"{where}: give the bandwidth per GPU per direction once, as "
                           "gbytes_per_s (GB/s) or gbits_per_s (Gb/s)"
                           + (", not both" if given else ""))
    if given[0] == "gbytes_per_s":
        bandwidth = _positive(table, "gbytes_per_s", where, MAX_GBYTES_PER_S) * 1e9
    else:
        bandwidth = _positive(table, "gbits_per_s", where, MAX_GBYTES_PER_S * 8) * 1e9 / 8
    link = table.get("link")
    if link is not None and link not in LINKS:
        raise OpgraphError(f"{where}: link = {link!r}; choose one of: {', '.join(LINKS)} "
                           "(NCCL's class of the hop)")
    latencies = [k for k in ("latency_us", "tree_latency_us") if k in table]
    if link is not None and latencies:
        raise OpgraphError(f"{where}: give link (NCCL's latencies for that class of hop) or "
                           f"{latencies[0]}, not both")
    if link is None and "latency_us" not in table:
        raise OpgraphError(f"{where}: missing latency_us, the time of one ring step in "
                           "microseconds, or link, NCCL's class of the hop ("
                           f"{', '.join(LINKS)})")
    if link is not None:  # NCCL's ring/LL and tree/LL figures, for reports
        table = {**table, "latency_us": HOP_LATENCY_S[link, "ring"][0] * 1e6,
                 "tree_latency_us": HOP_LATENCY_S[link, "tree"][0] * 1e6}
    topology = _text(table, "topology", where, "switch")
    if topology not in TOPOLOGIES:
        raise OpgraphError(f"{where}: topology = {topology!r}; choose one of: "
                           f"{', '.join(TOPOLOGIES)}")
    return Tier(name=_text(table, "name", where, role),
                bandwidth=bandwidth,
                latency_s=_positive(table, "latency_us", where, MAX_LATENCY_US) * 1e-6,
                source=_text(table, "source", where, ""), topology=topology,
                tree_latency=(_positive(table, "tree_latency_us", where, MAX_LATENCY_US) * 1e-6
                              if "tree_latency_us" in table else None),
                link=link)


def _parse_measured(table: object, where: str) -> tuple[tuple, str]:
    """[id.network.measured]: `nodes` ascending and, per kind of MEASURED_KINDS, as many bus
    bandwidths in GB/s (per GPU per direction), with a source."""
    if not isinstance(table, dict):
        raise OpgraphError(f"{where} must be a table with nodes = [...] and a list of GB/s per "
                           f"kind ({', '.join(MEASURED_KINDS)})")
    check_keys(table, {"nodes", "source", *MEASURED_KINDS}, where)
    nodes = table.get("nodes")
    if (not isinstance(nodes, list) or not nodes
            or any(isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_NODES
                   for v in nodes)
            or any(a >= b for a, b in zip(nodes, nodes[1:]))):
        raise OpgraphError(f"{where}: nodes = {nodes!r} must be a list of whole numbers of "
                           "nodes, ascending, e.g. [1, 2, 4, 8]")
    rows = []
    for kind in MEASURED_KINDS:
        if kind not in table:
            continue
        values = table[kind]
        if not isinstance(values, list) or len(values) != len(nodes):
            raise OpgraphError(f"{where}: {kind} must list {len(nodes)} bandwidths in GB/s, "
                               "one per entry of nodes")
        points = tuple((count, _positive({kind: v}, kind, where, MAX_GBYTES_PER_S) * 1e9)
                       for count, v in zip(nodes, values))
        rows.append((kind, points))
    if not rows:
        raise OpgraphError(f"{where}: give at least one of {', '.join(MEASURED_KINDS)}")
    return tuple(rows), _text(table, "source", where, "")


def _parse(cluster_id: str, table: object, where: str) -> Cluster:
    if not isinstance(table, dict):
        raise OpgraphError(f"{where}: [{cluster_id}] must be a table with gpus_per_node, "
                           f"[{cluster_id}.node] and [{cluster_id}.network]")
    where = f"{where} [{cluster_id}]"
    check_keys(table, _CLUSTER_KEYS, where)
    for key in ("gpus_per_node", *TIER_NAMES):
        if key not in table:
            raise OpgraphError(f"{where}: missing {key}; a cluster needs gpus_per_node and the "
                               "tables node and network")
    gpus = table["gpus_per_node"]
    if isinstance(gpus, bool) or not isinstance(gpus, int) or not 1 <= gpus <= MAX_GPUS_PER_NODE:
        raise OpgraphError(f"{where}: gpus_per_node = {gpus!r} must be a whole number from 1 "
                           f"to {MAX_GPUS_PER_NODE}")
    tray = table.get("gpus_per_tray")
    if tray is not None and (isinstance(tray, bool) or not isinstance(tray, int) or tray < 1
                             or tray >= gpus or gpus % tray):
        raise OpgraphError(f"{where}: gpus_per_tray = {tray!r} must be a whole number below "
                           f"gpus_per_node ({gpus}) that divides it (the GPUs of one host of "
                           "the NVLink domain); leave it out where a node is one host")
    tables = {name: table[name] for name in TIER_NAMES}
    nics, measured = None, None
    if isinstance(tables["network"], dict):  # the NICs and the table are the network's
        nics = tables["network"].get("nics_per_node")
        measured = tables["network"].get("measured")
        tables["network"] = {k: v for k, v in tables["network"].items()
                             if k not in ("nics_per_node", "measured")}
    if nics is not None and (isinstance(nics, bool) or not isinstance(nics, int)
                             or not 1 <= nics <= MAX_NICS_PER_NODE):
        raise OpgraphError(f"{where[:-1]}.network]: nics_per_node = {nics!r} must be a whole "
                           f"number from 1 to {MAX_NICS_PER_NODE}")
    if tray is not None and nics is not None and nics % (gpus // tray):
        raise OpgraphError(f"{where[:-1]}.network]: nics_per_node = {nics} must divide evenly "
                           f"over the node's {gpus // tray} trays of {tray} GPUs")
    tiers = tuple(_parse_tier(tables[name], f"{where[:-1]}.{name}]", name) for name in TIER_NAMES)
    if nics is not None:  # the network's bandwidth is per NIC: share the node's NICs per GPU
        tiers = (tiers[0], attrs.evolve(tiers[1], bandwidth=tiers[1].bandwidth * nics / gpus))
    if measured is not None:
        rows, source = _parse_measured(measured, f"{where[:-1]}.network.measured]")
        tiers = (tiers[0], attrs.evolve(tiers[1], measured=rows, measured_source=source))
    if tiers[0].topology == "mesh" and gpus < 2:
        raise OpgraphError(f"{where}: a mesh node needs 2 or more GPUs")
    if tiers[1].topology != "switch":
        raise OpgraphError(f"{where[:-1]}.network]: topology must be switch; a mesh describes "
                           "the links inside one node")
    return Cluster(id=cluster_id, name=_text(table, "name", where, cluster_id), gpus_per_node=gpus,
                   tiers=tiers, source=_text(table, "source", where, ""), nics_per_node=nics,
                   gpus_per_tray=tray)


def from_table(table: object, where: str) -> Cluster:
    """A cluster given inline (a case file's `cluster` object): a cluster file's table with its
    `id` beside gpus_per_node, node and network (`id` default "inline")."""
    if not isinstance(table, dict):
        raise OpgraphError(f"{where}: give a catalog id or an object with id, gpus_per_node, "
                           "node and network (a cluster file's fields)")
    cluster_id = table.get("id", "inline")
    if not isinstance(cluster_id, str) or not cluster_id.strip():
        raise OpgraphError(f"{where}: id = {cluster_id!r} must name the cluster, such as "
                           '"my-cluster"')
    return _parse(cluster_id, {k: v for k, v in table.items() if k != "id"}, where)


def load(path: str | Path) -> dict[str, Cluster]:
    """Every cluster in a TOML file: `load("my_cluster.toml")["my-cluster"]`.

    A file with a single cluster may leave out the enclosing table: then its keys are
    gpus_per_node, [node] and [network], and its id is the file's stem.
    """
    tables = load_tables(path, "cluster file", noun="cluster", example="[my-cluster] with gpus_per_node, "
                         "[my-cluster.node] and [my-cluster.network]",
                         is_one=lambda d: "gpus_per_node" in d)
    return {cid: _parse(cid, table, str(path)) for cid, table in tables.items()}


def catalog() -> dict[str, Cluster]:
    """The clusters that ship with opgraph, by id; the file is read once a process (it ships with
    opgraph; a case file names a catalog entry on every run it holds)."""
    return dict(_catalog())


@functools.cache
def _catalog() -> dict[str, Cluster]:
    return load(CATALOG)


def get(name_or_path: str) -> Cluster:
    """A catalog cluster by id (`get("dgx-h100")`), or the single cluster in a TOML file."""
    return pick(name_or_path, load, catalog, "cluster")


def for_hardware(part) -> Cluster:
    """The default cluster a hardware part names: `for_hardware(hardware.get("h200"))`."""
    if not part.cluster:
        raise OpgraphError(f"hardware {part.id!r} names no cluster; add cluster = \"dgx-h100\" "
                           "(or another catalog id) to its table, or give the cluster")
    return get(part.cluster)
