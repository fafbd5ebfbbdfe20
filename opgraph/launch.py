"""Launch configs: what a torchtitan job TOML or a Megatron-LM command line says, in opgraph's
terms (a model, a sequence length, a `Parallel` layout, a recompute policy, a precision), and
back again.

    launch = read_torchtitan("llama3_8b.toml", gpus=64)
    launch.model, launch.parallel.dp, launch.recompute      # "llama3-8b", 64, "selective-op"
    launch = read_megatron("--num-layers 96 --hidden-size 12288 ...", gpus=64)
    text = to_megatron(launch)                              # the arguments again, one line

Nothing a file says is dropped in silence. A key or flag the framework itself does not have (a
misspelling: `tensor_paralel_degree`) is a one-line OpgraphError with the nearest real name, as
the framework's own parser would refuse it (the names: opgraph/data/launch_keys.json). A real
key or flag opgraph does not model, or a known one set to something opgraph does not model (a
GPipe schedule, CPU offload, HSDP), is listed in `Launch.unknown`, which the CLI prints as a
warning naming it; keys that do not change the step's time (paths, logging, checkpoints,
learning rates) are known and quiet. A setting opgraph cannot stand in for at all (activation
checkpointing of every second layer, fp32 training) is a one-line OpgraphError that names it,
and says so where it is the framework's default rather than what the file wrote.

A Launch holds its layout resolved (`dp`, `gpus` and the global batch explicit; ZeRO stage 0 where
the ranks that hold the same weights, dp x cp, are one, so sharding has nothing to shard over),
so two Launches of one job
compare equal however they were written. `source` and `unknown` say where a Launch came from, not
what it is, and take no part in equality: `read_torchtitan(f)` of the file `to_torchtitan(l)`
wrote equals `l`, and so does `read_megatron(to_megatron(l), gpus=l.parallel.gpus)` (Megatron's
arguments do not carry the world size: the launcher does).
"""

from __future__ import annotations

import difflib
import functools
import json
import math
import re
import shlex
import tomllib
from pathlib import Path

import attrs

from opgraph.models import PRESETS, deepseek, gpt2, llama
from opgraph.models.deepseek import DeepSeekV2Config
from opgraph.models.gpt2 import GPT2Config
from opgraph.models.llama import LlamaConfig

from .datafile import read_small
from .errors import OpgraphError
from .limits import MAX_DIGITS, MAX_DIM, check_whole
from .frameworks import reduce_dtype
from .parallel import Parallel

RECOMPUTE = ("none", "selective", "selective-op", "full")  # passes/recompute.py POLICIES
PRECISIONS = ("bf16", "fp8")
FUSE = (None, "elementwise")
MEGATRON_SOURCE = "megatron arguments"
MEGATRON_MODEL = "megatron-model"  # the name of a model read from Megatron's dimensions



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


# --- the record -----------------------------------------------------------------------------------
def _resolved(layout: Parallel) -> Parallel:
    """The layout with dp, gpus and the global batch explicit; ZeRO 0 where the sharding group
    (`Parallel.size("dp")`: dp x cp, the ranks that hold the same weights) is one rank, which
    a stage of sharding shards nothing over."""
    if not isinstance(layout, Parallel):
        raise OpgraphError(f"launch parallel {layout!r} is not an opgraph.parallel.Parallel")
    return attrs.evolve(layout, dp=layout.dp_degree, gpus=layout.world,
                        global_batch=layout.batch,
                        zero=layout.zero if layout.size("dp") > 1 else 0)


def _one_of(choices: tuple):
    def check(launch, attribute, value) -> None:
        if value not in choices:
            shown = ", ".join(repr(c) for c in choices)
            raise OpgraphError(f"launch {attribute.name} {value!r}: give one of {shown}")
    return check


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
    recompute: str = attrs.field(default="none", validator=_one_of(RECOMPUTE))
    precision: str = attrs.field(default="bf16", validator=_one_of(PRECISIONS))
    fuse: str | None = attrs.field(default=None, validator=_one_of(FUSE))
    unknown: tuple[str, ...] = attrs.field(default=(), converter=tuple, eq=False)
    source: str = attrs.field(default="", eq=False)

    def forward(self):
        """The model's forward graph (a preset's, or built from the configuration)."""
        from opgraph.models import preset

        if isinstance(self.model, str):
            return preset(self.model)
        builders = ((LlamaConfig, llama.build), (GPT2Config, gpt2.build),
                    (DeepSeekV2Config, deepseek.build))
        return next(build for kind, build in builders if isinstance(self.model, kind))(
            self.model)


def check_emittable(model: str, framework: str) -> None:
    """Raise a one-line OpgraphError, before any search, where `framework`'s writer
    ("torchtitan" or "megatron") has no form for the model named `model`."""
    if framework == "torchtitan":
        if model not in TORCHTITAN_MODELS.values():
            raise OpgraphError(f"--emit torchtitan writes the presets of torchtitan's model "
                               f"flavors ({', '.join(TORCHTITAN_MODELS.values())}); {model} "
                               "is not one")
    elif model not in PRESET_CONFIGS:
        raise OpgraphError(f"--emit megatron writes a Llama-, GPT-2- or DeepSeek-V2-shaped "
                           f"preset ({', '.join(PRESET_CONFIGS)}); {model} is not one")


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
    return json.loads((Path(__file__).with_name("data") / "launch_keys.json").read_text())


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


# --- torchtitan -----------------------------------------------------------------------------------
# Key names as torchtitan spells them. The 2025 layout: pytorch/torchtitan
# torchtitan/config/job_config.py and torchtitan/models/llama3/train_configs/llama3_8b.toml, as of
# 9810191bb^ (the last TOML-configured version: [parallelism], [compile], training.local_batch_size
# and global_batch_size, model.converters = ["quantize.linear.float8"], earlier "float8"). The
# late-2024 layout: torchtitan/config_manager.py and train_configs/llama3_8b.toml at 9dec370
# (the degrees in [training] and [experimental], training.batch_size, training.compile,
# [float8] enable_float8_linear; mid-2024: training.enable_float8_linear).
_TT_RENAMED = {  # late-2024 key -> its 2025 name
    "training.batch_size": "training.local_batch_size",
    "training.data_parallel_replicate_degree": "parallelism.data_parallel_replicate_degree",
    "training.data_parallel_shard_degree": "parallelism.data_parallel_shard_degree",
    "training.tensor_parallel_degree": "parallelism.tensor_parallel_degree",
    "training.disable_loss_parallel": "parallelism.disable_loss_parallel",
    "training.compile": "compile.enable",
    "training.enable_float8_linear": "float8.enable_float8_linear",
    "training.warmup_steps": "lr_scheduler.warmup_steps",
    "experimental.pipeline_parallel_degree": "parallelism.pipeline_parallel_degree",
    "experimental.pipeline_parallel_schedule": "parallelism.pipeline_parallel_schedule",
    "experimental.pipeline_parallel_schedule_csv": "parallelism.pipeline_parallel_schedule_csv",
    "experimental.pipeline_parallel_split_points": "parallelism.pipeline_parallel_split_points",
    "experimental.pipeline_parallel_microbatches": "parallelism.pipeline_parallel_microbatches",
    "experimental.context_parallel_degree": "parallelism.context_parallel_degree",
    "experimental.context_parallel_rotate_method": "parallelism.context_parallel_rotate_method",
    "experimental.enable_async_tensor_parallel": "parallelism.enable_async_tensor_parallel",
}
_TT_READ = {  # keys that become part of the Launch
    "model.name", "model.flavor", "model.converters",
    "training.local_batch_size", "training.global_batch_size", "training.seq_len",
    "training.mixed_precision_reduce",
    "parallelism.data_parallel_replicate_degree", "parallelism.data_parallel_shard_degree",
    "parallelism.tensor_parallel_degree", "parallelism.pipeline_parallel_degree",
    "parallelism.context_parallel_degree", "parallelism.expert_parallel_degree",
    "parallelism.enable_async_tensor_parallel", "parallelism.pipeline_parallel_schedule",
    "parallelism.pipeline_parallel_microbatch_size", "parallelism.pipeline_parallel_microbatches",
    "parallelism.pipeline_parallel_layers_per_stage",
    "parallelism.pipeline_parallel_first_stage_less_layers",
    "parallelism.pipeline_parallel_last_stage_less_layers",
    "compile.enable", "float8.enable_float8_linear",
    "activation_checkpoint.mode", "activation_checkpoint.selective_ac_option",
}
_TT_ASSUMED = {  # known keys whose time-relevant effect opgraph models only at this value
    "optimizer.name": "AdamW",
    "training.mixed_precision_param": "bfloat16",
    "training.enable_cpu_offload": False,
    "parallelism.fsdp_reshard_after_forward": "default",
    "parallelism.expert_tensor_parallel_degree": 1,
    "parallelism.pipeline_parallel_schedule_csv": "",
}
_TT_QUIET_SECTIONS = {  # nothing in these changes the step's time
    "job", "profiling", "metrics", "checkpoint", "comm", "memory_estimation", "fault_tolerance",
    "validation", "lr_scheduler", "debug", "optimizer", "float8", "quantize",
}
_TT_QUIET = {
    "model.tokenizer_path", "model.hf_assets_path", "model.norm_type",
    "model.print_after_conversion",
    "training.dataset", "training.dataset_path", "training.max_norm", "training.steps",
    "training.seed", "training.deterministic", "training.gc_freq", "training.gc_debug",
    "training.dtype",
    "parallelism.disable_loss_parallel", "parallelism.context_parallel_rotate_method",
    "parallelism.context_parallel_load_balancer", "parallelism.expert_parallel_comm_backend",
    "parallelism.pipeline_parallel_expert_parallel_overlap",
    "activation_checkpoint.preserve_rng_state", "activation_checkpoint.determinism_check",
    "activation_checkpoint.debug", "activation_checkpoint.early_stop",
    "activation_checkpoint.memory_budget", "activation_checkpoint.visualize_memory_budget_pareto",
    "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns",
    "compile.components", "compile.backend",
    "experimental.custom_import", "experimental.custom_args_module",
}
_TT_QUIET_PREFIXES = ("training.dataloader.", "validation.")
# (model.name, model.flavor) -> the preset of the same shape: torchtitan/models/llama3/__init__.py,
# and torchtitan/models/deepseek_v3/__init__.py, whose "16B" flavor has DeepSeek-V2-Lite's
# dimensions (27 layers of 2,048, MLA with kv_lora_rank 512, one dense layer first, 64 routed
# experts of 1,408 and 2 shared, 6 a token, vocabulary 102,400)
TORCHTITAN_MODELS = {("llama3", "8B"): "llama3-8b", ("llama3", "70B"): "llama3-70b",
                     ("llama3", "405B"): "llama3.1-405b",
                     ("deepseek_v3", "16B"): "deepseek-v2-lite"}
_TT_FLOAT8 = ("float8", "quantize.linear.float8")  # model.converters that turn float8 on
_TT_SINGLE_STAGE = ("1F1B", "GPipe")  # one stage per rank; the others interleave several
_TT_MODELLED_SCHEDULES = ("1F1B", "Interleaved1F1B")


def read_torchtitan(path: str | Path, gpus: int | None = None) -> Launch:
    """The Launch of a torchtitan job TOML, in its late-2024 or its 2025 layout.

    The model is torchtitan's llama3 flavor 8B, 70B or 405B (presets llama3-8b, llama3-70b,
    llama3.1-405b). Defaults are torchtitan's: local batch 8, sequence 2048, shard degree -1,
    selective activation checkpointing of every 2nd layer (an error: say the mode).

    Data parallelism: `data_parallel_shard_degree` ranks run FSDP (ZeRO 3), -1 meaning the GPUs
    left over (then `gpus` is needed); `data_parallel_replicate_degree` ranks alone run DDP
    (ZeRO 0). Both above one is HSDP: read as FSDP over all shard x replicate ranks (sharding
    within the shard group and all-reducing across the replicas is not modelled separately) and
    listed in `unknown`. With context parallelism torchtitan's FSDP shards over the cp ranks
    too (ZeRO 3 over dp x cp, opgraph's sharding group, even where the shard degree is 1).
    FSDP reduces gradients in `mixed_precision_reduce` (float32; bfloat16 is the layout's
    `grad_reduce_dtype`). Tensor parallelism always shards the sequence.

    Batches: the local batch (`batch_size`, later `local_batch_size`: sequences per
    data-parallel rank per step) is the micro-batch; with a pipeline it is cut into micro-batches
    of `pipeline_parallel_microbatch_size` (late 2024: into `pipeline_parallel_microbatches` of
    them, by default pp). The global batch is local x dp, or `global_batch_size` (gradient
    accumulation). An interleaved schedule has two stages per rank unless
    `pipeline_parallel_layers_per_stage` says otherwise; torchtitan's split, which counts the
    embedding and the head as a layer each, is read as an even one.

    Activation checkpointing "none" and "full" are themselves; "selective" with
    `selective_ac_option` "op" is selective-op, "1" (every layer) full, any other N an error.
    float8 linears are fp8; compile is elementwise fusion.

        read_torchtitan("train_configs/llama3_8b.toml", gpus=8).parallel.zero   # 3: FSDP
    """
    text = read_small(path, "torchtitan config")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise OpgraphError(f"torchtitan config {path} is not valid TOML: {e}") from None
    except RecursionError:
        raise OpgraphError(f"torchtitan config {path} nests too deeply; it is not a job "
                           "config") from None
    except ValueError as e:
        raise OpgraphError(f"torchtitan config {path}: {str(e).split(':')[0]}") from None
    return _from_torchtitan(data, gpus, str(path))


def _flatten(table: dict, prefix: str = "") -> dict[str, object]:
    """A TOML document's leaves by dotted key, in file order: `{"training.seq_len": 8192}`."""
    leaves = {}
    for key, value in table.items():
        if isinstance(value, dict):
            leaves |= _flatten(value, f"{prefix}{key}.")
        else:
            leaves[f"{prefix}{key}"] = value
    return leaves


def _prefixes(key: str) -> list[str]:
    """The dotted keys above `key`: "a.b.c" -> ["a", "a.b"]."""
    parts = key.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _tt_is_quiet(key: str) -> bool:
    return (key in _TT_QUIET or key.split(".")[0] in _TT_QUIET_SECTIONS
            or key.startswith(_TT_QUIET_PREFIXES))


def _tt_keys(data: dict) -> tuple[dict[str, object], list[str], bool]:
    """The file's keys under their 2025 names, what it says that opgraph does not model, and
    whether it is in the late-2024 layout."""
    keys: dict[str, object] = {}
    unknown: list[str] = []
    legacy = False
    for key, value in _flatten(data).items():
        name = _TT_RENAMED.get(key, key)
        table = next((part for part in _prefixes(name) if part in _TT_READ or part in _TT_ASSUMED),
                     None)
        if table is not None:  # `tensor_parallel_degree = {a = 1}`: a table where a value goes
            raise OpgraphError(f"torchtitan config: {table} is a table ({key} = {value!r}); "
                               "give it a single value")
        legacy |= name != key or key == "experimental.pipeline_parallel_microbatches"
        if name in keys and keys[name] != value:
            raise OpgraphError(f"torchtitan config gives {name} twice ({keys[name]!r} and "
                               f"{value!r}, as {key}); keep one")
        keys[name] = value
        if name in _TT_READ:
            continue
        if name in _TT_ASSUMED:
            if value != _TT_ASSUMED[name]:
                unknown.append(f"{key} = {value!r} (opgraph models {_TT_ASSUMED[name]!r})")
        elif not _tt_is_quiet(name):
            unknown.append(key)
    return keys, unknown, legacy


def _tt_check_real(key: str) -> None:
    """Raise where torchtitan has no such section, or no such key in a section opgraph reads
    (the others change no step time; their keys are not checked)."""
    real = _real_names()["torchtitan"]
    section, _, rest = key.partition(".")
    if section not in real["sections"]:
        raise _not_real(f"torchtitan's job config (at {key})", "section", f"[{section}]",
                        [f"[{s}]" for s in real["sections"]])
    keys = real["keys"].get(section)
    if keys is not None and rest.split(".")[0] not in keys and not _tt_is_quiet(key):
        raise _not_real("torchtitan's job config", "key", key,
                        [f"{s}.{k}" for s, ks in real["keys"].items() for k in ks])


def _tt_whole(keys: dict, key: str, default: int, lowest: int = 1) -> int:
    value = keys.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest or (
            value > MAX_DIM):
        raise OpgraphError(f"torchtitan config: {key} = {value!r} is not a whole number from "
                           f"{lowest} to {MAX_DIM:,}")
    return value


def _tt_flag(keys: dict, key: str) -> bool:
    value = keys.get(key, False)
    if not isinstance(value, bool):
        raise OpgraphError(f"torchtitan config: {key} = {value!r} must be true or false")
    return value


def _tt_model(keys: dict) -> str:
    name, flavor = keys.get("model.name", "llama3"), keys.get("model.flavor", "debugmodel")
    try:
        return TORCHTITAN_MODELS[(name, flavor)]
    except (KeyError, TypeError):
        known = ", ".join(f"{n} {f}" for n, f in TORCHTITAN_MODELS)
        raise OpgraphError(f"torchtitan model {name!r} flavor {flavor!r} has no opgraph preset; "
                           f"opgraph reads {known}") from None


# torchtitan's activation checkpointing when a file does not say: torchtitan/config/job_config.py
# ActivationCheckpoint (mode "selective", selective_ac_option "2": every second layer), as in the
# late-2024 config_manager.py
_TT_AC_DEFAULTS = {"activation_checkpoint.mode": "selective",
                   "activation_checkpoint.selective_ac_option": "2"}


def _tt_recompute(keys: dict) -> str:
    """torchtitan's activation checkpointing as a recompute policy (defaults: selective, "2")."""
    mode = keys.get("activation_checkpoint.mode", "selective")
    option = keys.get("activation_checkpoint.selective_ac_option", "2")
    if mode in ("none", "full"):
        return mode
    if mode != "selective":
        raise OpgraphError(f"torchtitan activation_checkpoint.mode {mode!r} is not modelled; "
                           "opgraph reads none, selective and full")
    if option == "op":
        return "selective-op"
    if str(option) == "1":
        return "full"  # a checkpoint every layer is full recomputation
    if "activation_checkpoint.selective_ac_option" not in keys:  # torchtitan's, not the file's
        said = " and ".join(f"{k.split('.')[1]} = {v!r}"
                            for k, v in _TT_AC_DEFAULTS.items() if k not in keys)
        raise OpgraphError(
            f"the file leaves activation checkpointing to torchtitan's default ({said}: a "
            "checkpoint every second layer), which opgraph does not model; say what the run "
            "does in [activation_checkpoint]: mode = 'none' or 'full', or selective_ac_option "
            "= 'op'")
    raise OpgraphError(f"torchtitan activation_checkpoint.selective_ac_option {option!r} "
                       "(checkpoint every Nth layer) is not modelled; opgraph recomputes every "
                       "layer or none: give 'op', '1' or mode 'full'")


def _tt_precision(keys: dict, unknown: list[str]) -> str:
    converters = keys.get("model.converters", [])
    if isinstance(converters, str):  # torchtitan's command line gives them comma-separated
        converters = [c.strip() for c in converters.split(",") if c.strip()]
    if not isinstance(converters, list) or not all(isinstance(c, str) for c in converters):
        raise OpgraphError(f"torchtitan config: model.converters = {converters!r} must be a "
                           "list of names")
    unknown.extend(f"model.converters {c!r}" for c in converters if c not in _TT_FLOAT8)
    fp8 = _tt_flag(keys, "float8.enable_float8_linear") or any(c in _TT_FLOAT8
                                                               for c in converters)
    return "fp8" if fp8 else "bf16"


def _tt_virtual_stages(keys: dict, model: str, pp: int, unknown: list[str]) -> int:
    """Stages per pipeline rank: 1 for a single-stage schedule, else as torchtitan counts them."""
    if pp == 1:
        return 1
    schedule = keys.get("parallelism.pipeline_parallel_schedule", "1F1B")
    if schedule not in _TT_MODELLED_SCHEDULES:
        read = "1F1B" if schedule in _TT_SINGLE_STAGE else "interleaved 1F1B"
        unknown.append(f"pipeline_parallel_schedule = {schedule!r} (read as {read})")
    splits = keys.get("parallelism.pipeline_parallel_split_points")
    per_stage = keys.get("parallelism.pipeline_parallel_layers_per_stage")
    if splits is not None:
        if not isinstance(splits, list):
            raise OpgraphError(f"torchtitan config: pipeline_parallel_split_points = {splits!r} "
                               "must be a list of layer names")
        unknown.append("pipeline_parallel_split_points (read as an even split)")
        stages = len(splits) + 1
    elif per_stage is not None:
        per_stage = _tt_whole(keys, "parallelism.pipeline_parallel_layers_per_stage", 1)
        weights = sum(_tt_whole(keys, f"parallelism.pipeline_parallel_{end}_stage_less_layers", 1,
                                lowest=0) for end in ("first", "last"))
        stages = math.ceil((PRESET_CONFIGS[model].layers + weights) / per_stage)
    else:
        return 1 if schedule in _TT_SINGLE_STAGE else 2
    if stages % pp:
        raise OpgraphError(f"torchtitan config: {stages} pipeline stages do not divide over "
                           f"pipeline_parallel_degree {pp}")
    return stages // pp


def _tt_data_parallel(keys: dict, model_ranks: int, cp: int, gpus: int | None,
                      unknown: list[str]) -> tuple[int, int]:
    """The data-parallel degree and ZeRO stage: FSDP over the shard and context-parallel ranks
    (torchtitan's `dp_shard_cp` mesh: its ParallelDims.fsdp_enabled is dp_shard > 1 or
    cp > 1, torchtitan/distributed/parallel_dims.py), DDP over the replicas."""
    replicate = _tt_whole(keys, "parallelism.data_parallel_replicate_degree", 1)
    shard = keys.get("parallelism.data_parallel_shard_degree", -1)
    if shard == -1:
        if gpus is None:
            raise OpgraphError("torchtitan data_parallel_shard_degree = -1 takes the GPUs left "
                               "over: give the number of GPUs (--gpus)")
        gpus = check_whole(gpus, "--gpus", MAX_DIM)
        if gpus % (replicate * model_ranks):
            raise OpgraphError(f"--gpus {gpus} is not divisible by replicate x tp x cp x pp = "
                               f"{replicate * model_ranks}")
        shard = gpus // (replicate * model_ranks)
    shard = _tt_whole({"parallelism.data_parallel_shard_degree": shard},
                      "parallelism.data_parallel_shard_degree", 1)
    if gpus is not None and replicate * shard * model_ranks != gpus:
        raise OpgraphError(f"torchtitan config's degrees (replicate x shard x tp x cp x pp) "
                           f"make {replicate * shard * model_ranks} GPUs, not --gpus {gpus}")
    fsdp = shard * cp > 1
    if fsdp and replicate > 1:
        unknown.append(f"data_parallel_replicate_degree = {replicate} with shard degree {shard} "
                       f"and cp {cp} (HSDP, read as FSDP over {replicate * shard * cp} ranks)")
    return replicate * shard, 3 if fsdp else 0


def _tt_batches(keys: dict, dp: int, pp: int, legacy: bool) -> tuple[int, int]:
    """The micro-batch and the global batch, in sequences."""
    local = _tt_whole(keys, "training.local_batch_size", 8)
    micro = local
    if pp > 1:
        if "parallelism.pipeline_parallel_microbatches" in keys or legacy:
            count = _tt_whole(keys, "parallelism.pipeline_parallel_microbatches", pp)
            if local % count:
                raise OpgraphError(f"torchtitan config: batch size {local} does not split into "
                                   f"{count} pipeline micro-batches")
            micro = local // count
        else:
            micro = _tt_whole(keys, "parallelism.pipeline_parallel_microbatch_size", 1)
            if local % micro:
                raise OpgraphError(f"torchtitan config: local_batch_size {local} is not a "
                                   f"multiple of pipeline_parallel_microbatch_size {micro}")
    total = keys.get("training.global_batch_size", -1)
    if total == -1:
        return micro, local * dp
    total = _tt_whole(keys, "training.global_batch_size", -1)
    if total % (local * dp):
        raise OpgraphError(f"torchtitan config: global_batch_size {total} is not a multiple of "
                           f"local_batch_size x dp = {local} x {dp}")
    return micro, total


def _from_torchtitan(data: dict, gpus: int | None, source: str) -> Launch:
    for key in _flatten(data):  # a key torchtitan lacks is refused before any is read
        _tt_check_real(key)
    keys, unknown, legacy = _tt_keys(data)
    model = _tt_model(keys)
    tp = _tt_whole(keys, "parallelism.tensor_parallel_degree", 1)
    pp = _tt_whole(keys, "parallelism.pipeline_parallel_degree", 1)
    cp = _tt_whole(keys, "parallelism.context_parallel_degree", 1)
    ep = _tt_whole(keys, "parallelism.expert_parallel_degree", 1)
    dp, zero = _tt_data_parallel(keys, tp * cp * pp, cp, gpus, unknown)
    if tp > 1 and _has_experts(model):
        unknown.append(f"expert_tensor_parallel_degree 1 with tensor_parallel_degree {tp} "
                       "(read as the experts split over TP)")
    micro, total = _tt_batches(keys, dp, pp, legacy)
    reduce = keys.get("training.mixed_precision_reduce", "float32")
    if reduce not in ("float32", "bfloat16"):
        raise OpgraphError(f"torchtitan training.mixed_precision_reduce {reduce!r}: give "
                           "float32 or bfloat16")
    for end in ("first", "last"):
        key = f"parallelism.pipeline_parallel_{end}_stage_less_layers"
        if key in keys and "parallelism.pipeline_parallel_layers_per_stage" not in keys:
            unknown.append(f"pipeline_parallel_{end}_stage_less_layers (read as an even split)")
    layout = Parallel(
        tp=tp, pp=pp, cp=cp, ep=ep, dp=dp, gpus=gpus, micro_batch=micro, global_batch=total,
        virtual_stages=_tt_virtual_stages(keys, model, pp, unknown),
        sequence_parallel=tp > 1, zero=zero,
        async_tp=_tt_flag(keys, "parallelism.enable_async_tensor_parallel"),
        grad_reduce_dtype="bf16" if reduce == "bfloat16" else None)
    return Launch(model=model, seq_len=_tt_whole(keys, "training.seq_len", 2048),
                  parallel=layout, recompute=_tt_recompute(keys),
                  precision=_tt_precision(keys, unknown),
                  fuse="elementwise" if _tt_flag(keys, "compile.enable") else None,
                  unknown=tuple(unknown), source=source)


def _has_experts(model: str | Config) -> bool:
    config = PRESET_CONFIGS.get(model) if isinstance(model, str) else model
    return bool(getattr(config, "routed_experts", 0) or getattr(config, "experts", 0))


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return str(value)


def _tt_layers_per_stage(layers: int, stages: int) -> int:
    """A pipeline_parallel_layers_per_stage for which torchtitan counts `stages` stages
    (ceil((layers + 1 + 1) / n), the embedding and the head counted as a layer each)."""
    for per_stage in range(1, layers + 3):
        if math.ceil((layers + 2) / per_stage) == stages:
            return per_stage
    raise OpgraphError(f"torchtitan cannot cut {layers} layers into {stages} pipeline stages "
                       "with pipeline_parallel_layers_per_stage; pick other virtual stages")


def to_torchtitan(launch: Launch) -> str:
    """The torchtitan job TOML (2025 layout) of a launch: the inverse of `read_torchtitan`.

    Only what torchtitan can say is written: a preset of one of its flavors
    (`TORCHTITAN_MODELS`); FSDP (ZeRO 3, over dp x cp) or DDP (ZeRO 0, without context
    parallelism); tensor parallelism with sequence parallelism (tp 1 for a model with
    experts); selective-op, full or no recomputation; an even pipeline split. Anything else is
    a one-line OpgraphError naming it.

        >>> print(to_torchtitan(Launch(model="llama3-8b", seq_len=8192,
        ...                            parallel=Parallel(gpus=8, zero=3))).splitlines()[2])
        name = "llama3"
    """
    by_preset = {preset: key for key, preset in TORCHTITAN_MODELS.items()}
    if launch.model not in by_preset:
        shown = launch.model if isinstance(launch.model, str) else launch.model.name
        raise OpgraphError(f"model {shown!r} has no torchtitan flavor; torchtitan trains "
                           f"{', '.join(by_preset)}")
    name, flavor = by_preset[launch.model]
    p = launch.parallel
    if p.size("dp") > 1 and p.zero not in (0, 3):
        raise OpgraphError(f"torchtitan has no ZeRO stage {p.zero}: it runs FSDP (zero 3) or "
                           "DDP (zero 0)")
    if p.zero == 0 and p.cp > 1:
        raise OpgraphError("torchtitan shards the weights over the context-parallel ranks "
                           "(FSDP over dp x cp): ZeRO stage 0 with cp above 1 has no "
                           "torchtitan form")
    if p.tp > 1 and not p.sequence_parallel:
        raise OpgraphError("torchtitan's tensor parallelism always shards the sequence: give "
                           "sequence parallelism with tp above 1")
    if p.first_stage_layers or p.last_stage_layers:
        raise OpgraphError("torchtitan splits the pipeline's layers itself; uneven first or last "
                           "stages have no torchtitan form")
    if launch.recompute == "selective":
        raise OpgraphError("torchtitan has no attention-core ('selective') recomputation; give "
                           "selective-op, full or none")
    if p.tp > 1 and _has_experts(launch.model):
        raise OpgraphError("torchtitan runs the experts whole on each TP rank "
                           "(expert_tensor_parallel_degree 1) where opgraph splits them over "
                           "TP: give tp 1 for a model with experts")
    shard, replicate = (p.dp, 1) if p.zero == 3 else (1, p.dp)
    local = p.global_batch // p.dp if p.pp > 1 else p.micro_batch
    config = PRESET_CONFIGS[launch.model]
    model = {"name": name, "flavor": flavor}
    if launch.precision == "fp8":
        model["converters"] = ["quantize.linear.float8"]
    wire = reduce_dtype(p)
    if wire == "fp16":
        raise OpgraphError("torchtitan reduces gradients in float32 or bfloat16, not fp16")
    training = {"local_batch_size": local, "seq_len": launch.seq_len or config.seq_len,
                "mixed_precision_reduce": "bfloat16" if wire == "bf16" else "float32"}
    if p.global_batch != local * p.dp:
        training["global_batch_size"] = p.global_batch
    parallelism = {"data_parallel_replicate_degree": replicate,
                   "data_parallel_shard_degree": shard, "tensor_parallel_degree": p.tp,
                   "pipeline_parallel_degree": p.pp, "context_parallel_degree": p.cp,
                   "expert_parallel_degree": p.ep, "enable_async_tensor_parallel": p.async_tp}
    if p.pp > 1:
        parallelism["pipeline_parallel_microbatch_size"] = p.micro_batch
        parallelism["pipeline_parallel_schedule"] = (
            "1F1B" if p.virtual_stages == 1 else "Interleaved1F1B")
        if p.virtual_stages > 2:
            parallelism["pipeline_parallel_layers_per_stage"] = _tt_layers_per_stage(
                config.layers, p.pp * p.virtual_stages)
    checkpoint = {"mode": "selective" if launch.recompute == "selective-op" else launch.recompute}
    if launch.recompute == "selective-op":
        checkpoint["selective_ac_option"] = "op"
    sections = {"model": model, "training": training, "parallelism": parallelism,
                "activation_checkpoint": checkpoint,
                "compile": {"enable": launch.fuse == "elementwise"}}
    lines = ["# torchtitan job config written by opgraph"]
    for section, table in sections.items():
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in table.items())
        lines.append("")
    return "\n".join(lines)


# --- Megatron-LM ---------------------------------------------------------------------------------
# Flag names as NVIDIA/Megatron-LM spells them: megatron/training/arguments.py at core_r0.11.0
# (explicit argparse), checked against its main branch (2026), where several come from
# TransformerConfig fields, and megatron/core/transformer/transformer_config.py for the recompute
# rules. `--padded-vocab-size` is not a Megatron flag (Megatron computes padded_vocab_size); it is
# read as the embedding's rows given directly.
_MG_CHOICES = {  # flags with a value from a list (None: any)
    "--normalization": ("LayerNorm", "RMSNorm"),
    "--position-embedding-type": ("learned_absolute", "rope"),
    "--recompute-granularity": ("full", "selective"),
    "--recompute-method": ("uniform", "block"),
    "--fp8-format": ("e4m3", "hybrid"),
    "--data-parallel-sharding-strategy": ("no_shard", "optim", "optim_grads",
                                          "optim_grads_params"),
    "--tokenizer-type": None,  # any name
}
# Megatron's fused kernels, on by default: read as elementwise fusion; any turned off, as none.
_MG_NO_FUSION = ("--no-bias-gelu-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion",
                 "--no-masked-softmax-fusion")
# Flags that do not change the step's time: data, tokenizer files, checkpoints, logging,
# the learning-rate schedule, initialisation, loss scaling.
_MG_QUIET = frozenset((
    "--data-path", "--train-data-path", "--valid-data-path", "--test-data-path", "--split",
    "--vocab-file", "--merge-file", "--tokenizer-model", "--data-cache-path", "--mock-data",
    "--num-workers", "--save", "--load", "--save-interval", "--no-load-optim", "--no-load-rng",
    "--finetune", "--use-checkpoint-args", "--ckpt-format", "--eval-interval", "--eval-iters",
    "--log-interval", "--tensorboard-dir", "--wandb-project", "--wandb-exp-name",
    "--log-throughput", "--log-timers-to-tensorboard", "--log-params-norm",
    "--log-num-zeros-in-grad", "--timing-log-level", "--exit-duration-in-mins", "--exit-interval",
    "--lr", "--min-lr", "--lr-decay-style", "--lr-decay-iters", "--lr-decay-samples",
    "--lr-warmup-iters", "--lr-warmup-fraction", "--lr-warmup-samples", "--train-iters",
    "--train-samples", "--weight-decay", "--clip-grad", "--adam-beta1", "--adam-beta2",
    "--adam-eps", "--init-method-std", "--seed", "--attention-dropout", "--hidden-dropout",
    "--norm-epsilon", "--layernorm-epsilon", "--rotary-base", "--loss-scale",
    "--initial-loss-scale", "--min-loss-scale", "--loss-scale-window", "--hysteresis",
    "--distributed-backend", "--use-mcore-models", "--transformer-impl", "--use-flash-attn",
    "--attention-softmax-in-fp32", "--accumulate-allreduce-grads-in-fp32",
    "--manual-gc", "--no-async-tensor-model-parallel-allreduce",
    "--no-gradient-accumulation-fusion", "--no-rope-fusion",
))  # overlapping DP communication with compute, and flash attention, are what opgraph assumes
_MG_SHARDING = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}
GPT2_BPE_VOCAB = 50257  # rows of GPT-2's BPE vocabulary (openai-community/gpt2 config.json)


def _mg_tokens(text: str) -> tuple[list[str], int | None]:
    """The argument tokens after any launcher, and the launcher's GPUs (torchrun's
    --nproc-per-node x --nnodes) where it says them."""
    text = text.replace("\\\n", " ")  # a shell script's continued lines
    try:
        tokens = shlex.split(text, comments=True)
    except ValueError as e:
        raise OpgraphError(f"Megatron arguments cannot be split like a shell line: {e}") from None
    script = next((i for i, t in enumerate(tokens) if t.endswith(".py")), None)
    if script is None:
        return tokens, None
    launcher, tokens = tokens[:script], tokens[script + 1:]
    found = {}
    for i, token in enumerate(launcher):
        name, _, value = token.partition("=")
        name = name.replace("_", "-")
        if name in ("--nproc-per-node", "--nnodes"):
            value = value or (launcher[i + 1] if i + 1 < len(launcher) else "")
            if value.isdigit():
                found[name] = int(value)
    if len(found) == 2:
        return tokens, found["--nproc-per-node"] * found["--nnodes"]
    return tokens, None


def _mg_flags(tokens: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """Each flag with the values after it (a later one wins, as in argparse), and the tokens
    that belong to no flag."""
    flags: dict[str, list[str]] = {}
    stray: list[str] = []
    current = None
    for token in tokens:
        if token.startswith("--"):
            current, has_value, value = token.partition("=")
            flags[current] = [value] if has_value else []
        elif current is None:
            stray.append(token)
        else:
            flags[current].append(token)
    return flags, stray


class _Flags:
    """A parsed command line, read one flag at a time; what no one read is left over."""

    def __init__(self, flags: dict[str, list[str]]):
        self.flags = flags
        self.read: set[str] = set()

    def __contains__(self, flag: str) -> bool:
        self.read.add(flag)
        return flag in self.flags

    def switch(self, flag: str) -> bool:
        if flag not in self:
            return False
        if self.flags[flag]:
            raise OpgraphError(f"Megatron flag {flag} takes no value; got "
                               f"{' '.join(self.flags[flag])!r}")
        return True

    def text(self, flag: str) -> str | None:
        if flag not in self:
            return None
        values = self.flags[flag]
        if len(values) != 1:
            raise OpgraphError(f"Megatron flag {flag} takes one value; got "
                               f"{len(values)}: {' '.join(values)!r}")
        choices = _MG_CHOICES.get(flag)
        if choices and values[0] not in choices:
            raise OpgraphError(f"Megatron {flag} {values[0]!r}: opgraph reads "
                               f"{', '.join(choices)}")
        return values[0]

    def whole(self, flag: str, default: int | None = None) -> int | None:
        value = self.text(flag)
        return default if value is None else _whole_text(value, f"Megatron {flag}")

    def leftover(self) -> list[str]:
        return [f for f in self.flags if f not in self.read and f not in _MG_QUIET]


def read_megatron(text: str, gpus: int | None = None) -> Launch:
    """The Launch of Megatron-LM's command-line arguments, one string ("@path": read that file).

    The model: `--swiglu --normalization RMSNorm --position-embedding-type rope` is a Llama
    (LlamaConfig named "megatron-model": kv heads from --num-query-groups with
    --group-query-attention, head size from --kv-channels, biases on every linear layer unless
    --disable-bias-linear, as Megatron's add_bias_linear default; --num-experts / --moe-router-topk
    make it a mixture of experts; with --multi-latent-attention it is a DeepSeek-V2,
    DeepSeekV2Config, its latents from --kv-lora-rank and --q-lora-rank, its dense layers first
    by --moe-layer-freq, parsed and never evaluated); Megatron's defaults (GeLU, LayerNorm,
    learned positions) are a
    GPT-2 (GPT2Config, positions from --max-position-embeddings). The FFN defaults to Megatron's
    4h, or int(8h/3 / 64) x 64 with SwiGLU. Megatron pads the vocabulary to a multiple of
    --make-vocab-size-divisible-by (128) x tp; the model has the padded rows. With
    --tokenizer-type GPT2BPETokenizer and no --vocab-size the vocabulary is GPT-2's 50,257.

    The layout: dp = gpus / (tp x cp x pp), `gpus` being the caller's or a torchrun launcher's
    (--nproc-per-node x --nnodes) at the head of the text. --use-distributed-optimizer is ZeRO 1;
    Megatron FSDP (--use-megatron-fsdp) ZeRO 0-3 by --data-parallel-sharding-strategy;
    --tp-comm-overlap async tensor parallelism; --overlap-grad-reduce the gradient reduction
    under the backward (without it, Megatron's default, after it); --grad-reduce-in-bf16 the
    reduction in BF16 (the layout's `grad_reduce_dtype`; without it FP32).
    Recomputation: selective (--recompute-activations, or --recompute-granularity selective), or
    full with --recompute-method uniform --recompute-num-layers 1 (every layer; other methods are
    an error). Precision: --fp8-format is fp8, --bf16 or --fp16 (the same width and rate) bf16.
    Megatron's hand-fused kernels (bias-GeLU, bias-dropout-add, softmax) are read as elementwise
    fusion, unless a --no-...-fusion flag turns one off.

        >>> read_megatron("--num-layers 2 --hidden-size 64 --num-attention-heads 4 "
        ...               "--seq-length 128 --vocab-size 1000 --micro-batch-size 1 --bf16",
        ...               gpus=2).parallel.dp
        2
    """
    if not isinstance(text, str):
        raise OpgraphError("Megatron arguments must be one string of flags")
    if text.startswith("@"):
        text = read_small(text[1:], "Megatron arguments file")
    tokens, launcher_gpus = _mg_tokens(text)
    if gpus is None:
        gpus = launcher_gpus
    elif launcher_gpus is not None and launcher_gpus != gpus:
        raise OpgraphError(f"--gpus {gpus} differs from the launcher's {launcher_gpus} GPUs; "
                           "give one")
    parsed, stray = _mg_flags(tokens)
    flags = _Flags(parsed)
    tp = flags.whole("--tensor-model-parallel-size", 1)
    model, seq_len = _mg_model(flags, tp)
    layout = _mg_layout(flags, model.layers, tp, gpus)
    recompute = _mg_recompute(flags)
    half = flags.switch("--bf16") | flags.switch("--fp16")
    if flags.text("--fp8-format") is not None:
        precision = "fp8"
    elif half:
        precision = "bf16"
    else:
        raise OpgraphError("Megatron trains in fp32 without --bf16 or --fp16; opgraph models "
                           "bf16 and fp8: add --bf16")
    fused = not any([flags.switch(f) for f in _MG_NO_FUSION])  # noqa: C419 - consume them all
    real = set(_real_names()["megatron"]) | flags.read | _MG_QUIET
    for flag in flags.leftover():
        if flag not in real:
            raise _not_real("Megatron-LM", "flag", flag, real)
    unknown = [*stray, *flags.leftover()]
    return Launch(model=model, seq_len=seq_len, parallel=layout, recompute=recompute,
                  precision=precision, fuse="elementwise" if fused else None,
                  unknown=tuple(unknown), source=MEGATRON_SOURCE)


def _mg_vocab(flags: _Flags, tp: int) -> int | None:
    padded = flags.whole("--padded-vocab-size")
    vocab = flags.whole("--vocab-size")
    divisor = flags.whole("--make-vocab-size-divisible-by", 128)
    multiple = divisor * tp
    if padded is not None:
        return padded
    if vocab is None and flags.text("--tokenizer-type") == "GPT2BPETokenizer":
        vocab = GPT2_BPE_VOCAB
    if vocab is None:
        return None
    # Megatron pads for the GEMMs' sake (its default 128 x tp); a multiple beyond both that
    # and the vocabulary itself would make most of the output head padding.
    if multiple > max(vocab, 128 * tp):
        raise OpgraphError(f"Megatron --make-vocab-size-divisible-by {divisor:,} x tp {tp} "
                           f"= {multiple:,} is more than the vocabulary of {vocab:,}: most of "
                           "the output head would be padding; give 128 (Megatron's default) "
                           "or another multiple below the vocabulary")
    return check_whole(math.ceil(vocab / multiple) * multiple, "Megatron's padded vocabulary",
                       MAX_DIM)


def _mg_model(flags: _Flags, tp: int) -> tuple[Config, int]:
    """The model the flags describe, and the sequence length."""
    dims = {flag: flags.whole(flag) for flag in ("--num-layers", "--hidden-size",
                                                 "--num-attention-heads", "--seq-length")}
    dims["--vocab-size"] = _mg_vocab(flags, tp)
    missing = [flag for flag, value in dims.items() if value is None]
    if missing:
        raise OpgraphError(f"Megatron arguments lack the model's {', '.join(missing)}; give "
                           "them all")
    layers, hidden, heads, seq = (dims[f] for f in ("--num-layers", "--hidden-size",
                                                    "--num-attention-heads", "--seq-length"))
    llama_parts = {"--swiglu": flags.switch("--swiglu"),
                   "--normalization RMSNorm": flags.text("--normalization") == "RMSNorm",
                   "--position-embedding-type rope":
                       flags.text("--position-embedding-type") == "rope"}
    untie = flags.switch("--untie-embeddings-and-output-weights")
    ffn = flags.whole("--ffn-hidden-size")
    positions = flags.whole("--max-position-embeddings")
    experts, topk = flags.whole("--num-experts"), flags.whole("--moe-router-topk", 2)
    no_bias, qkv_bias = flags.switch("--disable-bias-linear"), flags.switch("--add-qkv-bias")
    gqa = flags.switch("--group-query-attention")
    groups = flags.whole("--num-query-groups", 1)  # Megatron's default with GQA
    head_dim = flags.whole("--kv-channels")
    if flags.switch("--multi-latent-attention"):
        if not all(llama_parts.values()) or not no_bias or qkv_bias or gqa or not experts:
            raise OpgraphError("Megatron --multi-latent-attention: opgraph models DeepSeek-V2's "
                               "form of it, with --swiglu --normalization RMSNorm "
                               "--position-embedding-type rope --disable-bias-linear and "
                               "--num-experts, without --group-query-attention or biases")
        return _mg_deepseek(flags, layers, hidden, heads, seq, dims["--vocab-size"], ffn,
                            experts, topk, untie), seq
    # As Megatron-LM checks them: each query group holds whole heads
    # (megatron/core/transformer/attention.py divides heads by groups), and a token's top-k
    # experts are among the experts (megatron/core/transformer/transformer_config.py,
    # "moe_router_topk ... should be less than or equal to num_moe_experts").
    if gqa and heads % groups:
        raise OpgraphError(f"Megatron --num-attention-heads {heads} is not a multiple of "
                           f"--num-query-groups {groups}; give a number of groups that divides "
                           "the heads")
    if experts and topk > experts:
        raise OpgraphError(f"Megatron --moe-router-topk {topk} is more than --num-experts "
                           f"{experts}; a token is routed to at most every expert")
    if all(llama_parts.values()):
        if hidden % heads and head_dim is None:
            raise OpgraphError(f"Megatron --hidden-size {hidden} is not divisible by "
                               f"--num-attention-heads {heads}; give --kv-channels")
        return LlamaConfig(
            MEGATRON_MODEL, d_model=hidden, layers=layers, heads=heads,
            kv_heads=groups if gqa else heads,
            d_ff=ffn or 8 * hidden // 192 * 64, vocab=dims["--vocab-size"],
            head_dim=head_dim, seq_len=seq, tie_embeddings=not untie,
            qkv_bias=qkv_bias or not no_bias, o_bias=not no_bias, mlp_bias=not no_bias,
            experts=experts or 0, experts_per_token=topk if experts else 0), seq
    if any(llama_parts.values()):
        given = [part for part, on in llama_parts.items() if on]
        raise OpgraphError(f"Megatron model with {' and '.join(given)} but not the rest: opgraph "
                           "models SwiGLU + RMSNorm + RoPE (Llama) or GeLU + LayerNorm + learned "
                           "positions (GPT-2)")
    for flag, on in (("--num-experts", experts), ("--group-query-attention", gqa),
                     ("--kv-channels", head_dim not in (None, hidden // heads))):
        if on:
            raise OpgraphError(f"Megatron {flag} with a GPT-2 model (GeLU, LayerNorm, learned "
                               "positions) is not modelled; opgraph's GPT-2 is dense "
                               "multi-head attention")
    if no_bias:
        flags.read.discard("--disable-bias-linear")  # not modelled for GPT-2: left over
    if hidden % heads:
        raise OpgraphError(f"Megatron --hidden-size {hidden} is not divisible by "
                           f"--num-attention-heads {heads}")
    return GPT2Config(MEGATRON_MODEL, d_model=hidden, layers=layers, heads=heads,
                      vocab=dims["--vocab-size"], positions=positions or seq,
                      d_ff=ffn if ffn != 4 * hidden else None, seq_len=seq,
                      tie_embeddings=not untie), seq


_MG_MLA = ("--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim",
           "--moe-ffn-hidden-size")


def _mg_deepseek(flags: _Flags, layers: int, hidden: int, heads: int, seq: int, vocab: int,
                 ffn: int | None, experts: int, topk: int, untie: bool) -> DeepSeekV2Config:
    """A DeepSeek-V2 model from Megatron's latent-attention and MoE flags (`_mg_deepseek_args`
    writes them): the latents' widths and the heads' parts, each expert's width, the shared
    experts as whole experts of that width, the dense layers first (--moe-layer-freq)."""
    widths = {flag: flags.whole(flag) for flag in _MG_MLA}
    missing = [flag for flag, value in widths.items() if value is None]
    if missing:
        raise OpgraphError(f"Megatron --multi-latent-attention arguments lack "
                           f"{', '.join(missing)}; give them all")
    flags.switch("--qk-layernorm")  # DeepSeek-V2 norms its latents; the model has the norms
    expert = widths["--moe-ffn-hidden-size"]
    shared = flags.whole("--moe-shared-expert-intermediate-size", 0)
    if shared % expert:
        raise OpgraphError(f"Megatron --moe-shared-expert-intermediate-size {shared} is not a "
                           f"whole number of experts of --moe-ffn-hidden-size {expert}")
    return DeepSeekV2Config(
        MEGATRON_MODEL, d_model=hidden, layers=layers, heads=heads,
        kv_lora_rank=widths["--kv-lora-rank"], qk_nope_head_dim=widths["--qk-head-dim"],
        qk_rope_head_dim=widths["--qk-pos-emb-head-dim"], v_head_dim=widths["--v-head-dim"],
        d_ff=ffn or 8 * hidden // 192 * 64, moe_d_ff=expert, shared_experts=shared // expert,
        routed_experts=experts, experts_per_token=topk,
        first_dense=_mg_dense_first(flags.text("--moe-layer-freq"), layers), vocab=vocab,
        q_lora_rank=flags.whole("--q-lora-rank"), seq_len=seq, tie_embeddings=not untie,
        mtp_depth=flags.whole("--mtp-num-layers", 0))


_MG_FREQ_LIST = re.compile(r"(?:\[0\]\*(\d+)\+)?\[1\]\*(\d+)")  # [0]*k+[1]*m


def _mg_dense_first(text: str | None, layers: int) -> int:
    """How many dense layers come first, from Megatron's --moe-layer-freq (parsed, never
    evaluated): 1 (Megatron's default, every layer has experts), `[0]*k+[1]*m` (in parentheses
    or quotes or not), or a list of 0s and then 1s; other patterns are not modelled."""
    if text is None:
        return 0
    form = text.replace(" ", "").strip("'\"")
    while form.startswith("(") and form.endswith(")"):
        form = form[1:-1]
    shown = (f"Megatron --moe-layer-freq {text!r}: opgraph models dense layers first, then "
             "experts in every layer: 1, [0]*k+[1]*m, or a list of 0s then 1s")
    if form.isdigit():
        if _whole_text(form, "Megatron --moe-layer-freq") != 1:
            raise OpgraphError(shown)
        return 0
    found = _MG_FREQ_LIST.fullmatch(form)
    if found:
        dense = (0 if found[1] in (None, "0") else
                 _whole_text(found[1], "Megatron --moe-layer-freq's dense layers"))
        total = dense + _whole_text(found[2], "Megatron --moe-layer-freq's expert layers")
    elif re.fullmatch(r"\[[01](,[01])*\]", form):
        bits = form[1:-1].split(",")
        dense = bits.index("1") if "1" in bits else len(bits)
        if "0" in bits[dense:]:
            raise OpgraphError(shown)
        total = len(bits)
    else:
        raise OpgraphError(shown)
    if total != layers:
        raise OpgraphError(f"Megatron --moe-layer-freq {text!r} has {total} layers; "
                           f"--num-layers is {layers}")
    return dense


def _mg_zero(flags: _Flags) -> int:
    """ZeRO stage: the distributed optimizer shards optimizer states; Megatron FSDP as told."""
    strategy = flags.text("--data-parallel-sharding-strategy") or "optim_grads_params"
    if flags.switch("--use-megatron-fsdp") | flags.switch("--use-custom-fsdp"):
        return _MG_SHARDING[strategy]
    return 1 if flags.switch("--use-distributed-optimizer") else 0


def _mg_layout(flags: _Flags, layers: int, tp: int, gpus: int | None) -> Parallel:
    pp = flags.whole("--pipeline-model-parallel-size", 1)
    cp = flags.whole("--context-parallel-size", 1)
    if gpus is None:
        raise OpgraphError("Megatron's arguments do not say how many GPUs the job has (the "
                           "launcher does): give the number of GPUs (--gpus)")
    gpus = check_whole(gpus, "--gpus", MAX_DIM)
    if gpus % (tp * cp * pp):
        raise OpgraphError(f"--gpus {gpus} is not divisible by tp x cp x pp = {tp * cp * pp}")
    micro = flags.whole("--micro-batch-size")
    if micro is None:
        raise OpgraphError("Megatron arguments lack --micro-batch-size; give it")
    per_virtual = flags.whole("--num-layers-per-virtual-pipeline-stage")
    virtual = flags.whole("--num-virtual-stages-per-pipeline-rank")
    if per_virtual is not None:
        if layers % (pp * per_virtual):
            raise OpgraphError(f"Megatron --num-layers {layers} is not divisible by pp x "
                               f"--num-layers-per-virtual-pipeline-stage = {pp} x {per_virtual}")
        from_layers = layers // pp // per_virtual
        if virtual is not None and virtual != from_layers:
            raise OpgraphError(f"Megatron --num-virtual-stages-per-pipeline-rank {virtual} "
                               f"disagrees with {from_layers} from "
                               "--num-layers-per-virtual-pipeline-stage; give one")
        virtual = from_layers
    return Parallel(
        tp=tp, pp=pp, cp=cp, ep=flags.whole("--expert-model-parallel-size", 1),
        dp=gpus // (tp * cp * pp), gpus=gpus, micro_batch=micro,
        global_batch=flags.whole("--global-batch-size"), virtual_stages=virtual or 1,
        sequence_parallel=flags.switch("--sequence-parallel"), zero=_mg_zero(flags),
        async_tp=flags.switch("--tp-comm-overlap"),
        overlap_grad_reduce=flags.switch("--overlap-grad-reduce"),
        overlap_param_gather=flags.switch("--overlap-param-gather"),
        grad_reduce_dtype="bf16" if flags.switch("--grad-reduce-in-bf16") else None,
        first_stage_layers=flags.whole("--decoder-first-pipeline-num-layers"),
        last_stage_layers=flags.whole("--decoder-last-pipeline-num-layers"))


def _mg_recompute(flags: _Flags) -> str:
    granularity = flags.text("--recompute-granularity")
    method = flags.text("--recompute-method")
    count = flags.whole("--recompute-num-layers")
    if flags.switch("--recompute-activations"):
        granularity = "selective"  # as Megatron's arguments.py sets it
    if "--recompute-modules" in flags and flags.flags["--recompute-modules"] != ["core_attn"]:
        flags.read.discard("--recompute-modules")  # other modules are not modelled: left over
    if granularity is None:
        return "none"
    if granularity == "selective":
        return "selective"
    if method != "uniform" or count != 1:
        raise OpgraphError(f"Megatron full recomputation with --recompute-method {method} "
                           f"--recompute-num-layers {count} is not modelled; opgraph re-runs "
                           "every layer: --recompute-method uniform --recompute-num-layers 1")
    return "full"


def to_megatron(launch: Launch) -> str:
    """Megatron-LM's arguments for a launch, one line: the inverse of `read_megatron` (give
    `gpus=launch.parallel.gpus` to read them back; a preset is written as its dimensions and
    reads back as a config named "megatron-model").

    A vocabulary that tp divides is kept as it is (--make-vocab-size-divisible-by 1 where 128 x
    tp does not divide it); any other is padded by Megatron. torchtitan's per-op selective
    recomputation ("selective-op") has no Megatron form and is an error.

        >>> to_megatron(Launch(model="gpt2", seq_len=1024, parallel=Parallel(gpus=1)))[:38]
        '--num-layers 12 --hidden-size 768 --nu'
    """
    config = _config(launch.model, "Megatron")
    p = launch.parallel
    seq = launch.seq_len or config.seq_len or config.positions
    args: list[str] = ["--num-layers", str(config.layers), "--hidden-size", str(config.d_model),
                       "--num-attention-heads", str(config.heads)]
    if isinstance(config, LlamaConfig):
        args += _mg_llama_args(config)
        positions = seq
    elif isinstance(config, DeepSeekV2Config):
        args += _mg_deepseek_args(config)
        positions = seq
    else:
        positions = config.positions
        if config.d_ff is not None:
            args += ["--ffn-hidden-size", str(config.d_ff)]
    args += ["--seq-length", str(seq), "--max-position-embeddings", str(positions),
             "--vocab-size", str(config.vocab)]
    if config.vocab % (128 * p.tp) and not config.vocab % p.tp:
        args += ["--make-vocab-size-divisible-by", "1"]
    if not config.tie_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    args += ["--tensor-model-parallel-size", str(p.tp), "--pipeline-model-parallel-size",
             str(p.pp), "--context-parallel-size", str(p.cp), "--expert-model-parallel-size",
             str(p.ep), "--micro-batch-size", str(p.micro_batch), "--global-batch-size",
             str(p.global_batch)]
    if p.virtual_stages > 1:
        if config.layers % (p.pp * p.virtual_stages):
            raise OpgraphError(f"{config.layers} layers do not divide into pp x virtual stages = "
                               f"{p.pp} x {p.virtual_stages} chunks for Megatron")
        args += ["--num-layers-per-virtual-pipeline-stage",
                 str(config.layers // p.pp // p.virtual_stages)]
    for flag, value in (("--decoder-first-pipeline-num-layers", p.first_stage_layers),
                        ("--decoder-last-pipeline-num-layers", p.last_stage_layers)):
        if value is not None:
            args += [flag, str(value)]
    args += [flag for flag, on in (("--sequence-parallel", p.sequence_parallel),
                                   ("--tp-comm-overlap", p.async_tp),
                                   ("--overlap-grad-reduce", p.overlap_grad_reduce),
                                   ("--overlap-param-gather", p.overlap_param_gather),
                                   ("--grad-reduce-in-bf16", reduce_dtype(p) == "bf16")) if on]
    if reduce_dtype(p) == "fp16":
        raise OpgraphError("Megatron-LM trained in bf16 reduces gradients in fp32 or bf16 "
                           "(--grad-reduce-in-bf16), not fp16")
    args += _mg_zero_args(p.zero) + _mg_recompute_args(launch.recompute) + ["--bf16"]
    if launch.precision == "fp8":
        args += ["--fp8-format", "hybrid"]
    if launch.fuse is None:
        args += list(_MG_NO_FUSION)
    return shlex.join(args)


def _mg_llama_args(config: LlamaConfig) -> list[str]:
    args = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
            "--ffn-hidden-size", str(config.d_ff)]
    if config.kv_heads != config.heads:
        args += ["--group-query-attention", "--num-query-groups", str(config.kv_heads)]
    if config.head_dim is not None:
        args += ["--kv-channels", str(config.head_dim)]
    if config.o_bias != config.mlp_bias or (config.o_bias and not config.qkv_bias):
        raise OpgraphError(f"model {config.name}: Megatron puts biases on all linear layers or "
                           "none (plus --add-qkv-bias); these biases have no Megatron form")
    if not config.o_bias:
        args.append("--disable-bias-linear")
        if config.qkv_bias:
            args.append("--add-qkv-bias")
    if config.experts:
        args += ["--num-experts", str(config.experts), "--moe-router-topk",
                 str(config.experts_per_token)]
    return args


def _mg_deepseek_args(config: DeepSeekV2Config) -> list[str]:
    """DeepSeek-V2 in Megatron-LM's flags: multi-head latent attention with its latents'
    norms (--qk-layernorm), and the routed and shared experts of every layer after the first
    `first_dense` (--moe-layer-freq, the list form Megatron's DeepSeek scripts write)."""
    args = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
            "--disable-bias-linear", "--ffn-hidden-size", str(config.d_ff),
            "--multi-latent-attention", "--qk-layernorm",
            "--kv-lora-rank", str(config.kv_lora_rank),
            "--qk-head-dim", str(config.qk_nope_head_dim),
            "--qk-pos-emb-head-dim", str(config.qk_rope_head_dim),
            "--v-head-dim", str(config.v_head_dim)]
    if config.q_lora_rank:
        args += ["--q-lora-rank", str(config.q_lora_rank)]
    moe = config.layers - config.first_dense
    args += ["--num-experts", str(config.routed_experts),
             "--moe-router-topk", str(config.experts_per_token),
             "--moe-ffn-hidden-size", str(config.moe_d_ff),
             "--moe-layer-freq", f"[0]*{config.first_dense}+[1]*{moe}" if config.first_dense
             else "1"]
    if config.shared_experts:
        args += ["--moe-shared-expert-intermediate-size",
                 str(config.shared_experts * config.moe_d_ff)]
    if config.mtp_depth:
        args += ["--mtp-num-layers", str(config.mtp_depth)]
    return args


def _mg_zero_args(zero: int) -> list[str]:
    if zero == 1:
        return ["--use-distributed-optimizer"]
    if zero in (2, 3):
        strategy = {2: "optim_grads", 3: "optim_grads_params"}[zero]
        return ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy]
    return []


def _mg_recompute_args(recompute: str) -> list[str]:
    if recompute == "selective-op":
        raise OpgraphError("Megatron has no per-op selective recomputation ('selective-op'); "
                           "give selective (attention core), full or none")
    return {"none": [], "selective": ["--recompute-granularity", "selective"],
            "full": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                     "--recompute-num-layers", "1"]}[recompute]
