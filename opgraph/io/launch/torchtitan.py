"""torchtitan's job TOML read into a `Launch` (`read_torchtitan`) and written from one
(`to_torchtitan`)."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

from ...core.choices import TORCHTITAN
from ...core.datafile import read_small
from ...core.errors import OpgraphError
from ...core.limits import MAX_DIM, check_whole
from ...parallel.frameworks import reduce_dtype
from ...parallel.parallel import Parallel
from .record import PRESET_CONFIGS, Config, Launch, _not_real, _real_names, own_framework

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
    "compile.enable", "compile.components", "float8.enable_float8_linear",
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
    "compile.backend",
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
# torchao's Float8 recipes (`recipe_name`; none: tensor-wise) -> the precision that models them
_TT_FLOAT8_RECIPES = {None: "fp8", "tensorwise": "fp8", "rowwise": "fp8-rowwise"}
# Float8 options whose effect opgraph models only at this value (their sections are otherwise
# quiet): FSDP gathering BF16 weights and each layer's FP8 weight kept for its backward
# (torchao's Float8LinearConfig, as torchtitan's [float8] and [quantize.linear.float8]
# sections pass them)
_TT_FLOAT8_ASSUMED = {"enable_fsdp_float8_all_gather": False,
                      "precompute_float8_dynamic_scale_for_fsdp": False,
                      "force_recompute_fp8_weight_in_bwd": False}
_TT_SINGLE_STAGE = ("1F1B", "GPipe")  # one stage per rank; the others interleave several
_TT_MODELLED_SCHEDULES = ("1F1B", "Interleaved1F1B")


def read_torchtitan(path: str | Path, gpus: int | None = None) -> Launch:
    """The Launch of a torchtitan job TOML, in its late-2024 or its 2025 layout.

    The model is torchtitan's llama3 flavor 8B, 70B or 405B (presets llama3-8b, llama3-70b,
    llama3.1-405b). Defaults are torchtitan's: local batch 8, sequence 2048, shard degree -1,
    selective activation checkpointing of every 2nd layer (an error: say the mode).

    Data parallelism: `data_parallel_shard_degree` ranks run FSDP (ZeRO 3), -1 meaning the GPUs
    left over (then `gpus` is needed); `data_parallel_replicate_degree` ranks alone run DDP
    (ZeRO 0). Both above one is HSDP: FSDP within each replica's shard x cp ranks, the
    gradient shards all-reduced across the replicas (the layout's `replicate`). With context
    parallelism torchtitan's FSDP shards over the cp ranks
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
    if not fp8:
        return "bf16"
    recipe = None
    for section in ("float8", "quantize.linear.float8"):
        # the Float8 options that change the step, which opgraph's FP8 does not model
        for name, modelled in _TT_FLOAT8_ASSUMED.items():
            value = keys.get(f"{section}.{name}")
            if value is not None and value != modelled:
                unknown.append(f"{section}.{name} = {value!r} (opgraph models {modelled!r})")
        value = keys.get(f"{section}.recipe_name")
        if not isinstance(value, (str, type(None))) or value not in _TT_FLOAT8_RECIPES:
            unknown.append(f"{section}.recipe_name = {value!r} (opgraph models "
                           f"{', '.join(repr(r) for r in _TT_FLOAT8_RECIPES if r)}; read as "
                           "'tensorwise')")
        elif value is not None:
            recipe = value
    return _TT_FLOAT8_RECIPES[recipe]


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


def _tt_data_parallel(keys: dict, model_ranks: int, cp: int,
                      gpus: int | None) -> tuple[int, int, int]:
    """The data-parallel degree, ZeRO stage and HSDP replicas: FSDP over the shard and
    context-parallel ranks (torchtitan's `dp_shard_cp` mesh: its ParallelDims.fsdp_enabled is
    dp_shard > 1 or cp > 1, torchtitan/distributed/parallel_dims.py), replicated over the
    replicas (DDP where nothing is sharded)."""
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
    return replicate * shard, 3 if fsdp else 0, replicate if fsdp else 1


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
    dp, zero, replicate = _tt_data_parallel(keys, tp * cp * pp, cp, gpus)
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
        sequence_parallel=tp > 1, zero=zero, replicate=replicate,
        async_tp=_tt_flag(keys, "parallelism.enable_async_tensor_parallel"),
        grad_reduce_dtype="bf16" if reduce == "bfloat16" else None,
        framework=_tt_framework(keys, data, unknown))
    return Launch(model=model, seq_len=_tt_whole(keys, "training.seq_len", 2048),
                  parallel=layout, recompute=_tt_recompute(keys),
                  precision=_tt_precision(keys, unknown),
                  fuse="elementwise" if _tt_flag(keys, "compile.enable") else None,
                  unknown=tuple(unknown), source=source)


def _tt_framework(keys: dict, data: dict, unknown: list[str]) -> str:
    """The framework row the file's torchtitan runs: "torchtitan", whose torch.compile takes the
    loss beside the blocks (from pytorch/torchtitan@bbb1b616e, April 2025; `compile.components`,
    August 2025, default the model and the loss), or "torchtitan-2024", which leaves the loss
    eager: a file that says `training.batch_size` (renamed `local_batch_size` in June 2025), as
    the December 2024 benchmark runs' do (9dec370). A file of April to June 2025 in that layout
    ran the compiled loss and is read as the earlier."""
    components = keys.get("compile.components")
    if components is not None:
        if not isinstance(components, list) or not all(isinstance(c, str) for c in components):
            raise OpgraphError(f"torchtitan compile.components = {components!r}: give a list of "
                               'names, e.g. ["model", "loss"]')
        if "model" not in components:
            unknown.append(f"compile.components = {components!r} (read as the model compiled)")
        return "torchtitan" if "loss" in components else "torchtitan-2024"
    return "torchtitan-2024" if "batch_size" in data.get("training", {}) else "torchtitan"


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
    own_framework(p, p.framework if p.framework in TORCHTITAN else "torchtitan")
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
    if p.attention_library not in (None, "flash"):
        raise OpgraphError(f"torchtitan's config names no attention kernel (PyTorch's SDPA picks "
                           f"FlashAttention); {p.attention_library} attention has no torchtitan "
                           "form")
    if p.cp > 1 and p.cp_comm == "a2a":
        raise OpgraphError("torchtitan's context parallelism is ring attention (its rotate "
                           "methods pass keys and values around the ring); the all-to-all "
                           "(--cp-comm a2a) has no torchtitan form")
    if launch.recompute.startswith("selective") and launch.recompute != "selective-op":
        raise OpgraphError(f"torchtitan has no Megatron-style selective recomputation "
                           f"({launch.recompute!r}); give selective-op, full or none")
    if p.tp > 1 and _has_experts(launch.model):
        raise OpgraphError("torchtitan runs the experts whole on each TP rank "
                           "(expert_tensor_parallel_degree 1) where opgraph splits them over "
                           "TP: give tp 1 for a model with experts")
    if p.dp % p.replicate:
        raise OpgraphError(f"torchtitan's replicas are a mesh dimension of the data-parallel "
                           f"ranks: --replicate {p.replicate} must divide dp {p.dp}, not only "
                           f"dp x cp")
    shard, replicate = (p.dp // p.replicate, p.replicate) if p.zero == 3 else (1, p.dp)
    local = p.global_batch // p.dp if p.pp > 1 else p.micro_batch
    config = PRESET_CONFIGS[launch.model]
    model = {"name": name, "flavor": flavor}
    if launch.precision != "bf16":
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
                **({"quantize.linear.float8": {"recipe_name": "rowwise"}}
                   if launch.precision == "fp8-rowwise" else {}),
                "activation_checkpoint": checkpoint,
                "compile": {"enable": launch.fuse == "elementwise",
                            # the row that leaves the loss eager (`_tt_framework`)
                            **({"components": ["model"]} if launch.fuse == "elementwise"
                               and p.framework == "torchtitan-2024" else {})}}
    lines = ["# torchtitan job config written by opgraph"]
    for section, table in sections.items():
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in table.items())
        lines.append("")
    return "\n".join(lines)
