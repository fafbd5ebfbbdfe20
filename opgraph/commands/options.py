"""The options every model-facing subcommand shares, as argparse declarations: built from light
modules only (`opgraph.core.choices`, `opgraph.core.limits`), so that `--help` and a bad flag import
no sympy, numpy or pass. What the options resolve to is `opgraph.commands.common`'s."""

from __future__ import annotations

import argparse

from ..core.choices import (
    ADAMW_OPTIONS,
    BACKWARD_MODES,
    COST_MODELS,
    FUSION_POLICIES,
    PRECISIONS,
    RECOMPUTE_MODULES,
)
from ..core.limits import MAX_DIM, MAX_TOKENS
from .args import positive_float, recompute, whole


def add_model_args(parser: argparse.ArgumentParser, tokens: bool = True,
                   cost: str | None = "roofline") -> None:
    g = parser.add_argument_group("model and hardware")
    g.add_argument("--model",
                   help="a preset (see `opgraph models`; default llama3-8b), or a model of "
                        "your own: path/to/file.py:build")
    g.add_argument("--config", metavar="CONFIG_JSON",
                   help="a Hugging Face config.json on disk (Llama 3 and 4, Mistral, Mixtral, "
                        "Qwen2 and 3, their MoEs, GPT-2, Gemma 2, DeepSeek-V2 and V3, gpt-oss, "
                        "Nemotron-4 and -H, BERT, ...: docs/models.md), instead of --model")
    add_pass_arg(g)
    g.add_argument("--hardware",
                   help="a catalog part (see `opgraph hardware`) or a .toml file "
                        "(default h100-sxm, or the --case's part)")
    g.add_argument("--peak-tflops", type=positive_float, metavar="TFLOPS",
                   help="override the part's dense BF16 peak, TFLOP/s")
    g.add_argument("--bandwidth-tbs", type=positive_float, metavar="TBS",
                   help="override the part's HBM bandwidth, TB/s")
    if tokens:
        g.add_argument("--tokens", type=whole(MAX_TOKENS),
                       help="tokens per step, a multiple of --seq-len (default: one sequence)")
        g.add_argument("--seq-len", type=whole(MAX_DIM),
                       help="sequence length (default: the model's, 8192 for Llama 3)")
    g.add_argument("--no-fused-attention", action="store_true",
                   help="keep the attention core unfused: the score matrix goes through HBM")
    g.add_argument("--fuse", choices=FUSION_POLICIES,
                   metavar="{" + ",".join(FUSION_POLICIES) + "}",
                   help="also fuse element-wise and norm chains into one kernel each, across "
                        "the layer boundary too (elementwise: nothing into a library matmul, "
                        "torch.compile's default; elementwise+matmul: also a matmul's prologue "
                        "and epilogue)")
    g.add_argument("--backward-traffic", choices=BACKWARD_MODES, default="plate",
                   help="backward costs: 2x the forward's FLOPs and bytes (plate, default); "
                        "FLOPs so, bytes from the tensors each backward kernel touches "
                        "(tensors); or each kernel's own FLOPs and tensors (derived)")
    g.add_argument("--recompute", type=recompute, default="none", metavar="POLICY",
                   help="activation recomputation: none (default); selective, Megatron's "
                        "(the attention core re-run); selective:MODULE+... Megatron-Core's "
                        f"--recompute-modules ({', '.join(RECOMPUTE_MODULES)}); selective-op, "
                        "torchtitan's per-op (matmul and attention outputs kept, the rest "
                        "re-run); full (each layer keeps its input and runs its forward again)")
    g.add_argument("--precision", choices=PRECISIONS, default="bf16",
                   help="the layers' matmuls in bf16 (default), fp8 (tensor-wise scaling, "
                        "as torchao and Transformer Engine: FP8 operands at the part's FP8 "
                        "peak, plus their amax and cast kernels) or fp8-rowwise (torchao's "
                        "row-wise recipe: a scale per row, each operand cast along the axis "
                        "its matmul contracts, the backward's products rescaled)")
    add_cost_args(g, cost)
    g.add_argument("--adamw", choices=ADAMW_OPTIONS, default="mixed",
                   help="AdamW's precisions: mixed (FP32 master and moments, default), "
                        "bf16-moments, no-master, bf16, 8bit")


def add_pass_arg(group) -> None:
    """`--pass FILE.py:FUNCTION`, repeatable: the user's passes over the forward graph."""
    group.add_argument("--pass", dest="forward_passes", action="append",
                       metavar="FILE.py:FUNCTION",
                       help="run a pass of your own over the model's forward graph, a function "
                            "Graph -> Graph in a .py file, before the built-in passes (repeat "
                            "for more, run in order)")


def add_cost_args(group, default: str | None = "roofline") -> None:
    """`--cost` (roofline or calibrated, `default` first) and `--calibration FILE`. A default of
    None is the job's (`common.default_cost`): calibrated for a job over many GPUs, as `plan` and
    `validate` predict one, roofline for one GPU's step (the plate)."""
    texts = {"roofline": "roofline, the ceiling no run beats",
             "calibrated": "calibrated, each hardware generation's measured efficiencies "
                           "(opgraph/calibration.toml): the time a run can expect"}
    if default is None:
        text = (f"the cost model: {texts['calibrated']}; or {texts['roofline']}. Default: "
                "calibrated for a job over many GPUs (any layout flag, --torchtitan or "
                "--megatron-args), as plan and validate predict it; roofline for one GPU's "
                "step (the plate)")
    else:
        other = next(name for name in COST_MODELS if name != default)
        text = f"the cost model: {texts[default]} (default); or {texts[other]}"
    group.add_argument("--cost", choices=COST_MODELS, default=default, help=text)
    group.add_argument("--calibration", metavar="FILE.toml",
                       help="with --cost calibrated: efficiencies from this file (written by "
                            "`opgraph calibrate`) instead of the shipped ones")
