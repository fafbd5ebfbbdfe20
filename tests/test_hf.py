"""Hugging Face config.json files, written here from published fields, through the pipeline."""

import json

import sympy

import pytest
from opgraph.models import preset, qwen_moe
from opgraph.models.hf import from_config

from opgraph import compile_step, evaluate, hardware
from opgraph.core.parameters import active_parameters
from opgraph.cli import main
from opgraph.core.errors import OpgraphError
from opgraph.core.symbols import H, H_kv, dim

H100 = hardware.get("h100-sxm")

# Published config.json fields (the Hub's copies), trimmed of what does not shape a cost only
# where noted; the ignored fields are kept to show they are ignored.
LLAMA3_8B = {  # meta-llama/Meta-Llama-3-8B
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 8192,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.0.dev0", "use_cache": True, "vocab_size": 128256,
}
MISTRAL_7B = {  # mistralai/Mistral-7B-v0.1
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 32000,
}
MIXTRAL_8X7B = {  # mistralai/Mixtral-8x7B-v0.1
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
    "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1e6, "router_aux_loss_coef": 0.02,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "vocab_size": 32000,
}
QWEN2_7B = {  # Qwen/Qwen2-7B
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 3584,
    "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 131072,
    "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 152064,
}
GPT2 = {  # openai-community/gpt2 (no tie_word_embeddings field: transformers' default, true)
    "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"],
    "attn_pdrop": 0.1, "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256,
    "initializer_range": 0.02, "layer_norm_epsilon": 1e-05, "model_type": "gpt2",
    "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024,
    "resid_pdrop": 0.1, "vocab_size": 50257,
}
GEMMA2_2B = {  # google/gemma-2-2b
    "architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid",
    "eos_token_id": 1, "final_logit_softcapping": 30.0, "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 2304, "initializer_range": 0.02, "intermediate_size": 9216,
    "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 8,
    "num_hidden_layers": 26, "num_key_value_heads": 4, "pad_token_id": 0,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
    "sliding_window": 4096, "torch_dtype": "float32", "use_cache": True, "vocab_size": 256000,
}
DEEPSEEK_V2_LITE = {  # deepseek-ai/DeepSeek-V2-Lite (rope_scaling trimmed: it shapes no cost)
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 100000,
    "eos_token_id": 100001, "first_k_dense_replace": 1, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 10944,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64,
    "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 16,
    "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16,
    "pretraining_tp": 1, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06, "rope_theta": 10000, "routed_scaling_factor": 1.0,
    "scoring_func": "softmax", "seq_aux": True, "tie_word_embeddings": False, "topk_group": 1,
    "topk_method": "greedy", "torch_dtype": "bfloat16", "use_cache": True, "v_head_dim": 128,
    "vocab_size": 102400,
}
DEEPSEEK_V3 = {  # deepseek-ai/DeepSeek-V3 config.json (rope_scaling and quantization trimmed)
    "architectures": ["DeepseekV3ForCausalLM"], "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06, "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid", "tie_word_embeddings": False, "topk_group": 4,
    "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128,
    "vocab_size": 129280,
}
BERT_BASE = {  # google-bert/bert-base-uncased
    "architectures": ["BertForMaskedLM"], "attention_probs_dropout_prob": 0.1,
    "gradient_checkpointing": False, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
    "hidden_size": 768, "initializer_range": 0.02, "intermediate_size": 3072,
    "layer_norm_eps": 1e-12, "max_position_embeddings": 512, "model_type": "bert",
    "num_attention_heads": 12, "num_hidden_layers": 12, "pad_token_id": 0,
    "position_embedding_type": "absolute", "type_vocab_size": 2, "use_cache": True,
    "vocab_size": 30522,
}

OPT_125M = {  # facebook/opt-125m
    "_remove_final_layer_norm": False, "activation_dropout": 0.0, "activation_function": "relu",
    "architectures": ["OPTForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 2,
    "do_layer_norm_before": True, "dropout": 0.1, "eos_token_id": 2, "ffn_dim": 3072,
    "hidden_size": 768, "init_std": 0.02, "layerdrop": 0.0, "max_position_embeddings": 2048,
    "model_type": "opt", "num_attention_heads": 12, "num_hidden_layers": 12, "pad_token_id": 1,
    "prefix": "</s>", "torch_dtype": "float16", "use_cache": True, "vocab_size": 50272,
    "word_embed_proj_dim": 768,
}
# OPT-175B is not on the Hub; arXiv:2205.01068 (OPT), Table 1: 96 layers, 96 heads, width
# 12288 (FFN 4x), the family's 50272-row vocabulary and 2048 context.
OPT_175B = OPT_125M | {"ffn_dim": 49152, "hidden_size": 12288, "num_attention_heads": 96,
                       "num_hidden_layers": 96, "word_embed_proj_dim": 12288}
# facebook/opt-350m: post-LayerNorm, and a 512-wide token table projected in and out.
OPT_350M = OPT_125M | {"do_layer_norm_before": False, "ffn_dim": 4096, "hidden_size": 1024,
                       "num_attention_heads": 16, "num_hidden_layers": 24,
                       "word_embed_proj_dim": 512}

GPT_NEOX_20B = {  # EleutherAI/gpt-neox-20b
    "architectures": ["GPTNeoXForCausalLM"], "bos_token_id": 0, "eos_token_id": 0,
    "hidden_act": "gelu_fast", "hidden_size": 6144, "initializer_range": 0.02,
    "intermediate_size": 24576, "layer_norm_eps": 1e-05, "max_position_embeddings": 2048,
    "model_type": "gpt_neox", "num_attention_heads": 64, "num_hidden_layers": 44,
    "rotary_emb_base": 10000, "rotary_pct": 0.25, "tie_word_embeddings": False,
    "torch_dtype": "float16", "use_cache": True, "use_parallel_residual": True,
    "vocab_size": 50432,
}
BLOOM_176B = {  # bigscience/bloom
    "apply_residual_connection_post_layernorm": False, "architectures": ["BloomForCausalLM"],
    "attention_dropout": 0.0, "attention_softmax_in_fp32": True, "bias_dropout_fusion": True,
    "bos_token_id": 1, "eos_token_id": 2, "hidden_dropout": 0.0, "hidden_size": 14336,
    "initializer_range": 0.02, "layer_norm_epsilon": 1e-05, "masked_softmax_fusion": True,
    "model_type": "bloom", "n_head": 112, "n_inner": None, "n_layer": 70, "offset_alibi": 100,
    "pad_token_id": 3, "pretraining_tp": 4, "skip_bias_add": True, "skip_bias_add_qkv": False,
    "slow_but_exact": False, "unk_token_id": 0, "use_cache": True, "vocab_size": 250880,
}
# bigscience/bloom-560m: the older spelling of the width, n_embed
BLOOM_560M = {k: v for k, v in BLOOM_176B.items() if k != "hidden_size"} | {
    "n_embed": 1024, "n_head": 16, "n_layer": 24, "pretraining_tp": 1}
FALCON_7B = {  # tiiuae/falcon-7b
    "alibi": False, "apply_residual_connection_post_layernorm": False,
    "architectures": ["FalconForCausalLM"], "attention_dropout": 0.0, "bias": False,
    "bos_token_id": 11, "eos_token_id": 11, "hidden_dropout": 0.0, "hidden_size": 4544,
    "initializer_range": 0.02, "layer_norm_epsilon": 1e-05, "model_type": "falcon",
    "multi_query": True, "new_decoder_architecture": False, "num_attention_heads": 71,
    "num_hidden_layers": 32, "parallel_attn": True, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 65024,
}
# tiiuae/falcon-40b: the new decoder architecture, 8 KV heads
FALCON_40B = FALCON_7B | {"hidden_size": 8192, "new_decoder_architecture": True,
                          "num_attention_heads": 128, "num_hidden_layers": 60,
                          "num_kv_heads": 8}
QWEN3_8B = {  # Qwen/Qwen3-8B
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
QWEN3_0_6B = QWEN3_8B | {  # Qwen/Qwen3-0.6B: narrower than its heads, tied embeddings
    "hidden_size": 1024, "intermediate_size": 3072, "max_window_layers": 28,
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "tie_word_embeddings": True,
}
QWEN1_5_MOE_A2_7B = {  # Qwen/Qwen1.5-MoE-A2.7B
    "architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "decoder_sparse_step": 1, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 5632, "max_position_embeddings": 32768,
    "max_window_layers": 21, "model_type": "qwen2_moe", "moe_intermediate_size": 1408,
    "norm_topk_prob": False, "num_attention_heads": 16, "num_experts": 60,
    "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 16,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 5632,
    "sliding_window": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
    "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}


GPT_OSS_120B = {  # openai/gpt-oss-120b config.json (rope_scaling trimmed)
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
    "num_experts_per_tok": 4, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "num_local_experts": 128, "rms_norm_eps": 1e-05, "rope_theta": 150000,
    "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "vocab_size": 201088,
}


def write(tmp_path, fields, folder="model", text=None):
    path = tmp_path / folder / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(fields) if text is None else text)
    return path


def profile_json(graph, **values):
    j = evaluate(compile_step(graph), H100, values).to_json(ops=True)
    j.pop("model")
    return j


@pytest.mark.parametrize("fields, name", [
    (LLAMA3_8B, "llama3-8b"), (MIXTRAL_8X7B, "mixtral-8x7b"), (QWEN2_7B, "qwen2-7b"),
    (GPT2, "gpt2"), (GEMMA2_2B, "gemma2-2b"), (DEEPSEEK_V2_LITE, "deepseek-v2-lite"),
    (BERT_BASE, "bert-base"),
])
def test_a_config_gives_exactly_its_presets_profile(tmp_path, fields, name):
    graph = from_config(write(tmp_path, fields, "Some-Model"))
    assert graph.name == "Some-Model"  # named after the checkout's folder
    reference = preset(name)
    assert (graph.seq_len, graph.max_seq_len) == (reference.seq_len, reference.max_seq_len)
    assert profile_json(graph) == profile_json(reference)
    assert profile_json(graph, B=2) == profile_json(reference, B=2)


def test_mistral_7b_profiles_end_to_end(tmp_path, capsys):
    path = write(tmp_path, MISTRAL_7B, "Mistral-7B-v0.1")
    code = main(["profile", "--config", str(path), "--json"])
    out, _ = capsys.readouterr()
    assert code == 0
    j = json.loads(out)
    assert j["model"] == "Mistral-7B-v0.1"
    assert j["parameters"] == pytest.approx(7.24e9, rel=0.005)  # HF Mistral-7B-v0.1: 7.24B
    assert j["seq_len"] == 8192  # the 32768 context, capped at the plate's 8192


def test_a_checkout_folder_reads_its_config_json(tmp_path):
    path = write(tmp_path, GPT2, "gpt2-checkout")
    assert from_config(path.parent).name == "gpt2-checkout"


def test_context_shorter_than_the_cap_is_the_default_seq_len(tmp_path):
    fields = LLAMA3_8B | {"max_position_embeddings": 2048}
    assert from_config(write(tmp_path, fields)).seq_len == 2048


def test_defaults_follow_transformers(tmp_path):
    # Llama without num_key_value_heads is multi-head attention; tie defaults to false
    fields = {k: v for k, v in LLAMA3_8B.items()
              if k not in ("num_key_value_heads", "tie_word_embeddings")}
    graph = from_config(write(tmp_path, fields, "a"))
    assert graph.dims[H_kv] == graph.dims[H] == 32
    assert graph.has_tensor("lm_head.weight")
    # GPT-2 ties unless told otherwise; n_inner null means 4 x n_embd
    untied = from_config(write(tmp_path, GPT2 | {"tie_word_embeddings": False, "n_inner": None},
                               "b"))
    assert untied.has_tensor("lm_head.weight") and not from_config(
        write(tmp_path, GPT2, "c")).has_tensor("lm_head.weight")
    # a head_dim field wins over hidden_size / heads
    wide = from_config(write(tmp_path, MISTRAL_7B | {"head_dim": 256}, "d"))
    assert wide.tensor("layers.q_proj.weight").shape[1].xreplace(wide.dims) == 32 * 256
    # Llama's attention_bias and mlp_bias add biases to all four and all three projections
    biased = from_config(write(tmp_path, LLAMA3_8B | {"attention_bias": True, "mlp_bias": True},
                               "e"))
    biases = {w.name for w in biased.weights() if w.name.endswith(".bias")}
    assert biases == {f"layers.{p}.bias" for p in
                      ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                       "down_proj")}


def without(fields, key):
    return {k: v for k, v in fields.items() if k != key}


@pytest.mark.parametrize("fields, text, needles", [
    (LLAMA3_8B | {"model_type": "t5"}, None, ["model_type", '"t5"', "gpt2", "bert"]),
    (GEMMA2_2B | {"num_hidden_layers": 25}, None, ["num_hidden_layers = 25", "alternates"]),
    (without(GEMMA2_2B, "sliding_window"), None, ["missing field 'sliding_window'"]),
    (GEMMA2_2B | {"attn_logit_softcapping": "high"}, None, ["'attn_logit_softcapping'"]),
    (DEEPSEEK_V2_LITE | {"moe_layer_freq": 2}, None, ["moe_layer_freq = 2"]),
    (without(DEEPSEEK_V2_LITE, "kv_lora_rank"), None, ["missing field 'kv_lora_rank'"]),
    (DEEPSEEK_V2_LITE | {"num_experts_per_tok": 65}, None, ["n_routed_experts = 64"]),
    (BERT_BASE | {"hidden_act": "relu"}, None, ["'hidden_act'", "'gelu'"]),
    (without(BERT_BASE, "type_vocab_size"), None, ["missing field 'type_vocab_size'"]),
    (without(LLAMA3_8B, "model_type"), None, ["missing field 'model_type'"]),
    (without(LLAMA3_8B, "hidden_size"), None, ["missing field 'hidden_size'"]),
    (without(MIXTRAL_8X7B, "num_local_experts"), None, ["missing field 'num_local_experts'"]),
    (without(MISTRAL_7B, "num_key_value_heads"), None, ["missing field 'num_key_value_heads'"]),
    (without(GPT2, "n_embd"), None, ["missing field 'n_embd'"]),
    (LLAMA3_8B | {"num_hidden_layers": "32"}, None, ["'num_hidden_layers'", "whole number"]),
    (LLAMA3_8B | {"hidden_size": True}, None, ["'hidden_size'", "whole number"]),
    (LLAMA3_8B | {"vocab_size": 128256.0}, None, ["'vocab_size'", "whole number"]),
    (LLAMA3_8B | {"intermediate_size": -1}, None, ["'intermediate_size'"]),
    (LLAMA3_8B | {"tie_word_embeddings": "no"}, None, ["'tie_word_embeddings'", "true or false"]),
    (LLAMA3_8B | {"hidden_size": 4100}, None, ["hidden_size = 4100", "num_attention_heads"]),
    (LLAMA3_8B | {"num_key_value_heads": 5}, None, ["num_key_value_heads = 5"]),
    (MIXTRAL_8X7B | {"num_experts_per_tok": 9}, None, ["num_experts_per_tok"]),
    (OPT_125M | {"activation_function": "silu"}, None, ["'activation_function'", "'relu'"]),
    (OPT_125M | {"layer_norm_elementwise_affine": False},
     None, ["'layer_norm_elementwise_affine'"]),
    (GPT_NEOX_20B | {"rotary_pct": 1.5}, None, ["'rotary_pct'", "96"]),
    (BLOOM_560M | {"num_hidden_layers": 30}, None, ["'n_layer' = 24", "'num_hidden_layers'"]),
    (FALCON_40B | {"parallel_attn": False}, None, ["parallel_attn", "new_decoder_architecture"]),
    (FALCON_7B | {"num_ln_in_parallel_attn": 2}, None, ["'num_ln_in_parallel_attn' is 2"]),
    (without(QWEN3_8B, "head_dim"), None, ["missing field 'head_dim'"]),
    (QWEN3_8B | {"attention_bias": "no"}, None, ["'attention_bias'", "true or false"]),
    (without(QWEN1_5_MOE_A2_7B, "shared_expert_intermediate_size"), None,
     ["missing field 'shared_expert_intermediate_size'"]),
    (QWEN1_5_MOE_A2_7B | {"mlp_only_layers": "0"}, None, ["'mlp_only_layers'", "layer indices"]),
    (QWEN3_30B_A3B | {"mlp_only_layers": [5]}, None,
     ["mlp_only_layers makes layer 5 dense between", "start or the end"]),
    (QWEN3_30B_A3B | {"num_experts_per_tok": 129}, None, ["num_experts = 128"]),
    (QWEN3_30B_A3B | {"decoder_sparse_step": 65, "num_hidden_layers": 130}, None,
     ["decoder_sparse_step = 65"]),
    (without(QWEN3_30B_A3B, "num_key_value_heads"), None,
     ["missing field 'num_key_value_heads'"]),
    (None, '{"model_type": "llama",', ["not valid JSON"]),
    (None, "[1, 2]", ["JSON list"]),
])
def test_bad_config_is_one_line_naming_the_field_and_file(tmp_path, cli, fields, text, needles):
    path = write(tmp_path, fields, text=text)
    code, out, err = cli("profile", "--config", str(path))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("opgraph: error: ")
    assert str(path) in err
    for needle in needles:
        assert needle in err


def test_missing_config_file_and_both_model_and_config(tmp_path, cli):
    code, _, err = cli("profile", "--config", str(tmp_path / "nope.json"))
    assert code == 2 and "does not exist" in err and err.count("\n") == 1
    path = write(tmp_path, LLAMA3_8B)
    code, out, err = cli("profile", "--config", str(path), "--model", "gpt2")
    assert code == 2 and out == "" and "not both" in err and err.count("\n") == 1


def test_gemma2_deepseek_and_bert_options(tmp_path):
    # Gemma 2 without soft-capping: null turns it off, in attention and on the logits
    plain = from_config(write(tmp_path, GEMMA2_2B | {"attn_logit_softcapping": None,
                                                     "final_logit_softcapping": None}, "a"))
    assert plain.op("layers.local.attn.scores").param("softcap") is None
    assert not plain.has_op("final_softcap")
    # DeepSeek-V2 (not Lite) has a low-rank query: q_a, its norm, q_b
    full = from_config(write(tmp_path, DEEPSEEK_V2_LITE | {"q_lora_rank": 1536}, "b"))
    assert full.has_op("layers.q_a_proj") and not full.has_op("layers.q_proj")
    # no routed experts: every layer dense, no shared experts
    dense = from_config(write(tmp_path, DEEPSEEK_V2_LITE | {"n_routed_experts": None}, "c"))
    assert [r.name for r in dense.regions()] == ["dense_layers"]
    assert not any(op.kind == "expert_matmul" for op in dense.ops())
    # BERT with the tanh GELU
    tanh = from_config(write(tmp_path, BERT_BASE | {"hidden_act": "gelu_new"}, "d"))
    assert tanh.op("layers.gelu").param("approximate") is None  # the builder's default, tanh


def test_deepseek_v3_is_671b_plus_its_prediction_module(tmp_path):
    """DeepSeek-V3 (arXiv:2412.19437, section 4.2; its model card): 671 B parameters, 37 B
    activated per token; the released checkpoint adds a 14 B multi-token prediction module,
    which holds its own copies of the embedding and the output head (V x D each), shared in
    training (section 2.2) and so counted once here."""
    c = DEEPSEEK_V3
    D, V, E, K = c["hidden_size"], c["vocab_size"], c["n_routed_experts"], c["num_experts_per_tok"]
    H, r_q, r_kv = c["num_attention_heads"], c["q_lora_rank"], c["kv_lora_rank"]
    d_qk, d_v = c["qk_nope_head_dim"] + c["qk_rope_head_dim"], c["v_head_dim"]
    attention = (D * r_q + r_q + r_q * H * d_qk + D * (r_kv + c["qk_rope_head_dim"]) + r_kv
                 + r_kv * H * (c["qk_nope_head_dim"] + d_v) + H * d_v * D + 2 * D)
    expert = 3 * D * c["moe_intermediate_size"]
    moe = D * E + (E + c["n_shared_experts"]) * expert
    dense = 3 * D * c["intermediate_size"]
    first, layers = c["first_k_dense_replace"], c["num_hidden_layers"]
    main = 2 * V * D + D + first * (attention + dense) + (layers - first) * (attention + moe)
    module = 3 * D + 2 * D * D + attention + moe  # enorm, hnorm, norm; eh_proj; one MoE layer
    graph = from_config(write(tmp_path, c))
    total = int(sympy.sympify(graph.parameters()).xreplace(graph.dims))
    assert total == main + module
    assert main == pytest.approx(671e9, rel=1e-3)
    assert module + 2 * V * D == pytest.approx(14e9, rel=0.05)  # the checkpoint's copies
    # a token runs K of the E routed experts of every expert layer, the module's included
    idle = (E - K) * expert
    main_active = main - (layers - first) * idle
    active = int(sympy.sympify(active_parameters(graph)).xreplace(graph.dims))
    assert active == main_active + module - idle
    assert main_active - V * D == pytest.approx(37e9, rel=0.02)  # the lookup reads one row
    assert [r.name for r in graph.regions()] == ["dense_layers", "layers", "mtp"]
    losses = [op.name for op in graph.ops() if op.kind == "cross_entropy"]
    assert losses == ["loss", "mtp.loss"]  # the main loss and the module's, both trained


def test_kimi_k2_reads_as_deepseek_v3(tmp_path):
    """Kimi K2 (moonshotai/Kimi-K2-Base config.json, model_type kimi_k2, DeepseekV3ForCausalLM):
    DeepSeek-V3's fields at other widths, 384 experts (8 a token), one dense layer first, no
    prediction module; its model card: 1 T parameters, 32 B activated."""
    c = DEEPSEEK_V3 | {"model_type": "kimi_k2", "n_routed_experts": 384,
                       "first_k_dense_replace": 1, "num_attention_heads": 64,
                       "num_key_value_heads": 64, "vocab_size": 163840,
                       "num_nextn_predict_layers": 0}
    graph = from_config(write(tmp_path, c))
    total = int(sympy.sympify(graph.parameters()).xreplace(graph.dims))
    active = int(sympy.sympify(active_parameters(graph)).xreplace(graph.dims))
    assert total == pytest.approx(1.0e12, rel=0.05)
    assert active - c["vocab_size"] * c["hidden_size"] == pytest.approx(32e9, rel=0.02)
    assert [r.name for r in graph.regions()] == ["dense_layers", "layers"]


NEMOTRON4_340B = {  # nvidia/Nemotron-4-340B-Base, as transformers' NemotronConfig names it
    "architectures": ["NemotronForCausalLM"], "model_type": "nemotron", "hidden_size": 18432,
    "intermediate_size": 73728, "num_hidden_layers": 96, "num_attention_heads": 96,
    "num_key_value_heads": 8, "partial_rotary_factor": 0.5, "hidden_act": "relu2",
    "vocab_size": 256000, "max_position_embeddings": 4096, "tie_word_embeddings": False,
    "norm_eps": 1e-05, "rope_theta": 10000,
}


@pytest.mark.parametrize("fields, rest", [
    # Nemotron-4 340B technical report (arXiv:2406.11704), Table 1: 331.6 B non-embedding
    # parameters (beside 9.4 B embedding: the token table and the untied head, V x D each)
    ({}, 331.6e9),
    # Nemotron-4 15B (arXiv:2402.16819), section 2: 12.5 B non-embedding parameters
    ({"hidden_size": 6144, "intermediate_size": 24576, "num_hidden_layers": 32,
      "num_attention_heads": 48}, 12.5e9),
])
def test_nemotron4_has_its_published_parameter_counts(tmp_path, fields, rest):
    """Nemotron-4 (model_type nemotron): a ReLU-squared MLP without a gate, RoPE on half of
    each head, grouped-query attention, no biases, untied embeddings."""
    c = NEMOTRON4_340B | fields
    graph = from_config(write(tmp_path, c))
    total = int(sympy.sympify(graph.parameters()).xreplace(graph.dims))
    assert total - 2 * c["vocab_size"] * c["hidden_size"] == pytest.approx(rest, rel=0.002)
    kinds = {op.kind for op in graph.ops()}
    assert "relu2" in kinds and "swiglu" not in kinds
    rotary = sympy.sympify(graph.op("layers.q_rope").param("rotary")).xreplace(graph.dims)
    assert rotary == c["hidden_size"] // c["num_attention_heads"] // 2


LLAMA4_SCOUT = {  # meta-llama/Llama-4-Scout-17B-16E config.json, its text model's fields
    "architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
    "text_config": {"model_type": "llama4_text", "hidden_size": 5120, "intermediate_size": 8192,
                    "intermediate_size_mlp": 16384, "num_hidden_layers": 48,
                    "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
                    "num_local_experts": 16, "num_experts_per_tok": 1,
                    "interleave_moe_layer_step": 1, "vocab_size": 202048,
                    "max_position_embeddings": 10485760, "use_qk_norm": True,
                    "attention_chunk_size": 8192, "tie_word_embeddings": False},
}


@pytest.mark.parametrize("changes, total, sparse", [
    # Llama 4's model cards: Scout 109 B parameters (its vision encoder's among them), 17 B
    # active; Maverick 400 B, 17 B active, its experts in every second layer
    ({}, 109e9, 48),
    ({"num_local_experts": 128, "interleave_moe_layer_step": 2, "use_qk_norm": False}, 400e9,
     24),
])
def test_llama4_text_models_have_their_published_counts(tmp_path, changes, total, sparse):
    c = LLAMA4_SCOUT | {"text_config": LLAMA4_SCOUT["text_config"] | changes}
    graph = from_config(write(tmp_path, c))
    params = int(sympy.sympify(graph.parameters()).xreplace(graph.dims))
    active = int(sympy.sympify(active_parameters(graph)).xreplace(graph.dims))
    assert params == pytest.approx(total, rel=0.02)
    assert active == pytest.approx(17e9, rel=0.02)
    routers = [op for op in graph.ops() if op.kind == "topk"]
    assert sum(int(sympy.sympify(op.count).xreplace(graph.dims)) for op in routers) == sparse
    assert not any("shared_expert_gate" in op.name for op in graph.ops())


def test_deepseek_v3_over_experts_and_a_pipeline(tmp_path, cli):
    path = write(tmp_path, DEEPSEEK_V3 | {"num_hidden_layers": 5})
    code, out, err = cli("profile", "--config", str(path), "--seq-len", "1024", "--gpus", "64",
                         "--ep", "64", "--zero", "3", "--global-batch", "64", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["step_time_s"] > 0 and data["parameters"] > 0
    assert any(c["group"] == "ep" for c in data["communication"])  # the experts' all-to-all
    # a pipeline: 3 dense layers on the first stage, 1 of the 2 expert layers on each, the
    # prediction module and both losses on the last
    code, out, err = cli("profile", "--config", str(path), "--seq-len", "1024", "--gpus", "2",
                         "--pp", "2", "--global-batch", "4", "--json")
    assert code == 0, err
    first, last = json.loads(out)["stage_times_s"]
    assert first > 0 and last > 0
    bad = write(tmp_path, DEEPSEEK_V3 | {"n_routed_experts": None}, "dense")
    code, _, err = cli("profile", "--config", str(bad))
    assert code == 2 and "num_nextn_predict_layers" in err and len(err.strip().splitlines()) == 1


# --- the LayerNorm decoders of GPT-2's lineage: OPT, GPT-NeoX, BLOOM, Falcon ----------------------

def parameters(graph):
    """Every weight's elements, each layer's counted: what a checkpoint holds."""
    return int(sympy.sympify(graph.parameters()).xreplace(graph.dims))


def profile_cli(cli, tmp_path, fields, folder):
    code, out, err = cli("profile", "--config", str(write(tmp_path, fields, folder)), "--json")
    assert code == 0, err
    return json.loads(out)


def opt_parameters(c):
    """transformers' OPTForCausalLM: token table [V, D_w] (the head tied to it), positions
    [P + 2, D], per layer Q, K, V, O with biases, fc1 and fc2 with biases, two LayerNorms; the
    final LayerNorm (pre-norm only); project_in and project_out where D_w differs from D."""
    d, f, v, w = c["hidden_size"], c["ffn_dim"], c["vocab_size"], c["word_embed_proj_dim"]
    layer = 4 * (d * d + d) + 2 * d * f + f + d + 2 * 2 * d
    return (v * w + (c["max_position_embeddings"] + 2) * d + c["num_hidden_layers"] * layer
            + (2 * d if c["do_layer_norm_before"] else 0) + (2 * d * w if w != d else 0))


@pytest.mark.parametrize("fields, published", [
    (OPT_125M, 125e6),  # arXiv:2205.01068, Table 1: 125M
    (OPT_175B, 175e9),  # the same table: 175B
    (OPT_350M, 331e6),  # facebook/opt-350m's checkpoint: 331M (the paper's "350M")
])
def test_opt_parameters_are_the_formula_and_the_published_total(tmp_path, fields, published):
    graph = from_config(write(tmp_path, fields))
    assert parameters(graph) == opt_parameters(fields)
    assert parameters(graph) == pytest.approx(published, rel=0.005)


def test_opt_structure(tmp_path):
    pre = from_config(write(tmp_path, OPT_125M, "a"))
    assert pre.dims[dim("P")] == 2048 + 2 and pre.max_seq_len == pre.seq_len == 2048
    assert pre.has_op("layers.relu") and pre.has_op("ln_f") and not pre.has_op("project_in")
    assert not pre.has_tensor("lm_head.weight")  # tied
    post = from_config(write(tmp_path, OPT_350M, "b"))
    assert post.has_op("project_in") and post.has_op("project_out") and not post.has_op("ln_f")
    unbiased = from_config(write(tmp_path, OPT_125M | {"enable_bias": False}, "c"))
    assert not any(w.name.startswith("layers.") and w.name.endswith("_proj.bias")
                   for w in unbiased.weights())


def test_opt_profiles_end_to_end(tmp_path, cli):
    j = profile_cli(cli, tmp_path, OPT_125M, "opt-125m")
    assert j["model"] == "opt-125m" and j["seq_len"] == 2048
    assert j["parameters"] == opt_parameters(OPT_125M)


def gpt_neox_parameters(c):
    """transformers' GPTNeoXForCausalLM: embed_in and an untied embed_out, each [V, D]; per
    layer two LayerNorms, the fused QKV and the dense projection with biases, the MLP with
    biases; the final LayerNorm."""
    d, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    layer = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d * f + f + d
    return 2 * v * d + c["num_hidden_layers"] * layer + 2 * d


def test_gpt_neox_20b_parameters_and_partial_rope(tmp_path):
    graph = from_config(write(tmp_path, GPT_NEOX_20B))
    assert parameters(graph) == gpt_neox_parameters(GPT_NEOX_20B)
    # HF EleutherAI/gpt-neox-20b model card: "Num. parameters 20,556,201,984" (20.6B; the
    # card's figure is 266 x 6144 more than the checkpoint's tensors hold)
    assert parameters(graph) == pytest.approx(20_556_201_984, rel=1e-4)
    rope = graph.op("layers.q_rope")
    assert rope.param("rotary").xreplace(graph.dims) == 6144 // 64 // 4  # rotary_pct 0.25
    assert graph.has_tensor("lm_head.weight") and not graph.has_tensor("wpe.weight")
    # the parallel residual reads the layer's input in both norms: same ops, same count
    serial = from_config(write(tmp_path, GPT_NEOX_20B | {"use_parallel_residual": False}, "s"))
    assert parameters(serial) == parameters(graph)
    assert sorted(op.kind for op in serial.ops()) == sorted(op.kind for op in graph.ops())


def test_gpt_neox_profiles_end_to_end(tmp_path, cli):
    j = profile_cli(cli, tmp_path, GPT_NEOX_20B, "gpt-neox-20b")
    assert j["model"] == "gpt-neox-20b" and j["seq_len"] == 2048
    assert j["parameters"] == gpt_neox_parameters(GPT_NEOX_20B)


def bloom_parameters(d, layers, v):
    """transformers' BloomForCausalLM: the word table [V, D] (the head tied to it) and its
    LayerNorm; per layer two LayerNorms, QKV and dense with biases, the 4 x D MLP with biases;
    the final LayerNorm."""
    layer = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * 4 * d * d + 4 * d + d
    return v * d + 2 * d + layers * layer + 2 * d


# arXiv:2211.05100 (BLOOM), Table 3, parameters in millions: 176,247 and 559
@pytest.mark.parametrize("fields, width, published", [
    (BLOOM_176B, 14336, 176_247e6),
    (BLOOM_560M, 1024, 559e6),
])
def test_bloom_parameters_are_the_formula_and_the_published_total(tmp_path, fields, width,
                                                                  published):
    graph = from_config(write(tmp_path, fields))
    assert parameters(graph) == bloom_parameters(width, fields["n_layer"], 250880)
    assert parameters(graph) == pytest.approx(published, rel=0.001)


def test_bloom_adds_alibi_to_the_scores_and_fuses_it(tmp_path):
    graph = from_config(write(tmp_path, BLOOM_560M))
    assert graph.op("layers.attn.scores").param("alibi") is True
    assert graph.has_op("embed_norm") and not graph.has_tensor("wpe.weight")
    assert not graph.has_op("layers.q_rope")
    step = compile_step(graph)
    (flash,) = [op for op in step.ops() if op.kind == "flash_attention"]
    assert flash.param("alibi") is True
    # BLOOM's other residual: from the LayerNorm's output; the same ops
    other = from_config(write(tmp_path, BLOOM_560M | {
        "apply_residual_connection_post_layernorm": True}, "r"))
    assert other.op("layers.attn_residual").inputs[0] == "layers.ln_1"
    assert graph.op("layers.attn_residual").inputs[0] != "layers.ln_1"


def test_bloom_profiles_end_to_end(tmp_path, cli):
    j = profile_cli(cli, tmp_path, BLOOM_560M, "bloom-560m")
    assert j["model"] == "bloom-560m" and j["seq_len"] == 8192
    assert j["parameters"] == bloom_parameters(1024, 24, 250880)


def falcon_parameters(c, kv_heads, norms):
    """transformers' FalconForCausalLM without biases: the word table [V, D] (the head tied to
    it by default), per layer the fused QKV (H + 2 KV heads of D / H), dense, the 4 x D MLP and
    `norms` LayerNorms; the final LayerNorm."""
    d, h, v = c["hidden_size"], c["num_attention_heads"], c["vocab_size"]
    layer = d * (h + 2 * kv_heads) * (d // h) + d * d + 2 * 4 * d * d + norms * 2 * d
    return v * d + c["num_hidden_layers"] * layer + 2 * d


def test_falcon_parameters_are_the_formula_and_the_published_totals(tmp_path):
    seven = from_config(write(tmp_path, FALCON_7B, "7b"))
    assert parameters(seven) == falcon_parameters(FALCON_7B, kv_heads=1, norms=1)
    # HF tiiuae/falcon-7b model card: "a 7B parameters causal decoder-only model", to its one
    # significant figure (the head tied to the embedding, as transformers loads it)
    assert parameters(seven) == pytest.approx(7e9, rel=0.05)
    forty = from_config(write(tmp_path, FALCON_40B, "40b"))
    assert parameters(forty) == falcon_parameters(FALCON_40B, kv_heads=8, norms=2)
    # The Hub's count for tiiuae/falcon-40b, 41.8B, holds lm_head as a [V, D] tensor of its
    # own; transformers ties it to the embedding by default, 65024 x 8192 fewer (41.3B)
    untied = from_config(write(tmp_path, FALCON_40B | {"tie_word_embeddings": False}, "u"))
    assert parameters(untied) - parameters(forty) == 65024 * 8192
    assert parameters(untied) == pytest.approx(41.8e9, rel=0.001)


def test_falcon_architectures(tmp_path):
    forty = from_config(write(tmp_path, FALCON_40B, "a"))
    assert (forty.dims[H], forty.dims[H_kv]) == (128, 8)
    assert forty.has_op("layers.ln_2") and forty.has_op("layers.q_rope")
    assert forty.op("layers.q_rope").param("rotary") is None  # whole heads
    assert not any(w.name.endswith("_proj.bias") for w in forty.weights())
    seven = from_config(write(tmp_path, FALCON_7B, "b"))
    assert seven.dims[H_kv] == 1 and not seven.has_op("layers.ln_2")  # one shared LayerNorm
    assert seven.op("layers.fc").inputs[0] == seven.op("layers.q_proj").inputs[0]
    # num_ln_in_parallel_attn 1: the new architecture with one shared LayerNorm
    shared = from_config(write(tmp_path, FALCON_40B | {"num_ln_in_parallel_attn": 1}, "c"))
    assert parameters(shared) == falcon_parameters(FALCON_40B, kv_heads=8, norms=1)
    # the old architecture, sequential, multi-head, biased, with ALiBi (Falcon-RW's layout)
    rw = from_config(write(tmp_path, FALCON_7B | {"parallel_attn": False, "multi_query": False,
                                                  "bias": True, "alibi": True}, "d"))
    assert rw.dims[H_kv] == 71 and rw.has_op("layers.ln_2") and not rw.has_op("layers.q_rope")
    assert rw.op("layers.attn.scores").param("alibi") is True
    assert rw.has_tensor("layers.fc.bias") and rw.has_tensor("layers.q_proj.bias")
    # ffn_hidden_size, where given, is the MLP's width
    wide = from_config(write(tmp_path, FALCON_7B | {"ffn_hidden_size": 20000}, "e"))
    assert wide.dims[dim("F")] == 20000


def test_falcon_profiles_end_to_end(tmp_path, cli):
    j = profile_cli(cli, tmp_path, FALCON_7B, "falcon-7b")
    assert j["model"] == "falcon-7b" and j["seq_len"] == 2048
    assert j["parameters"] == falcon_parameters(FALCON_7B, kv_heads=1, norms=1)


# --- Qwen3, Qwen2-MoE, Qwen3-MoE ---------------------------------------------------------------

def qwen_counts(c: dict) -> tuple[int, int, int]:
    """(all parameters, those one token uses, the embedding's and the head's) from a Qwen
    config's fields, by transformers' modules: Qwen3Attention / Qwen2MoeAttention, the RMSNorms,
    Qwen2MoeSparseMoeBlock (router D x E, E experts, one shared expert and its D -> 1 gate) or a
    SwiGLU MLP; every layer of these configs is a mixture of experts when there are experts."""
    d, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or d // heads
    attention = d * heads * hd + 2 * d * kv * hd + heads * hd * d  # q, k, v, o
    if c["model_type"] == "qwen2_moe":
        attention += heads * hd + 2 * kv * hd  # the Q, K and V biases
    else:
        attention += 2 * hd  # q_norm and k_norm, each a weight of head_dim

    def swiglu(width):
        return 3 * d * width

    if c.get("num_experts"):  # 0: every layer dense
        experts, top_k = c["num_experts"], c["num_experts_per_tok"]
        shared = (swiglu(c["shared_expert_intermediate_size"]) + d
                  if "shared_expert_intermediate_size" in c else 0)
        mlp = d * experts + experts * swiglu(c["moe_intermediate_size"]) + shared
        active_mlp = d * experts + top_k * swiglu(c["moe_intermediate_size"]) + shared
    else:
        mlp = active_mlp = swiglu(c["intermediate_size"])
    ends = vocab * d * (1 if c["tie_word_embeddings"] else 2)
    total = layers * (attention + 2 * d + mlp) + d + ends
    active = layers * (attention + 2 * d + active_mlp) + d + ends
    return total, active, ends


# Published figures, each within one unit of its last digit shown (rounded or cut):
# Qwen3-8B: 8.19 B (the Hub's count of its safetensors; the model card's 8.2 B), 6.95 B without
# the embedding and head (model card). Qwen3-0.6B: 0.6 B, 0.44 B without the tied embedding
# (model card). Qwen1.5-MoE-A2.7B: 14.3 B in total, 2.7 B activated (model card and the Qwen
# blog "Qwen1.5-MoE: Matching 7B Model Performance with 1/3 Activated Parameters").
# Qwen3-30B-A3B: 30.5 B in total, 3.3 B activated, 29.9 B without the embedding and head
# (model card).
@pytest.mark.parametrize("fields, total, active, body", [
    (QWEN3_8B, "8.19", None, "6.95"),
    (QWEN3_0_6B, "0.6", None, "0.44"),
    (QWEN1_5_MOE_A2_7B, "14.3", "2.7", None),
    (QWEN3_30B_A3B, "30.5", "3.3", "29.9"),
])
def test_qwen_parameters_are_the_formula_and_the_published_totals(tmp_path, fields, total,
                                                                   active, body):
    graph = from_config(write(tmp_path, fields))
    all_, used, ends = qwen_counts(fields)
    assert int(graph.parameters().xreplace(graph.dims)) == all_
    assert int(active_parameters(graph).xreplace(graph.dims)) == used

    def near(count, published):
        unit = 10.0 ** -len(published.split(".")[1])
        return abs(count / 1e9 - float(published)) < unit

    assert near(all_, total)
    assert active is None or near(used, active)
    assert body is None or near(all_ - ends, body)


@pytest.mark.parametrize("fields, config", [
    (QWEN1_5_MOE_A2_7B, qwen_moe.QWEN1_5_MOE_A2_7B), (QWEN3_30B_A3B, qwen_moe.QWEN3_30B_A3B),
])
def test_a_qwen_moe_config_gives_its_models_profile(tmp_path, fields, config):
    graph, reference = from_config(write(tmp_path, fields)), qwen_moe.build(config)
    assert profile_json(graph) == profile_json(reference)


def test_qwen3_is_the_llama_graph_with_each_query_and_key_head_normed(tmp_path):
    from opgraph.cost import costmodel
    from opgraph.core.symbols import B, S, d_h

    qwen3 = from_config(write(tmp_path, QWEN3_0_6B, "a"))
    llama = from_config(write(tmp_path, QWEN3_0_6B | {"model_type": "llama"}, "b"))
    extra = {f"layers.{n}_norm{part}" for n in "qk" for part in (".heads", "", ".flat")}
    assert {op.name for op in qwen3.ops()} - {op.name for op in llama.ops()} == extra
    assert {op.name for op in llama.ops()} <= {op.name for op in qwen3.ops()}
    # head_dim 128 of 16 heads: a query is 2048 wide on a hidden size of 1024
    assert qwen3.tensor("layers.q_proj.weight").shape[1].xreplace(qwen3.dims) == 16 * 128
    for t, heads in (("q", H), ("k", H_kv)):
        norm = qwen3.op(f"layers.{t}_norm")
        assert qwen3.tensor(f"layers.{t}_norm.weight").shape == (d_h,)
        assert qwen3.tensor(norm.outputs[0]).shape == (B, S, heads, d_h)
        # RMSNorm's 4 FLOPs an element, over every head of every token
        assert costmodel.rule_flops(qwen3, norm) - 4 * B * S * heads * d_h == 0
        assert qwen3.op(f"layers.{t}_rope").inputs == (f"layers.{t}_norm.flat",)
    assert not qwen3.has_tensor("lm_head.weight")  # tied, as the small Qwen3 ship
    assert not any(w.name.endswith(".bias") for w in qwen3.weights())
    biased = from_config(write(tmp_path, QWEN3_0_6B | {"attention_bias": True}, "c"))
    assert {w.name for w in biased.weights() if w.name.endswith(".bias")} == {
        f"layers.{p}.bias" for p in ("q_proj", "k_proj", "v_proj", "o_proj")}


def test_qwen2_moe_gates_its_shared_expert(tmp_path):
    from opgraph.core.symbols import B, D, F_e, F_s, S

    graph = from_config(write(tmp_path, QWEN1_5_MOE_A2_7B))
    assert graph.dims[F_s] == 5632 and graph.dims[F_e] == 1408
    assert graph.tensor("layers.shared_expert.up_proj.weight").shape == (D, F_s)
    assert graph.tensor("layers.shared_expert_gate.weight").shape == (D, 1)
    gated = graph.op("layers.shared_expert.gated")  # sigmoid(gate(h)) * shared_expert(h)
    assert gated.kind == "moe_combine"
    assert [graph.tensor(n).shape for n in gated.inputs] == [(B, S, 1, D), (B, S, 1)]
    assert graph.op("layers.experts.sum").inputs == ("layers.experts.combine",
                                                     "layers.shared_expert.gated")
    # Q, K and V biases (qkv_bias, true unless the config says otherwise), none on O
    assert {w.name for w in graph.weights() if w.name.endswith(".bias")} == {
        f"layers.{p}.bias" for p in ("q_proj", "k_proj", "v_proj")}
    plain = from_config(write(tmp_path, QWEN1_5_MOE_A2_7B | {"qkv_bias": False}, "b"))
    assert not any(w.name.endswith(".bias") for w in plain.weights())


def test_qwen_moe_layouts_are_regions(tmp_path):
    from opgraph.core.parameters import is_routed
    from opgraph.core.symbols import L

    def regions(**fields):
        graph = from_config(write(tmp_path, QWEN3_30B_A3B | fields, str(len(fields))))
        return graph, [(r.name, r.count) for r in graph.regions()]

    assert regions()[1] == [("layers", L)]
    # layer i is sparse iff (i + 1) % decoder_sparse_step == 0: a dense then a sparse layer, 24x
    graph, stacks = regions(decoder_sparse_step=2)
    assert stacks == [("layers", L / 2)]
    assert graph.has_op("layers.dense.mlp.down_proj") and graph.has_op("layers.moe.router")
    dense = QWEN3_30B_A3B | {"num_hidden_layers": 24, "num_experts": 0}
    sparse = QWEN3_30B_A3B | {"num_hidden_layers": 24}
    assert int(graph.parameters().xreplace(graph.dims)) == (
        qwen_counts(dense)[0] + qwen_counts(sparse)[0] - qwen_counts(dense)[2]
        - QWEN3_30B_A3B["hidden_size"])  # the embedding, head and final norm once
    # 25 layers by 3: 8 of (dense, dense, sparse), then layer 24 dense
    assert regions(decoder_sparse_step=3, num_hidden_layers=25)[1] == [
        ("layers", (L - 1) / 3), ("last_dense_layers", 1)]
    # mlp_only_layers at both ends; an index past the last layer matches none (transformers)
    assert regions(mlp_only_layers=[0, 1, 47, 99])[1] == [
        ("dense_layers", 2), ("layers", L - 3), ("last_dense_layers", 1)]
    graph, stacks = regions(num_experts=0)  # no experts: every layer dense, of intermediate_size
    assert stacks == [("dense_layers", L)] and not is_routed(graph)
    assert graph.has_op("dense_layers.mlp.down_proj")


@pytest.mark.parametrize("fields, folder", [
    (QWEN3_8B, "Qwen3-8B"), (QWEN1_5_MOE_A2_7B, "Qwen1.5-MoE-A2.7B"),
    (QWEN3_30B_A3B, "Qwen3-30B-A3B"),
])
def test_qwen_profiles_end_to_end(tmp_path, cli, fields, folder):
    code, out, _ = cli("profile", "--config", str(write(tmp_path, fields, folder)), "--json")
    assert code == 0
    j = json.loads(out)
    total, active, _ = qwen_counts(fields)
    assert (j["model"], j["parameters"], j["seq_len"]) == (folder, total, 8192)
    assert j.get("active_parameters", total) == active
    assert j["step_time_s"] > 0


def test_qwen_moe_spreads_its_experts_over_gpus(tmp_path, cli):
    path = write(tmp_path, QWEN3_30B_A3B, "Qwen3-30B-A3B")
    code, out, _ = cli("profile", "--config", str(path), "--gpus", "8", "--ep", "8",
                       "--global-batch", "8", "--json")
    assert code == 0
    j = json.loads(out)
    c = QWEN3_30B_A3B
    d, top_k, seq = c["hidden_size"], c["num_experts_per_tok"], j["seq_len"]
    dispatch = [x for x in j["communication"] if x["collective"] == "all-to-all"]
    # to the experts and back, forward and backward, once a layer: K copies of each of a
    # micro-batch's tokens in BF16
    assert len(dispatch) == 4 and {x["group_size"] for x in dispatch} == {8}
    assert {x["bytes"] for x in dispatch} == {seq * top_k * d * 2}
    assert {x["count"] for x in dispatch} == {c["num_hidden_layers"]}
    experts = c["num_hidden_layers"] * c["num_experts"] * 3 * d * c["moe_intermediate_size"]
    assert j["parameters"] == qwen_counts(c)[0] - experts * 7 // 8  # an eighth of the experts
    # Qwen1.5-MoE's 60 experts spread over 4 of the 8 GPUs, not 8
    path = write(tmp_path, QWEN1_5_MOE_A2_7B, "Qwen1.5-MoE-A2.7B")
    code, out, _ = cli("profile", "--config", str(path), "--gpus", "8", "--ep", "4",
                       "--global-batch", "8")
    assert code == 0 and "ep all-to-all" in out
    code, out, err = cli("profile", "--config", str(path), "--gpus", "8", "--ep", "8",
                         "--global-batch", "8")
    assert code == 2 and err.count("\n") == 1 and "E = 60 experts are not divisible" in err
    # a pipeline splits the sparse stack; the dense layers at its ends go with the first and
    # the last stage
    path = write(tmp_path, QWEN3_30B_A3B | {"mlp_only_layers": [0, 47]}, "ends")
    code, out, err = cli("profile", "--config", str(path), "--gpus", "2", "--pp", "2",
                         "--global-batch", "4", "--json")
    assert code == 0, err
    assert len(json.loads(out)["stage_times_s"]) == 2


def _dropouts(graph):
    return [op for op in graph.ops() if op.kind == "dropout"]


def test_gpt2_attention_dropout_is_read_with_transformers_default(tmp_path):
    """attn_pdrop: absent means 0.1 (GPT2Config's default), 0 means no kernel; resid_pdrop and
    embd_pdrop add none (fused into the bias-and-residual kernels)."""
    bare = {k: v for k, v in GPT2.items() if not k.endswith("_pdrop")}
    for fields, p in ((GPT2, 0.1), (bare, 0.1), (GPT2 | {"attn_pdrop": 0.25}, 0.25),
                      (GPT2 | {"attn_pdrop": 0}, None)):
        ops = _dropouts(from_config(write(tmp_path, fields)))
        assert [op.param("p") for op in ops] == ([] if p is None else [p])


@pytest.mark.parametrize("fields", [OPT_125M, GPT_NEOX_20B, BLOOM_560M, FALCON_7B],
                         ids=["opt", "gpt-neox", "bloom", "falcon"])
def test_the_gpt2_lineage_reads_attention_dropout_default_none(tmp_path, fields):
    """OPT, GPT-NeoX, BLOOM and Falcon name it `attention_dropout` (transformers' default 0.0:
    no kernel); a value puts one dropout in each layer's core."""
    plain = {k: v for k, v in fields.items() if k != "attention_dropout"}
    assert _dropouts(from_config(write(tmp_path, plain, "plain"))) == []
    ops = _dropouts(from_config(write(tmp_path, plain | {"attention_dropout": 0.2}, "with")))
    assert [op.param("p") for op in ops] == [0.2]


@pytest.mark.parametrize("value", [1, 1.5, -0.1, "0.1", True, None])
def test_a_bad_attention_dropout_is_one_line(tmp_path, cli, value):
    code, out, err = cli("profile", "--config", str(write(tmp_path, GPT2 | {"attn_pdrop": value})))
    assert code == 2 and out == "" and "'attn_pdrop'" in err and "[0, 1)" in err
    assert len(err.strip().splitlines()) == 1


def test_unfused_attention_dropout_moves_the_probabilities_twice_and_fuses_away(tmp_path):
    """Unfused, the dropout kernel reads and writes the [B, H, S, S] BF16 probabilities, no
    FLOPs, and its backward as much again (the plate's convention, twice the forward's); fused,
    FlashAttention draws the mask in the kernel: the same step as without dropout."""
    with_p = from_config(write(tmp_path, GPT2, "with"))
    without = from_config(write(tmp_path, GPT2 | {"attn_pdrop": 0.0}, "without"))
    B, S, layers, heads = 1, 1024, 12, 12
    scores = B * heads * S * S
    a = evaluate(compile_step(with_p, fused_attention=False), H100).to_json(ops=True)
    b = evaluate(compile_step(without, fused_attention=False), H100).to_json(ops=True)
    assert a["bytes"] - b["bytes"] == layers * 3 * (2 * scores * 2)  # forward, backward x 2
    assert a["flops"] == b["flops"]
    fused = (profile_json(with_p), profile_json(without))
    assert fused[0] == fused[1]


def test_attention_dropout_saves_its_output_and_selective_recomputes_it(tmp_path):
    """Unfused, P.V's backward reads the dropped probabilities: 2 a s^2 b bytes more saved a
    layer (Korthikanti et al.'s dropout output; the one-byte mask is not modelled). Megatron's
    selective recomputation re-runs the whole core, dropout included, so it saves what it
    saves without dropout."""
    with_p = from_config(write(tmp_path, GPT2, "with"))
    without = from_config(write(tmp_path, GPT2 | {"attn_pdrop": 0.0}, "without"))

    def activations(graph, recompute):
        step = compile_step(graph, fused_attention=False, recompute=recompute)
        return evaluate(step, H100).to_json()["memory"]["activations"]

    layers, heads, S = 12, 12, 1024
    assert activations(with_p, "none") - activations(without, "none") == layers * heads * S * S * 2
    assert activations(with_p, "selective") == activations(without, "selective")


def test_gpt_oss_120b_is_the_model_cards_117b_with_5_1b_active(tmp_path):
    """gpt-oss-120b (OpenAI's model card, arXiv:2508.10925, Table 1): 116.83 B parameters,
    5.13 B active per token. opgraph counts every weight but the experts' and the router's
    biases (E x (2 F + D) + E a layer) and the attention sinks (H a layer), which the
    model card's total holds."""
    c = GPT_OSS_120B
    D, V, E, K = c["hidden_size"], c["vocab_size"], c["num_local_experts"], c["num_experts_per_tok"]
    H_, G, d, F = (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"],
                   c["intermediate_size"])
    attention = 2 * D * H_ * d + 2 * D * G * d + H_ * d + 2 * G * d + D  # Q, K, V, O, biases
    expert = 3 * D * F
    layer = attention + 2 * D + D * E + E * expert  # two norms, the router, the experts
    layers = c["num_hidden_layers"]
    total = 2 * V * D + D + layers * layer  # embedding, untied head, final norm
    graph = from_config(write(tmp_path, c, "gpt-oss-120b"))
    assert int(sympy.sympify(graph.parameters()).xreplace(graph.dims)) == total
    uncounted = layers * (E * (2 * F + D) + E + H_)
    assert total + uncounted == pytest.approx(116.83e9, rel=1e-4)
    active = int(sympy.sympify(active_parameters(graph)).xreplace(graph.dims))
    assert active == total - layers * (E - K) * expert
    assert active - V * D == pytest.approx(5.13e9, rel=2e-3)  # the lookup reads one row
    assert graph.seq_len == 4096  # initial_context_length, not the YaRN-extended 131,072


def test_gpt_oss_alternates_a_128_key_window_and_the_whole_sequence(tmp_path):
    """One region of L / 2 pairs; per head and sequence the sliding layer scores S W - W^2 / 2
    causal pairs and the full one S^2 / 2: 4 d_h FLOPs a pair forward (QK^T and PV)."""
    graph = from_config(write(tmp_path, GPT_OSS_120B))
    assert [(r.name, str(r.count)) for r in graph.regions()] == [("layers", "L/2")]
    c = GPT_OSS_120B
    S, W, heads, d = 4096, c["sliding_window"], c["num_attention_heads"], c["head_dim"]
    ops = {o["name"]: o for o in profile_json(graph)["ops"]}
    for name, pairs in (("layers.sliding.attn.flash", S * W - W * W / 2),
                        ("layers.full.attn.flash", S * S / 2)):
        assert ops[name]["count"] == c["num_hidden_layers"] // 2
        assert ops[name]["flops"] / ops[name]["count"] == pytest.approx(4 * d * heads * pairs,
                                                                        rel=1e-12), name


@pytest.mark.parametrize("change, needles", [
    ({"layer_types": ["full_attention", "sliding_attention"] * 18},
     ("layer_types", "sliding first")),
    ({"layer_types": ["sliding_attention"] * 36}, ("layer_types", "alternate")),
    ({"layer_types": ["sliding_attention", "chunked"] * 18}, ("layer_types", "not a list")),
    ({"num_hidden_layers": 35, "layer_types": None}, ("num_hidden_layers = 35", "odd")),
    ({"num_local_experts": None}, ("num_local_experts",)),
    ({"num_experts_per_tok": 129, "experts_per_token": None}, ("num_experts_per_tok = 129",)),
])
def test_a_gpt_oss_config_opgraph_cannot_build_is_one_line(tmp_path, change, needles):
    fields = {k: v for k, v in (GPT_OSS_120B | change).items() if v is not None}
    with pytest.raises(OpgraphError) as e:
        from_config(write(tmp_path, fields))
    assert "\n" not in str(e.value)
    for needle in needles:
        assert needle in str(e.value)


def test_mistral_7b_v0_1_attends_over_its_sliding_window(tmp_path):
    """Mistral 7B v0.1's `sliding_window` (4,096) holds in every layer: at 8,192 tokens each head
    scores S W - W^2 / 2 causal pairs, not S^2 / 2 (4 d_h FLOPs a pair forward); v0.2's null
    window (and Mixtral 8x7B's) leaves the full causal attention."""
    S, W = 8192, MISTRAL_7B["sliding_window"]
    heads = MISTRAL_7B["num_attention_heads"]
    d = MISTRAL_7B["hidden_size"] // heads  # its head dim
    for window, pairs in ((W, S * W - W * W / 2), (None, S * S / 2)):
        graph = from_config(write(tmp_path, MISTRAL_7B | {"sliding_window": window}, str(window)))
        op = {o["name"]: o for o in profile_json(graph)["ops"]}["layers.attn.flash"]
        assert op["flops"] / op["count"] == pytest.approx(4 * d * heads * pairs, rel=1e-12)
