"""Hardware as data: peak dense BF16 FLOP/s and HBM bandwidth, with a source for each part.

The catalog is `hardware.toml` beside this file; a user's own part is a TOML file of the same
form (one table, or several).
"""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

import attrs

from .errors import OpgraphError

CATALOG = Path(__file__).with_name("hardware.toml")
_REQUIRED = ("bf16_tflops", "bandwidth_tbs")


@attrs.frozen
class Hardware:
    """One accelerator: `Hardware("x", "X", peak_flops=989e12, bandwidth=3.35e12)`."""

    id: str
    name: str
    peak_flops: float  # dense BF16 FLOP/s
    bandwidth: float  # HBM bytes/s
    memory_bytes: float | None = None
    fp8_flops: float | None = None  # dense FP8 FLOP/s, where the part has it
    source: str = ""
    cluster: str | None = None  # id of the default cluster in cluster.toml (or a .toml path)

    def describe(self) -> str:
        return (f"{self.name} ({self.peak_flops / 1e12:g} TFLOP/s BF16 dense, "
                f"{self.bandwidth / 1e12:g} TB/s)")


def _number(table: dict, key: str, where: str, required: bool = True) -> float | None:
    value = table.get(key)
    if value is None:
        if required:
            raise OpgraphError(f"{where}: missing {key}; give it as a positive number")
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and value > 0):
        raise OpgraphError(f"{where}: {key} = {value!r} is not a positive number")
    return float(value)


def _cluster_id(table: dict, where: str) -> str | None:
    value = table.get("cluster")
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise OpgraphError(f"{where}: cluster = {value!r} must name a cluster, "
                           'such as cluster = "dgx-h100"')
    return value


def _parse(part_id: str, table: dict, where: str) -> Hardware:
    if not isinstance(table, dict):
        raise OpgraphError(f"{where}: [{part_id}] must be a table of fields such as "
                           "bf16_tflops = 989 and bandwidth_tbs = 3.35")
    where = f"{where} [{part_id}]"
    memory = _number(table, "memory_gb", where, required=False)
    fp8 = _number(table, "fp8_tflops", where, required=False)
    return Hardware(
        id=part_id,
        name=str(table.get("name", part_id)),
        peak_flops=_number(table, "bf16_tflops", where) * 1e12,
        bandwidth=_number(table, "bandwidth_tbs", where) * 1e12,
        memory_bytes=memory * 1e9 if memory else None,
        fp8_flops=fp8 * 1e12 if fp8 else None,
        source=str(table.get("source", "")),
        cluster=_cluster_id(table, where),
    )


def load(path: str | Path) -> dict[str, Hardware]:
    """Every part in a TOML file: `load("my_gpu.toml")["my-gpu"]`."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise OpgraphError(f"hardware file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise OpgraphError(f"cannot read hardware file {path}: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise OpgraphError(f"hardware file {path} is not valid TOML: {e}") from None
    if not data:
        raise OpgraphError(f"hardware file {path} defines no part; add a table like "
                           "[my-gpu] with bf16_tflops and bandwidth_tbs")
    if all(not isinstance(v, dict) for v in data.values()):  # one part, written without a table
        data = {path.stem: data}
    return {pid: _parse(pid, table, str(path)) for pid, table in data.items()}


def catalog() -> dict[str, Hardware]:
    """The parts that ship with opgraph, by id."""
    return load(CATALOG)


def get(name: str) -> Hardware:
    """A catalog part by id (`get("h100-sxm")`), or the single part in a TOML file's path."""
    if name.endswith(".toml") or "/" in name:
        parts = load(name)
        if len(parts) != 1:
            raise OpgraphError(f"hardware file {name} defines {len(parts)} parts; "
                               "keep one table in it")
        return next(iter(parts.values()))
    parts = catalog()
    try:
        return parts[name]
    except KeyError:
        raise OpgraphError(f"unknown hardware {name!r}; choose one of: {', '.join(parts)}, "
                           "or give a .toml file") from None
