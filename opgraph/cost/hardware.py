"""Hardware as data: peak dense BF16 FLOP/s and HBM bandwidth, with a source for each part.

The catalog is `hardware.toml` beside this file; a user's own part is a TOML file of the same
form (one table, or several).

A part may also say how its peak is made (`sms` streaming multiprocessors at `boost_mhz`, the
clock its datasheet's dense peak assumes) and its board power (`tdp_w`). A run whose parts are
power-capped below that (`with_power_limit`: torchtitan's H100s ran at 500 W of 700) sustains a
lower tensor clock, and the calibrated cost model runs its arithmetic at `clock_ratio` x the
peak. The roofline stays the datasheet's ceiling.

Under a cap, DVFS lowers clock and voltage together: dynamic power is C V^2 A f (Rabaey,
*Digital Integrated Circuits*, 1996) and the stable voltage rises about in proportion to the
clock, so power goes as f^3 and a part capped at P of its TDP sustains about (P / TDP)^(1/3)
of its clock. That is the physical assumption here, not a measurement: static (leakage) power
and the voltage floor make the real clock drop somewhat larger.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import attrs

from ..core.datafile import check_keys, load_tables, pick
from ..core.errors import OpgraphError

CATALOG = Path(__file__).parents[1] / "hardware.toml"
_REQUIRED = ("bf16_tflops", "bandwidth_tbs")

# The figures a part may have, in the units its TOML file and the flags use (TFLOP/s, TB/s, GB):
# from a millionth of today's parts to a million times them. Inside these ranges every time,
# share and ceiling of a profile is a finite float (see `opgraph.core.limits`); outside, a figure
# overflows to inf after scaling (1e300 TFLOP/s) or makes times infinite (a denormal 1e-320).
RANGES = {"bf16_tflops": (1e-6, 1e6), "fp8_tflops": (1e-6, 1e6), "bandwidth_tbs": (1e-6, 1e6),
          "memory_gb": (1e-6, 1e9)}
SCALE = {"bf16_tflops": 1e12, "fp8_tflops": 1e12, "bandwidth_tbs": 1e12, "memory_gb": 1e9}
FLAGS = {"bf16_tflops": "--peak-tflops", "bandwidth_tbs": "--bandwidth-tbs"}


def check_figure(key: str, value: float, where: str) -> float:
    """`value` (in `key`'s unit) if it is within `RANGES[key]`, else one line saying the range."""
    lo, hi = RANGES[key]
    if not (math.isfinite(value) and lo <= value <= hi):
        flag = f" (or {FLAGS[key]})" if key in FLAGS else ""
        raise OpgraphError(f"{where}: {key}{flag} = {value!r} is out of range; give a number "
                           f"from {lo:g} to {hi:g}")
    return value


def _in_range(key: str, unit_scale: float):
    """An attrs validator: the field, in its own unit (FLOP/s, bytes/s, bytes), within range."""
    def check(part, attribute, value) -> None:
        if value is None and attribute.default is None:
            return
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise OpgraphError(f"hardware {part.id}: {attribute.name} = {value!r} is not a number")
        check_figure(key, value / unit_scale, f"hardware {part.id}")
    return check


def _counted(key: str):
    """An attrs validator: None, or a positive finite number (an SM count, a clock, a power)."""
    def check(part, attribute, value) -> None:
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int | float) or not (
                math.isfinite(value) and 0 < value < 1e7):
            raise OpgraphError(f"hardware {part.id}: {key} = {value!r} is not a positive number")
    return check


@attrs.frozen
class Hardware:
    """One accelerator: `Hardware("x", "X", peak_flops=989e12, bandwidth=3.35e12)`."""

    id: str
    name: str
    peak_flops: float = attrs.field(validator=_in_range("bf16_tflops", 1e12))  # dense BF16 FLOP/s
    bandwidth: float = attrs.field(validator=_in_range("bandwidth_tbs", 1e12))  # HBM bytes/s
    memory_bytes: float | None = attrs.field(default=None, validator=_in_range("memory_gb", 1e9))
    fp8_flops: float | None = attrs.field(default=None,  # dense FP8 FLOP/s, where the part has it
                                          validator=_in_range("fp8_tflops", 1e12))
    source: str = ""
    cluster: str | None = None  # id of the default cluster in cluster.toml (or a .toml path)
    generation: str | None = None  # its calibrated efficiencies' table in calibration.toml
    sms: int | None = attrs.field(default=None, validator=_counted("sms"))  # SMs (AMD: CUs)
    boost_mhz: float | None = attrs.field(default=None, validator=_counted("boost_mhz"))
    tdp_w: float | None = attrs.field(default=None, validator=_counted("tdp_w"))  # board power
    power_limit_w: float | None = None  # a cap below `tdp_w` (`with_power_limit`); None: none
    clock_mhz: float | None = None  # a sustained clock below `boost_mhz` (`with_clock`)

    @property
    def clock_ratio(self) -> float:
        """The sustained tensor clock over the one the dense peak assumes: (cap / TDP)^(1/3)
        under a power cap (see the module), 1 without one.

            >>> with_power_limit(get("h100-sxm"), 500).clock_ratio  # (500 / 700) ** (1 / 3)
            0.8939...
        """
        ratio = 1.0
        if self.power_limit_w is not None and self.tdp_w is not None:
            ratio = (self.power_limit_w / self.tdp_w) ** (1 / 3)
        if self.clock_mhz is not None and self.boost_mhz is not None:
            ratio = min(ratio, self.clock_mhz / self.boost_mhz)
        return min(1.0, ratio)

    def describe(self) -> str:
        capped = "" if self.power_limit_w is None else f", capped at {self.power_limit_w:g} W"
        capped += "" if self.clock_mhz is None else f", clock {self.clock_mhz:g} MHz"
        return (f"{self.name} ({self.peak_flops / 1e12:g} TFLOP/s BF16 dense, "
                f"{self.bandwidth / 1e12:g} TB/s{capped})")


def with_power_limit(part: Hardware, watts: float) -> Hardware:
    """`part` power-capped at `watts` (`nvidia-smi -pl`): its compute runs at `clock_ratio` of
    the peak's clock under the calibrated cost model. One line if the part has no TDP, or
    `watts` is not above 0 and at most the TDP.

        with_power_limit(get("h100-sxm"), 500)  # torchtitan's H100s
    """
    return _held(part, "power_limit_w", watts, "tdp_w", "W", "its TDP",
                 "a power limit cannot scale its clock; add tdp_w = ... (its board power, W)")


def with_headroom(part: Hardware, gb: float) -> Hardware:
    """`part` with `gb` GB of its memory kept free: a layout fits where its live tensors fit
    in the rest. What live tensors do not count takes memory too: the CUDA context, NCCL's
    buffers, the caching allocator's freed blocks. One line if the part gives no memory, or
    `gb` is not at least 0 and below it.

        with_headroom(get("h100-sxm"), 8).memory_bytes  # 72e9
    """
    if part.memory_bytes is None:
        raise OpgraphError(f"a headroom of {gb:g} GB: {part.id} gives no memory_gb to keep it "
                           "from; add memory_gb = ... to its file")
    if not 0 <= gb * 1e9 < part.memory_bytes:
        raise OpgraphError(f"a headroom of {gb:g} GB leaves nothing of {part.id}'s "
                           f"{part.memory_bytes / 1e9:g} GB; give a number of GB from 0 to "
                           "below it")
    return attrs.evolve(part, memory_bytes=part.memory_bytes - gb * 1e9)


def with_clock(part: Hardware, mhz: float) -> Hardware:
    """`part` with its tensor clock held at `mhz` (`nvidia-smi -lgc`, or a clock measured in
    the run): its compute runs at `mhz / boost_mhz` of the peak under the calibrated cost
    model. One line if the part has no `boost_mhz`, or `mhz` is not above 0 and at most it."""
    return _held(part, "clock_mhz", mhz, "boost_mhz", "MHz", "its boost clock",
                 "a clock cannot scale its peak; add boost_mhz = ... (the clock its dense peak "
                 "assumes)")


def _held(part: Hardware, field: str, value, limit: str, unit: str, what: str,
          missing: str) -> Hardware:
    """`part` with `field` set to `value`, a number above 0 and at most the part's `limit`."""
    most = getattr(part, limit)
    if most is None:
        raise OpgraphError(f"hardware {part.id} has no {limit}, so {missing} to its table")
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and 0 < value <= most):
        raise OpgraphError(f"hardware {part.id}: {field} = {value!r} must be above 0 and at most "
                           f"{what}, {most:g} {unit}")
    return attrs.evolve(part, **{field: float(value)})


def _number(table: dict, key: str, where: str, required: bool = True) -> float | None:
    value = table.get(key)
    if value is None:
        if required:
            raise OpgraphError(f"{where}: missing {key}; give it as a positive number")
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and value > 0):
        raise OpgraphError(f"{where}: {key} = {value!r} is not a positive number")
    return check_figure(key, float(value), where)


def _named(table: dict, key: str, where: str, example: str) -> str | None:
    value = table.get(key)
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise OpgraphError(f"{where}: {key} = {value!r} must name a {key}, such as {example}")
    return value


def _cluster_id(table: dict, where: str) -> str | None:
    return _named(table, "cluster", where, 'cluster = "dgx-h100"')


PART_KEYS = {"name", "source", "cluster", "generation", "bf16_tflops", "fp8_tflops",
             "bandwidth_tbs", "memory_gb", "sms", "boost_mhz", "tdp_w"}


def _positive(table: dict, key: str, where: str) -> float | None:
    """An optional positive number of `table` (an SM count, a clock, a power), or one line."""
    value = table.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                              or not (math.isfinite(value) and 0 < value < 1e7)):
        raise OpgraphError(f"{where}: {key} = {value!r} is not a positive number")
    return value


def _parse(part_id: str, table: dict, where: str) -> Hardware:
    if not isinstance(table, dict):
        raise OpgraphError(f"{where}: [{part_id}] must be a table of fields such as "
                           "bf16_tflops = 989 and bandwidth_tbs = 3.35")
    where = f"{where} [{part_id}]"
    check_keys(table, PART_KEYS, where)
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
        generation=_named(table, "generation", where, 'generation = "hopper"'),
        sms=_positive(table, "sms", where),
        boost_mhz=_positive(table, "boost_mhz", where),
        tdp_w=_positive(table, "tdp_w", where),
    )


def from_table(table: object, where: str) -> Hardware:
    """A part given inline (a case file's `hardware` object): a hardware file's part table with
    its `id` beside the fields (`id` default "inline")."""
    if not isinstance(table, dict):
        raise OpgraphError(f"{where}: give a catalog id or an object with id, bf16_tflops and "
                           "bandwidth_tbs (a hardware file's fields)")
    part_id = table.get("id", "inline")
    if not isinstance(part_id, str) or not part_id.strip():
        raise OpgraphError(f"{where}: id = {part_id!r} must name the part, such as \"my-gpu\"")
    return _parse(part_id, {k: v for k, v in table.items() if k != "id"}, where)


def load(path: str | Path) -> dict[str, Hardware]:
    """Every part in a TOML file: `load("my_gpu.toml")["my-gpu"]`. A file with one part may
    leave out its enclosing table; its id is then the file's stem."""
    tables = load_tables(path, "hardware file", noun="part", example="[my-gpu] with bf16_tflops and "
                         "bandwidth_tbs", is_one=lambda d: all(not isinstance(v, dict)
                                                                for v in d.values()))
    return {pid: _parse(pid, table, str(path)) for pid, table in tables.items()}


def catalog() -> dict[str, Hardware]:
    """The parts that ship with opgraph, by id; the file is read once a process (it ships with
    opgraph; a case file names a catalog entry on every run it holds)."""
    return dict(_catalog())


@functools.cache
def _catalog() -> dict[str, Hardware]:
    return load(CATALOG)


def get(name: str) -> Hardware:
    """A catalog part by id (`get("h100-sxm")`), or the single part in a TOML file's path."""
    return pick(name, load, catalog, "hardware")
