"""A forward graph from a Hugging Face `config.json` on disk (never from the network).

    graph = from_config("Meta-Llama-3-8B/config.json")

`model_type` picks the family: `llama`, `mistral`, `mixtral`, `qwen2` and `qwen3` build the
Llama graph (`models.llama`), `qwen2_moe` and `qwen3_moe` the Qwen mixture-of-experts graph
(`models.qwen_moe`), `gpt2` the GPT-2 graph (`models.gpt2`), `gemma2` the Gemma 2 graph
(`models.gemma2`), `deepseek_v2`, `deepseek_v3` and `kimi_k2` the DeepSeek graph
(`models.deepseek`), `gpt_oss` the gpt-oss graph (`models.gpt_oss`), `nemotron_h` the
Nemotron-H / Nemotron 3 hybrid graph (`models.nemotron_h`) and `bert` the BertForMaskedLM graph
(`models.bert`); `opt`, `gpt_neox`, `bloom`, `falcon` and `nemotron` (Nemotron-4) build the
GPT-2 graph with its flags set (`models.gpt2`: ReLU or ReLU squared, partial RoPE, parallel
residual, ALiBi, grouped-query attention, ...); `llama4` (its text model) builds the Qwen
mixture-of-experts graph. The fields read are the ones that shape the cost; the rest
(RoPE base, norm epsilon, dtype, token ids) do not change a roofline and are ignored; of the
dropouts, the one on the attention probabilities is read, a kernel of its own in the unfused core
(`models.gpt2`): GPT-2's `attn_pdrop` (absent: 0.1, transformers' default) and the
`attention_dropout` of OPT, GPT-NeoX, BLOOM and Falcon (absent: 0.0, theirs); the dropouts on
activations of width D or F (`resid_pdrop`, `embd_pdrop`, `hidden_dropout` and the like) are not:
frameworks fuse them into the bias-and-residual kernel beside them, a one-byte mask an
element.
Defaults follow `transformers` where it has a rule rather than a model's number:

- `head_dim`: absent or null means `hidden_size / num_attention_heads`; Qwen3's transformers
  default is a particular model's (128), so there it is required.
- `num_key_value_heads`: Llama's absent means `num_attention_heads` (multi-head attention);
  Mistral, Mixtral, Qwen2, Qwen2-MoE and Qwen3-MoE default to a particular model's count (8, 8,
  32, 16, 4), so there it is required, and for Qwen3 too.
- `tie_word_embeddings`: absent means false for Llama, Mistral, Mixtral and the Qwen families,
  true for GPT-2 (transformers' `PretrainedConfig` default).
- biases: Qwen2 has them on Q, K and V by architecture, Qwen2-MoE unless `qkv_bias` is false;
  the `attention_bias` of Llama, Qwen3 and Qwen3-MoE (absent: false) puts them on Q, K, V and O;
  Llama's `mlp_bias` on the MLP's three projections; GPT-2 has them everywhere.
- `sliding_window`: Mistral's and Mixtral's (absent or null: none; Mistral 7B v0.1's 4,096)
  makes every layer attend over its last W keys; Qwen2's (used only with
  `use_sliding_window`, on some layers) is not read.
- Qwen3 and Qwen3-MoE: an RMSNorm on each query and key head (`q_norm`, `k_norm`, a weight of
  `head_dim`) before RoPE, by architecture.
- Qwen2-MoE and Qwen3-MoE: `num_experts`, `num_experts_per_tok` and `moe_intermediate_size`
  are required (transformers' defaults are a particular model's), and Qwen2-MoE's
  `shared_expert_intermediate_size`; `num_experts` 0 means every layer dense;
  `decoder_sparse_step` absent means 1; `mlp_only_layers` absent or null means none, indices
  past the last layer are ignored (as in transformers); `intermediate_size` is read only when
  some layer is dense. The layout must be one the graph's regions express
  (`models.qwen_moe.stacks`): the layers `mlp_only_layers` makes dense at the start or the end
  of the stack, a `decoder_sparse_step` of at most 64; any other is an error.
  `norm_topk_prob` (the gates renormalised: a few FLOPs a token) is ignored.
- gpt-oss: `num_local_experts`, `num_experts_per_tok` (or the older `experts_per_token`),
  `intermediate_size` (an expert's width), `head_dim` and `sliding_window` are required;
  `layer_types` absent means sliding-window and full layers alternating, sliding first (any
  other order is an error: the stack is built as pairs); the sequence is
  `initial_context_length` (the pre-training context), else `max_position_embeddings`, each
  capped at 8,192; `tie_word_embeddings` absent means false. Its biases on Q, K, V and O are
  built by architecture; the experts' and router's biases, the clamped activation and the
  attention sinks are approximated (`models.gpt_oss`).
- Nemotron-H and Nemotron 3: `hybrid_override_pattern` is required (one character a layer: M
  Mamba-2, * attention, - MLP, E mixture of experts) and must have `num_hidden_layers` layers
  where that is given; the fields of each layer kind the pattern holds are required
  (`mamba_num_heads`, `mamba_head_dim`, `ssm_state_size`, `n_groups`; `num_attention_heads`,
  `num_key_value_heads`; `intermediate_size`; `n_routed_experts`, `num_experts_per_tok`,
  `moe_intermediate_size`), `moe_shared_expert_intermediate_size` absent means no shared
  expert; `conv_kernel` and `chunk_size` (or transformers' `mamba_d_conv`, `mamba_chunk_size`)
  absent mean 4 and 128 (Megatron-Core's chunk); `head_dim` (or the older
  `attention_head_dim`) absent means `hidden_size / num_attention_heads`; `n_groups` may be
  written `mamba_n_groups`;
  `mlp_hidden_act` must be "relu2" (absent: so); `tie_word_embeddings` absent means false. The
  attention has no position encoding, by architecture.
- GPT-2: `n_positions` (or the older `n_ctx`) is the position table; `n_inner` null means
  `4 x n_embd`.
- OPT: the position table has `max_position_embeddings` (absent: 2048) + 2 rows (OPT's
  offset); `activation_function` absent means "relu" ("gelu" exact; "gelu_new",
  "gelu_pytorch_tanh" and "gelu_fast" tanh); `do_layer_norm_before` absent means true
  (false: post-LN, no final LayerNorm, OPT-350M);
  `word_embed_proj_dim` absent or equal to `hidden_size` means no projection, else
  project_in / project_out matrices without bias; `enable_bias` absent means true (all four
  attention and both MLP projections); `tie_word_embeddings` absent means true.
  `layer_norm_elementwise_affine` false, and `_remove_final_layer_norm` true on a pre-LN
  config, are refused.
- GPT-NeoX: RoPE on `int(head size x rotary_pct)` dims of each head (absent: 0.25; it must
  give an even count; newer transformers also write it as `partial_rotary_factor`);
  `hidden_act` absent means "gelu" (exact; "gelu_fast" is the tanh form);
  `use_parallel_residual` absent means true; `attention_bias` absent means true (QKV
  and dense; the MLP always has biases); `tie_word_embeddings` absent means false;
  `max_position_embeddings` absent means 2048.
- BLOOM: `n_embed` or `hidden_size`, `n_layer` or `num_hidden_layers`, `n_head` or
  `num_attention_heads` (transformers' two names of each; two that disagree are an error);
  the MLP is 4 x hidden whatever `n_inner` says (`BloomMLP`); ALiBi on every layer's scores;
  `apply_residual_connection_post_layernorm` absent means false; `tie_word_embeddings`
  absent means true. No field gives the context (ALiBi has no table), so 8192.
- Falcon: `new_decoder_architecture` absent means false. New: `num_kv_heads` (or
  `n_head_kv`; absent: `num_attention_heads`) KV heads, attention and MLP in parallel,
  `num_ln_in_parallel_attn` absent means 2 LayerNorms (1: shared); `parallel_attn` false is
  refused (transformers builds no such layer). Old: one KV head if `multi_query` (absent:
  true), else as many as the query heads (`num_kv_heads` is not read, as in transformers);
  `parallel_attn` absent means true, with one shared LayerNorm. `bias` absent means false (no
  projection has one; the LayerNorms do); `alibi` true replaces RoPE (on whole heads) with
  ALiBi; `ffn_hidden_size` absent means 4 x hidden; `activation` absent means "gelu" (exact);
  `max_position_embeddings` absent means 2048; `tie_word_embeddings` absent means true.
- Mixtral: `num_local_experts` and `num_experts_per_tok` are required.
- Gemma 2: `tie_word_embeddings` absent means true; `attn_logit_softcapping` and
  `final_logit_softcapping` absent mean transformers' 50.0 and 30.0, null means no capping;
  `head_dim`, `num_key_value_heads` and `sliding_window` are required; the layer count must be
  even (local and global layers alternate).
- DeepSeek-V2 and -V3: `q_lora_rank` null means a full-rank query projection; `n_routed_experts`
  null means every layer is dense; `n_shared_experts` null means none; `first_k_dense_replace`
  absent means 0; `moe_layer_freq` must be 1 (every later layer a mixture of experts).
  `num_nextn_predict_layers` (V3; absent: 0) adds that many multi-token prediction modules, each
  a projection, one mixture-of-experts layer and a second loss through the shared output head.
  V3's router (sigmoid scores, `n_group` / `topk_group` node-limited choice, a bias for load
  balance) picks `num_experts_per_tok` experts as V2's does: the same cost.
- BERT: `hidden_act` absent means "gelu" (exact); "gelu_new" and "gelu_pytorch_tanh" are the
  tanh approximation. The masked-LM head predicts 5/32 of the sequence (20 of 128, 80 of 512,
  BERT's own pre-training).

The profile's default sequence length is the model's context, `max_position_embeddings` (GPT-2:
`n_positions`), capped at 8192, the plate's: a 128 K context profiled by default would be all
attention; `--seq-len` asks for longer. Without `max_position_embeddings` it is 8192 (OPT,
GPT-NeoX and Falcon have transformers' default, 2048; BLOOM has none). Sliding-window
attention (Mistral's `sliding_window`, the Qwen families' `use_sliding_window`) is profiled as
full causal attention.

Bad input (no file, not JSON, an unknown `model_type`, a missing field, a field of the wrong
type) raises OpgraphError: one line naming the field and the file.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import attrs

from opgraph.core.datafile import read_small
from opgraph.core.errors import OpgraphError
from opgraph.core.ir import Graph
from opgraph.core.limits import MAX_DIM, check_whole

from . import bert, deepseek, gemma2, gpt2, gpt_oss, llama, nemotron_h, qwen_moe

DEFAULT_SEQ_LEN = 8192  # the plate's; and the cap on a config's own context
_REQUIRED = object()


def _shown(value) -> str:
    """A field's value in a message: JSON, cut short."""
    text = json.dumps(value) if not isinstance(value, int) or value < 10**20 else "a huge number"
    return text if len(text) <= 60 else text[:57] + "..."


class _Fields:
    """Typed reads of one config's fields, each failure one line naming field and file."""

    def __init__(self, data: dict, path: Path):
        self.data, self.path = data, path

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None  # null counts as absent, as in transformers

    def _get(self, key: str, default):
        if self.has(key):
            return self.data[key]
        if default is _REQUIRED:
            raise OpgraphError(f"{self.path}: missing field {key!r}; a "
                               f"{self.data.get('model_type')} config.json needs it")
        return default

    def int(self, key: str, default=_REQUIRED) -> int | None:
        value = self._get(key, default)
        if not self.has(key):
            return value
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise OpgraphError(f"{self.path}: field {key!r} is {_shown(value)}, "
                               "not a positive whole number")
        return check_whole(value, f"{self.path}: field {key!r} =", MAX_DIM)

    def bool(self, key: str, default: bool) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise OpgraphError(f"{self.path}: field {key!r} is {_shown(value)}, "
                               "not true or false")
        return value

    def name(self) -> str:
        """A checkout's folder is named after the model: `Meta-Llama-3-8B/config.json`."""
        folder = self.path.resolve().parent.name
        return folder if self.path.name == "config.json" and folder else self.path.stem

    def count(self, key: str) -> int:
        """A whole number that may be 0 (a count of layers or experts); absent or null: 0."""
        return self.int(key) if self.data.get(key) != 0 and self.has(key) else 0

    def number(self, key: str, default: float | None) -> float | None:
        """A positive number; absent gives `default`, an explicit null gives None."""
        if key in self.data and self.data[key] is None:
            return None
        value = self.data.get(key, default)
        if value is None:
            return None
        if (isinstance(value, bool) or not isinstance(value, int | float)
                or not 0 < value < float("inf")):
            raise OpgraphError(f"{self.path}: field {key!r} is {_shown(value)}, "
                               "not a positive number")
        return float(value)

    def fraction(self, key: str, default: float) -> float:
        """A probability in [0, 1): absent gives `default`."""
        value = self.data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
            raise OpgraphError(f"{self.path}: field {key!r} is {_shown(value)}, not a "
                               "probability in [0, 1)")
        return float(value)

    def choice(self, key: str, default: str, choices: dict):
        """One of the names `choices` maps, to what it maps it to."""
        value = self._get(key, default)
        if not isinstance(value, str) or value not in choices:
            raise OpgraphError(f"{self.path}: field {key!r} is {_shown(value)}; opgraph reads "
                               f"{', '.join(map(repr, choices))}")
        return choices[value]

    def alias(self, *keys: str) -> str:
        """The one of `keys` (names transformers takes for one field: `n_layer`,
        `num_hidden_layers`) the config gives, the first when it gives none; two that
        disagree are an error."""
        given = [k for k in keys if self.has(k)]
        if len({json.dumps(self.data[k]) for k in given}) > 1:
            raise OpgraphError(f"{self.path}: fields {given[0]!r} = {_shown(self.data[given[0]])}"
                               f" and {given[1]!r} = {_shown(self.data[given[1]])} name one "
                               "field; give one of them")
        return given[0] if given else keys[0]

    def indices(self, key: str) -> tuple[int, ...]:
        """A list of layer indices (whole numbers from 0); absent or null: none."""
        value = self.data.get(key)
        if value is None:
            return ()
        if not isinstance(value, list) or any(
                isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < MAX_DIM
                for i in value):
            raise OpgraphError(f"{self.path}: field {key!r} is {_shown(value)}, not a list of "
                               "layer indices (whole numbers from 0)")
        return tuple(sorted(set(value)))

    def divisible(self, key: str, value: int, by_key: str, by: int) -> None:
        if value % by:
            raise OpgraphError(f"{self.path}: {key} = {value} is not a multiple of "
                               f"{by_key} = {by}")


def _seq_len(context: int | None) -> int:
    return min(context, DEFAULT_SEQ_LEN) if context else DEFAULT_SEQ_LEN


def _llama_family(model_type: str) -> Callable[[_Fields], Graph]:
    """A reader for Llama and its relatives, which share `LlamaConfig`."""
    def _read(f: _Fields) -> Graph:
        heads = f.int("num_attention_heads")
        d_model = f.int("hidden_size")
        head_dim = f.int("head_dim", _REQUIRED if model_type == "qwen3" else None)
        if head_dim is None:
            f.divisible("hidden_size", d_model, "num_attention_heads", heads)
        kv_heads = f.int("num_key_value_heads", heads if model_type == "llama" else _REQUIRED)
        f.divisible("num_attention_heads", heads, "num_key_value_heads", kv_heads)
        attention_bias = model_type in ("llama", "qwen3") and f.bool("attention_bias", False)
        experts = {}
        if model_type == "mixtral":
            experts = {"experts": f.int("num_local_experts"),
                       "experts_per_token": f.int("num_experts_per_tok")}
            _check_top_k(f, experts["experts_per_token"], "num_local_experts",
                         experts["experts"])
        config = llama.LlamaConfig(
            f.name(), d_model=d_model, layers=f.int("num_hidden_layers"), heads=heads,
            kv_heads=kv_heads, d_ff=f.int("intermediate_size"), vocab=f.int("vocab_size"),
            head_dim=head_dim, seq_len=_seq_len(f.int("max_position_embeddings", None)),
            tie_embeddings=f.bool("tie_word_embeddings", False),
            qkv_bias=model_type == "qwen2" or attention_bias, o_bias=attention_bias,
            mlp_bias=model_type == "llama" and f.bool("mlp_bias", False),
            qk_norm=model_type == "qwen3",
            # Mistral's and Mixtral's sliding window, every layer's (null: none)
            window=(f.int("sliding_window", None) if model_type in ("mistral", "mixtral")
                    else None), **experts)
        return llama.build(config)
    _read.__name__ = f"_read_{model_type}"
    return _read


def _check_top_k(f: _Fields, top_k: int, experts_key: str, experts: int) -> None:
    if top_k > experts:
        raise OpgraphError(f"{f.path}: num_experts_per_tok = {top_k} is more than "
                           f"{experts_key} = {experts}")


def _qwen_moe_family(model_type: str) -> Callable[[_Fields], Graph]:
    """A reader for Qwen2-MoE and Qwen3-MoE (`models.qwen_moe`)."""
    qwen3 = model_type == "qwen3_moe"

    def _read(f: _Fields) -> Graph:
        heads, d_model = f.int("num_attention_heads"), f.int("hidden_size")
        head_dim = f.int("head_dim", None)
        if head_dim is None:
            f.divisible("hidden_size", d_model, "num_attention_heads", heads)
        kv_heads = f.int("num_key_value_heads")
        f.divisible("num_attention_heads", heads, "num_key_value_heads", kv_heads)
        zero = type(f.data.get("num_experts")) is int and f.data["num_experts"] == 0
        experts = 0 if zero else f.int("num_experts")  # transformers: 0 experts, every layer dense
        moe = {"experts": 0, "experts_per_token": 1, "moe_d_ff": 1}  # the fields shape nothing
        if experts:
            moe = {"experts": experts, "experts_per_token": f.int("num_experts_per_tok"),
                   "moe_d_ff": f.int("moe_intermediate_size"),
                   "sparse_step": f.int("decoder_sparse_step", 1),
                   "dense_layers": f.indices("mlp_only_layers")}
            _check_top_k(f, moe["experts_per_token"], "num_experts", experts)
            if not qwen3:
                moe["shared_d_ff"] = f.int("shared_expert_intermediate_size")
        attention_bias = qwen3 and f.bool("attention_bias", False)
        config = qwen_moe.QwenMoeConfig(
            f.name(), d_model=d_model, layers=f.int("num_hidden_layers"), heads=heads,
            kv_heads=kv_heads, vocab=f.int("vocab_size"), head_dim=head_dim,
            qkv_bias=attention_bias or (not qwen3 and f.bool("qkv_bias", True)),
            o_bias=attention_bias, qk_norm=qwen3,
            seq_len=_seq_len(f.int("max_position_embeddings", None)),
            tie_embeddings=f.bool("tie_word_embeddings", False), **moe)
        layout = qwen_moe.stacks(config, where=str(f.path))
        if any(qwen_moe.DENSE in stack.body for stack in layout):  # only they read its width
            config = attrs.evolve(config, d_ff=f.int("intermediate_size"))
        return qwen_moe.build(config)
    _read.__name__ = f"_read_{model_type}"
    return _read


def _read_llama4(f: _Fields) -> Graph:
    """Llama 4's text model (`model_type` llama4, its fields under `text_config`; or
    llama4_text): the Qwen mixture-of-experts graph (`models.qwen_moe`) with a shared expert of
    `intermediate_size` and no gate, sparse every `interleave_moe_layer_step` layers, dense
    layers of `intermediate_size_mlp`."""
    if f.data.get("model_type") == "llama4":
        text = f.data.get("text_config")
        if not isinstance(text, dict):
            raise OpgraphError(f"{f.path}: field 'text_config' is {_shown(text)}; a llama4 "
                               "config.json holds its language model's fields there")
        f = _Fields({"model_type": "llama4_text", **text}, f.path)
    heads, kv_heads = f.int("num_attention_heads"), f.int("num_key_value_heads")
    f.divisible("num_attention_heads", heads, "num_key_value_heads", kv_heads)
    experts, top_k = f.int("num_local_experts"), f.int("num_experts_per_tok")
    _check_top_k(f, top_k, "num_local_experts", experts)
    config = qwen_moe.QwenMoeConfig(
        f.name(), d_model=f.int("hidden_size"), layers=f.int("num_hidden_layers"), heads=heads,
        kv_heads=kv_heads, vocab=f.int("vocab_size"), experts=experts,
        experts_per_token=top_k, moe_d_ff=f.int("intermediate_size"),
        shared_d_ff=f.int("intermediate_size"), shared_gate=False,
        sparse_step=f.int("interleave_moe_layer_step", 1), head_dim=f.int("head_dim", None),
        qk_norm=f.bool("use_qk_norm", False),
        seq_len=_seq_len(f.int("max_position_embeddings", None)),
        tie_embeddings=f.bool("tie_word_embeddings", False))
    layout = qwen_moe.stacks(config, where=str(f.path))
    if any(qwen_moe.DENSE in stack.body for stack in layout):
        config = attrs.evolve(config, d_ff=f.int("intermediate_size_mlp"))
    return qwen_moe.build(config)


def _read_gpt2(f: _Fields) -> Graph:
    d_model, heads = f.int("n_embd"), f.int("n_head")
    f.divisible("n_embd", d_model, "n_head", heads)
    positions = f.int("n_ctx") if not f.has("n_positions") and f.has("n_ctx") else (
        f.int("n_positions"))
    config = gpt2.GPT2Config(
        f.name(), d_model=d_model, layers=f.int("n_layer"), heads=heads,
        vocab=f.int("vocab_size"), positions=positions, d_ff=f.int("n_inner", None),
        seq_len=_seq_len(positions), tie_embeddings=f.bool("tie_word_embeddings", True),
        attention_dropout=f.fraction("attn_pdrop", 0.1))
    return gpt2.build(config)


def _read_gemma2(f: _Fields) -> Graph:
    layers = f.int("num_hidden_layers")
    if layers % 2:
        raise OpgraphError(f"{f.path}: num_hidden_layers = {layers} is odd; Gemma 2 alternates "
                           "sliding-window and global layers")
    heads, kv_heads = f.int("num_attention_heads"), f.int("num_key_value_heads")
    f.divisible("num_attention_heads", heads, "num_key_value_heads", kv_heads)
    config = gemma2.Gemma2Config(
        f.name(), d_model=f.int("hidden_size"), layers=layers, heads=heads, kv_heads=kv_heads,
        head_dim=f.int("head_dim"), d_ff=f.int("intermediate_size"), vocab=f.int("vocab_size"),
        window=f.int("sliding_window"),
        attn_softcap=f.number("attn_logit_softcapping", 50.0),
        final_softcap=f.number("final_logit_softcapping", 30.0),
        seq_len=_seq_len(f.int("max_position_embeddings", None)),
        tie_embeddings=f.bool("tie_word_embeddings", True))
    return gemma2.build(config)


# gpt-oss's two kinds of layer, as `layer_types` names them (transformers' GptOssConfig)
_GPT_OSS_LAYERS = {"sliding_attention": gpt_oss.SLIDING, "full_attention": gpt_oss.FULL}


def _read_gpt_oss(f: _Fields) -> Graph:
    """gpt-oss (`models.gpt_oss`): its layers alternate a sliding window and the full
    sequence, sliding first (`layer_types`; absent, transformers' default, that alternation)."""
    layers = f.int("num_hidden_layers")
    if layers % 2:
        raise OpgraphError(f"{f.path}: num_hidden_layers = {layers} is odd; gpt-oss alternates "
                           "sliding-window and full layers in pairs")
    if f.has("layer_types"):
        given = f.data["layer_types"]
        if (not isinstance(given, list) or len(given) != layers
                or any(not isinstance(t, str) or t not in _GPT_OSS_LAYERS for t in given)):
            raise OpgraphError(f"{f.path}: field 'layer_types' is {_shown(given)}, not a list of "
                               f"{layers} of {', '.join(map(repr, _GPT_OSS_LAYERS))}")
        if [_GPT_OSS_LAYERS[t] for t in given] != [gpt_oss.SLIDING, gpt_oss.FULL] * (layers // 2):
            raise OpgraphError(f"{f.path}: layer_types does not alternate sliding_attention and "
                               "full_attention, sliding first; opgraph builds gpt-oss's stack as "
                               "pairs of them")
    heads, kv_heads = f.int("num_attention_heads"), f.int("num_key_value_heads")
    f.divisible("num_attention_heads", heads, "num_key_value_heads", kv_heads)
    experts = f.int("num_local_experts")
    top_k = f.int(f.alias("num_experts_per_tok", "experts_per_token"))
    _check_top_k(f, top_k, "num_local_experts", experts)
    config = gpt_oss.GptOssConfig(
        f.name(), d_model=f.int("hidden_size"), layers=layers, heads=heads, kv_heads=kv_heads,
        head_dim=f.int("head_dim"), experts=experts, experts_per_token=top_k,
        moe_d_ff=f.int("intermediate_size"), vocab=f.int("vocab_size"),
        window=f.int("sliding_window"),
        seq_len=_seq_len(f.int("initial_context_length", None)
                         or f.int("max_position_embeddings", None)),
        tie_embeddings=f.bool("tie_word_embeddings", False))
    return gpt_oss.build(config)


def _read_nemotron_h(f: _Fields) -> Graph:
    """Nemotron-H and Nemotron 3 (`models.nemotron_h`): the layers by `hybrid_override_pattern`
    (M Mamba-2, * attention, - MLP, E mixture of experts)."""
    pattern = f.data.get("hybrid_override_pattern")
    if not isinstance(pattern, str) or not pattern or set(pattern) - set(nemotron_h.REGIONS):
        raise OpgraphError(f"{f.path}: field 'hybrid_override_pattern' is {_shown(pattern)}, not "
                           "a string of M (Mamba-2), * (attention), - (MLP) and E (experts)")
    layers = f.int("num_hidden_layers", len(pattern))
    if layers != len(pattern):
        raise OpgraphError(f"{f.path}: num_hidden_layers = {layers} but hybrid_override_pattern "
                           f"has {len(pattern)} layers; give one of each")
    f.choice("mlp_hidden_act", "relu2", {"relu2": None})
    attention, mamba = "*" in pattern, "M" in pattern
    moe, mlp = "E" in pattern, "-" in pattern
    heads = f.int("num_attention_heads") if attention else 1
    kv_heads = f.int("num_key_value_heads") if attention else 1
    experts = f.int("n_routed_experts") if moe else 0
    top_k = f.int("num_experts_per_tok") if moe else 0
    if moe:
        _check_top_k(f, top_k, "n_routed_experts", experts)
    try:
        config = nemotron_h.NemotronHConfig(
            f.name(), d_model=f.int("hidden_size"), pattern=pattern, heads=heads,
            kv_heads=kv_heads,
            head_dim=(f.int(f.alias("head_dim", "attention_head_dim"),
                            f.int("hidden_size") // heads) if attention else 1),
            mamba_heads=f.int("mamba_num_heads") if mamba else 1,
            mamba_head_dim=f.int("mamba_head_dim") if mamba else 1,
            state=f.int("ssm_state_size") if mamba else 1,
            groups=f.int(f.alias("n_groups", "mamba_n_groups")) if mamba else 1,
            conv_width=f.int(f.alias("conv_kernel", "mamba_d_conv"), 4),
            chunk=f.int(f.alias("chunk_size", "mamba_chunk_size"), 128),
            vocab=f.int("vocab_size"), d_ff=f.int("intermediate_size") if mlp else 0,
            experts=experts, experts_per_token=top_k,
            moe_d_ff=f.int("moe_intermediate_size") if moe else 0,
            shared_d_ff=(f.count("moe_shared_expert_intermediate_size") if moe else 0),
            seq_len=_seq_len(f.int("max_position_embeddings", None)),
            tie_embeddings=f.bool("tie_word_embeddings", False))
    except OpgraphError as e:
        raise OpgraphError(f"{f.path}: {e}") from None
    return nemotron_h.build(config)


def _read_deepseek(f: _Fields) -> Graph:
    """DeepSeek-V2 and -V3 (`model_type` deepseek_v2 / deepseek_v3), and Kimi K2 (`kimi_k2`,
    DeepseekV3ForCausalLM with other widths): one graph; V3 adds the multi-token prediction
    modules (`num_nextn_predict_layers`)."""
    layers = f.int("num_hidden_layers")
    routed = f.int("n_routed_experts", None)
    first_dense = layers if routed is None else min(layers, f.count("first_k_dense_replace"))
    if routed is not None and f.has("moe_layer_freq") and f.int("moe_layer_freq") != 1:
        raise OpgraphError(f"{f.path}: moe_layer_freq = {f.data['moe_layer_freq']}; opgraph "
                           "reads DeepSeek configs whose later layers are all experts (1)")
    moe = {}
    if routed is not None:
        moe = {"routed_experts": routed, "experts_per_token": f.int("num_experts_per_tok"),
               "moe_d_ff": f.int("moe_intermediate_size"),
               "shared_experts": f.count("n_shared_experts")}
        _check_top_k(f, moe["experts_per_token"], "n_routed_experts", routed)
    else:  # every layer dense: the expert fields shape nothing
        moe = {"routed_experts": 1, "experts_per_token": 1, "moe_d_ff": 1, "shared_experts": 0}
    config = deepseek.DeepSeekV2Config(
        f.name(), d_model=f.int("hidden_size"), layers=layers,
        heads=f.int("num_attention_heads"), kv_lora_rank=f.int("kv_lora_rank"),
        qk_nope_head_dim=f.int("qk_nope_head_dim"), qk_rope_head_dim=f.int("qk_rope_head_dim"),
        v_head_dim=f.int("v_head_dim"), d_ff=f.int("intermediate_size"),
        first_dense=first_dense, vocab=f.int("vocab_size"),
        q_lora_rank=f.int("q_lora_rank", None),
        seq_len=_seq_len(f.int("max_position_embeddings", None)),
        tie_embeddings=f.bool("tie_word_embeddings", False),
        mtp_depth=f.count("num_nextn_predict_layers"), **moe)
    if config.mtp_depth and routed is None:
        raise OpgraphError(f"{f.path}: num_nextn_predict_layers = {config.mtp_depth} with no "
                           "routed experts; opgraph builds DeepSeek-V3's prediction module as a "
                           "mixture-of-experts layer")
    return deepseek.build(config)


GELU_FORMS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


def _read_bert(f: _Fields) -> Graph:
    d_model, heads = f.int("hidden_size"), f.int("num_attention_heads")
    f.divisible("hidden_size", d_model, "num_attention_heads", heads)
    positions = f.int("max_position_embeddings")
    config = bert.BertConfig(
        f.name(), d_model=d_model, layers=f.int("num_hidden_layers"), heads=heads,
        d_ff=f.int("intermediate_size"), vocab=f.int("vocab_size"), positions=positions,
        token_types=f.int("type_vocab_size"), seq_len=_seq_len(positions),
        gelu=f.choice("hidden_act", "gelu", GELU_FORMS))
    return bert.build(config)


# transformers' ACT2FN names of the MLP activations the LayerNorm decoders' graph has.
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu_tanh",
               "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh"}


def _read_opt(f: _Fields) -> Graph:
    """OPT (transformers' `OPTForCausalLM`): learned positions in a table of
    `max_position_embeddings + 2` rows (`OPTLearnedPositionalEmbedding`'s offset)."""
    if not f.bool("layer_norm_elementwise_affine", True):
        raise OpgraphError(f"{f.path}: field 'layer_norm_elementwise_affine' is false; "
                           "opgraph's LayerNorm has a weight and a bias; give true")
    pre_norm = f.bool("do_layer_norm_before", True)
    if pre_norm and f.bool("_remove_final_layer_norm", False):  # post-LN has none anyway
        raise OpgraphError(f"{f.path}: field '_remove_final_layer_norm' is true; opgraph reads "
                           "pre-LN OPT configs with the final LayerNorm; give false")
    d_model, heads = f.int("hidden_size"), f.int("num_attention_heads")
    f.divisible("hidden_size", d_model, "num_attention_heads", heads)
    positions = f.int("max_position_embeddings", 2048)
    proj = f.int("word_embed_proj_dim", d_model)
    bias = f.bool("enable_bias", True)
    config = gpt2.GPT2Config(
        f.name(), d_model=d_model, layers=f.int("num_hidden_layers"), heads=heads,
        vocab=f.int("vocab_size"), positions=positions, position_offset=2,
        d_ff=f.int("ffn_dim"), seq_len=_seq_len(positions),
        tie_embeddings=f.bool("tie_word_embeddings", True),
        activation=f.choice("activation_function", "relu", ACTIVATIONS),
        attention_bias=bias, mlp_bias=bias,
        post_norm=not pre_norm,
        embed_proj=proj if proj != d_model else None,
        attention_dropout=f.fraction("attention_dropout", 0.0))
    return gpt2.build(config)


def _rotary(f: _Fields, key: str, default: float, head: int) -> int:
    """The dims of each `head`-wide head RoPE rotates: `int(head x field key)` (absent:
    `default`), as transformers' `rotary_ndims`; one line unless that is an even count."""
    pct = f.number(key, default)
    rotary = int(head * pct) if pct is not None else 0
    if pct is None or pct > 1 or rotary == 0 or rotary % 2:
        raise OpgraphError(f"{f.path}: field {key!r} is {_shown(f.data.get(key))}; RoPE needs "
                           f"an even number of a head's {head} dims (a fraction in (0, 1])")
    return rotary


def _read_gpt_neox(f: _Fields) -> Graph:
    """GPT-NeoX (transformers' `GPTNeoXForCausalLM`): RoPE on `int(head size x rotary_pct)`
    dims of each head, as transformers' `rotary_ndims`."""
    d_model, heads = f.int("hidden_size"), f.int("num_attention_heads")
    f.divisible("hidden_size", d_model, "num_attention_heads", heads)
    # newer transformers write both names
    rotary = _rotary(f, f.alias("rotary_pct", "partial_rotary_factor"), 0.25, d_model // heads)
    positions = f.int("max_position_embeddings", 2048)
    config = gpt2.GPT2Config(
        f.name(), d_model=d_model, layers=f.int("num_hidden_layers"), heads=heads,
        vocab=f.int("vocab_size"), positions=None, d_ff=f.int("intermediate_size"),
        seq_len=_seq_len(positions), tie_embeddings=f.bool("tie_word_embeddings", False),
        rotary=rotary, activation=f.choice("hidden_act", "gelu", ACTIVATIONS),
        attention_bias=f.bool("attention_bias", True),
        parallel=f.bool("use_parallel_residual", True),
        attention_dropout=f.fraction("attention_dropout", 0.0))
    return gpt2.build(config)


def _read_nemotron(f: _Fields) -> Graph:
    """Nemotron-4 and Minitron (transformers' `NemotronForCausalLM`): grouped-query attention
    with RoPE on `partial_rotary_factor` of each head (absent: 0.5), LayerNorm (its `1p`
    form: the same kernel), a ReLU-squared MLP without a gate, no biases unless
    `attention_bias` / `mlp_bias`, untied unless `tie_word_embeddings`: the GPT-2 graph with
    those flags (`models.gpt2`)."""
    d_model, heads = f.int("hidden_size"), f.int("num_attention_heads")
    f.divisible("hidden_size", d_model, "num_attention_heads", heads)
    if f.has("head_dim") and f.int("head_dim") != d_model // heads:
        raise OpgraphError(f"{f.path}: head_dim = {f.data['head_dim']} is not hidden_size / "
                           f"num_attention_heads = {d_model // heads}; opgraph builds this "
                           "family's heads at that size")
    kv_heads = f.int("num_key_value_heads", heads)
    f.divisible("num_attention_heads", heads, "num_key_value_heads", kv_heads)
    rotary = _rotary(f, "partial_rotary_factor", 0.5, d_model // heads)
    f.choice("hidden_act", "relu2", {"relu2": None})
    config = gpt2.GPT2Config(
        f.name(), d_model=d_model, layers=f.int("num_hidden_layers"), heads=heads,
        vocab=f.int("vocab_size"), positions=None, d_ff=f.int("intermediate_size"),
        seq_len=_seq_len(f.int("max_position_embeddings", 4096)),
        tie_embeddings=f.bool("tie_word_embeddings", False),
        kv_heads=kv_heads if kv_heads != heads else None, rotary=rotary, activation="relu2",
        attention_bias=f.bool("attention_bias", False), mlp_bias=f.bool("mlp_bias", False),
        attention_dropout=f.fraction("attention_dropout", 0.0))
    return gpt2.build(config)


def _read_bloom(f: _Fields) -> Graph:
    """BLOOM (transformers' `BloomForCausalLM`): ALiBi, no position table; a LayerNorm on the
    word embeddings; the MLP 4 x hidden with the tanh GELU (`BloomGelu`); biases everywhere."""
    width, heads = f.alias("hidden_size", "n_embed"), f.alias("n_head", "num_attention_heads")
    d_model, n_heads = f.int(width), f.int(heads)
    f.divisible(width, d_model, heads, n_heads)
    config = gpt2.GPT2Config(
        f.name(), d_model=d_model, layers=f.int(f.alias("n_layer", "num_hidden_layers")),
        heads=n_heads, vocab=f.int("vocab_size"), positions=None, seq_len=DEFAULT_SEQ_LEN,
        tie_embeddings=f.bool("tie_word_embeddings", True), alibi=True, embed_norm=True,
        residual_from_norm=f.bool("apply_residual_connection_post_layernorm", False),
        attention_dropout=f.fraction("attention_dropout", 0.0))
    return gpt2.build(config)


def _read_falcon(f: _Fields) -> Graph:
    """Falcon (transformers' `FalconForCausalLM`). The new decoder architecture (Falcon-40B,
    180B): grouped-query attention over `num_kv_heads`, attention and MLP in parallel, each
    with its LayerNorm (`num_ln_in_parallel_attn` 2, or 1 shared). The old one (Falcon-7B):
    one KV head when `multi_query`, parallel with one shared LayerNorm when `parallel_attn`,
    else sequential. RoPE on whole heads, or ALiBi when `alibi`."""
    width, heads_key = f.alias("hidden_size", "n_embed"), f.alias("num_attention_heads", "n_head")
    d_model, heads = f.int(width), f.int(heads_key)
    f.divisible(width, d_model, heads_key, heads)
    new = f.bool("new_decoder_architecture", False)
    parallel = f.bool("parallel_attn", True)
    norms = f.int("num_ln_in_parallel_attn", 2 if new else None)
    if new and not parallel:
        raise OpgraphError(f"{f.path}: new_decoder_architecture with parallel_attn false: "
                           "transformers builds no such Falcon layer; give parallel_attn true")
    if parallel and norms not in ((1, 2) if new else (None, 1)):
        raise OpgraphError(f"{f.path}: field 'num_ln_in_parallel_attn' is {norms}; transformers' "
                           f"Falcon runs {'1 or 2' if new else '1 (or none)'} with "
                           f"new_decoder_architecture {str(new).lower()}")
    if new:
        kv_key = f.alias("num_kv_heads", "n_head_kv")
        kv_heads = f.int(kv_key, heads)
        f.divisible(heads_key, heads, kv_key, kv_heads)
    else:  # num_kv_heads is not read: the fused QKV is hidden + 2 heads, or 3 x hidden
        kv_heads = 1 if f.bool("multi_query", True) else heads
    bias, alibi = f.bool("bias", False), f.bool("alibi", False)
    config = gpt2.GPT2Config(
        f.name(), d_model=d_model, layers=f.int(f.alias("num_hidden_layers", "n_layer")),
        heads=heads, vocab=f.int("vocab_size"), positions=None,
        d_ff=f.int("ffn_hidden_size", 4 * d_model),
        seq_len=_seq_len(f.int("max_position_embeddings", 2048)),
        tie_embeddings=f.bool("tie_word_embeddings", True), kv_heads=kv_heads,
        rotary=None if alibi else d_model // heads, alibi=alibi,
        activation=f.choice("activation", "gelu", ACTIVATIONS),
        attention_bias=bias, mlp_bias=bias, parallel=parallel,
        shared_norm=parallel and norms != 2,
        attention_dropout=f.fraction("attention_dropout", 0.0))
    return gpt2.build(config)


FAMILIES: dict[str, Callable[[_Fields], Graph]] = {
    "llama": _llama_family("llama"),
    "mistral": _llama_family("mistral"),
    "mixtral": _llama_family("mixtral"),
    "qwen2": _llama_family("qwen2"),
    "qwen3": _llama_family("qwen3"),
    "qwen2_moe": _qwen_moe_family("qwen2_moe"),
    "qwen3_moe": _qwen_moe_family("qwen3_moe"),
    "llama4": _read_llama4,
    "llama4_text": _read_llama4,
    "gpt2": _read_gpt2,
    "gemma2": _read_gemma2,
    "deepseek_v2": _read_deepseek,
    "deepseek_v3": _read_deepseek,
    "kimi_k2": _read_deepseek,  # Kimi K2's config: DeepSeek-V3's architecture and fields
    "gpt_oss": _read_gpt_oss,
    "nemotron_h": _read_nemotron_h,
    "bert": _read_bert,
    "opt": _read_opt,
    "gpt_neox": _read_gpt_neox,
    "bloom": _read_bloom,
    "nemotron": _read_nemotron,
    "falcon": _read_falcon,
}


def from_config(path: str | Path) -> Graph:
    """The forward graph a `config.json` (or a folder holding one) describes:
    `from_config("gpt2/config.json")`."""
    if not str(path).strip():
        raise OpgraphError("the config file name is empty; give the path of a Hugging Face "
                           "config.json")
    path = Path(path)
    if path.is_dir():  # a checkout's folder
        path = path / "config.json"
    if not path.exists():
        raise OpgraphError(f"config file {path} does not exist; give the path of a "
                           "Hugging Face config.json")
    text = read_small(path, "config file")  # at most CONFIG_MAX_BYTES: not /dev/zero
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise OpgraphError(f"config file {path} is not valid JSON: {e}") from None
    except RecursionError:
        raise OpgraphError(f"config file {path} nests too deeply to be a config.json") from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise OpgraphError(f"config file {path}: {str(e).split(':')[0]}") from None
    if not isinstance(data, dict):
        raise OpgraphError(f"config file {path} holds a JSON {type(data).__name__}, not an "
                           "object of fields like a Hugging Face config.json")
    return from_dict(data, path)


def from_dict(data: dict, where: str | Path) -> Graph:
    """The forward graph a config object (a parsed config.json) describes; `where` names it in
    error messages: `from_dict({"model_type": "gpt2", ...}, "case 7: model")`."""
    model_type = data.get("model_type")
    if model_type is None:
        raise OpgraphError(f"{where}: missing field 'model_type'; give one of "
                           f"{', '.join(FAMILIES)}")
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise OpgraphError(f"{where}: model_type {_shown(model_type)} is not supported; "
                           f"opgraph reads {', '.join(FAMILIES)}")
    return FAMILIES[model_type](_Fields(data, Path(str(where))))
