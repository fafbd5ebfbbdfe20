"""The result of `evaluate`: per-op rows, per-category totals and the step's figures."""

from __future__ import annotations

import attrs

from ..core.categories import CATEGORIES  # noqa: F401 - the one vocabulary, re-exported here

# An attention library (`core.choices.ATTENTION_LIBRARIES`) as a report names its kernels
LIBRARY_NAMES = {"flash": "FlashAttention-2", "cudnn": "cuDNN",
                 "triton": "Triton FlashAttention", "flash1": "FlashAttention 1"}
from .hardware import Hardware
from .memory import Memory


@attrs.frozen
class OpCost:
    """One op's share of the step; `flops`, `bytes` and `time_s` include its repetitions."""

    name: str
    kind: str
    category: str
    phase: str
    count: int
    flops: float
    bytes: float
    time_s: float
    bound: str  # "compute" or "memory"

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOPs per HBM byte."""
        return self.flops / self.bytes if self.bytes else float("inf")


@attrs.frozen
class CategoryCost:
    name: str
    time_s: float
    time_share: float
    flops: float
    flop_share: float
    bytes: float
    bound: str  # where most of the category's time goes


@attrs.frozen
class Profile:
    model: str
    hardware: Hardware
    values: dict  # dimension name -> value used
    parameters: int
    mfu_parameters: int  # the parameters the MFU convention counts (all but input embeddings)
    tokens: int
    ops: tuple[OpCost, ...]
    categories: tuple[CategoryCost, ...]
    step_time_s: float
    flops: float
    bytes: float
    mfu_ceiling: float  # 6 x mfu_parameters x tokens / (step time x peak)
    hfu_ceiling: float  # every counted FLOP / (step time x peak)
    fused_attention: bool = False
    memory: Memory | None = None  # the step's HBM footprint against the part's capacity
    active_parameters: int | None = None  # parameters a token uses; None for a dense model
    parallel: object | None = None  # a job over many GPUs: `distributed.ParallelResult`
    cost: str = "roofline"  # the cost model's name: "roofline" (a ceiling) or "calibrated"
    # op name -> its matrix multiply's (GEMMs, M, N) as numbers (`costmodel.Cost.grid`), for
    # what reads the waves from a profile (`opgraph.analysis.traces.calibrate`); not in its JSON
    grids: dict = attrs.field(factory=dict, eq=False, repr=False)

    @property
    def seq_len(self) -> int:
        return int(self.values["S"])

    @property
    def attention(self) -> str:
        """"fused attention", "unfused attention", or "no attention" for a model without it;
        a many-GPU job's fused attention names its kernels where they are not
        FlashAttention-2's ("fused attention (cuDNN)")."""
        if not any(c.name == "attention" for c in self.categories):
            return "no attention"
        if not self.fused_attention:
            return "unfused attention"
        library = getattr(self.parallel, "attention_library", "flash")
        return "fused attention" + (f" ({LIBRARY_NAMES[library]})" if library != "flash"
                                    else "")

    def category(self, name: str) -> CategoryCost:
        for c in self.categories:
            if c.name == name:
                return c
        raise KeyError(f"no category {name!r}; have {[c.name for c in self.categories]}")

    def to_json(self, ops: bool = False) -> dict:
        """The `--json` object: step figures, categories, and with `ops=True` every op; with
        `peak=True`, `memory.peak`, the liveness peak (`PeakMemory.to_json`)."""
        out = {
            "model": self.model,
            "hardware": {"id": self.hardware.id, "name": self.hardware.name,
                         "peak_flops": self.hardware.peak_flops,
                         "bandwidth_bytes_per_s": self.hardware.bandwidth},
            "parameters": self.parameters,
            **({} if self.active_parameters is None
               else {"active_parameters": self.active_parameters}),
            **({} if self.memory is None else {"memory": self.memory.to_json()}),
            "mfu_parameters": self.mfu_parameters,
            "tokens": self.tokens,
            "seq_len": self.seq_len,
            "batch": self.tokens // self.seq_len,
            "fused_attention": self.fused_attention,
            "dimensions": dict(self.values),
            "step_time_s": self.step_time_s,
            "flops": self.flops,
            "bytes": self.bytes,
            "mfu_ceiling": self.mfu_ceiling,
            "hfu_ceiling": self.hfu_ceiling,
            "categories": [attrs.asdict(c) for c in self.categories],
        }
        if self.parallel is not None:
            out |= self.parallel.to_json()
        if ops:
            out["ops"] = [attrs.asdict(o) | {"intensity": o.intensity if o.bytes else None}
                          for o in self.ops]
        return out
