"""The launch record: a job config in opgraph's terms (`Launch`), the model configurations a
config can name, and what both frameworks' readers share (the frameworks' real key and flag
names, whole numbers parsed from text)."""

from __future__ import annotations

import difflib
import functools
import json
import math
from pathlib import Path

import attrs

from opgraph.models import PRESETS, deepseek, gpt2, llama
from opgraph.models.deepseek import DeepSeekV2Config
from opgraph.models.gpt2 import GPT2Config
from opgraph.models.llama import LlamaConfig

from ...core.choices import (FUSION_POLICIES, PRECISIONS, RECOMPUTE_POLICIES, SELECTIVE,
                             check_recompute, recompute_policy)
from ...core.errors import OpgraphError
from ...core.limits import MAX_DIGITS, MAX_DIM, check_whole
from ...parallel.parallel import Parallel

RECOMPUTE = RECOMPUTE_POLICIES
# A launch config fuses element-wise chains where the job compiles its model (torch.compile),
# or not at all: the first of the fusion policies, or None.
FUSE = (None, FUSION_POLICIES[0])



# Megatron's data-parallel sharding strategies (Megatron FSDP's `data_parallel_sharding_strategy`)
# as ZeRO stages; both Megatron forms (Megatron-LM's flags, Megatron-Bridge's overrides) read them.
MEGATRON_SHARDING = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}


def megatron_recompute(granularity: str | None, method: str | None, count: int | None,
                       modules: list[str] | None) -> str | None:
    """Megatron-Core's recomputation (`TransformerConfig`'s recompute_granularity, _method,
    _num_layers and _modules) as opgraph's policy. Selective re-runs the listed modules,
    ["core_attn"] where none are listed: opgraph's "selective" (the attention core), else
    "selective:" and the modules (`choices.recompute_policy`: an unknown one is an error);
    full is opgraph's "full" where it re-runs every layer (uniform, one layer at a time), and
    None (not modelled) otherwise."""
    if granularity is None:
        return "none"
    if granularity == "selective":
        if not modules:
            return "none" if modules == [] else "selective"
        return recompute_policy(SELECTIVE + "+".join(modules))
    return "full" if method == "uniform" and count == 1 else None


def megatron_modules(recompute: str) -> list[str]:
    """The `--recompute-modules` of an opgraph "selective" policy (`megatron_recompute`'s
    inverse): ["core_attn"] for "selective", the listed ones for "selective:..."."""
    if recompute == "selective":
        return ["core_attn"]
    return recompute[len(SELECTIVE):].split("+")


GPUS_PER_NODE = 8  # the nodes a written launcher line assumes (DGX / HGX: 8 GPUs each)


def data_parallel(gpus: int | None, model_ranks: int, what: str) -> tuple[int, int]:
    """(GPUs, data-parallel degree) of a Megatron job whose arguments (`what`: Megatron's,
    Megatron-Bridge's) give tp x cp x pp = `model_ranks` but not the world size, which the
    launcher or the caller (`gpus`) does."""
    if gpus is None:
        raise OpgraphError(f"{what} arguments do not say how many GPUs the job has (the "
                           "launcher does): give the number of GPUs (--gpus)")
    gpus = check_whole(gpus, "--gpus", MAX_DIM)
    if gpus % model_ranks:
        raise OpgraphError(f"--gpus {gpus} is not divisible by tp x cp x pp = {model_ranks}")
    return gpus, gpus // model_ranks



def launcher(gpus: int, script: str) -> list[str]:
    """torchrun's line for `gpus` GPUs in front of `script`: 8 processes a node where the GPUs
    fill whole nodes of 8, else the most that divide them. A reader takes the job's GPUs from
    it (--nproc-per-node x --nnodes), so what a writer emits needs no --gpus beside it; the
    rendezvous (--master-addr, --node-rank) is the site's to add."""
    per_node = math.gcd(gpus, GPUS_PER_NODE)
    return ["torchrun", "--nproc-per-node", str(per_node), "--nnodes", str(gpus // per_node),
            script]


# The model configurations a launch writes: the shapes Megatron's flags describe.
Config = LlamaConfig | GPT2Config | DeepSeekV2Config


def _preset_configs() -> dict[str, Config]:
    """Every preset of the model registry (`opgraph.models.PRESETS`) whose configuration is a
    Llama, a GPT-2 or a DeepSeek-V2 one, in the registry's order; the others (Gemma 2's
    soft-capping and local attention, BERT's encoder) have no Megatron form."""
    configs = {c.name: c for module in (llama, gpt2, deepseek) for c in vars(module).values()
               if isinstance(c, Config)}
    return {name: configs[name] for name in PRESETS if name in configs}


# The configurations behind the presets a launch config can name or be written as.
PRESET_CONFIGS: dict[str, Config] = _preset_configs()


def _resolved(layout: Parallel) -> Parallel:
    """The layout with dp, gpus and the global batch explicit; ZeRO 0 where the sharding group
    (`Parallel.size("dp")`: dp x cp, the ranks that hold the same weights) is one rank, which
    a stage of sharding shards nothing over."""
    if not isinstance(layout, Parallel):
        raise OpgraphError(f"launch parallel {layout!r} is not an "
                           "opgraph.parallel.parallel.Parallel")
    return attrs.evolve(layout, dp=layout.dp_degree, gpus=layout.world,
                        global_batch=layout.batch,
                        zero=layout.zero if layout.size("dp") > 1 else 0)


def own_framework(layout: Parallel, framework: str) -> None:
    """A launch written as `framework`'s config runs `framework`'s behaviour (its reader sets
    the layout's framework so): one that follows another framework is a one-line error,
    rather than a file that profiles back to other figures."""
    if layout.framework not in (None, framework):
        raise OpgraphError(f"the layout follows --framework {layout.framework}; a {framework} "
                           f"config runs {framework}'s: plan or profile it with --framework "
                           f"{framework}")


def _one_of(choices: tuple):
    def check(launch, attribute, value) -> None:
        if value not in choices:
            shown = ", ".join(repr(c) for c in choices)
            raise OpgraphError(f"launch {attribute.name} {value!r}: give one of {shown}")
    return check


def _recompute(launch, attribute, value) -> None:
    check_recompute(value, "launch ")


def _check_model(launch, attribute, value) -> None:
    if isinstance(value, GPT2Config) and value.variant_flags():
        # Megatron's and torchtitan's GPT-2 form has none of OPT's, NeoX's, BLOOM's or Falcon's
        raise OpgraphError(f"launch model {value.name}: a launch writes GPT-2 and Llama "
                           f"models; this GPT2Config sets {', '.join(value.variant_flags())}")
    if isinstance(value, Config):
        return
    if not isinstance(value, str) or value not in PRESETS:
        raise OpgraphError(f"launch model {value!r}: give a preset ({', '.join(sorted(PRESETS))}) "
                           "or a LlamaConfig / GPT2Config / DeepSeekV2Config")


def _check_seq_len(launch, attribute, value) -> None:
    if value is not None:
        check_whole(value, "sequence length", MAX_DIM)


@attrs.frozen(kw_only=True)
class Launch:
    """A job config in opgraph's terms.

    `model` is a preset name or a model configuration; `seq_len` the job's sequence length
    (None: the model's own); `recompute` a policy of
    passes/recompute.py; `fuse` "elementwise" where the job compiles its model (torch.compile);
    `unknown` the keys or flags the reader did not understand or opgraph does not model, as the
    file spelt them; `source` the file, or "megatron arguments".

        Launch(model="llama3-8b", seq_len=8192, parallel=Parallel(gpus=8, zero=3))
    """

    model: str | Config = attrs.field(validator=_check_model)
    seq_len: int | None = attrs.field(default=None, validator=_check_seq_len)
    parallel: Parallel = attrs.field(factory=Parallel, converter=_resolved)
    recompute: str = attrs.field(default="none", validator=_recompute)
    precision: str = attrs.field(default="bf16", validator=_one_of(PRECISIONS))
    fuse: str | None = attrs.field(default=None, validator=_one_of(FUSE))
    unknown: tuple[str, ...] = attrs.field(default=(), converter=tuple, eq=False)
    source: str = attrs.field(default="", eq=False)

    def job(self, hardware, *, cluster=None, cost=None):
        """The job this config runs on `hardware` (`opgraph.parallel.job.JobSpec`), on
        `cluster` (default: the part's) under `cost` (default: the roofline)."""
        from ...parallel.job import JobSpec

        extra = {k: v for k, v in (("cluster", cluster), ("cost", cost)) if v is not None}
        forward = self.forward()
        return JobSpec(forward=forward, hardware=hardware, layout=self.parallel,
                       seq_len=self.seq_len or forward.seq_len, recompute=self.recompute,
                       precision=self.precision, fuse=self.fuse, **extra)

    def forward(self):
        """The model's forward graph (a preset's, or built from the configuration)."""
        from opgraph.models import preset

        if isinstance(self.model, str):
            return preset(self.model)
        builders = ((LlamaConfig, llama.build), (GPT2Config, gpt2.build),
                    (DeepSeekV2Config, deepseek.build))
        return next(build for kind, build in builders if isinstance(self.model, kind))(
            self.model)


def _config(model: str | Config, what: str) -> Config:
    """The configuration behind a launch's model, for writers that need its dimensions."""
    if not isinstance(model, str):
        return model
    try:
        return PRESET_CONFIGS[model]
    except KeyError:
        raise OpgraphError(f"model {model!r} has no {what} form; opgraph writes "
                           f"{', '.join(PRESET_CONFIGS)} or a LlamaConfig / GPT2Config / "
                           "DeepSeekV2Config") from None


@functools.cache
def _real_names() -> dict:
    """The keys and flags the frameworks have (opgraph/data/launch_keys.json, with its
    sources): torchtitan's sections and the keys of the sections opgraph reads, Megatron-LM's
    flags."""
    return json.loads((Path(__file__).parents[2] / "data" / "launch_keys.json").read_text())


def _not_real(what: str, kind: str, name: str, real) -> OpgraphError:
    """The error for a `kind` ("key", "flag", "section") called `name` that `what` (torchtitan,
    Megatron) does not have, with the nearest real name where one is close (difflib)."""
    near = difflib.get_close_matches(name, sorted(real), n=1, cutoff=0.75)
    hint = f"did you mean {near[0]}?" if near else "fix or remove it"
    return OpgraphError(f"{what} has no {kind} {name}; {hint}")


def _whole_text(text: str, what: str, maximum: int = MAX_DIM) -> int:
    """A whole number written in decimal digits, parsed (never evaluated), within bounds."""
    digits = text.strip()
    if not digits.isascii() or not digits.isdigit():
        raise OpgraphError(f"{what} {text!r} is not a whole number")
    if len(digits) > MAX_DIGITS:
        raise OpgraphError(f"{what} has {len(digits)} digits; give a whole number up to "
                           f"{maximum:,}")
    return check_whole(int(digits), what, maximum)
