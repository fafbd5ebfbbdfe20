"""Megatron-Bridge's recipe runner read into a `Launch` (`read_bridge`) and written from one
(`to_bridge`): the form of a Megatron job whose model Megatron-LM's flags cannot describe.

Megatron-Bridge (NVIDIA-NeMo/Megatron-Bridge) trains Hugging Face architectures on Megatron-Core.
Its launcher, `scripts/training/run_recipe.py`, takes a recipe function by name (`--recipe`), which
builds the whole ConfigContainer (the model among it), then Hydra-style `KEY=VALUE` overrides of
that container and a few short forms of them (`-tp 2` is `model.tensor_model_parallel_size=2`):

    torchrun --nproc-per-node 8 scripts/training/run_recipe.py \\
        --recipe gemma2_2b_pretrain_config --mode pretrain \\
        model.tensor_model_parallel_size=2 train.global_batch_size=64 ...

A recipe fixes the model, so opgraph reads it as the preset it builds (`RECIPES`), and a field
the overrides leave alone as the recipe sets it (each recipe's settings are copied from its
source below). Values are parsed as OmegaConf writes them (true, false, null, whole numbers,
[a,b] lists), never evaluated. As with Megatron-LM's flags, a key opgraph reads but spelt wrong
is a one-line error with the nearest name; another real key opgraph does not model is listed
in `Launch.unknown` (Bridge's ConfigContainer has hundreds; opgraph does not keep their names,
so a key it neither reads nor keeps quiet is reported, not refused); a setting opgraph cannot
stand in for is a one-line error.
"""

from __future__ import annotations

import difflib
import re
import shlex

import attrs

from ...core.errors import OpgraphError
from ...core.limits import MAX_DIM, check_whole
from ...parallel.frameworks import check_precision, reduce_dtype
from ...parallel.parallel import Parallel
from ...core.choices import SELECTIVE
from .record import (MEGATRON_SHARDING, Launch, _whole_text, data_parallel, launcher,
                     megatron_modules, megatron_recompute, own_framework)

BRIDGE_SOURCE = "megatron-bridge recipe"
BRIDGE_SCRIPT = "scripts/training/run_recipe.py"
VIRTUAL = "model.virtual_pipeline_model_parallel_size"


@attrs.frozen
class Recipe:
    """A Megatron-Bridge recipe opgraph can read and write: the preset it builds, the settings
    it gives the fields opgraph reads (override key -> value), and whether its attention runs
    under context parallelism."""

    name: str
    preset: str
    settings: dict
    aliases: tuple[str, ...] = ()
    context_parallel: bool = True


# The keys opgraph reads, as `_pretrain_common` (src/megatron/bridge/recipes/common.py) sets them
# (or the field's own default, where it sets none); a recipe sets some of them again.
_COMMON = {
    "train.global_batch_size": 32, "train.micro_batch_size": 2, "dataset.seq_length": 4096,
    "ddp.use_distributed_optimizer": True, "ddp.use_megatron_fsdp": False,
    "ddp.data_parallel_sharding_strategy": "optim_grads_params",
    "ddp.grad_reduce_in_fp32": True, "ddp.overlap_grad_reduce": True,
    "ddp.overlap_param_gather": True, "mixed_precision": "bf16_mixed",
    "model.tensor_model_parallel_size": 1, "model.pipeline_model_parallel_size": 1,
    "model.context_parallel_size": 1, "model.virtual_pipeline_model_parallel_size": None,
    "model.expert_model_parallel_size": 1, "model.sequence_parallel": False,
    "model.recompute_granularity": None, "model.recompute_method": None,
    "model.recompute_num_layers": None, "model.recompute_modules": None,
    "model.num_layers_in_first_pipeline_stage": None,
    "model.num_layers_in_last_pipeline_stage": None,
    "model.pipeline_model_parallel_layout": None,
    # Megatron-Core's TransformerConfig leaves the bias fusions off; Bridge's GPTModelProvider
    # turns the masked-softmax one on (models/gpt_provider.py)
    "model.bias_activation_fusion": False, "model.bias_dropout_fusion": False,
    "model.masked_softmax_fusion": True, "comm_overlap.tp_comm_overlap": False,
}

# Megatron-Bridge at 067f987 (2026-08-22).
RECIPES: tuple[Recipe, ...] = (
    # recipes/gemma/h100/gemma2.py, gemma2_2b_pretrain_2gpu_h100_bf16_config ("Default
    # parallelism: TP=2, PP=1"), aliased as gemma2_2b_pretrain_config by recipes/gemma/gemma2.py;
    # its model is AutoBridge.from_hf_pretrained("google/gemma-2-2b"), opgraph's gemma2-2b. Its
    # attention (models/gemma/gemma2_provider.py, Gemma2DotProductAttention, for the logits'
    # soft-capping) raises "Context parallelism is only supported by TEDotProductAttention".
    Recipe("gemma2_2b_pretrain_config", "gemma2-2b", _COMMON | {
        "model.tensor_model_parallel_size": 2,
        "ddp.grad_reduce_in_fp32": False, "ddp.overlap_grad_reduce": False,
        "ddp.overlap_param_gather": False, "ddp.data_parallel_sharding_strategy": "no_shard"},
        aliases=("gemma2_2b_pretrain_2gpu_h100_bf16_config",), context_parallel=False),
)
BRIDGE_PRESETS = {r.preset: r for r in RECIPES}
_BY_NAME = {name: r for r in RECIPES for name in (r.name, *r.aliases)}

# run_recipe.py's short forms (its COMMON_OVERRIDE_FIELDS and argparse short names): `-tp 2` or
# `--tensor_model_parallel_size 2`, the key's own field name, for each key below
_SHORT_KEYS = {
    "gb": "train.global_batch_size", "mb": "train.micro_batch_size", "sl": "dataset.seq_length",
    "tp": "model.tensor_model_parallel_size", "pp": "model.pipeline_model_parallel_size",
    "cp": "model.context_parallel_size", "vp": "model.virtual_pipeline_model_parallel_size",
    "ep": "model.expert_model_parallel_size",
}
_SHORT = {form: key for short, key in _SHORT_KEYS.items()
          for form in (f"-{short}", f"--{key.partition('.')[2]}")}
# run_recipe.py options and ConfigContainer keys that do not change the step's time
_QUIET_OPTIONS = frozenset((
    "-ms", "--max_steps", "--lr", "--min_lr", "--warmup_iters", "--pretrained_checkpoint",
    "--save_dir", "--load_dir", "--save_interval", "--dataset", "--step-func", "--step_func",
    "--dry-run", "--dry_run", "--deterministic", "--dump-env", "--dump_env"))
_SWITCHES = frozenset(("--dry-run", "--dry_run", "--deterministic", "--dump-env", "--dump_env"))
_QUIET_SECTIONS = ("optimizer.", "scheduler.", "checkpoint.", "logger.", "tokenizer.", "rng.",
                   "validation.", "profiling.", "ft.", "straggler.", "nvrx_straggler.",
                   "rerun_state_machine.", "inprocess_restart.", "tensor_inspect.", "env_vars.")
_QUIET_KEYS = frozenset(("train.train_iters", "train.manual_gc", "train.manual_gc_interval",
                         "train.manual_gc_eval", "dataset.blend", "dataset.num_workers",
                         "dataset.random_seed", "dataset.split", "ddp.check_for_nan_in_grad",
                         "ddp.average_in_collective", "model.seq_length"))
_SECTIONS = ("model.", "train.", "ddp.", "dataset.", "dist.", "comm_overlap.", "peft.",
             *_QUIET_SECTIONS)
_PRECISIONS = {"bf16_mixed": "bf16", "fp16_mixed": "bf16",
               "bf16_with_fp8_current_scaling_mixed": "fp8",
               "bf16_with_fp8_delayed_scaling_mixed": "fp8"}


def _bridge_precision(precision: str) -> str:
    """Megatron-Bridge's mixed_precision recipe for a precision opgraph models (Megatron-Core
    runs it: Megatron-LM's precisions, `frameworks.check_precision`)."""
    check_precision("megatron", precision)
    return "bf16_with_fp8_current_scaling_mixed" if precision == "fp8" else "bf16_mixed"


def is_bridge(tokens: list[str]) -> bool:
    """Whether a command line's tokens run Megatron-Bridge's recipe runner."""
    return any(t.endswith("run_recipe.py") or t == "--recipe" or t.startswith("--recipe=")
               for t in tokens)


def read_bridge(tokens: list[str], gpus: int | None) -> Launch:
    """The Launch of run_recipe.py's arguments (`tokens`, after the script), on `gpus` GPUs
    (the caller's or the launcher's)."""
    recipe, values, unknown = _parse(tokens)
    s = recipe.settings | values
    whole = {key: _whole(s, key) for key in (
        "model.tensor_model_parallel_size", "model.pipeline_model_parallel_size",
        "model.context_parallel_size", "model.expert_model_parallel_size",
        "train.global_batch_size", "train.micro_batch_size", "dataset.seq_length")}
    tp, pp, cp = (whole[f"model.{k}_parallel_size"] for k in ("tensor_model", "pipeline_model",
                                                             "context"))
    if cp > 1 and not recipe.context_parallel:
        raise OpgraphError(f"Megatron-Bridge's {recipe.name} runs its own attention, without "
                           "context parallelism; give model.context_parallel_size=1")
    gpus, dp = data_parallel(gpus, tp * cp * pp, "Megatron-Bridge's")
    for key in ("model.num_layers_in_first_pipeline_stage",
                "model.num_layers_in_last_pipeline_stage", "model.pipeline_model_parallel_layout"):
        if s[key] is not None:
            raise OpgraphError(f"Megatron-Bridge {key}: opgraph reads even pipeline splits of "
                               f"{recipe.preset}; leave it null")
    virtual, zero = s[VIRTUAL], _zero(s)
    layout = Parallel(
        tp=tp, pp=pp, cp=cp, ep=whole["model.expert_model_parallel_size"],
        dp=dp, gpus=gpus, micro_batch=whole["train.micro_batch_size"],
        global_batch=whole["train.global_batch_size"],
        virtual_stages=1 if virtual is None else _whole(s, VIRTUAL),
        sequence_parallel=_switch(s, "model.sequence_parallel"), zero=zero,
        async_tp=_switch(s, "comm_overlap.tp_comm_overlap"),
        overlap_grad_reduce=_switch(s, "ddp.overlap_grad_reduce"),
        # what opgraph calls the parameter gather's overlap is the distributed optimizer's
        # (ZeRO 1-2); Megatron FSDP's ZeRO-3 prefetch is modelled with ZeRO-3 itself
        overlap_param_gather=_switch(s, "ddp.overlap_param_gather") and zero in (1, 2),
        grad_reduce_dtype=None if _switch(s, "ddp.grad_reduce_in_fp32") else "bf16",
        framework="megatron")
    precision = _PRECISIONS.get(s["mixed_precision"])
    if precision is None:
        raise OpgraphError(f"Megatron-Bridge mixed_precision={s['mixed_precision']}: opgraph "
                           f"models {', '.join(_PRECISIONS)}")
    fused = all(_switch(s, f"model.{k}_fusion") for k in ("bias_activation", "bias_dropout",
                                                          "masked_softmax"))
    return Launch(model=recipe.preset, seq_len=whole["dataset.seq_length"], parallel=layout,
                  recompute=_recompute(s, unknown), precision=precision,
                  fuse="elementwise" if fused else None, unknown=tuple(unknown),
                  source=BRIDGE_SOURCE)


def _parse(tokens: list[str]) -> tuple[Recipe, dict, list[str]]:
    """The recipe, the overrides' values by key, and what is not modelled."""
    recipe_name, mode, values, unknown = None, None, {}, []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token.startswith("-"):
            name, has_value, value = token.partition("=")
            known = name in ("--recipe", "--mode") or name in _SHORT or name in _QUIET_OPTIONS
            if name == "--model":
                raise OpgraphError("Megatron-Bridge --model names a recipe stem; opgraph reads "
                                   f"recipes by their function: give --recipe "
                                   f"({', '.join(_BY_NAME)})")
            if not known:
                raise OpgraphError(f"Megatron-Bridge's run_recipe.py has no option {name}; "
                                   "give KEY=VALUE overrides, --recipe and its short forms")
            if name not in _SWITCHES and not has_value:
                if i + 1 >= len(tokens):
                    raise OpgraphError(f"Megatron-Bridge option {name} takes a value; give one")
                value, i = tokens[i + 1], i + 1
            if name == "--recipe":
                recipe_name = value
            elif name == "--mode":
                mode = value
            elif name in _SHORT:
                values[_SHORT[name]] = _value(value, _SHORT[name])
        elif "=" in token:
            key, _, value = token.partition("=")
            key = key.lstrip("+")
            _check_key(key)
            values[key] = _value(value, key)
            if key not in _COMMON and key not in _QUIET_KEYS and not key.startswith(
                    _QUIET_SECTIONS):
                unknown.append(key)
        else:
            raise OpgraphError(f"Megatron-Bridge argument {token!r} is neither an option nor a "
                               "KEY=VALUE override")
        i += 1
    if mode not in (None, "pretrain"):
        raise OpgraphError(f"Megatron-Bridge --mode {mode}: opgraph models pre-training; give "
                           "--mode pretrain")
    if recipe_name is None:
        raise OpgraphError("Megatron-Bridge arguments lack --recipe; give the recipe function "
                           f"({', '.join(_BY_NAME)})")
    if recipe_name not in _BY_NAME:
        raise OpgraphError(f"Megatron-Bridge recipe {recipe_name}: opgraph reads "
                           f"{', '.join(_BY_NAME)} (Megatron-LM's flags describe the other "
                           "models)")
    if "model.seq_length" in values and values["model.seq_length"] != values.get(
            "dataset.seq_length", _BY_NAME[recipe_name].settings["dataset.seq_length"]):
        raise OpgraphError("Megatron-Bridge's run_recipe.py sets model.seq_length from "
                           "dataset.seq_length; give dataset.seq_length")
    return _BY_NAME[recipe_name], {k: v for k, v in values.items() if k in _COMMON}, unknown


def _check_key(key: str) -> None:
    """A key of a ConfigContainer section; a near miss of a key opgraph reads is refused."""
    if not key.startswith(_SECTIONS) and key != "mixed_precision":
        raise OpgraphError(f"Megatron-Bridge's ConfigContainer has no section for {key}; give "
                           f"a key under {', '.join(s.rstrip('.') for s in _SECTIONS[:6])}, ...")
    if key in _COMMON:
        return
    near = difflib.get_close_matches(key, sorted(_COMMON), n=1, cutoff=0.9)
    if near:
        raise OpgraphError(f"Megatron-Bridge key {key} is not one opgraph knows; did you mean "
                           f"{near[0]}?")


_LIST = re.compile(r"\[([A-Za-z0-9_, ]*)\]")


def _value(text: str, key: str):
    """An override's value as OmegaConf reads it: true/false, null, a whole number, a list of
    names, or text (quotes stripped). Parsed, never evaluated."""
    bare = text.strip().strip("'\"")
    if bare.lower() in ("true", "false"):
        return bare.lower() == "true"
    if bare.lower() in ("null", "none", "~"):
        return None
    if bare.isascii() and bare.isdigit():
        return _whole_text(bare, f"Megatron-Bridge {key}")
    match = _LIST.fullmatch(bare)
    if match:
        return [part.strip() for part in match.group(1).split(",") if part.strip()]
    return bare


def _whole(s: dict, key: str) -> int:
    value = s[key]
    if not isinstance(value, int) or isinstance(value, bool):
        raise OpgraphError(f"Megatron-Bridge {key}={value}: give a whole number")
    return check_whole(value, f"Megatron-Bridge {key}", MAX_DIM)


def _switch(s: dict, key: str) -> bool:
    value = s[key]
    if not isinstance(value, bool):
        raise OpgraphError(f"Megatron-Bridge {key}={value}: give true or false")
    return value


def _zero(s: dict) -> int:
    """Megatron FSDP by its sharding strategy, else the distributed optimizer (ZeRO 1)."""
    if _switch(s, "ddp.use_megatron_fsdp"):
        strategy = s["ddp.data_parallel_sharding_strategy"]
        if strategy not in MEGATRON_SHARDING:
            raise OpgraphError(f"Megatron-Bridge ddp.data_parallel_sharding_strategy="
                               f"{strategy}: give one of {', '.join(MEGATRON_SHARDING)}")
        return MEGATRON_SHARDING[strategy]
    return 1 if _switch(s, "ddp.use_distributed_optimizer") else 0


def _recompute(s: dict, unknown: list[str]) -> str:
    """As Megatron-LM's flags (`record.megatron_recompute`)."""
    granularity, method = s["model.recompute_granularity"], s["model.recompute_method"]
    modules = s["model.recompute_modules"]
    if modules is not None and not isinstance(modules, list):
        raise OpgraphError(f"Megatron-Bridge model.recompute_modules={modules}: give a list of "
                           "module names, such as [core_attn]")
    policy = megatron_recompute(granularity, method, s["model.recompute_num_layers"], modules)
    if policy is None:
        raise OpgraphError(f"Megatron-Bridge model.recompute_granularity={granularity} with "
                           f"model.recompute_method={method} is not modelled; opgraph re-runs "
                           "every layer (full, uniform, 1 layer) or the attention core "
                           "(selective)")
    return policy


def to_bridge(launch: Launch) -> str:
    """run_recipe.py's command line for `launch`, every field opgraph reads written out, behind
    torchrun's line for its GPUs (`record.launcher`): the recipe, then an override a line,
    continued with backslashes as a shell script writes it."""
    recipe = BRIDGE_PRESETS.get(launch.model) if isinstance(launch.model, str) else None
    if recipe is None:
        raise OpgraphError(f"Megatron-Bridge recipes opgraph writes: "
                           f"{', '.join(BRIDGE_PRESETS)}; {launch.model!r} is not one")
    p = launch.parallel
    own_framework(p, "megatron")
    refusals = ((p.cp > 1 and not recipe.context_parallel,
                 f"{recipe.name} runs its own attention, without context parallelism"),
                (p.stage_layers is not None or p.first_stage_layers is not None
                 or p.last_stage_layers is not None, "opgraph writes even pipeline splits"),
                (p.async_tp, "opgraph does not write comm_overlap"),
                (p.attention_library is not None, f"{recipe.name} picks its own attention"),
                (p.cp > 1 and p.cp_comm == "a2a",
                 "opgraph writes ring attention's context parallelism (no cp_comm_type)"),
                (launch.recompute == "selective-op",
                 "Megatron has no per-op selective recomputation ('selective-op')"),
                (reduce_dtype(p) == "fp16", "Megatron reduces gradients in fp32 or bf16"))
    for refused, why in refusals:
        if refused:
            raise OpgraphError(f"Megatron-Bridge: {why}")
    sharding = {v: k for k, v in MEGATRON_SHARDING.items()}
    values = {
        "model.tensor_model_parallel_size": p.tp, "model.pipeline_model_parallel_size": p.pp,
        "model.context_parallel_size": p.cp,
        "model.virtual_pipeline_model_parallel_size":
            p.virtual_stages if p.virtual_stages > 1 else None,
        "model.expert_model_parallel_size": p.ep, "model.sequence_parallel": p.sequence_parallel,
        "train.global_batch_size": p.global_batch, "train.micro_batch_size": p.micro_batch,
        "dataset.seq_length": launch.seq_len or launch.forward().seq_len,
        "ddp.use_distributed_optimizer": p.zero == 1, "ddp.use_megatron_fsdp": p.zero >= 2,
        "ddp.data_parallel_sharding_strategy": sharding[p.zero] if p.zero >= 2 else "no_shard",
        "ddp.grad_reduce_in_fp32": reduce_dtype(p) != "bf16",
        "ddp.overlap_grad_reduce": p.overlap_grad_reduce,
        "ddp.overlap_param_gather": p.overlap_param_gather,
        "mixed_precision": _bridge_precision(launch.precision),
        "model.recompute_granularity": ("selective" if launch.recompute.startswith(SELECTIVE)
                                        else None if launch.recompute == "none"
                                        else launch.recompute),
        "model.recompute_method": "uniform" if launch.recompute == "full" else None,
        "model.recompute_num_layers": 1 if launch.recompute == "full" else None,
        "model.recompute_modules": (f"[{','.join(megatron_modules(launch.recompute))}]"
                                    if launch.recompute.startswith("selective") else None),
    }
    values |= {f"model.{k}_fusion": launch.fuse is not None
               for k in ("bias_activation", "bias_dropout", "masked_softmax")}
    head = shlex.join([*launcher(p.gpus, BRIDGE_SCRIPT), "--recipe", recipe.name, "--mode",
                       "pretrain"])
    lines = [head, *(shlex.quote(f"{key}={_text(value)}") for key, value in values.items())]
    return " \\\n    ".join(lines)


def _text(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
