"""The names the command line offers, in the order its help lists them.

A light module (nothing beyond the standard library), so that building the parser imports no
sympy, networkx, numpy, model or pass, and `opgraph --help`, a mistyped flag or a bad value
return at once. The tables that give each name its meaning are keyed by these names where they
are defined; tests/test_cli_imports.py checks that each table has exactly these keys, in this
order:

- `BACKWARD_MODES`, `COST_MODELS`: `opgraph.cost.costmodel` (which imports them from here);
- `FUSION_POLICIES`: `opgraph.core.fusion.POLICIES`;
- `RECOMPUTE_POLICIES`: `opgraph.passes.recompute.POLICIES` (`RECOMPUTE_MODULES`: its
  `MODULES`);
- `PRECISIONS`: `opgraph.passes.precision` (imports it from here);
- `ADAMW_OPTIONS`: `opgraph.passes.attach_adamw.ADAMW_OPTIONS`;
- `ZERO_STAGES`, `FRAMEWORKS`, `GRAD_REDUCE_DTYPES`, `ATTENTION_LIBRARIES`:
  `opgraph.parallel.parallel` (imports them from here); `ATTENTION_LIBRARIES` less "flash":
  `passes.pick_attention_kernel.KERNELS`.
"""

from __future__ import annotations

from .errors import OpgraphError

# How a backward kernel is costed (`opgraph.cost.costmodel`): 2x its forward op (the plate), FLOPs
# so and bytes from its own tensors, or its own FLOP rule and tensors.
BACKWARD_MODES = ("plate", "tensors", "derived")
# The cost model `--cost` names: the roofline ceiling, or the measured efficiencies.
COST_MODELS = ("roofline", "calibrated")
# `--fuse`: element-wise and norm chains fused, and with a matmul's prologue and epilogue.
FUSION_POLICIES = ("elementwise", "elementwise+matmul")
# `--recompute`: activation recomputation (`passes.recompute`), by name, or "selective:" and a
# list of Megatron-Core's modules (its `--recompute-modules`; "selective" alone is its default,
# the attention core).
RECOMPUTE_POLICIES = ("none", "selective", "selective-op", "full")
RECOMPUTE_MODULES = ("core_attn", "layernorm", "moe_act", "moe", "shared_experts", "mlp",
                     "mla_up_proj")
SELECTIVE = "selective:"


def recompute_policy(value) -> str:
    """`value` as a recompute policy's one spelling: a name of RECOMPUTE_POLICIES, or
    "selective:" and Megatron-Core's modules joined by "+" (or commas), each once, in
    RECOMPUTE_MODULES' order ("selective:core_attn" is "selective"); OpgraphError, one line,
    for anything else.

        >>> recompute_policy("selective:moe_act,core_attn")
        'selective:core_attn+moe_act'
    """
    if isinstance(value, str) and value in RECOMPUTE_POLICIES:
        return value
    if isinstance(value, str) and value.startswith(SELECTIVE):
        given = [m.strip() for m in value[len(SELECTIVE):].replace(",", "+").split("+")]
        unknown = [m for m in given if m not in RECOMPUTE_MODULES]
        if not unknown:
            modules = [m for m in RECOMPUTE_MODULES if m in given]
            return "selective" if modules == ["core_attn"] else SELECTIVE + "+".join(modules)
        raise OpgraphError(f"recompute {value[:60]!r}: {unknown[0][:20]!r} is not one of "
                           f"Megatron-Core's modules ({', '.join(RECOMPUTE_MODULES)})")
    raise OpgraphError(f"recompute {str(value)[:60]!r}: give one of "
                       f"{', '.join(RECOMPUTE_POLICIES)}, or selective:MODULE+... with "
                       f"Megatron-Core's modules ({', '.join(RECOMPUTE_MODULES)})")


def check_recompute(value, where: str) -> None:
    """OpgraphError, one line headed by `where` ("job ", "launch ", "--"), unless `value` is a
    recompute policy in its one spelling (`recompute_policy`)."""
    try:
        spelled = recompute_policy(value)
    except OpgraphError as e:
        raise OpgraphError(f"{where}{e}") from None
    if spelled != value:
        raise OpgraphError(f"{where}recompute {value!r}: write it {spelled!r}")
# `--precision`: the layers' matmuls in BF16, or in FP8 with a scale per tensor ("fp8", torchao's
# and Transformer Engine's tensor-wise recipes) or per row ("fp8-rowwise", torchao's row-wise
# recipe) (`passes.precision`). A search tries the first two: row-wise scaling is chosen for
# accuracy, and is never the faster.
PRECISIONS = ("bf16", "fp8", "fp8-rowwise")
SEARCHED_PRECISIONS = ("bf16", "fp8")
# `--adamw`: AdamW's precisions (`passes.attach_adamw`).
ADAMW_OPTIONS = ("mixed", "bf16-moments", "no-master", "bf16", "8bit")
# `--zero`: data-parallel sharding, ZeRO stages 0 to 3.
ZERO_STAGES = (0, 1, 2, 3)
# The training framework whose behaviour the passes follow (how it shards, gathers, reduces and
# recomputes); None: opgraph's generic data parallelism (FSDP-like, gradients reduced in FP32).
# "deepspeed-0.3": DeepSpeed before v0.5.5, whose ZeRO-3 collectives copy one tensor per rank
# and whose gathers wait for the compute before them; "deepspeed-bf16": DeepSpeed training in
# BF16 through its BF16 optimizer, which adds each micro-batch's gradients into FP32
# (`opgraph.parallel.frameworks`).
FRAMEWORKS = ("megatron", "deepspeed", "deepspeed-0.3", "deepspeed-bf16", "torchtitan",
              "torchtitan-2024", "nanotron", "composer")
# The frameworks that run DeepSpeed's pipeline engine (ZeRO 0 or 1 under a pipeline).
DEEPSPEED = ("deepspeed", "deepspeed-0.3", "deepspeed-bf16")
# torchtitan's rows: today's, and December 2024's, whose torch.compile left the loss eager; its
# config writer says either (`io.launch.torchtitan`)
TORCHTITAN = ("torchtitan", "torchtitan-2024")
# The dtype gradients are reduced in across data-parallel ranks; None: the framework's default.
GRAD_REDUCE_DTYPES = ("fp32", "bf16", "fp16")
# The attention kernels a framework may run (`opgraph.parallel.frameworks`'s `attention_library`):
# FlashAttention-2, cuDNN's fused attention, flash-attn's Triton FlashAttention, FlashAttention 1.
ATTENTION_LIBRARIES = ("flash", "cudnn", "triton", "flash1")
# How context parallelism moves the attention's inputs (`passes.shard`): "ring", each GPU's
# keys and values passed around the ring while its queries stay (ring attention: Megatron-LM's
# `--cp-comm-type p2p` and `allgather`, torchtitan's rotate methods); "a2a", an all-to-all that
# trades the sequence shard for a head shard before the attention and back after it
# (DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv:2309.14509; Megatron-LM's `--cp-comm-type a2a`).
CP_COMMS = ("ring", "a2a")
