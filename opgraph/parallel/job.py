"""The job record: one training job as every entry point states it.

    job = JobSpec(forward=preset("llama3-8b"), hardware=hardware.get("h100-sxm"),
                  layout=Parallel(tp=2, pp=2, gpus=8, micro_batch=1, global_batch=32),
                  seq_len=8192, recompute="selective")
    job.profile().parallel.step_time_s     # `distributed.profile_parallel`
    job.prepare()                          # compiled once (`distributed.Job`), for a fit

The model (its forward graph, a user's passes already run over it), the sequence length, the
batch and the layout (`Parallel`: the micro and global batch are the layout's), the step's
options (recomputation, precision, element-wise fusion, attention fusion, AdamW's precisions),
the part, the cluster (default: the part's own) and the cost model. `opgraph profile --gpus`,
the launch-config readers (`Launch.job`), the case files (`Case.job`) and `plan --compare`
build one, and it checks itself in one place, in one vocabulary (`opgraph.core.choices`): each
option one of its names, the sequence length a whole number within the model's positions, and
a layout the model divides at that length. Each error is one line.
"""

from __future__ import annotations

import attrs

from ..core.choices import ADAMW_OPTIONS, FUSION_POLICIES, PRECISIONS, check_recompute
from ..core.errors import OpgraphError
from ..core.ir import Graph
from ..core.limits import MAX_DIM, check_whole
from ..cost.costmodel import DEFAULT, CostModel
from ..cost.hardware import Hardware
from . import cluster as clusters
from .parallel import Parallel


def _one_of(choices: tuple, what: str):
    def check(job, attribute, value) -> None:
        if value not in choices:
            shown = ", ".join(str(c) for c in choices)
            raise OpgraphError(f"job {attribute.name} {value!r}: give {what}, one of {shown}")
    return check


def _recompute(job, attribute, value) -> None:
    check_recompute(value, "job ")


def _typed(kind: type, what: str):
    def check(job, attribute, value) -> None:
        if not isinstance(value, kind):
            raise OpgraphError(f"job {attribute.name} is a {type(value).__name__}; give "
                               f"{what}")
    return check


def _default_seq_len(job: JobSpec) -> int | None:
    return job.forward.seq_len if isinstance(job.forward, Graph) else None


def _default_cluster(job: JobSpec):
    return clusters.for_hardware(job.hardware) if isinstance(job.hardware, Hardware) else None


@attrs.frozen(kw_only=True)
class JobSpec:
    """One training job (see the module). `fuse` is an element-wise fusion policy's name or
    None; `adamw` one of AdamW's named precisions (`passes.attach_adamw`)."""

    forward: Graph = attrs.field(validator=_typed(Graph, "the model's forward graph"))
    hardware: Hardware = attrs.field(validator=_typed(Hardware, "a part, hardware.get(...)"))
    layout: Parallel = attrs.field(validator=_typed(Parallel, "a Parallel layout"))
    seq_len: int = attrs.field(default=attrs.Factory(_default_seq_len, takes_self=True))
    recompute: str = attrs.field(default="none", validator=_recompute)
    precision: str = attrs.field(default="bf16", validator=_one_of(PRECISIONS, "a precision"))
    fuse: str | None = attrs.field(default=None,
                                   validator=_one_of((None, *FUSION_POLICIES), "a fusion policy"))
    fused_attention: bool = attrs.field(default=True, validator=_typed(bool, "True or False"))
    adamw: str = attrs.field(default="mixed", validator=_one_of(ADAMW_OPTIONS, "AdamW's"))
    cluster: clusters.Cluster = attrs.field(
        default=attrs.Factory(_default_cluster, takes_self=True),
        validator=_typed(clusters.Cluster, "a cluster, cluster.get(...)"))
    cost: CostModel = attrs.field(default=DEFAULT, validator=_typed(CostModel, "a cost model"))

    def __attrs_post_init__(self):
        from .distributed import check_layout

        if self.seq_len is None:
            raise OpgraphError(f"{self.forward.name} has no default sequence length; give "
                               "seq_len")
        check_whole(self.seq_len, "sequence length", MAX_DIM)
        longest = self.forward.max_seq_len
        if longest and self.seq_len > longest:
            raise OpgraphError(f"seq_len {self.seq_len:,} is longer than {self.forward.name}'s "
                               f"{longest:,} positions; give at most {longest:,}")
        check_layout(self.forward, self.layout, self.seq_len)

    def step_options(self) -> dict:
        """`compile_step`'s options for the job (`pipeline.step_passes`)."""
        from ..core.pipeline import fusion_passes
        from ..passes.attach_adamw import AdamW

        options = {"recompute": self.recompute, "precision": self.precision,
                   "fused_attention": self.fused_attention,
                   "extra_passes": fusion_passes(self.fuse)}
        if self.adamw != "mixed":
            options["adamw"] = AdamW.named(self.adamw)
        return options

    def prepare(self, cost: CostModel | None = None, rank: int | None = None):
        """The job compiled (`distributed.prepare`), under `cost` (default: the job's)."""
        from .distributed import prepare

        return prepare(self.forward, self.hardware, self.layout, cluster=self.cluster,
                       values={"S": self.seq_len}, cost=cost or self.cost, rank=rank,
                       **self.step_options())

    def profile(self, rank: int | None = None):
        """The first stage's profile with the job's figures (`distributed.profile_parallel`);
        `rank`: that GPU's timeline too."""
        from .distributed import profile_parallel

        return profile_parallel(self.forward, self.hardware, self.layout, cluster=self.cluster,
                                values={"S": self.seq_len}, cost=self.cost, rank=rank,
                                **self.step_options())
