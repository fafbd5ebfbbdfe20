"""The cluster catalog against its datasheets, the tier rule, and users' own cluster files."""

import json
import math

import pytest

from opgraph.parallel import cluster
from opgraph import hardware
from opgraph.core.errors import OpgraphError
from opgraph.core.limits import CONFIG_MAX_BYTES

GB = 1e9  # GB/s = 1e9 bytes/s
GBIT = 1e9 / 8  # Gb/s = 1e9 bits/s, as NICs are sold: 400 Gb/s = 50e9 bytes/s

# Datasheet figures, per GPU. NVIDIA prints NVLink as the sum of both directions; the catalog stores
# one direction. id: (GPUs per node, NVLink bidirectional GB/s per GPU, NIC Gb/s per GPU)
DATASHEETS = {
    "dgx-a100": (8, 600, 200),  # DGX A100: NVLink 3 600 GB/s, 8 x ConnectX-6 HDR 200 Gb/s
    "dgx-h100": (8, 900, 400),  # DGX H100: NVLink 4 900 GB/s, 8 x ConnectX-7 NDR 400 Gb/s
    "dgx-h200": (8, 900, 400),  # DGX H200: the DGX H100 fabric
    "dgx-b200": (8, 14400 / 8, 400),  # DGX B200: NVLink 5 14.4 TB/s over 8 GPUs, 8 x 400 Gb/s
    "mi300x": (8, 7 * 128, 400),  # MI300X: 7 Infinity Fabric links x 128 GB/s bidirectional
}


@pytest.mark.parametrize("cluster_id", sorted(DATASHEETS))
def test_catalog_stores_datasheet_figures_per_direction(cluster_id):
    gpus, nvlink_bidirectional, nic_gbits = DATASHEETS[cluster_id]
    c = cluster.get(cluster_id)
    node, network = c.tiers
    assert c.gpus_per_node == gpus
    assert node.bandwidth == pytest.approx(nvlink_bidirectional / 2 * GB)
    assert network.bandwidth == pytest.approx(nic_gbits * GBIT)
    assert c.nics == 8  # eight NICs per node of eight: one each (MI300X's is an assumption)
    assert "datasheet" in node.source and "datasheet" in c.source


def test_gb200_nvl72_is_one_nvlink_domain_of_72():
    """GB200 NVL72 (NVIDIA's datasheet): 72 GPUs on NVLink 5 at 1.8 TB/s bidirectional each
    (130 TB/s over the rack); one 400 Gb/s NIC per GPU, assumed as DGX B200's."""
    c = cluster.get("gb200-nvl72")
    node, network = c.tiers
    assert c.gpus_per_node == 72 and c.nics == 72
    assert node.bandwidth == pytest.approx(1800 / 2 * GB)
    assert network.bandwidth == pytest.approx(400 * GBIT)
    assert "datasheet" in node.source and "ASSUMPTION" in network.source


def test_a_job_smaller_than_a_node_sits_in_one_node():
    """64 GPUs of a 72-GPU NVLink domain talk over NVLink although 64 does not divide 72 (the
    rule for groups of a job that fills nodes), and so do 6 GPUs of an 8-GPU DGX; a job larger
    than a node keeps the rule: its data-parallel ring of 144 crosses the network."""
    nvl72, dgx = cluster.get("gb200-nvl72"), cluster.get("dgx-h100")
    assert nvl72.spans_nodes(64) and dgx.spans_nodes(6)  # as groups of a job filling nodes
    assert nvl72.for_job(64).tier_for(64) is nvl72.tiers[0]
    assert dgx.for_job(6).tier_for(6) is dgx.tiers[0]
    assert nvl72.for_job(144) is nvl72 and nvl72.for_job(144).tier_for(144) is nvl72.tiers[1]


@pytest.mark.parametrize("gpus, domain", [(128, 64), (256, 64), (512, 64), (96, 48),
                                           (144, 72), (1152, 72), (72, 72)])
def test_a_job_over_nvl72_racks_takes_segments_of_whole_trays(gpus, domain):
    """A GB200 job larger than one NVL72 rack (18 trays of 4 GPUs) is placed in segments of
    whole trays, the largest count of at most 18 that divides its trays (Slurm's --segment, as
    Megatron-Bridge's launcher picks it): each segment is the NVLink domain its groups see. So
    256 GPUs (64 trays) sit in four segments of 16 trays, and an expert-parallel group of 32
    stays on NVLink, where in 72-GPU nodes it would straddle two."""
    nvl72 = cluster.get("gb200-nvl72")
    trays = gpus // 4
    assert domain == 4 * max(n for n in range(1, 19) if trays % n == 0)
    job = nvl72.for_job(gpus)
    assert job.gpus_per_node == domain and job.nics == domain  # one NIC per GPU still
    assert job.tiers == nvl72.tiers
    inside = domain % 32 == 0
    assert (job.tier_for(32) is nvl72.tiers[0]) == inside
    assert nvl72.spans_nodes(32)  # in whole 72-GPU racks it would cross the network


def test_h800_cluster_is_nvlink_cut_to_400_bidirectional():
    """DeepSeek-V3's H800 nodes (arXiv:2412.19437, sections 3.1-3.2.2): NVLink at 400 GB/s
    bidirectional per GPU (the H100's 900 cut for export), 50 GB/s of InfiniBand per GPU."""
    c = cluster.for_hardware(hardware.get("h800"))
    node, network = c.tiers
    assert c.id == "h800-ib" and c.gpus_per_node == 8
    assert node.bandwidth == pytest.approx(400 / 2 * GB)
    assert network.bandwidth == pytest.approx(50 * GB)


def test_nic_conversion_in_bytes():
    assert cluster.get("dgx-h100").tiers[1].bandwidth == 50e9  # 400 Gb/s / 8 bits
    assert cluster.get("dgx-a100").tiers[1].bandwidth == 25e9  # 200 Gb/s / 8 bits


def test_pcie_tiers_follow_the_pcie_spec():
    # 16 lanes x GT/s x 128/130 encoding / 8 bits per byte, one direction
    assert cluster.get("pcie-gen5").tiers[0].bandwidth == pytest.approx(
        16 * 32e9 * 128 / 130 / 8, rel=2e-3)
    assert cluster.get("pcie-gen4").tiers[0].bandwidth == pytest.approx(
        16 * 16e9 * 128 / 130 / 8, rel=2e-3)


def test_latencies_are_microseconds_and_network_is_slower():
    for c in cluster.catalog().values():
        node, network = c.tiers
        assert 0 < node.latency_s <= network.latency_s < 1e-4
        assert network.bandwidth < node.bandwidth or c.id == "pcie-gen4"
        assert node.source and network.source


def test_every_hardware_part_names_a_cluster_that_exists():
    clusters = cluster.catalog()
    for part in hardware.catalog().values():
        assert part.cluster in clusters, part.id
        assert cluster.for_hardware(part).id == part.cluster
    assert cluster.for_hardware(hardware.get("h100-sxm")).id == "dgx-h100"
    assert cluster.for_hardware(hardware.get("a100-sxm-80gb")).id == "dgx-a100"


def test_a_users_hardware_without_a_cluster(tmp_path):
    path = tmp_path / "gpu.toml"
    path.write_text("bf16_tflops = 100\nbandwidth_tbs = 1\n")
    part = hardware.get(str(path))
    assert part.cluster is None
    with pytest.raises(OpgraphError, match="names no cluster"):
        cluster.for_hardware(part)
    path.write_text('bf16_tflops = 100\nbandwidth_tbs = 1\ncluster = "dgx-h1000"\n')
    with pytest.raises(OpgraphError, match="unknown cluster 'dgx-h1000'"):
        cluster.for_hardware(hardware.get(str(path)))
    path.write_text("bf16_tflops = 100\nbandwidth_tbs = 1\ncluster = 8\n")
    with pytest.raises(OpgraphError, match="must name a cluster"):
        hardware.get(str(path))


# Tier rule: a group of n GPUs s ranks apart covers n*s consecutive ranks (Megatron order: TP
# innermost, then CP, then PP/DP), inside a node of 8 iff n*s <= 8 and 8 is a multiple of n*s.
@pytest.mark.parametrize("n, stride, inside", [
    (1, 1, True), (2, 1, True), (8, 1, True),  # TP up to the node
    (16, 1, False),  # TP 16 spans two nodes
    (2, 4, True),  # CP 2 outside TP 4: ranks r and r+4 share a node
    (4, 2, True), (2, 8, False),  # DP 2 outside TP 8: ranks r and r+8
    (4, 4, False),  # CP 4 outside TP 4 spans 16 ranks
    (3, 1, False),  # groups of 3 straddle nodes of 8 (ranks 6, 7, 8)
    (1, 64, True),  # a group of one never leaves its GPU
])
def test_tier_for_group_size_and_stride(n, stride, inside):
    c = cluster.get("dgx-h100")
    assert c.spans_nodes(n, stride) is not inside
    assert c.tier_for(n, stride) == c.tiers[0 if inside else 1]


def test_mesh_group_uses_only_its_links():
    c = cluster.get("mi300x")
    per_link = 64e9  # 128 GB/s bidirectional per Infinity Fabric link
    for k in (2, 4, 8):  # groups that divide the node (3 would straddle two nodes)
        assert c.tier_for(k, 1).bandwidth == pytest.approx((k - 1) * per_link)
    assert c.tier_for(16, 1) == c.tiers[1]


@pytest.mark.parametrize("n, stride", [(0, 1), (2, 0), (1.5, 1), (True, 1)])
def test_bad_group_is_an_error(n, stride):
    with pytest.raises(OpgraphError, match="whole number"):
        cluster.get("dgx-h100").tier_for(n, stride)


GOOD = """[mine]
gpus_per_node = 4
[mine.node]
gbytes_per_s = 100
latency_us = 1
[mine.network]
gbits_per_s = 100
latency_us = 5
"""


def test_a_users_cluster_file(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(GOOD)
    c = cluster.get(str(path))
    assert (c.id, c.gpus_per_node) == ("mine", 4)
    assert c.tiers[0].bandwidth == 100e9 and c.tiers[1].bandwidth == 12.5e9
    assert c.tiers[0].latency_s == pytest.approx(1e-6)
    assert c.tiers[1].latency_s == pytest.approx(5e-6)
    assert c.tier_for(4, 1) == c.tiers[0] and c.tier_for(8, 1) == c.tiers[1]
    # one cluster may be written without its enclosing table; its id is the file's stem
    bare = tmp_path / "bare.toml"
    bare.write_text(GOOD.replace("[mine]\n", "").replace("mine.", ""))
    assert cluster.get(str(bare)).tiers == c.tiers


@pytest.mark.parametrize("text, message", [
    (GOOD.replace("gpus_per_node = 4", "gpus_per_node = 0"), "gpus_per_node = 0"),
    (GOOD.replace("gpus_per_node = 4", "gpus_per_node = 4.5"), "whole number"),
    (GOOD.replace("gpus_per_node = 4", "gpus_per_node = 5000"), "from 1 to 1024"),
    (GOOD.replace("gpus_per_node = 4\n", ""), "missing gpus_per_node"),
    (GOOD.replace("gbytes_per_s = 100", "gbytes_per_s = -1"), "above 0"),
    (GOOD.replace("gbytes_per_s = 100", "gbytes_per_s = nan"), "above 0"),
    (GOOD.replace("gbytes_per_s = 100", "gbytes_per_s = inf"), "above 0"),
    (GOOD.replace("gbytes_per_s = 100", "gbytes_per_s = true"), "above 0"),
    (GOOD.replace("gbytes_per_s = 100", "gbytes_per_s = '100'"), "above 0"),
    (GOOD.replace("gbytes_per_s = 100", "gbytes_per_s = 1e9"), "at most"),
    (GOOD.replace("gbytes_per_s = 100", "gbytes_per_s = 100\ngbits_per_s = 800"), "not both"),
    (GOOD.replace("gbytes_per_s = 100\n", ""), "gbytes_per_s"),
    (GOOD.replace("latency_us = 5", "latency_us = 0"), "latency_us = 0"),
    (GOOD.replace("latency_us = 5\n", ""), "missing latency_us"),
    (GOOD.replace("latency_us = 1", "latency_us = 1\nlatncy = 2"), "unknown key 'latncy'"),
    (GOOD.replace("gpus_per_node = 4", "gpus_per_node = 4\nnodes = 2"), "unknown key 'nodes'"),
    (GOOD.replace("latency_us = 1", "latency_us = 1\ntopology = 'torus'"), "topology"),
    (GOOD.replace("latency_us = 5", "latency_us = 5\ntopology = 'mesh'"), "must be switch"),
    (GOOD.replace("[mine.network]", "[mine.netwrk]"), "unknown key 'netwrk'"),
    (GOOD + "name = 3\n", "quoted string"),
    (GOOD.replace("gpus_per_node = 4", "gpus_per_node = 4\ngpus_per_tray = 3"), "divides it"),
    (GOOD.replace("gpus_per_node = 4", "gpus_per_node = 4\ngpus_per_tray = 4"), "below"),
    (GOOD.replace("gpus_per_node = 4", "gpus_per_node = 4\ngpus_per_tray = true"), "whole"),
    (GOOD.replace("gpus_per_node = 4", "gpus_per_node = 4\ngpus_per_tray = 2").replace(
        "gbits_per_s = 100", "gbits_per_s = 100\nnics_per_node = 3"), "over the node's 2 trays"),
    ("[mine]\ngpus_per_node = ", "not valid TOML"),
    ("", "defines no cluster"),
    ("mine = 3\n", "must be a table"),
])
def test_bad_cluster_files_give_one_line_errors(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(OpgraphError, match=message) as err:
        cluster.get(str(path))
    assert "\n" not in str(err.value)


def test_missing_huge_and_unknown(tmp_path):
    with pytest.raises(OpgraphError, match="does not exist"):
        cluster.get(str(tmp_path / "none.toml"))
    huge = tmp_path / "huge.toml"
    huge.write_text(GOOD + "#" * CONFIG_MAX_BYTES)
    with pytest.raises(OpgraphError, match="larger than 1,024 KiB"):
        cluster.get(str(huge))
    with pytest.raises(OpgraphError, match=r"unknown cluster 'dgx-h1000' \(did you mean "
                                           r"dgx-h100 or [^)]*\?\); choose one of: dgx-a100"):
        cluster.get("dgx-h1000")
    two = tmp_path / "two.toml"
    two.write_text(GOOD + GOOD.replace("mine", "other"))
    assert set(cluster.load(two)) == {"mine", "other"}
    with pytest.raises(OpgraphError, match="defines 2 entries"):
        cluster.get(str(two))


def test_hardware_clusters_lists_the_catalog(cli):
    from opgraph.parallel import cluster

    code, out, _ = cli("hardware", "--clusters")
    assert code == 0
    for cid in cluster.catalog():
        assert any(line.startswith(cid + " ") for line in out.splitlines()), cid
    code, out, _ = cli("hardware", "--clusters", "--json")
    listed = {c["id"]: c for c in json.loads(out)}
    # the datasheets' figures, per GPU per direction: NVLink 4 is 900 GB/s both ways
    assert listed["dgx-h100"]["tiers"][0]["bandwidth_bytes_per_s"] == 900e9 / 2
    assert listed["dgx-h100"]["tiers"][1]["bandwidth_bytes_per_s"] == 400e9 / 8
    # the NICs that share comes from: DGX H100's 8 x ConnectX-7, AWS p5's 32 x 100 Gb/s EFA
    assert (listed["dgx-h100"]["nics_per_node"], listed["hf-ultrascale-h100"]["nics_per_node"]) \
        == (8, 32)
    # an NVL72 rack is 18 trays of 4 GPUs (DGX GB200 user guide); a DGX is one host
    assert (listed["gb200-nvl72"]["gpus_per_tray"], listed["dgx-h100"]["gpus_per_tray"]) \
        == (4, None)
    # NCCL's ring step under LL, LL128 and Simple (tuning.cc hwLat): NVLink .6/1.9/3.4 us, the
    # network 2.7/4/14; a tier with its own latency (MI300X's) has one for every protocol
    node, network = listed["dgx-h100"]["tiers"]
    assert (node["link"], network["link"]) == ("nvlink", "net")
    assert network["ring_latency_s"] == pytest.approx({"LL": 2.7e-6, "LL128": 4e-6,
                                                       "Simple": 14e-6})
    assert listed["mi300x"]["tiers"][0]["ring_latency_s"] == {"any": 0.6e-6}
    row = next(line for line in cli("hardware", "--clusters")[1].splitlines()
               if line.startswith("dgx-h100 "))
    assert row.split()[3:] == ["0.6/1.9/3.4", "50", "2.7/4/14"]


# The Ultrascale Playbook's median bus bandwidth against node count, 256 MB messages
# (/work/shared/validation/network_playbook.json; HF Ultrascale Playbook, pp_comm_bandwidth.html)
PLAYBOOK_NODES = [1, 2, 4, 8, 16, 32, 64]
PLAYBOOK = {
    "all-reduce": [435.97, 361.75, 160.14, 99.56, 84.74, 64.93, 32.94],
    "all-gather": [249.85, 184.61, 118.97, 69.0, 54.97, 27.97, 11.04],
    "reduce-scatter": [249.73, 181.55, 115.76, 68.55, 54.52, 27.94, 11.07],
}


@pytest.mark.parametrize("kind", sorted(PLAYBOOK))
def test_the_playbook_table_at_and_between_its_points(kind):
    net = cluster.get("hf-ultrascale-h100").tiers[1]
    values = [v * GB for v in PLAYBOOK[kind]]
    for nodes, value in zip(PLAYBOOK_NODES, values):  # at the points: the figures themselves
        assert net.measured_bandwidth(kind, nodes) == pytest.approx(value)
    # between them: a straight line in log(nodes), log(bandwidth)
    for (n0, w0), (n1, w1), nodes in (((2, values[1]), (4, values[2]), 3),
                                      ((16, values[4]), (32, values[5]), 24)):
        t = math.log(nodes / n0) / math.log(n1 / n0)
        assert net.measured_bandwidth(kind, nodes) == pytest.approx(
            math.exp(math.log(w0) + t * (math.log(w1) - math.log(w0))))
        assert min(w0, w1) < net.measured_bandwidth(kind, nodes) < max(w0, w1)
    assert net.measured_bandwidth(kind, 1024) == pytest.approx(values[-1])  # clamped
    assert net.measured_bandwidth("all-to-all", 4) is None  # not measured: the NIC model


def test_the_playbook_figures_are_bus_bandwidth():
    # the argument in cluster.toml: read as algorithm bandwidth, the 1-node all-reduce would be a
    # bus bandwidth of 2(n-1)/n x 436 GB/s, above NVLink 4's 450 GB/s per direction
    c = cluster.get("hf-ultrascale-h100")
    one_node = c.tiers[1].measured_bandwidth("all-reduce", 1)
    assert 2 * 7 / 8 * one_node > c.tiers[0].bandwidth > one_node
    # and the 2-node one above the 3200 Gb/s of EFA a p5 node has (400 GB/s), unless it is bus
    two_nodes, efa = c.tiers[1].measured_bandwidth("all-reduce", 2), c.nics * 100 * GBIT
    assert 2 * 15 / 16 * two_nodes > efa > two_nodes
    assert c.tiers[1].bandwidth == efa / 8  # a GPU's share of the node's 32 EFA NICs


@pytest.mark.parametrize("text, message", [
    ("nodes = [2, 1]\nall-reduce = [1, 2]\n", "ascending"),
    ("nodes = []\nall-reduce = []\n", "ascending"),
    ("nodes = [1, 2]\nall-reduce = [1]\n", "must list 2 bandwidths"),
    ("nodes = [1, 2]\nall-reduce = [1, -2]\n", "above 0"),
    ("nodes = [1, 2]\nall-to-all = [1, 2]\n", "unknown key 'all-to-all'"),
    ("nodes = [1, 2]\n", "give at least one of"),
])
def test_bad_measured_tables(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(GOOD + "[mine.network.measured]\n" + text)
    with pytest.raises(OpgraphError, match=message) as err:
        cluster.get(str(path))
    assert "\n" not in str(err.value)


def test_plan_and_profile_see_a_job_smaller_than_a_node_alike():
    """A 64-GPU FSDP job on a GB200 NVL72 rack: profile's step (its data-parallel ring over
    NVLink, the job inside one 72-GPU domain) and plan's search path for the same layout agree
    to 1e-9, so the search's collectives take the job's view of the cluster too."""
    from opgraph import hardware
    from opgraph.cost.costmodel import cost_model
    from opgraph.parallel.distributed import profile_parallel
    from opgraph.models import preset
    from opgraph.parallel.parallel import Parallel
    from opgraph.parallel.search import Candidate, Searcher

    gb200, calibrated = hardware.get("gb200"), cost_model("calibrated")
    forward = preset("llama3.2-1b")
    layout = Parallel(dp=64, zero=3, micro_batch=1, global_batch=64, framework="megatron")
    profiled = profile_parallel(forward, gb200, layout, values={"S": 2048}, cost=calibrated)
    assert {t.tier for t in profiled.parallel.communication} == {
        cluster.get("gb200-nvl72").tiers[0].name}
    planned = Searcher(forward, gb200, seq_len=2048, cost=calibrated).one(
        Candidate(layout, "none", "bf16")).result
    assert planned.step_time_s == pytest.approx(profiled.parallel.step_time_s, rel=1e-9)
