"""Launch configs: what a torchtitan job TOML or a Megatron-LM command line says, in opgraph's
terms (a model, a sequence length, a `Parallel` layout, a recompute policy, a precision), and
back again.

    launch = read_torchtitan("llama3_8b.toml", gpus=64)
    launch.model, launch.parallel.dp, launch.recompute      # "llama3-8b", 64, "selective-op"
    launch = read_megatron("--num-layers 96 --hidden-size 12288 ...", gpus=64)
    text = to_megatron(launch)              # torchrun ... pretrain_gpt.py and the arguments again

Nothing a file says is dropped in silence. A key or flag the framework itself does not have (a
misspelling: `tensor_paralel_degree`) is a one-line OpgraphError with the nearest real name, as
the framework's own parser would refuse it (the names: opgraph/data/launch_keys.json). A real
key or flag opgraph does not model, or a known one set to something opgraph does not model (a
GPipe schedule, CPU offload), is listed in `Launch.unknown`, which the CLI prints as a
warning naming it; keys that do not change the step's time (paths, logging, checkpoints,
learning rates) are known and quiet. A setting opgraph cannot stand in for at all (activation
checkpointing of every second layer, fp32 training) is a one-line OpgraphError that names it,
and says so where it is the framework's default rather than what the file wrote.

A Launch holds its layout resolved (`dp`, `gpus` and the global batch explicit; ZeRO stage 0 where
the ranks that hold the same weights, dp x cp, are one, so sharding has nothing to shard over),
and a config is its framework's job: a reader sets the layout's `framework` ("torchtitan", or
"megatron" for Megatron-LM's arguments and Megatron-Bridge's line), and a writer refuses a
layout that follows another (`record.own_framework`). So two Launches of one job compare equal
however they were written. `source` and `unknown` say where a Launch came from, not what it is,
and take no part in equality: `read_torchtitan(f)` of the file `to_torchtitan(l)` wrote equals
`l` (its framework torchtitan), and so does `read_megatron(to_megatron(l))` (Megatron's
arguments do not carry the world size, so the writer puts torchrun's line for it in front:
`record.launcher`).

The package: `record.py` holds the `Launch` the formats read into and write from, and what
their readers share; `torchtitan.py` and `megatron.py` each one framework's reader and writer,
and `bridge.py` Megatron-Bridge's recipe runner, the Megatron form of a model Megatron-LM's
flags cannot describe (Gemma 2), which `read_megatron` and `to_megatron` hand over to.
"""

from __future__ import annotations

from ...core.errors import OpgraphError
from .bridge import BRIDGE_PRESETS, BRIDGE_SOURCE, RECIPES, read_bridge, to_bridge
from .megatron import GPT2_BPE_VOCAB, MEGATRON_MODEL, MEGATRON_SOURCE, read_megatron, to_megatron
from .record import FUSE, PRECISIONS, PRESET_CONFIGS, RECOMPUTE, Config, Launch
from .torchtitan import TORCHTITAN_MODELS, read_torchtitan, to_torchtitan


def check_emittable(model: str, framework: str) -> None:
    """Raise a one-line OpgraphError, before any search, where `framework`'s writer
    ("torchtitan" or "megatron") has no form for the model named `model`."""
    if framework == "torchtitan":
        if model not in TORCHTITAN_MODELS.values():
            raise OpgraphError(f"--emit torchtitan writes the presets of torchtitan's model "
                               f"flavors ({', '.join(TORCHTITAN_MODELS.values())}); {model} "
                               "is not one")
    elif model not in PRESET_CONFIGS and model not in BRIDGE_PRESETS:
        raise OpgraphError(f"--emit megatron writes Megatron-LM's flags for a Llama-, GPT-2- or "
                           f"DeepSeek-V2-shaped preset ({', '.join(PRESET_CONFIGS)}) and "
                           f"Megatron-Bridge's recipe for {', '.join(BRIDGE_PRESETS)}; {model} "
                           "is not one")


__all__ = [
    "BRIDGE_PRESETS",
    "BRIDGE_SOURCE",
    "FUSE",
    "GPT2_BPE_VOCAB",
    "MEGATRON_MODEL",
    "MEGATRON_SOURCE",
    "PRECISIONS",
    "PRESET_CONFIGS",
    "RECIPES",
    "RECOMPUTE",
    "TORCHTITAN_MODELS",
    "Config",
    "Launch",
    "check_emittable",
    "read_bridge",
    "read_megatron",
    "read_torchtitan",
    "to_bridge",
    "to_megatron",
    "to_torchtitan",
]
