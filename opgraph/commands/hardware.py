"""`opgraph hardware`: the hardware catalog (or a user's TOML file), every figure dense."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .args import json_text

if TYPE_CHECKING:
    from ..cost.hardware import Hardware


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "hardware", help="list the hardware catalog: dense peaks, bandwidth, memory, source",
        description="Each part's dense BF16 (and FP8) peak, memory bandwidth and capacity, "
                    "with the datasheet it comes from. Sparse (2:4) figures are not used.")
    p.add_argument("file", nargs="?", metavar="FILE.toml",
                   help="list the parts in your own TOML file instead (the catalog's format)")
    p.add_argument("--clusters", action="store_true",
                   help="list the cluster catalog (or the clusters in FILE.toml) instead: GPUs "
                        "per node, each tier's bandwidth per GPU per direction and latency")
    p.add_argument("--json", action="store_true", help="print one JSON list")
    p.set_defaults(func=run)


def part_json(part: Hardware) -> dict:
    """One part as `--json` lists it: FLOP/s, bytes/s and bytes, as plain numbers."""
    return {"id": part.id, "name": part.name, "bf16_flops_dense": part.peak_flops,
            "fp8_flops_dense": part.fp8_flops, "bandwidth_bytes_per_s": part.bandwidth,
            "memory_bytes": part.memory_bytes, "source": part.source}


def _num(value: float | None, scale: float, fmt: str) -> str:
    return "-" if value is None else format(value / scale, fmt)


def format_catalog(parts: list[Hardware]) -> str:
    """The `opgraph hardware` table, one row per part, then each part's source."""
    lines = [(f"{'id':<14} {'name':<30} {'BF16 TFLOP/s':>12} {'FP8 TFLOP/s':>11} "
              f"{'memory TB/s':>11} {'GB':>5}"),
             f"{'':<14} {'':<30} {'dense':>12} {'dense':>11}"]
    for p in parts:
        lines.append(f"{p.id:<14} {p.name:<30} {_num(p.peak_flops, 1e12, 'g'):>12} "
                     f"{_num(p.fp8_flops, 1e12, 'g'):>11} {_num(p.bandwidth, 1e12, 'g'):>11} "
                     f"{_num(p.memory_bytes, 1e9, 'g'):>5}")
    lines += ["", "sources:"] + [f"  {p.id}: {p.source or '(none given)'}" for p in parts]
    return "\n".join(lines)


def cluster_json(c) -> dict:
    """One cluster as `--clusters --json` lists it: bytes/s per GPU per direction, seconds."""
    return {"id": c.id, "name": c.name, "gpus_per_node": c.gpus_per_node, "source": c.source,
            "nics_per_node": c.nics, "gpus_per_tray": c.gpus_per_tray,
            "tiers": [{"name": t.name, "bandwidth_bytes_per_s": t.bandwidth,
                       "latency_s": t.latency_s, "link": t.link,
                       "ring_latency_s": _ring_latencies(t), "topology": t.topology,
                       "source": t.source}
                      for t in c.tiers]}


def _ring_latencies(tier) -> dict[str, float]:
    """A ring step's latency under each of NCCL's protocols, where the tier names its link
    class; its own one latency otherwise."""
    from ..parallel.cluster import PROTOCOLS

    if tier.link is None:
        return {"any": tier.latency_s}
    return {p: tier.hop_latency("ring", p) for p in PROTOCOLS}


def _latencies_us(tier) -> str:
    return "/".join(f"{v * 1e6:g}" for v in _ring_latencies(tier).values())


def format_clusters(found: list) -> str:
    """The `opgraph hardware --clusters` table, then each cluster's source."""
    w = max([10, *(len(c.id) for c in found)])
    lines = [f"{'id':<{w}} {'GPUs/node':>9} {'node GB/s':>9} {'ring step us':>13} "
             f"{'network GB/s':>12} {'ring step us':>13}"]
    for c in found:
        node, net = c.tiers
        lines.append(f"{c.id:<{w}} {c.gpus_per_node:>9} {node.bandwidth / 1e9:>9g} "
                     f"{_latencies_us(node):>13} {net.bandwidth / 1e9:>12g} "
                     f"{_latencies_us(net):>13}")
    lines += ["", "GB/s per GPU, each way; a ring step's latency under NCCL's protocols,",
              "LL/LL128/Simple (one figure: the tier's own, for every protocol)"]
    lines += [f"{c.id}: a node of {c.gpus_per_node // c.gpus_per_tray} trays of "
              f"{c.gpus_per_tray} GPUs; a larger job runs in segments of whole trays"
              for c in found if c.gpus_per_tray]
    lines += ["", "sources:"] + [f"  {c.id}: {c.source or '(none given)'}" for c in found]
    return "\n".join(lines)


def run(args) -> int:
    if args.clusters:
        from ..parallel import cluster

        found = list((cluster.load(args.file) if args.file else cluster.catalog()).values())
        print(json_text([cluster_json(c) for c in found]) if args.json
              else format_clusters(found))
        return 0
    from ..cost import hardware as hw

    parts = list((hw.load(args.file) if args.file else hw.catalog()).values())
    if args.json:
        print(json_text([part_json(p) for p in parts]))
    else:
        print(format_catalog(parts))
    return 0
