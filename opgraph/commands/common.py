"""The options every model-facing subcommand shares, and what they resolve to."""

from __future__ import annotations

import argparse

import attrs

from .. import hardware as hw
from ..costmodel import BACKWARD_MODES, DEFAULT, CostModel
from ..errors import OpgraphError
from ..hardware import Hardware
from ..ir import Graph
from ..pipeline import compile_step
from .args import positive_float, positive_int


def add_model_args(parser: argparse.ArgumentParser, tokens: bool = True) -> None:
    g = parser.add_argument_group("model and hardware")
    g.add_argument("--model",
                   help="a preset (see `opgraph models`; default llama3-8b)")
    g.add_argument("--config", metavar="CONFIG_JSON",
                   help="a Hugging Face config.json on disk (Llama, Mistral, Mixtral, Qwen2, "
                        "GPT-2), instead of --model")
    g.add_argument("--hardware", default="h100-sxm",
                   help="a catalog part (see `opgraph hardware`) or a .toml file "
                        "(default h100-sxm)")
    g.add_argument("--peak-tflops", type=positive_float, metavar="TFLOPS",
                   help="override the part's dense BF16 peak, TFLOP/s")
    g.add_argument("--bandwidth-tbs", type=positive_float, metavar="TBS",
                   help="override the part's HBM bandwidth, TB/s")
    if tokens:
        g.add_argument("--tokens", type=positive_int,
                       help="tokens per step, a multiple of --seq-len (default: one sequence)")
        g.add_argument("--seq-len", type=positive_int,
                       help="sequence length (default: the model's, 8192 for Llama 3)")
    g.add_argument("--no-fused-attention", action="store_true",
                   help="keep the attention core unfused: the score matrix goes through HBM")
    g.add_argument("--backward-traffic", choices=BACKWARD_MODES, default="plate",
                   help="backward costs: 2x the forward's FLOPs and bytes (plate, default); "
                        "FLOPs so, bytes from the tensors each backward kernel touches "
                        "(tensors); or each kernel's own FLOPs and tensors (derived)")


@attrs.frozen
class Setup:
    forward: Graph
    step: Graph
    hardware: Hardware
    values: dict  # dimension name -> value
    cost: CostModel = DEFAULT


def load_forward(args) -> Graph:
    config = getattr(args, "config", None)
    if config is not None:
        if args.model is not None:
            raise OpgraphError("give --model or --config, not both")
        from opgraph.models.hf import from_config

        return from_config(config)
    from opgraph.models import preset

    return preset(args.model or "llama3-8b")


def load_hardware(args) -> Hardware:
    part = hw.get(args.hardware)
    changes = {}
    if args.peak_tflops is not None:
        changes["peak_flops"] = args.peak_tflops * 1e12
    if args.bandwidth_tbs is not None:
        changes["bandwidth"] = args.bandwidth_tbs * 1e12
    if changes:
        part = attrs.evolve(part, id=f"{part.id}-custom", name=f"{part.name} (custom)", **changes)
    return part


def token_values(forward: Graph, tokens: int | None, seq_len: int | None) -> dict:
    """`{"S": seq_len, "B": batch}` from tokens per step and sequence length, checked as the
    library checks them (`opgraph.passes.evaluate.resolve`)."""
    from ..passes.evaluate import resolve
    from ..symbols import B, S

    seq = seq_len or forward.seq_len
    if seq is None:
        raise OpgraphError(f"{forward.name} has no default sequence length; give --seq-len")
    subs = resolve(forward, {"S": seq, "tokens": tokens or seq})
    return {"S": int(subs[S]), "B": int(subs[B])}


def cost_model(args) -> CostModel:
    """The cost model the options ask for: `--backward-traffic` names its backward convention."""
    return CostModel(backward=getattr(args, "backward_traffic", "plate"))


def setup(args) -> Setup:
    forward = load_forward(args)
    part = load_hardware(args)
    values = token_values(forward, getattr(args, "tokens", None), getattr(args, "seq_len", None))
    step = compile_step(forward, fused_attention=not args.no_fused_attention)
    return Setup(forward, step, part, values, cost_model(args))
