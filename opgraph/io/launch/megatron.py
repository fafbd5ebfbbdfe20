"""Megatron-LM's command-line arguments read into a `Launch` (`read_megatron`) and written from
one (`to_megatron`)."""

from __future__ import annotations

import math
import re
import shlex

from opgraph.models.deepseek import DeepSeekV2Config
from opgraph.models.gpt2 import GPT2Config
from opgraph.models.llama import LlamaConfig

from ...core.datafile import read_small
from ...core.choices import SELECTIVE
from ...core.errors import OpgraphError
from ...core.limits import MAX_DIM, check_whole
from ...parallel.frameworks import check_precision, reduce_dtype
from ...parallel.parallel import Parallel, chunk_layers
from .bridge import BRIDGE_PRESETS, is_bridge, read_bridge, to_bridge
from .record import (MEGATRON_SHARDING, PRESET_CONFIGS, Config, Launch, _config, _not_real,
                     _real_names, _whole_text, data_parallel, launcher, megatron_modules,
                     megatron_recompute, own_framework)

MEGATRON_SOURCE = "megatron arguments"
MEGATRON_MODEL = "megatron-model"  # the name of a model read from Megatron's dimensions
MEGATRON_SCRIPT = "pretrain_gpt.py"  # Megatron-LM's GPT (and Llama, DeepSeek) pre-training


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
    (--nproc-per-node x --nnodes) at the head of the text; the pipeline split from
    --decoder-first/last-pipeline-num-layers or --pipeline-model-parallel-layout (`_mg_split`).
    --use-distributed-optimizer is ZeRO 1, with --num-distributed-optimizer-instances its
    replicas (`Parallel.replicate`); Megatron FSDP (--use-megatron-fsdp) ZeRO 0-3 by
    --data-parallel-sharding-strategy;
    --tp-comm-overlap async tensor parallelism; --overlap-grad-reduce the gradient reduction
    under the backward (without it, Megatron's default, after it); --grad-reduce-in-bf16 the
    reduction in BF16 (the layout's `grad_reduce_dtype`; without it FP32); --attention-backend
    flash or fused the attention library (FlashAttention-2 or cuDNN's; auto, the default,
    cuDNN's on Hopper).
    Recomputation: selective (--recompute-activations, or --recompute-granularity selective),
    the modules --recompute-modules lists (the attention core where it is not given;
    `_mg_recompute`), or full with --recompute-method uniform --recompute-num-layers 1 (every
    layer; other methods are an error). Precision:
    --fp8-format is fp8 (--fp8-recipe delayed or tensorwise: a scale per tensor; blockwise and
    mxfp8 are warned of as not modelled), --bf16 or --fp16 (the same width and rate) bf16.
    Megatron's hand-fused kernels (bias-GeLU, bias-dropout-add, softmax) are read as elementwise
    fusion, unless a --no-...-fusion flag turns one off.

    Megatron-Bridge's recipe runner (run_recipe.py with --recipe and KEY=VALUE overrides), the
    Megatron form of models these flags cannot describe (Gemma 2), is read by
    `bridge.read_bridge`.

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
    if is_bridge(text.split()):
        return read_bridge(tokens, gpus)
    parsed, stray = _mg_flags(tokens)
    flags = _Flags(parsed)
    tp = flags.whole("--tensor-model-parallel-size", 1)
    model, seq_len = _mg_model(flags, tp)
    layout = _mg_layout(flags, model.layers, tp, gpus, getattr(model, "first_dense", 0),
                        getattr(model, "mtp_depth", 0))
    recompute = _mg_recompute(flags)
    bf16, fp16 = flags.switch("--bf16"), flags.switch("--fp16")
    if bf16 and fp16:  # Megatron asserts as much (arguments.py: `assert not args.fp16`)
        raise OpgraphError("Megatron arguments give both --bf16 and --fp16, which Megatron "
                           "refuses; give one")
    half = bf16 or fp16
    if flags.flags.get("--fp8-recipe") in (["delayed"], ["tensorwise"]):
        flags.text("--fp8-recipe")  # a scale per tensor, opgraph's FP8; a finer one is not
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
        return MEGATRON_SHARDING[strategy]
    return 1 if flags.switch("--use-distributed-optimizer") else 0


def _mg_layout(flags: _Flags, layers: int, tp: int, gpus: int | None,
               first_dense: int = 0, mtp: int = 0) -> Parallel:
    """The layout. Megatron's --decoder-first-pipeline-num-layers counts every decoder layer of
    the first stage, a DeepSeek's `first_dense` dense layers among them; a layout's
    `first_stage_layers` counts the layers of the stack the pipeline splits (the dense layers
    run on the first stage beside them, `passes.split_stages`), so `first_dense` fewer.
    --pipeline-model-parallel-layout gives every model chunk's layers (`_mg_split`)."""
    pp = flags.whole("--pipeline-model-parallel-size", 1)
    cp = flags.whole("--context-parallel-size", 1)
    gpus, dp = data_parallel(gpus, tp * cp * pp, "Megatron's")
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
    split: dict = {"first_stage_layers": _mg_first_stage(flags, first_dense),
                   "last_stage_layers": flags.whole("--decoder-last-pipeline-num-layers")}
    text = flags.text("--pipeline-model-parallel-layout")
    if text is not None:
        given = [f for f in ("--num-layers-per-virtual-pipeline-stage",
                             "--num-virtual-stages-per-pipeline-rank",
                             "--decoder-first-pipeline-num-layers",
                             "--decoder-last-pipeline-num-layers") if f in flags.flags]
        if given:
            raise OpgraphError(f"Megatron --pipeline-model-parallel-layout and {given[0]} both "
                               "split the pipeline; give one")
        virtual, split = _mg_split(text, pp, layers, first_dense, mtp)
    return Parallel(
        tp=tp, pp=pp, cp=cp, ep=flags.whole("--expert-model-parallel-size", 1),
        dp=dp, gpus=gpus, micro_batch=micro,
        global_batch=flags.whole("--global-batch-size"), virtual_stages=virtual or 1,
        sequence_parallel=flags.switch("--sequence-parallel"), zero=_mg_zero(flags),
        replicate=flags.whole("--num-distributed-optimizer-instances", 1),
        async_tp=flags.switch("--tp-comm-overlap"),
        overlap_grad_reduce=flags.switch("--overlap-grad-reduce"),
        overlap_param_gather=flags.switch("--overlap-param-gather"),
        grad_reduce_dtype="bf16" if flags.switch("--grad-reduce-in-bf16") else None,
        attention_library=_mg_attention(flags), cp_comm=_mg_cp_comm(flags),
        expert_tp=flags.whole("--expert-tensor-parallel-size"),
        framework="megatron", **split)


# Megatron-LM's --pipeline-model-parallel-layout (megatron/core/transformer/
# pipeline_parallel_layer_layout.py, `PipelineParallelLayerLayout`): the model chunks, pp x v of
# them separated by "|", chunk c on pipeline rank c % pp as its virtual stage c // pp; each the
# letters of what it runs: E the embedding, t a decoder layer, m a multi-token prediction
# module, L the loss. "(...)*n" and "x*n" repeat; commas are cosmetic. Parsed, never evaluated.
_MG_LAYOUT_LETTERS = frozenset("EtmL")
_MG_LAYOUT_MAX = 1 << 16  # letters and bars once the repeats are written out


def _mg_unroll(text: str) -> list[str]:
    """The layout's chunks, its repeats written out (Megatron's two patterns, in its order)."""
    shown = text
    text = text.replace(",", "")

    def repeat(match: re.Match) -> str:
        if len(match.group(2)) > 6:  # a count that long repeats past any cap
            times = _MG_LAYOUT_MAX + 1
        else:
            times = int(match.group(2))
        if len(match.group(1)) * times > _MG_LAYOUT_MAX:
            raise OpgraphError(f"Megatron --pipeline-model-parallel-layout {shown!r} repeats to "
                               f"more than {_MG_LAYOUT_MAX:,} letters")
        return match.group(1) * times

    text = re.sub(r"\(([^)]+)\)\*(\d+)", repeat, text)
    text = re.sub(r"(.)\*(\d+)", repeat, text)
    if len(text) > _MG_LAYOUT_MAX or set(text) - _MG_LAYOUT_LETTERS - {"|"}:
        raise OpgraphError(f"Megatron --pipeline-model-parallel-layout {shown!r}: write chunks "
                           "of E, t, m and L separated by |, with (...)*n or x*n to repeat")
    return text.split("|")


def _mg_split(text: str, pp: int, layers: int, first_dense: int, mtp: int):
    """(virtual stages, the layout's split fields) of a --pipeline-model-parallel-layout: the
    embedding first, the loss last, the prediction modules in the last chunk, the dense layers
    in the first; then its decoder layers per chunk as a layout says them (`chunk_layers`):
    even, uneven end stages (interleaved or not), or every stage's count."""
    chunks = _mg_unroll(text)
    where = f"Megatron --pipeline-model-parallel-layout {text!r}"
    if len(chunks) % pp:
        raise OpgraphError(f"{where} has {len(chunks)} chunks, not a multiple of "
                           f"--pipeline-model-parallel-size {pp}")
    joined = "".join(chunks)
    if (joined.count("E"), joined.count("L")) != (1, 1) or not chunks[0].startswith("E") \
            or not chunks[-1].endswith("L") \
            or not all(re.fullmatch("E?t*m*L?", c) for c in chunks):
        raise OpgraphError(f"{where}: the embedding (E) opens the first chunk and the loss (L) "
                           "closes the last, once each, the decoder layers (t) before the "
                           "prediction modules (m) in a chunk")
    if joined.count("m") != mtp or chunks[-1].count("m") != mtp:
        raise OpgraphError(f"{where}: the model's {mtp} multi-token prediction modules (m) run "
                           "in the last chunk, before the loss; opgraph places them there")
    counts = [c.count("t") for c in chunks]
    if sum(counts) != layers:
        raise OpgraphError(f"{where} holds {sum(counts)} decoder layers (t); --num-layers is "
                           f"{layers}")
    if counts[0] < first_dense:
        raise OpgraphError(f"{where}: the model's {first_dense} dense layers come first and run "
                           "on the first stage in opgraph; its first chunk holds "
                           f"{counts[0]}")
    virtual = len(chunks) // pp
    stages = [[counts[v * pp + r] for v in range(virtual)] for r in range(pp)]
    stages[0][0] -= first_dense
    totals = [sum(s) for s in stages]
    stack = layers - first_dense
    fields: dict = {}
    if any(n != counts[0] for n in counts[1:]) or first_dense:
        fields = {"first_stage_layers": totals[0], "last_stage_layers": totals[-1]}
    if pp == 1:
        if virtual > 1:
            raise OpgraphError(f"{where}: one pipeline stage runs one model chunk")
        return 1, {}
    candidates = [{}, fields] + ([{"stage_layers": tuple(totals)}] if virtual == 1 else [])
    for split in candidates:
        try:
            cut = chunk_layers(stack, Parallel(pp=pp, virtual_stages=virtual, **split))
        except OpgraphError:
            continue
        if cut == stages:
            return virtual, split
    raise OpgraphError(f"{where} gives the stages {[list(s) for s in stages]} decoder layers "
                       "per chunk; opgraph's interleaved stages split as `chunk_layers` does "
                       "(equal chunks, or the end stages' outer chunks short): this one is not")


def _mg_layout_text(config: Config, p: Parallel, dense: int) -> str:
    """The --pipeline-model-parallel-layout of a layout's split (`chunk_layers`), the inverse
    of `_mg_split`: the dense layers and the embedding in the first chunk, the prediction
    modules and the loss in the last."""
    stages = chunk_layers(config.layers - dense, p)
    chunks = []
    for v in range(p.virtual_stages):
        for r in range(p.pp):
            n = stages[r][v] + (dense if (r, v) == (0, 0) else 0)
            chunks.append("t" * n)
    chunks[0] = "E" + chunks[0]
    chunks[-1] += "m" * getattr(config, "mtp_depth", 0) + "L"
    return "|".join(chunks)


def _mg_first_stage(flags: _Flags, first_dense: int) -> int | None:
    """--decoder-first-pipeline-num-layers less the dense layers it counts (see `_mg_layout`)."""
    first = flags.whole("--decoder-first-pipeline-num-layers")
    if first is None or not first_dense:
        return first
    if first <= first_dense:
        raise OpgraphError(f"Megatron --decoder-first-pipeline-num-layers {first} leaves the "
                           f"first stage no layer of experts after the model's {first_dense} "
                           "dense layers; opgraph runs the dense layers on the first stage "
                           f"beside at least one more: give more than {first_dense}")
    return first - first_dense


# Megatron-LM's --attention-backend (`AttnBackend`, megatron/core/transformer/enums.py) -> the
# attention library: Transformer Engine's FlashAttention or its cuDNN FusedAttention; auto, the
# default, lets Transformer Engine pick (the framework's own, None). unfused and local are not
# modelled: left over, and said so.
_MG_ATTENTION = {"flash": "flash", "fused": "cudnn", "auto": None}


def _mg_attention(flags: _Flags) -> str | None:
    backend = flags.text("--attention-backend")
    if backend is not None and backend not in _MG_ATTENTION:
        flags.read.discard("--attention-backend")
    return _MG_ATTENTION.get(backend)


# --cp-comm-type (megatron/training/arguments.py; one value, or one per layer): p2p passes the
# keys and values around the ring, allgather gathers them once, both ring attention to opgraph
# (`Parallel.cp_comm`); a2a is DeepSpeed-Ulysses' all-to-all. a2a+p2p (an all-to-all inside a
# node, a ring across) and a different type per layer are not modelled: left over.
_MG_CP_COMM = {"p2p": "ring", "allgather": "ring", "a2a": "a2a"}


def _mg_cp_comm(flags: _Flags) -> str:
    if "--cp-comm-type" not in flags:
        return "ring"
    values = set(flags.flags["--cp-comm-type"])
    if len(values) != 1 or not values <= set(_MG_CP_COMM):
        flags.read.discard("--cp-comm-type")
        return "ring"
    return _MG_CP_COMM[values.pop()]


def _mg_recompute(flags: _Flags) -> str:
    """Selective recomputation re-runs the modules --recompute-modules lists, ["core_attn"]
    where none are given (Megatron-Core's `TransformerConfig.recompute_modules`): the attention
    core is opgraph's "selective", other lists "selective:" and the modules
    (`record.megatron_recompute`)."""
    granularity = flags.text("--recompute-granularity")
    method = flags.text("--recompute-method")
    count = flags.whole("--recompute-num-layers")
    if flags.switch("--recompute-activations"):
        granularity = "selective"  # as Megatron's arguments.py sets it
    modules = flags.flags["--recompute-modules"] if "--recompute-modules" in flags else None
    policy = megatron_recompute(granularity, method, count, modules)
    if policy is None:
        raise OpgraphError(f"Megatron full recomputation with --recompute-method {method} "
                           f"--recompute-num-layers {count} is not modelled; opgraph re-runs "
                           "every layer: --recompute-method uniform --recompute-num-layers 1")
    return policy


def to_megatron(launch: Launch) -> str:
    """Megatron-LM's command line for a launch, one line: torchrun's line for its GPUs
    (`record.launcher`), `pretrain_gpt.py` and its arguments; the inverse of `read_megatron`,
    which takes the GPUs from the launcher (a preset is written as its dimensions and reads back
    as a config named "megatron-model").

    A preset Megatron-LM's flags cannot describe but a Megatron-Bridge recipe builds (Gemma 2)
    is written as that recipe's command line (`bridge.to_bridge`).

    A vocabulary that tp divides is kept as it is (--make-vocab-size-divisible-by 1 where 128 x
    tp does not divide it); any other is padded by Megatron. torchtitan's per-op selective
    recomputation ("selective-op") has no Megatron form and is an error.

        >>> to_megatron(Launch(model="gpt2", seq_len=1024, parallel=Parallel(gpus=16)))[:78]
        'torchrun --nproc-per-node 8 --nnodes 2 pretrain_gpt.py --num-layers 12 --hidde'
    """
    if isinstance(launch.model, str) and launch.model not in PRESET_CONFIGS \
            and launch.model in BRIDGE_PRESETS:
        return to_bridge(launch)
    config = _config(launch.model, "Megatron")
    p = launch.parallel
    own_framework(p, "megatron")
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
    if p.expert_tp is not None:
        args += ["--expert-tensor-parallel-size", str(p.expert_tp)]
    dense = config.first_dense if isinstance(config, DeepSeekV2Config) else 0
    uneven = p.first_stage_layers is not None or p.last_stage_layers is not None
    if p.stage_layers is not None or (p.virtual_stages > 1 and (
            uneven or config.layers % (p.pp * p.virtual_stages))):
        args += ["--pipeline-model-parallel-layout", _mg_layout_text(config, p, dense)]
    else:
        if p.virtual_stages > 1:
            args += ["--num-layers-per-virtual-pipeline-stage",
                     str(config.layers // p.pp // p.virtual_stages)]
        for flag, value in (("--decoder-first-pipeline-num-layers",
                             None if p.first_stage_layers is None
                             else p.first_stage_layers + dense),
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
    if p.attention_library is not None:
        backend = {v: k for k, v in _MG_ATTENTION.items() if v is not None}
        if p.attention_library not in backend:
            raise OpgraphError(f"Megatron-LM runs no {p.attention_library} attention kernel; "
                               "give --attention-library flash or cudnn")
        args += ["--attention-backend", backend[p.attention_library]]
    if p.cp > 1 and p.cp_comm == "a2a":
        args += ["--cp-comm-type", "a2a"]
    args += _mg_zero_args(p.zero) + _mg_recompute_args(launch.recompute) + ["--bf16"]
    if p.replicate > 1:  # the distributed optimizer's replicas (`Parallel.replicate`)
        args += ["--num-distributed-optimizer-instances", str(p.replicate)]
    check_precision("megatron", launch.precision)  # the config runs Megatron-LM's, whatever
    if launch.precision == "fp8":
        args += ["--fp8-format", "hybrid"]
    if launch.fuse is None:
        args += list(_MG_NO_FUSION)
    return shlex.join(launcher(p.gpus, MEGATRON_SCRIPT) + args)


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
        strategy = {v: k for k, v in MEGATRON_SHARDING.items()}[zero]
        return ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy]
    return []


def _mg_recompute_args(recompute: str) -> list[str]:
    if recompute == "selective-op":
        raise OpgraphError("Megatron has no per-op selective recomputation ('selective-op'); "
                           "give selective (attention core), full or none")
    if recompute.startswith(SELECTIVE):
        return ["--recompute-granularity", "selective", "--recompute-modules",
                *megatron_modules(recompute)]
    return {"none": [], "selective": ["--recompute-granularity", "selective"],
            "full": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                     "--recompute-num-layers", "1"]}[recompute]
