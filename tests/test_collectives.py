"""Collective costs as formulas: bytes per GPU, latency steps, time on a tier, backward pairs."""

import math
import re
from pathlib import Path

import attrs
import pytest
import sympy

from opgraph.parallel import collectives as col
from opgraph.parallel.cluster import Tier, catalog, get
from opgraph.core.errors import OpgraphError

n, M, alpha, W = col.n, col.M, col.alpha, col.W

# Ring all-reduce (reduce-scatter + all-gather), ring reduce-scatter / all-gather, pairwise
# all-to-all, point to point: Thakur, Rabenseifner & Gropp 2005; NCCL PERFORMANCE.md.
# kind: (bytes each GPU sends, latency steps, backward kind)
EXPECTED = {
    "all-reduce": (2 * (n - 1) / n * M, 2 * (n - 1), "identity"),
    "reduce-scatter": ((n - 1) / n * M, n - 1, "all-gather"),
    "all-gather": ((n - 1) / n * M, n - 1, "reduce-scatter"),
    "all-to-all": ((n - 1) / n * M, n - 1, "all-to-all"),
    "send-recv": (M, 1, "send-recv"),
    "identity": (0, 0, "all-reduce"),
}


def test_every_kind_has_a_row_and_an_expectation():
    assert set(col.COLLECTIVES) == set(EXPECTED)
    for kind, row in col.COLLECTIVES.items():
        assert row.kind == kind
        for fn in (row.volume, row.steps):  # named rules, so tracebacks point at them
            assert fn.__name__ != "<lambda>"


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_bytes_and_steps_as_formulas(kind):
    volume, steps, _ = EXPECTED[kind]
    assert sympy.simplify(col.bytes_per_gpu(kind) - volume) == 0
    assert sympy.simplify(col.steps(kind) - steps) == 0
    assert sympy.simplify(col.time(kind) - (steps * alpha + volume / W)) == 0


def test_formulas_keep_any_group_size_and_buffer():
    t, B, D = sympy.symbols("t B D", positive=True, integer=True)
    buffer = 2 * B * D  # a BF16 activation of B x D elements
    ar = col.bytes_per_gpu("all-reduce", buffer, t)
    assert sympy.simplify(ar - 2 * (t - 1) / t * 2 * B * D) == 0
    # all-reduce = reduce-scatter + all-gather, in bytes and in steps
    rs_ag = col.bytes_per_gpu("reduce-scatter", buffer, t) + col.bytes_per_gpu(
        "all-gather", buffer, t)
    assert sympy.simplify(ar - rs_ag) == 0
    assert sympy.simplify(col.steps("all-reduce", t) - 2 * col.steps("all-gather", t)) == 0
    assert col.bytes_per_gpu("all-gather", buffer, 1) == 0  # a group of one moves nothing


def test_time_on_a_hand_picked_tier():
    tier = Tier("test link", bandwidth=100e9, latency_s=5e-6)
    size = 1e9
    assert col.seconds_on("all-reduce", size, 4, tier) == pytest.approx(
        6 * 5e-6 + 2 * 3 / 4 * size / 100e9)
    assert col.seconds_on("all-gather", size, 4, tier) == pytest.approx(
        3 * 5e-6 + 3 / 4 * size / 100e9)
    assert col.seconds_on("send-recv", size, 2, tier) == pytest.approx(5e-6 + size / 100e9)
    assert col.seconds_on("identity", size, 4, tier) == 0
    # the formula with the tier's numbers substituted is the same number
    formula = col.time("all-to-all").subs({n: 4, M: size, alpha: 5e-6, W: 100e9})
    assert float(formula) == pytest.approx(col.seconds_on("all-to-all", size, 4, tier))


# NCCL's cost model (NVIDIA/nccl src/graph/tuning.cc, ncclTopoTuneModel), Ring algorithm, LL
# protocol: baseLat 6.6 us once per call, hwLat 0.6 us per NVLink step and 2.7 us per network step
BASE, NVL, NET = 6.6e-6, 0.6e-6, 2.7e-6


def one_line(cluster):
    """`cluster` with tiers that name no NCCL link class, each at its LL latency: one line per
    algorithm (the tests below up to the protocols' own check the algorithms with it)."""
    return attrs.evolve(cluster, tiers=tuple(attrs.evolve(t, link=None) for t in cluster.tiers))


def h100():
    return one_line(get("dgx-h100"))


def test_seconds_use_the_tier_the_group_spans():
    c = h100()
    nvlink, ib = 450e9, 400e9 / 8  # DGX H100: 900 GB/s NVLink both ways, 400 Gb/s NDR per GPU
    size = 2.0**30
    # TP 8: ranks 0..7, inside one node. NCCL's base latency is the only change from the plain
    # alpha-beta ring: 6.6 us on 4.2 ms
    assert col.seconds("all-reduce", size, 8, c) == pytest.approx(
        BASE + 14 * NVL + 2 * 7 / 8 * size / nvlink)
    # DP 2 outside TP 8: ranks r and r+8 sit in two nodes; both ring steps cross the network
    assert col.seconds("all-reduce", size, 2, c, stride=8) == pytest.approx(
        BASE + 2 * NET + 2 * 1 / 2 * size / ib)
    assert col.seconds("reduce-scatter", size, 1, c) == 0.0
    assert col.seconds("identity", size, 8, c) == 0.0  # Megatron's f: nothing, not even a call


@pytest.mark.parametrize("kind, n, nodes, steps, inter", [
    # NCCL's nsteps and nInterSteps: all-reduce 2(n-1) steps, 2(nodes-1) of them between nodes;
    # all-gather and reduce-scatter n-1, nodes-1 of them between nodes
    ("all-reduce", 16, 2, 2 * 15, 2 * 1),
    ("all-gather", 16, 2, 15, 1),
    ("reduce-scatter", 64, 8, 63, 7),
    # pairwise all-to-all: a step per peer, n - n/nodes of them in other nodes
    ("all-to-all", 16, 2, 15, 8),
])
def test_ring_latency_counts_each_hop_at_its_own_tier(kind, n, nodes, steps, inter):
    c = h100()
    assert c.placement(n, 1) == (nodes, n // nodes)
    (latency, _), *_ = col.lines(kind, n, c)  # the ring (or pairwise) line comes first
    assert latency == pytest.approx(BASE + (steps - inter) * NVL + inter * NET)


# NCCL's tree all-reduce (tuning.cc): baseLat[Tree][LL] 6.8 us, hwLat Tree/LL 0.6 us per NVLink
# hop and 5.0 us per network hop; latency baseLat + 2((n/nodes - 1) intraLat + log2i(nodes)
# interLat); bus bandwidth 0.92 of the link, algorithm bandwidth half of that
TREE_BASE, TREE_NET = 6.8e-6, 5.0e-6


@pytest.mark.parametrize("n, stride, nodes, per_node, bandwidth", [
    (16, 1, 2, 8, 8 * 50e9),  # eight members per node pool their NIC shares (8 x 400 Gb/s)
    (1536, 1, 192, 8, 8 * 50e9),  # log2i(192) = 7
    (192, 8, 192, 1, 50e9),  # DP 192 outside TP 8: one GPU per node, no chain in the node
    (8, 1, 1, 8, 450e9),  # inside a node the tree is a chain: never faster than the ring
])
def test_tree_all_reduce_line(n, stride, nodes, per_node, bandwidth):
    c = h100()
    ring, tree = col.lines("all-reduce", n, c, stride)
    latency = TREE_BASE + 2 * ((per_node - 1) * NVL + math.floor(math.log2(nodes)) * TREE_NET)
    assert tree == pytest.approx((latency, 2 / (0.92 * bandwidth)))
    assert ring[1] == pytest.approx(2 * (n - 1) / n / bandwidth)
    for size in (0.0, 1e6, 1e9):  # NCCL's tuner runs the faster of the two
        assert col.seconds("all-reduce", size, n, c, stride) == pytest.approx(
            min(ring[0] + ring[1] * size, latency + 2 * size / (0.92 * bandwidth)))
    assert len(col.lines("all-gather", n, c, stride)) == 1  # the ring alone, as NCCL's


@pytest.mark.parametrize("kind, n, stride, bandwidth", [
    # DGX H100: 8 ConnectX-7 NICs of 400 Gb/s (50 GB/s) per node of 8, NVLink 4 450 GB/s inside
    ("all-gather", 16, 1, min(8 * 50e9, 450e9)),  # DP 16: a ring through two full nodes
    ("reduce-scatter", 8, 4, 2 * 50e9),  # DP 8 outside TP 4: two members per node
    ("all-reduce", 4, 8, 50e9),  # DP 4 outside TP 8: one member per node, its own share
    ("all-to-all", 16, 8, 50e9),  # pairwise, EP 16 outside TP 8: every peer in another node
    ("send-recv", 2, 8, 50e9),
])
def test_a_ring_across_nodes_pools_its_members_nic_shares(kind, n, stride, bandwidth):
    c = h100()
    (latency, per_byte), *_ = col.lines(kind, n, c, stride)
    assert per_byte == pytest.approx(float(col.rule(kind).volume(n)) / bandwidth)


@pytest.mark.parametrize("n, stride, per_node", [(16, 1, 8), (32, 1, 8), (16, 2, 4), (64, 4, 2)])
def test_an_all_to_all_across_nodes_sends_only_its_off_node_slices_over_the_network(
        n, stride, per_node):
    # NCCL's all-to-all is a group of sends and receives, one to each peer over its own
    # transport: of the n - 1 slices of M/n a GPU sends, the n - per_node for peers in other
    # nodes leave through its share of the NICs (DGX H100: 50 GB/s), the per_node - 1 others
    # take NVLink (450 GB/s) at the same time; the slower sets the time
    c = h100()
    (_, per_byte), = col.lines("all-to-all", n, c, stride)
    assert per_byte == pytest.approx(max((n - per_node) / n / 50e9, (per_node - 1) / n / 450e9))
    assert per_byte < (n - 1) / n / 50e9  # less than all of it at the network's rate
    # the formula a sweep reads agrees, the degree a symbol
    e = sympy.Symbol("e", positive=True, integer=True)
    formula = col.on_cluster("all-to-all", M, e, c, stride)
    assert float(formula.subs({e: n, M: 1e9})) == pytest.approx(
        col.seconds("all-to-all", 1e9, n, c, stride))


def test_an_all_to_all_on_a_mesh_node_sends_to_its_peers_over_their_links():
    # MI300X: 7 links of 64 GB/s each way, one to each other GPU of the node: a group of 4
    # per node reaches 3 of them, 3/7 of the GPU's 448 GB/s
    c = get("mi300x")
    node, net = c.tiers
    (_, per_byte), = col.lines("all-to-all", 16, c, 2)
    inside = node.bandwidth * 3 / 7
    assert per_byte == pytest.approx(max(12 / 16 / net.bandwidth, 3 / 16 / inside))
    # one member a node uses none of the node's links (a share of 0/7): all of it leaves
    (_, per_byte), = col.lines("all-to-all", 4, c, 8)
    assert per_byte == pytest.approx(3 / 4 / net.bandwidth)
    e = sympy.Symbol("e", positive=True, integer=True)
    for n, stride in ((4, 8), (16, 2)):
        formula = col.on_cluster("all-to-all", M, e, c, stride)
        assert float(formula.subs({e: n, M: 1e9})) == pytest.approx(
            col.seconds("all-to-all", 1e9, n, c, stride))


def test_nics_per_node_sets_a_gpus_share(tmp_path):
    # an AWS p5-like node: 32 EFA NICs of 100 Gb/s for 8 GPUs, 400 Gb/s (50 GB/s) per GPU
    path = tmp_path / "efa.toml"
    path.write_text("gpus_per_node = 8\n[node]\ngbytes_per_s = 450\nlatency_us = 0.6\n"
                    "[network]\nnics_per_node = 32\ngbits_per_s = 100\nlatency_us = 2.7\n")
    c = get(str(path))
    assert (c.nics, c.tiers[1].bandwidth) == (32, 32 * 100e9 / 8 / 8)
    (_, per_byte), *_ = col.lines("all-gather", 16, c)
    assert per_byte == pytest.approx(15 / 16 / (8 * 50e9))
    for bad in ("0", "true", "2.5", "2000"):
        path.write_text(path.read_text().replace("nics_per_node = 32", f"nics_per_node = {bad}"))
        with pytest.raises(OpgraphError, match="nics_per_node = .* must be a whole number"):
            get(str(path))
        path.write_text(path.read_text().replace(f"nics_per_node = {bad}", "nics_per_node = 32"))


def test_a_large_all_reduce_in_a_node_runs_the_ring():
    # 8 x H100, 1 GiB: the ring's 1.75 GiB over 450 GB/s beats the tree's 2 GiB over 0.92 of it;
    # the only change from the flat alpha-beta model is NCCL's base latency, 6.6 us of 4.2 ms
    c, size = h100(), 2.0**30
    assert col.seconds("all-reduce", size, 8, c) == pytest.approx(
        col.seconds_on("all-reduce", size, 8, c.tiers[0]) + BASE)


def test_a_thousand_rank_ring_pays_the_network_once_per_node():
    # ZeRO-3 over 1,536 GPUs (Narayanan et al. 2021, Table 2's ZeRO-3 runs): 192 nodes of 8.
    # The flat model charged every one of the 1,535 steps the network's 2.7 us (4.1 ms per
    # all-gather); NCCL's charges 191 of them the network's and the rest NVLink's 0.6 us.
    c = h100()
    latency = col.seconds("all-gather", 0.0, 1536, c)
    assert latency == pytest.approx(BASE + (1535 - 191) * NVL + 191 * NET)
    assert latency < 1535 * NET / 3
    # an all-reduce's latency grows with log2 of the nodes (the tree), not with the ranks
    assert col.seconds("all-reduce", 0.0, 1536, c) == pytest.approx(
        TREE_BASE + 2 * (7 * NVL + 7 * TREE_NET))
    # doubling the ranks adds one level to the tree between nodes (log2i(384) = 8), up and down
    assert col.seconds("all-reduce", 0.0, 3072, c) - col.seconds(
        "all-reduce", 0.0, 1536, c) == pytest.approx(2 * TREE_NET)


def test_a_published_measurement_is_slower_than_the_model():
    # The scaling book (GPU chapter): 8 x H100 all-reduce bus bandwidth tops out near 370 GB/s,
    # for ~10 GB buffers. The roofline must be a ceiling no real run beats.
    size = 10e9
    measured = size / (370e9 / (2 * 7 / 8))  # algorithm bandwidth = bus bandwidth / 2(n-1)/n
    assert col.seconds("all-reduce", size, 8, h100()) < measured


# NCCL's protocols (tuning.cc, NCCL 2.30.7), where a cluster's tiers name their link class:
# baseLat LL / LL128 / Simple, ring 6.6 / 14 / 8.4 us, tree 6.8 / 14 / 8.4; hwLat ring NVLink
# .6 / 1.9 / 3.4, NET 2.7 / 4.0 / 14; tree NVLink .6 / 1.25 / 4.0, NET 5.0 / 8.5 / 14; bus
# bandwidth LL x .5 (across nodes at most llMaxBw, 39 GB/s over two nodes, 20.4 over more),
# LL128 x .92; across nodes a ring step in a node costs at least 1 / 1 / 3 us (net overhead)
RING_BASE, TREE_BASE3 = (6.6e-6, 14e-6, 8.4e-6), (6.8e-6, 14e-6, 8.4e-6)
RING_NVL, RING_NET = (0.6e-6, 1.9e-6, 3.4e-6), (2.7e-6, 4.0e-6, 14e-6)
TREE_NVL, TREE_NET3 = (0.6e-6, 1.25e-6, 4.0e-6), (5.0e-6, 8.5e-6, 14e-6)


def test_protocol_lines_inside_a_node():
    c, w = get("dgx-h100"), 450e9
    share = (0.5, 0.92, 1.0)
    expected = [(RING_BASE[p] + 7 * RING_NVL[p], 7 / 8 / (share[p] * w)) for p in range(3)]
    assert col.lines("all-gather", 8, c) == pytest.approx(expected)
    # the tuner's choice: LL for a kilobyte (latency), Simple for a gigabyte (bandwidth)
    for size, chosen in ((1e3, 0), (1e9, 2)):
        latency, per_byte = expected[chosen]
        assert col.seconds("all-gather", size, 8, c) == pytest.approx(latency + per_byte * size)
    # the tiers' own numbers: LL's, for reports
    assert (c.tiers[0].latency_s, c.tiers[1].latency_s) == (0.6e-6, 2.7e-6)


def test_protocol_lines_across_nodes():
    c = get("dgx-h100")
    w = min(8 * 50e9, 450e9)  # a ring through whole nodes: eight members pool their NICs
    # reduce-scatter over 64 GPUs in 8 nodes: 56 steps inside nodes (at least the overhead),
    # 7 between them
    steps_in = tuple(max(hop, floor) for hop, floor in zip(RING_NVL, (1e-6, 1e-6, 3e-6)))
    assert col.lines("reduce-scatter", 64, c) == pytest.approx([
        (RING_BASE[0] + 56 * steps_in[0] + 7 * RING_NET[0], 63 / 64 / 20.4e9),  # LL at its cap
        (RING_BASE[1] + 56 * steps_in[1] + 7 * RING_NET[1], 63 / 64 / (0.92 * w)),
        (RING_BASE[2] + 56 * steps_in[2] + 7 * RING_NET[2], 63 / 64 / w)])
    # one member per node (DP 4 outside TP 8): every hop crosses at the tree's network latency
    assert col.lines("all-gather", 4, c, stride=8) == pytest.approx([
        (RING_BASE[0] + 3 * TREE_NET3[0], 3 / 4 / min(0.5 * 50e9, 20.4e9)),
        (RING_BASE[1] + 3 * TREE_NET3[1], 3 / 4 / (0.92 * 50e9)),
        (RING_BASE[2] + 3 * TREE_NET3[2], 3 / 4 / 50e9)])
    # an all-reduce over two nodes: ring and tree under each protocol; Simple's ring latency
    # x 1.4 across nodes; the tree at .92 of the link, then LL / 3.8 (at most half of 39 GB/s)
    # and LL128 x 120/128, its algorithm bandwidth half its bus bandwidth
    tree_w = 0.5 * 0.92 * w
    assert col.lines("all-reduce", 16, c) == pytest.approx([
        (RING_BASE[0] + 28 * steps_in[0] + 2 * RING_NET[0], 2 * 15 / 16 / 39e9),
        (TREE_BASE3[0] + 2 * (7 * TREE_NVL[0] + TREE_NET3[0]), 1 / min(tree_w / 3.8, 39e9 / 2)),
        (RING_BASE[1] + 28 * steps_in[1] + 2 * RING_NET[1], 2 * 15 / 16 / (0.92 * w)),
        (TREE_BASE3[1] + 2 * (7 * TREE_NVL[1] + TREE_NET3[1]), 1 / (tree_w * 120 / 128)),
        (1.4 * (RING_BASE[2] + 28 * steps_in[2] + 2 * RING_NET[2]), 2 * 15 / 16 / w),
        (TREE_BASE3[2] + 2 * (7 * TREE_NVL[2] + TREE_NET3[2]), 1 / tree_w)])
    # point to point is not tuned by protocol: one line, LL's latency at the full bandwidth
    assert col.lines("send-recv", 2, c, stride=8) == pytest.approx([(BASE + NET, 1 / 50e9)])


def test_the_roofline_takes_the_envelope_of_nccls_lines():
    """The roofline's collective is a ceiling: LL's latency with Simple's bandwidth, which no
    line NCCL may run has both of; the calibrated model keeps NCCL's lines."""
    from opgraph import hardware
    from opgraph.cost.costmodel import CostModel, cost_model

    c, part = get("dgx-h100"), hardware.get("h100-sxm")
    # DP 48 outside TP 8: one GPU in each of 48 nodes, every ring step at the tree's network hop
    ((latency, per_byte),) = CostModel().comm_lines("reduce_scatter", 48, c, 8, part)
    assert latency == pytest.approx(RING_BASE[0] + 47 * TREE_NET3[0])
    assert per_byte == pytest.approx(47 / 48 / 50e9)
    for size in (1e3, 1e6, 2e8, 1e10):  # below NCCL's fastest line at every size
        assert latency + per_byte * size < col.seconds("reduce-scatter", size, 48, c, 8)
    # a 192 MB bucket (48 M FP32 gradients): the full bandwidth and 0.24 ms, where NCCL's
    # Simple line pays 14 us a step, 0.67 ms
    bucket = 48e6 * 4
    assert latency + per_byte * bucket == pytest.approx(
        RING_BASE[0] + 47 * TREE_NET3[0] + bucket * 47 / 48 / 50e9)
    assert col.seconds("reduce-scatter", bucket, 48, c, 8) == pytest.approx(
        RING_BASE[2] + 47 * TREE_NET3[2] + bucket * 47 / 48 / 50e9)
    calibrated = cost_model("calibrated")
    assert len(calibrated.comm_lines("reduce_scatter", 48, c, 8, part)) == 3  # LL, LL128, Simple
    # a cluster's measured table (the playbook's median runs) is not a ceiling: the roofline
    # takes the datasheet, 32 x 100 Gb/s EFA a node pooled by a group's 8 members there
    # (400 GB/s), where NCCL's lines take the median all-gather over 4 nodes, 118.97 GB/s
    hf = get("hf-ultrascale-h100")
    ((_, per_byte),) = CostModel().comm_lines("all_gather", 32, hf, 1, part)
    assert per_byte == pytest.approx(31 / 32 / 400e9)
    assert min(b for _, b in col.lines("all-gather", 32, hf)) == pytest.approx(31 / 32 / 118.97e9)


def test_protocols_in_formulas_match_the_numbers():
    t, d = (sympy.Symbol(x, positive=True, integer=True) for x in "td")
    c = get("dgx-h100")
    for kind in ("all-gather", "all-reduce", "reduce-scatter"):
        formula = col.on_cluster(kind, M, t, c, stride=d)
        for tv, dv in ((2, 4), (8, 1), (3, 8), (16, 1), (4, 8), (64, 2), (512, 1)):
            for size in (1e3, 1e6, 1e9):
                assert float(formula.subs({t: tv, d: dv, M: size})) == pytest.approx(
                    col.seconds(kind, size, tv, c, stride=dv))


def test_a_tier_names_a_link_or_its_own_latency(tmp_path):
    path = tmp_path / "c.toml"
    base = ("gpus_per_node = 8\n[node]\ngbytes_per_s = 450\n{node}\n"
            "[network]\ngbits_per_s = 400\n{net}\n")
    path.write_text(base.format(node='link = "nvlink"', net='link = "net"'))
    assert [t.link for t in get(str(path)).tiers] == ["nvlink", "net"]
    for node, net, message in (
            ('link = "nvlink"', 'link = "net"\nlatency_us = 3',
             "give link .* or latency_us, not both"),
            ('link = "ethernet"', 'link = "net"',
             "link = 'ethernet'; choose one of: nvlink, pci, net")):
        path.write_text(base.format(node=node, net=net))
        with pytest.raises(OpgraphError, match=message):
            get(str(path))
    path.write_text(base.format(node="", net='link = "net"'))
    with pytest.raises(OpgraphError, match="missing latency_us, .* or link"):
        get(str(path))


def test_backward_pairs_are_involutions():
    for kind, (_, _, expected) in EXPECTED.items():
        assert col.backward(kind) == expected
        assert col.backward(col.backward(kind)) == kind
    # Megatron's f (identity forward, all-reduce backward) and g (all-reduce forward, identity
    # backward) move the same bytes over a forward and backward pass
    fwd_bwd = {k: col.bytes_per_gpu(k) + col.bytes_per_gpu(col.backward(k)) for k in EXPECTED}
    assert sympy.simplify(fwd_bwd["identity"] - fwd_bwd["all-reduce"]) == 0


# nccl-tests' bus bandwidth factors (NCCL PERFORMANCE.md; alltoall.cu and sendrecv.cu)
BUS_FACTORS = {
    "all-reduce": 2 * (n - 1) / n,
    "reduce-scatter": (n - 1) / n,
    "all-gather": (n - 1) / n,
    "all-to-all": (n - 1) / n,
    "send-recv": 1,
}


@pytest.mark.parametrize("kind", sorted(BUS_FACTORS))
def test_bus_bandwidth_factors(kind):
    algbw = sympy.Symbol("algbw", positive=True)
    assert sympy.simplify(col.bus_bandwidth(kind, algbw) - BUS_FACTORS[kind] * algbw) == 0
    # with no latency, the model's algorithm bandwidth M / time has bus bandwidth W: the link
    busbw = col.bus_bandwidth(kind, M / col.time(kind, latency=0))
    assert sympy.simplify(busbw - W) == 0


def test_bus_bandwidth_numbers():
    assert col.bus_bandwidth("all-reduce", 100e9, 8) == pytest.approx(175e9)
    assert col.bus_bandwidth("all-gather", 100e9, 4) == pytest.approx(75e9)
    with pytest.raises(OpgraphError, match="no bus bandwidth"):
        col.bus_bandwidth("identity", 100e9, 8)


def test_unknown_kind():
    with pytest.raises(OpgraphError, match="unknown collective 'allreduce'; choose one of"):
        col.time("allreduce")


DOC = Path(__file__).resolve().parents[1] / "docs" / "collectives.md"


def test_the_docs_code_runs_and_its_toml_loads(tmp_path):
    text = DOC.read_text()
    for i, code in enumerate(re.findall(r"```python\n(.*?)```", text, re.DOTALL)):
        exec(compile(code, f"{DOC.name} block {i + 1}", "exec"), {})  # noqa: S102 our own doc
    (toml,) = re.findall(r"```toml\n(.*?)```", text, re.DOTALL)
    path = tmp_path / "my_cluster.toml"
    path.write_text(toml)
    assert get(str(path)).tiers[1].bandwidth == 100e9  # 800 Gb/s


def test_the_docs_catalog_table_lists_every_cluster():
    section = DOC.read_text().split("## The catalog")[1].split("\n## ")[0]
    rows = {line.split("|")[1].strip(): line for line in section.splitlines()
            if line.startswith("| ") and "GB/s" in line}
    assert set(rows) == set(catalog())
    for cid, c in catalog().items():
        node, network = c.tiers
        assert f"| {c.gpus_per_node} |" in rows[cid]
        assert f"{node.bandwidth / 1e9:g} GB/s" in rows[cid]
        assert f"{network.bandwidth / 1e9:g} GB/s" in rows[cid]


def test_on_cluster_with_a_symbolic_degree_picks_the_tier_per_value():
    t = sympy.Symbol("t", positive=True, integer=True)  # a TP degree a sweep varies
    c = h100()
    formula = col.on_cluster("all-gather", M, t, c)
    assert isinstance(formula, sympy.Piecewise)
    nvlink = BASE + (t - 1) * NVL + (t - 1) / t * M / 450e9
    ib_flat = BASE + (t - 1) * NET + (t - 1) / t * M / 50e9  # groups of 3 straddle: every hop
    # 16 fill two nodes: 14 NVLink hops, 1 network hop, 8 members pooling 8 NICs of 50 GB/s
    ib_two_nodes = BASE + (t - 2) * NVL + NET + (t - 1) / t * M / 400e9
    for value, expected in ((2, nvlink), (8, nvlink), (3, ib_flat), (16, ib_two_nodes)):
        assert float(sympy.simplify(formula.subs(t, value) - expected.subs(t, value)).subs(
            M, 1e9)) == pytest.approx(0, abs=1e-12)
    # a stride symbol too: DP of degree t outside TP 4 stays in the node only for t <= 2
    d = sympy.Symbol("d", positive=True, integer=True)
    dp = col.on_cluster("all-reduce", 2**30, t, c, stride=d)
    for tv, dv in ((2, 4), (4, 2), (2, 8), (4, 4), (8, 2), (3, 8), (16, 2), (16, 1)):
        assert float(dp.subs({t: tv, d: dv})) == pytest.approx(
            col.seconds("all-reduce", 2**30, tv, c, stride=dv))
    # a fixed group with a symbolic buffer: NCCL's lines as a formula in M
    for kind, group in (("all-gather", 8), ("all-reduce", 64), ("send-recv", 2)):
        fixed = col.on_cluster(kind, M, group, c, 8 if kind == "send-recv" else 1)
        for size in (0.0, 1e6, 1e9):
            assert float(fixed.subs(M, size)) == pytest.approx(
                col.seconds(kind, size, group, c, 8 if kind == "send-recv" else 1))
    # lambdify (as sweeps do) gives the same numbers
    f = sympy.lambdify([t], col.on_cluster("all-reduce", 2**30, t, c))
    for tv in (2, 3, 4, 8, 16, 64):
        assert f(tv) == pytest.approx(col.seconds("all-reduce", 2**30, tv, c))


def test_mesh_bandwidth_in_formulas_and_numbers():
    t = sympy.Symbol("t", positive=True, integer=True)
    c = get("mi300x")
    assert sympy.simplify(c.node_share(t) - (t - 1) / 7) == 0
    link = 64e9  # one Infinity Fabric link, one direction
    assert col.on_cluster("all-reduce", 1e9, t, c).subs(t, 1) == 0  # degree 1: no traffic
    for k in (2, 4, 8):
        expected = BASE + 2 * (k - 1) * 0.6e-6 + 2 * (k - 1) / k * 1e9 / ((k - 1) * link)
        assert col.seconds("all-reduce", 1e9, k, c) == pytest.approx(expected)
        assert float(col.on_cluster("all-reduce", 1e9, t, c).subs(t, k)) == pytest.approx(
            expected)
        assert isinstance(c.tier_for(k, 1).bandwidth, float)


def test_a_measured_table_sets_the_network_bandwidth_by_nodes():
    c = one_line(get("hf-ultrascale-h100"))
    net = c.tiers[1]
    # DP 16, no TP: two full nodes at the playbook's 2-node all-reduce, 361.75 GB/s bus
    (_, ring), (_, tree) = col.lines("all-reduce", 16, c)
    assert ring == pytest.approx(2 * 15 / 16 / 361.75e9)
    assert tree == pytest.approx(2 / (0.92 * 361.75e9))
    # DP 8 outside TP 4: 2 members in each of 4 nodes get 2/8 of the 4-node figure
    (_, per_byte), = col.lines("all-gather", 8, c, stride=4)
    assert per_byte == pytest.approx(7 / 8 / (118.97e9 * 2 / 8))
    # 3 nodes of 8: between the 2- and 4-node figures, log-log
    (_, per_byte), = col.lines("reduce-scatter", 24, c)
    assert per_byte == pytest.approx(23 / 24 / net.measured_bandwidth("reduce-scatter", 3))
    # all-to-all is not in the table: a GPU's share of the 32 x 100 Gb/s EFA NICs for the
    # slices to the 8 peers in the other node, NVLink for the 7 in its own
    (_, per_byte), = col.lines("all-to-all", 16, c)
    assert per_byte == pytest.approx(8 / 16 / 50e9)
    # inside a node the datasheet's NVLink, not the table's 1-node column
    assert col.lines("all-gather", 8, c)[0][1] == pytest.approx(7 / 8 / 450e9)
    with pytest.raises(OpgraphError, match="measured bandwidth table"):
        col.on_cluster("all-reduce", M, sympy.Symbol("t", positive=True, integer=True), c)
