"""Launch configs: torchtitan job TOMLs and Megatron-LM arguments read into opgraph's terms,
against the published runs they describe; what is not understood is reported; bad input is one
line; and writing a launch back gives a file that reads to the same launch."""

import json
import math
import re
import shlex
import textwrap

import attrs
import pytest
from opgraph.models import deepseek, gpt2, llama
from opgraph.models.gpt2 import GPT2Config
from opgraph.models.llama import LlamaConfig

from opgraph.core.errors import OpgraphError
from opgraph.io.launch import (GPT2_BPE_VOCAB, MEGATRON_MODEL, Launch, read_megatron,
                               read_torchtitan, to_bridge, to_megatron, to_torchtitan)
from opgraph.parallel.parallel import Parallel

# pytorch/torchtitan train_configs/llama3_8b.toml at 9dec370 (late-2024 layout), with the run of
# torchtitan's benchmarks/llama3_h100_202412_torchtitan.md Table 1, "FSDP + torch.compile":
# Llama 3.1 8B, 8 GPUs, local batch size 2 (global 16), selective activation checkpointing. The
# file ships batch_size = 1 and compile = false; the table's run sets 2 and true.
TORCHTITAN_8B = """\
# torchtitan Config.toml
# NOTE: this toml config is a preset for 64 A100 GPUs.

[job]
dump_folder = "./outputs"
description = "Llama 3 8B training"

[profiling]
enable_profiling = true
save_traces_folder = "profile_trace"
profile_freq = 100

[metrics]
log_freq = 10
enable_tensorboard = true
save_tb_folder = "tb"

[model]
name = "llama3"
flavor = "8B"
norm_type = "rmsnorm"  # layernorm / np_layernorm / rmsnorm / fused_rmsnorm
tokenizer_path = "./torchtitan/datasets/tokenizer/original/tokenizer.model"

[optimizer]
name = "AdamW"
lr = 3e-4

[training]
batch_size = 2
seq_len = 8192
warmup_steps = 200  # lr scheduler warm up
max_norm = 1.0  # grad norm clipping
steps = 1000
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 1
compile = true
dataset = "c4"

[experimental]
context_parallel_degree = 1
pipeline_parallel_degree = 1

[checkpoint]
enable_checkpoint = false
folder = "checkpoint"
interval_type = "steps"
interval = 500
model_weights_only = false
export_dtype = "float32"
async_mode = "disabled" # ["disabled", "async", "async_with_pinned_mem"]

[activation_checkpoint]
mode = 'selective'  # ['none', 'selective', 'full']
selective_ac_option = 'op'  # 'int' = ac every positive int layer or 'op', ac based on ops policy

[float8]
enable_float8_linear = false
"""

# The 2025 layout (torchtitan/models/llama3/train_configs/llama3_405b.toml's sections), with the
# run of the same benchmark's Table 5: Llama 3.1 405B on 512 GPUs, FSDP 8, TP 8, PP 8, local
# batch 32, global batch 256, full activation checkpointing, torch.compile, Float8, AsyncTP,
# interleaved 1F1B.
TORCHTITAN_405B = """\
[job]
dump_folder = "./outputs"

[model]
name = "llama3"
flavor = "405B"
hf_assets_path = "./assets/hf/Llama-3.1-405B"
converters = ["quantize.linear.float8"]

[optimizer]
name = "AdamW"
lr = 8e-5

[training]
local_batch_size = 32
seq_len = 8192
steps = 3000
dataset = "c4"

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 8
enable_async_tensor_parallel = true
pipeline_parallel_degree = 8
pipeline_parallel_schedule = "Interleaved1F1B"
context_parallel_degree = 1

[compile]
enable = true
components = ["model", "loss"]

[activation_checkpoint]
mode = "full"

[quantize.linear.float8]
enable_fsdp_float8_all_gather = true
precompute_float8_dynamic_scale_for_fsdp = true
filter_fqns = ["output"]
"""

# torchtitan/models/llama3/train_configs/llama3_8b.toml as shipped at 9810191bb^ (the last
# TOML-configured torchtitan, 2025 layout): 8B, local batch 1, sequence 8192, FSDP over every GPU,
# selective per-op AC, compile off.
TORCHTITAN_8B_2025 = """\
[job]
dump_folder = "./outputs"
description = "Llama 3 8B training"

[profiling]
enable_profiling = true
save_traces_folder = "profile_trace"
profile_freq = 100

[metrics]
log_freq = 10
enable_tensorboard = true
save_tb_folder = "tb"

[model]
name = "llama3"
flavor = "8B"
hf_assets_path = "./assets/hf/Llama-3.1-8B"
# converters = ["float8"]

[optimizer]
name = "AdamW"
lr = 3e-4
eps = 1e-8

[lr_scheduler]
warmup_steps = 200  # lr scheduler warm up

[training]
local_batch_size = 1
seq_len = 8192
max_norm = 1.0  # grad norm clipping
steps = 1000
dataset = "c4"

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 1
pipeline_parallel_degree = 1
context_parallel_degree = 1

[checkpoint]
enable = false
folder = "checkpoint"
interval = 500
last_save_model_only = true
export_dtype = "float32"
async_mode = "disabled" # ["disabled", "async", "async_with_pinned_mem"]

[compile]
enable=false
components = ["model", "loss"]

[activation_checkpoint]
mode = "selective"  # ["none", "selective", "full"]
selective_ac_option = "op"  # "int" = ac every positive int layer or 'op', ac based on ops policy

[quantize.linear.float8]
enable_fsdp_float8_all_gather = false
precompute_float8_dynamic_scale_for_fsdp = false
filter_fqns = ["output"]

[validation]
enable = false
dataset = "c4_validation"
freq = 500
steps = 1200 # Recommend value for c4_validation with world-size=8 and seq_len=8192
"""

# Korthikanti et al. 2022 (Reducing Activation Recomputation in Large Transformer Models),
# Table 3 / 5: GPT-3 175B on 64 A100s, tensor 8 x pipeline 8, interleaved schedule with 3
# virtual stages, micro-batch 1, global batch 64, sequence 2048, sequence parallelism, selective
# recomputation. Vocabulary: GPT-2's BPE (50,257 tokens), padded by Megatron.
MEGATRON_175B = """\
torchrun --nproc_per_node 8 --nnodes 8 pretrain_gpt.py \\
    --num-layers 96 --hidden-size 12288 --num-attention-heads 96 \\
    --seq-length 2048 --max-position-embeddings 2048 \\
    --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt --vocab-size 50257 \\
    --tensor-model-parallel-size 8 --pipeline-model-parallel-size 8 \\
    --num-layers-per-virtual-pipeline-stage 4 \\
    --micro-batch-size 1 --global-batch-size 64 \\
    --sequence-parallel --recompute-activations \\
    --lr 6.0e-5 --min-lr 6.0e-6 --lr-decay-style cosine --train-iters 500 \\
    --weight-decay 0.1 --clip-grad 1.0 --init-method-std 0.006 --fp16 \\
    --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10
"""


@pytest.fixture
def toml(tmp_path):
    """Write a TOML text to a file and give its path."""
    def write(text: str, name: str = "job.toml"):
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return path
    return write


def one_line_error(call, *args, **kwargs) -> str:
    with pytest.raises(OpgraphError) as caught:
        call(*args, **kwargs)
    message = str(caught.value)
    assert message and "\n" not in message
    return message


# --- torchtitan -----------------------------------------------------------------------------------
def test_torchtitan_llama3_8b_fsdp_run(toml):
    launch = read_torchtitan(toml(TORCHTITAN_8B), gpus=8)
    assert launch.model == "llama3-8b"
    assert launch.seq_len == 8192
    p = launch.parallel
    assert (p.tp, p.pp, p.cp, p.dp, p.gpus) == (1, 1, 1, 8, 8)
    assert p.zero == 3  # FSDP
    assert p.micro_batch == 2
    assert p.global_batch == 2 * 8  # the table's global batch size 16
    assert p.micro_batches == 1
    assert launch.recompute == "selective-op"
    assert launch.fuse == "elementwise"
    assert launch.precision == "bf16"
    assert launch.unknown == ()  # a shipped file makes no noise
    assert launch.source.endswith("job.toml")


def test_torchtitan_reads_which_torchtitan_compiled_the_loss(toml):
    """torchtitan compiles its loss beside the blocks from April 2025 (bbb1b616e); a file that
    says `training.batch_size` (renamed local_batch_size in June 2025) is the December 2024
    layout, whose loss stayed eager: the row torchtitan-2024. `compile.components` (August 2025)
    says it outright, and the writer says it so for that row."""
    assert read_torchtitan(toml(TORCHTITAN_8B), gpus=8).parallel.framework == "torchtitan-2024"
    assert read_torchtitan(toml(TORCHTITAN_8B_2025), gpus=64).parallel.framework == "torchtitan"
    shipped = 'enable=false\ncomponents = ["model", "loss"]'
    assert shipped in TORCHTITAN_8B_2025
    for components, framework in (('["model", "loss"]', "torchtitan"),
                                  ('["model"]', "torchtitan-2024")):
        text = TORCHTITAN_8B_2025.replace(shipped, f"enable = true\ncomponents = {components}")
        launch = read_torchtitan(toml(text), gpus=64)
        assert (launch.parallel.framework, launch.fuse) == (framework, "elementwise")
        assert read_torchtitan(toml(to_torchtitan(launch), "again.toml"), gpus=64) == launch
    bad = TORCHTITAN_8B_2025.replace(shipped, 'components = "loss"')
    assert "components" in one_line_error(read_torchtitan, toml(bad), gpus=64)


def test_torchtitan_shard_minus_one_needs_the_gpus(toml):
    message = one_line_error(read_torchtitan, toml(TORCHTITAN_8B))
    assert "data_parallel_shard_degree = -1" in message and "--gpus" in message
    text = TORCHTITAN_8B.replace("data_parallel_shard_degree = -1",
                                 "data_parallel_shard_degree = 8")
    assert read_torchtitan(toml(text)).parallel.gpus == 8
    assert "make 8 GPUs, not --gpus 16" in one_line_error(read_torchtitan, toml(text), gpus=16)


def test_torchtitan_2025_layout_405b_3d_run(toml):
    launch = read_torchtitan(toml(TORCHTITAN_405B), gpus=512)
    assert launch.model == "llama3.1-405b"
    p = launch.parallel
    assert (p.tp, p.pp, p.dp, p.gpus) == (8, 8, 512 // (8 * 8), 512)
    assert p.zero == 3 and p.sequence_parallel and p.async_tp
    assert p.micro_batch == 1  # pipeline_parallel_microbatch_size's default
    assert p.global_batch == 32 * 8 == 256
    assert p.virtual_stages == 2  # torchtitan's default for an interleaved schedule
    assert launch.recompute == "full"
    assert launch.precision == "fp8"
    assert launch.fuse == "elementwise"
    # FSDP's Float8 all-gather (and its scales precomputed for it) gathers FP8 weights, half the
    # bytes of opgraph's BF16 gathers: reported, not modelled
    assert launch.unknown == (
        "quantize.linear.float8.enable_fsdp_float8_all_gather = True (opgraph models False)",
        "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp = True (opgraph models "
        "False)")


def test_torchtitan_float8_options_it_does_not_model_are_reported(toml):
    """The FP8 weight re-cast in the backward and a recipe opgraph does not build change the
    step; the file says them, so the launch lists them. Without Float8 they change nothing."""
    text = TORCHTITAN_405B.replace("enable_fsdp_float8_all_gather = true",
                                   'enable_fsdp_float8_all_gather = false\n'
                                   'recipe_name = "rowwise_with_gw_hp"'
                                   "\nforce_recompute_fp8_weight_in_bwd = true"
                                   ).replace("precompute_float8_dynamic_scale_for_fsdp = true",
                                             "precompute_float8_dynamic_scale_for_fsdp = false")
    launch = read_torchtitan(toml(text), gpus=512)
    assert launch.unknown == (
        "quantize.linear.float8.force_recompute_fp8_weight_in_bwd = True (opgraph models False)",
        ("quantize.linear.float8.recipe_name = 'rowwise_with_gw_hp' (opgraph models "
         "'tensorwise', 'rowwise'; read as 'tensorwise')"))
    assert launch.precision == "fp8"
    bf16 = text.replace('converters = ["quantize.linear.float8"]', "converters = []")
    assert read_torchtitan(toml(bf16, "bf16.toml"), gpus=512).unknown == ()


def test_torchtitan_rowwise_recipe_reads_and_writes_as_fp8_rowwise(toml):
    """torchao's row-wise recipe (`recipe_name = "rowwise"`) is the precision fp8-rowwise, in
    either Float8 section, and opgraph writes it back the same way; Megatron-LM and
    Megatron-Bridge, whose Transformer Engine has no such recipe, refuse it in one line, by the
    frameworks table's rule (`Traits.precisions`)."""
    text = TORCHTITAN_405B.replace("enable_fsdp_float8_all_gather = true",
                                   'enable_fsdp_float8_all_gather = false\nrecipe_name = "rowwise"'
                                   ).replace("precompute_float8_dynamic_scale_for_fsdp = true",
                                             "precompute_float8_dynamic_scale_for_fsdp = false")
    launch = read_torchtitan(toml(text), gpus=512)
    assert (launch.precision, launch.unknown) == ("fp8-rowwise", ())
    listed = read_torchtitan(toml(text.replace('"rowwise"', '["rowwise"]'), "list.toml"),
                             gpus=512)  # not a name: listed, read as tensor-wise
    assert listed.precision == "fp8" and listed.unknown[0].startswith(
        "quantize.linear.float8.recipe_name = ['rowwise'] (opgraph models")
    written = to_torchtitan(launch)
    assert '[quantize.linear.float8]\nrecipe_name = "rowwise"' in written
    again = read_torchtitan(toml(written, "again.toml"), gpus=512)
    assert (again.precision, again.unknown) == ("fp8-rowwise", ())
    for model, writer in (("llama3-8b", to_megatron), ("gemma2-2b", to_bridge)):
        megatron = Launch(model=model, parallel=Parallel(tp=2, dp=4, framework="megatron"),
                          precision="fp8-rowwise")
        with pytest.raises(OpgraphError, match="--framework megatron runs no fp8-rowwise"):
            writer(megatron)


def test_torchtitan_2025_shipped_8b_file(toml):
    launch = read_torchtitan(toml(TORCHTITAN_8B_2025), gpus=64)  # "a preset for 64 A100 GPUs"
    assert launch.model == "llama3-8b" and launch.seq_len == 8192
    p = launch.parallel
    assert (p.dp, p.zero, p.micro_batch, p.global_batch) == (64, 3, 1, 1 * 64)
    assert (launch.recompute, launch.fuse, launch.precision) == ("selective-op", None, "bf16")
    assert launch.unknown == ()


def test_torchtitan_old_and_new_names_of_one_key_must_agree(toml):
    text = TORCHTITAN_8B.replace("[experimental]", "[parallelism]\ntensor_parallel_degree = 2\n"
                                 "\n[experimental]")
    message = one_line_error(read_torchtitan, toml(text), gpus=8)
    assert "parallelism.tensor_parallel_degree" in message and "twice" in message


def test_torchtitan_other_converters_are_reported(toml):
    text = TORCHTITAN_405B.replace('["quantize.linear.float8"]',
                                   '["quantize.linear.float8", "quantize.grouped_mm.mx"]')
    launch = read_torchtitan(toml(text), gpus=512)
    assert launch.precision == "fp8"
    assert launch.unknown[0] == "model.converters 'quantize.grouped_mm.mx'"


def test_torchtitan_late_2024_pipeline_microbatches(toml):
    text = TORCHTITAN_8B.replace("pipeline_parallel_degree = 1", "pipeline_parallel_degree = 4\n"
                                 "pipeline_parallel_microbatches = 2")
    launch = read_torchtitan(toml(text), gpus=8)
    assert (launch.parallel.pp, launch.parallel.dp) == (4, 2)
    assert launch.parallel.micro_batch == 2 // 2
    # Without the count, torchtitan cut the local batch into pp micro-batches, here 2 // 4: none.
    text = TORCHTITAN_8B.replace("pipeline_parallel_degree = 1", "pipeline_parallel_degree = 2")
    assert read_torchtitan(toml(text), gpus=8).parallel.micro_batch == 2 // 2


def test_torchtitan_gradient_accumulation_and_ddp(toml):
    text = TORCHTITAN_405B.replace("local_batch_size = 32", "local_batch_size = 2\n"
                                   "global_batch_size = 64").replace(
        "data_parallel_replicate_degree = 1", "data_parallel_replicate_degree = 4").replace(
        "data_parallel_shard_degree = -1", "data_parallel_shard_degree = 1").replace(
        "pipeline_parallel_degree = 8", "pipeline_parallel_degree = 1")
    p = read_torchtitan(toml(text), gpus=32).parallel
    assert (p.dp, p.zero) == (4, 0)  # replicas only: DDP
    assert p.global_batch == 64 and p.micro_batch == 2
    assert p.micro_batches == 64 // (4 * 2)


def test_torchtitan_hsdp_is_read_as_replicas(toml):
    """Replicate 2 beside shard -1 on 16 GPUs: FSDP over each replica's 8 ranks, the two
    replicas all-reducing their shards (torchtitan's HSDP), nothing left unmodelled."""
    text = TORCHTITAN_8B.replace("data_parallel_replicate_degree = 1",
                                 "data_parallel_replicate_degree = 2")
    launch = read_torchtitan(toml(text), gpus=16)
    p = launch.parallel
    assert (p.dp, p.zero, p.replicate) == (2 * 8, 3, 2)
    assert (p.size("dp"), p.size("dpr")) == (8, 2)
    assert not any("replicate" in entry for entry in launch.unknown)


def test_torchtitan_real_keys_opgraph_does_not_model_are_reported(toml):
    # enable_compiled_autograd is a key of torchtitan's [parallelism] (job_config.py, 2025)
    text = TORCHTITAN_405B.replace("[compile]", "enable_compiled_autograd = true\n\n[compile]"
                                   ).replace('"Interleaved1F1B"', '"ZBVZeroBubble"').replace(
        'name = "AdamW"', 'name = "Muon"')
    launch = read_torchtitan(toml(text), gpus=512)
    assert "parallelism.enable_compiled_autograd" in launch.unknown
    assert any(e.startswith("pipeline_parallel_schedule = 'ZBVZeroBubble'")
               for e in launch.unknown)
    assert any(e.startswith("optimizer.name = 'Muon'") for e in launch.unknown)
    assert len(launch.unknown) == 3 + 2  # and the file's two Float8 FSDP options


@pytest.mark.parametrize("edit, words", [
    # a misspelt key would leave the run at tp 1 without a word: refused, with the real name
    (("[compile]", "tensor_paralel_degree = 8\n\n[compile]"),
     ("parallelism.tensor_paralel_degree", "did you mean parallelism.tensor_parallel_degree?")),
    (("[compile]", "frobnicate = 3\n\n[compile]"), ("parallelism.frobnicate", "remove it")),
    (("[activation_checkpoint]", "[activation_checkpont]"),
     ("section [activation_checkpont]", "did you mean [activation_checkpoint]?")),
    (("[job]", "[mystery]"), ("[mystery]",)),
])
def test_torchtitan_keys_torchtitan_lacks_are_refused(toml, edit, words):
    old, new = edit
    assert old in TORCHTITAN_405B
    message = one_line_error(read_torchtitan, toml(TORCHTITAN_405B.replace(old, new)), gpus=512)
    for word in words:
        assert word in message


def test_torchtitan_default_checkpointing_is_not_blamed_on_the_file(toml):
    """A file without [activation_checkpoint] gets torchtitan's default (selective, every 2nd
    layer: torchtitan/config/job_config.py ActivationCheckpoint), which opgraph cannot model;
    the error says the default is torchtitan's, and what to write."""
    start, end = TORCHTITAN_405B.index("[activation_checkpoint]"), TORCHTITAN_405B.index(
        "[quantize")
    text = TORCHTITAN_405B[:start] + TORCHTITAN_405B[end:]
    message = one_line_error(read_torchtitan, toml(text), gpus=512)
    assert "torchtitan's default" in message and "mode = 'selective'" in message
    assert "selective_ac_option = '2'" in message and "[activation_checkpoint]" in message


@pytest.mark.parametrize("option, verdict", [("'op'", "selective-op"), ("'1'", "full"),
                                             ("1", "full")])
def test_torchtitan_selective_options(toml, option, verdict):
    text = TORCHTITAN_8B.replace("selective_ac_option = 'op'", f"selective_ac_option = {option}")
    assert read_torchtitan(toml(text), gpus=8).recompute == verdict


@pytest.mark.parametrize("text, words", [
    (TORCHTITAN_8B.replace("selective_ac_option = 'op'", "selective_ac_option = '2'"),
     ("selective_ac_option", "'2'")),
    (TORCHTITAN_8B.replace("mode = 'selective'", "mode = 'memory_budget'"), ("memory_budget",)),
    (TORCHTITAN_8B.replace("tensor_parallel_degree = 1", 'tensor_parallel_degree = "2"'),
     ("tensor_parallel_degree", "'2'")),
    (TORCHTITAN_8B.replace("tensor_parallel_degree = 1", "tensor_parallel_degree = 2.5"),
     ("tensor_parallel_degree", "2.5")),
    (TORCHTITAN_8B.replace('flavor = "8B"', 'flavor = "debugmodel"'), ("debugmodel",)),
    (TORCHTITAN_8B.replace("batch_size = 2", "batch_size = 0"), ("local_batch_size", "0")),
    (TORCHTITAN_8B.replace("[training]", "[training\n"), ("not valid TOML",)),
])
def test_torchtitan_bad_input_is_one_line(toml, text, words):
    message = one_line_error(read_torchtitan, toml(text), gpus=8)
    for word in words:
        assert word in message


def test_torchtitan_missing_file_is_one_line(tmp_path):
    assert "does not exist" in one_line_error(read_torchtitan, tmp_path / "none.toml")


# --- Megatron-LM ----------------------------------------------------------------------------------
def test_megatron_gpt3_175b_run():
    launch = read_megatron(MEGATRON_175B)  # the world size from torchrun: 8 x 8
    pad = 128 * 8  # Megatron's make-vocab-size-divisible-by x tp
    assert launch.model == GPT2Config(MEGATRON_MODEL, d_model=12288, layers=96, heads=96,
                                      vocab=math.ceil(GPT2_BPE_VOCAB / pad) * pad,
                                      positions=2048, seq_len=2048, tie_embeddings=True)
    assert launch.model.vocab == 51200
    # no --overlap-grad-reduce: Megatron reduces gradients after the backward
    assert launch.parallel == Parallel(tp=8, pp=8, dp=1, gpus=64, micro_batch=1, global_batch=64,
                                       virtual_stages=96 // 8 // 4, sequence_parallel=True,
                                       overlap_grad_reduce=False, framework="megatron")
    assert launch.parallel.virtual_stages == 3
    assert launch.parallel.micro_batches == 64
    assert launch.seq_len == 2048
    assert launch.recompute == "selective"
    assert launch.precision == "bf16"  # fp16: the same width and tensor-core rate
    assert launch.fuse == "elementwise"  # Megatron's fused kernels on
    assert launch.unknown == ()
    assert launch.source == "megatron arguments"
    assert read_megatron(MEGATRON_175B, gpus=64) == launch


def test_megatron_gpus_must_agree_with_the_launcher():
    assert "launcher" in one_line_error(read_megatron, MEGATRON_175B, gpus=128)
    flags = MEGATRON_175B.split("pretrain_gpt.py", 1)[1]
    assert "--gpus" in one_line_error(read_megatron, flags)


def test_megatron_from_a_file(tmp_path):
    path = tmp_path / "args.sh"
    path.write_text("# GPT-3 175B, Korthikanti et al. 2022\n" + MEGATRON_175B)
    assert read_megatron(f"@{path}") == read_megatron(MEGATRON_175B)


def test_megatron_llama_model():
    text = ("--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention "
            "--num-query-groups 8 --seq-length 8192 --max-position-embeddings 131072 "
            "--vocab-size 128256 --swiglu --normalization RMSNorm --position-embedding-type rope "
            "--untie-embeddings-and-output-weights --disable-bias-linear "
            "--tensor-model-parallel-size 2 --context-parallel-size 2 --micro-batch-size 1 "
            "--global-batch-size 512 --use-distributed-optimizer --bf16 --fp8-format hybrid "
            "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
    launch = read_megatron(text, gpus=64)
    model = launch.model
    assert isinstance(model, LlamaConfig)
    assert (model.layers, model.d_model, model.heads, model.kv_heads) == (32, 4096, 32, 8)
    assert model.d_ff == int((4 * 4096 * 2 / 3) / 64) * 64  # Megatron's SwiGLU default
    assert model.vocab == math.ceil(128256 / (128 * 2)) * (128 * 2)
    assert not (model.tie_embeddings or model.qkv_bias or model.o_bias or model.mlp_bias)
    p = launch.parallel
    assert (p.tp, p.cp, p.dp, p.zero) == (2, 2, 64 // 4, 1)
    assert launch.recompute == "full" and launch.precision == "fp8"
    assert launch.unknown == ()
    # Transformer Engine's recipes that scale per tensor are opgraph's FP8; per block, not
    for recipe, unknown in (("delayed", ()), ("tensorwise", ()), ("blockwise", ("--fp8-recipe",)),
                            ("mxfp8", ("--fp8-recipe",))):
        launch = read_megatron(f"{text} --fp8-recipe {recipe}", gpus=64)
        assert launch.precision == "fp8" and launch.unknown == unknown


def test_megatron_unknown_flags_are_refused_and_real_ones_reported():
    # flags Megatron-LM has (megatron/training/arguments.py) that change nothing opgraph models
    launch = read_megatron(MEGATRON_175B + " --moe-aux-loss-coeff 0.01 "
                           "--empty-unused-memory-level 1", gpus=64)
    assert launch.unknown == ("--moe-aux-loss-coeff", "--empty-unused-memory-level")
    for flags, words in ((" --frobnicate 3", ("--frobnicate", "remove it")),
                         (" --tensor-model-paralel-size 2",
                          ("--tensor-model-paralel-size",
                           "did you mean --tensor-model-parallel-size?"))):
        message = one_line_error(read_megatron, MEGATRON_175B + flags, gpus=64)
        for word in words:
            assert word in message
    # GPT-2 has biases; Megatron's --disable-bias-linear is not modelled for it.
    launch = read_megatron(MEGATRON_175B + " --disable-bias-linear")
    assert "--disable-bias-linear" in launch.unknown


@pytest.mark.parametrize("edit, words", [
    (("--hidden-size 12288 ", ""), ("--hidden-size",)),
    (("--num-layers 96 --hidden-size 12288 --num-attention-heads 96", ""),
     ("--num-layers", "--hidden-size", "--num-attention-heads")),
    (("--vocab-size 50257", ""), ("--vocab-size",)),
    (("--tensor-model-parallel-size 8", "--tensor-model-parallel-size 2.5"),
     ("--tensor-model-parallel-size", "'2.5'")),
    (("--micro-batch-size 1", "--micro-batch-size -1"), ("--micro-batch-size",)),
    (("--micro-batch-size 1", "--micro-batch-size 0"), ("--micro-batch-size", "not positive")),
    (("--pipeline-model-parallel-size 8", "--pipeline-model-parallel-size 1e3"),
     ("--pipeline-model-parallel-size",)),
    (("--recompute-activations", ("--recompute-granularity full --recompute-method block "
      "--recompute-num-layers 4")), ("block", "--recompute-num-layers 4")),
    (("--recompute-activations", "--recompute-granularity sometimes"), ("sometimes",)),
    (("--fp16", ""), ("--bf16",)),
    (("--fp16", "--fp16 --bf16"), ("both --bf16 and --fp16",)),
    (("--sequence-parallel", "--sequence-parallel yes"), ("--sequence-parallel", "no value")),
    (("--hidden-size 12288", "--hidden-size 12288 --swiglu"), ("--swiglu",)),
    (("--num-layers-per-virtual-pipeline-stage 4", "--num-layers-per-virtual-pipeline-stage 5"),
     ("--num-layers-per-virtual-pipeline-stage",)),
    (("--hidden-size 12288", "--hidden-size '12288"), ("shell",)),
])
def test_megatron_bad_input_is_one_line(edit, words):
    old, new = edit
    assert old in MEGATRON_175B
    message = one_line_error(read_megatron, MEGATRON_175B.replace(old, new))
    for word in words:
        assert word in message


# --- round trips ----------------------------------------------------------------------------------
TORCHTITAN_LAUNCHES = [
    Launch(model="llama3-8b", seq_len=8192, parallel=Parallel(gpus=8, micro_batch=2, zero=3),
           recompute="selective-op", fuse="elementwise"),
    Launch(model="llama3.1-405b", seq_len=8192, recompute="full", precision="fp8",
           fuse="elementwise",
           parallel=Parallel(tp=8, pp=8, gpus=512, global_batch=256, virtual_stages=2,
                             sequence_parallel=True, async_tp=True, zero=3)),
    Launch(model="llama3-70b", seq_len=4096, recompute="none",
           parallel=Parallel(pp=4, cp=2, gpus=64, micro_batch=2, global_batch=256,
                             virtual_stages=3, zero=3)),
    # torchtitan's FSDP shards over the context-parallel ranks even with one data-parallel
    # rank (its dp_shard_cp mesh): ZeRO 3 over dp x cp = 8, not ZeRO 0
    Launch(model="llama3-70b", seq_len=32768, recompute="full",
           parallel=Parallel(tp=4, cp=8, pp=8, gpus=256, micro_batch=1, global_batch=128,
                             sequence_parallel=True, zero=3)),
    Launch(model="llama3-8b", seq_len=8192, parallel=Parallel(gpus=16, micro_batch=1, zero=0)),
    Launch(model="llama3-70b", seq_len=8192, recompute="full",
           parallel=Parallel(tp=8, gpus=256, micro_batch=1, global_batch=512,
                             sequence_parallel=True, zero=3)),
    # training.mixed_precision_reduce = "bfloat16"
    Launch(model="llama3-8b", seq_len=8192,
           parallel=Parallel(gpus=8, zero=3, grad_reduce_dtype="bf16")),
    # HSDP: FSDP within each of 4 replicas (data_parallel_replicate_degree), with and
    # without context parallelism (the shard group is then dp_shard x cp)
    Launch(model="llama3-70b", seq_len=8192, recompute="full",
           parallel=Parallel(tp=8, gpus=256, micro_batch=1, global_batch=512,
                             sequence_parallel=True, zero=3, replicate=4)),
    Launch(model="llama3-8b", seq_len=32768, recompute="full",
           parallel=Parallel(cp=2, gpus=64, micro_batch=1, zero=3, replicate=8)),
    # deepseek_v3's 16B flavor, experts spread over 8 of the 16 FSDP ranks
    Launch(model="deepseek-v2-lite", seq_len=4096,
           parallel=Parallel(gpus=16, ep=8, micro_batch=2, zero=3)),
]


def _running(launch: Launch, framework: str) -> Launch:
    """`launch` as a config of `framework` runs it: that framework's behaviour (a reader sets
    the layout's framework to the format's)."""
    return attrs.evolve(launch, parallel=attrs.evolve(launch.parallel, framework=framework))


@pytest.mark.parametrize("launch", TORCHTITAN_LAUNCHES)
def test_torchtitan_round_trip(toml, launch):
    again = read_torchtitan(toml(to_torchtitan(launch)))  # explicit degrees: no gpus needed
    assert again == _running(launch, "torchtitan")
    assert again.unknown == ()


def test_torchtitan_round_trip_of_a_read_file(toml):
    launch = read_torchtitan(toml(TORCHTITAN_8B), gpus=8)
    assert read_torchtitan(toml(to_torchtitan(launch), "again.toml")) == launch


@pytest.mark.parametrize("launch, words", [
    (Launch(model="gpt3-175b", seq_len=2048), ("gpt3-175b", "torchtitan")),
    (Launch(model="llama3-8b", parallel=Parallel(gpus=8, zero=1)), ("ZeRO stage 1",)),
    # ZeRO-1 over the context-parallel ranks alone (dp 1): still a stage torchtitan lacks
    (Launch(model="llama3-8b", parallel=Parallel(cp=8, gpus=8, zero=1)), ("ZeRO stage 1",)),
    (Launch(model="llama3-8b", parallel=Parallel(cp=2, gpus=8, zero=0)), ("context",)),
    (Launch(model="llama3-8b", parallel=Parallel(tp=8, gpus=8)), ("sequence",)),
    (Launch(model="llama3-8b", recompute="selective"), ("selective",)),
    (Launch(model="llama3-8b", parallel=Parallel(pp=4, first_stage_layers=5)), ("uneven",)),
    # torchtitan's experts are not split over TP (expert_tensor_parallel_degree 1); opgraph's are
    (Launch(model="deepseek-v2-lite", parallel=Parallel(tp=2, gpus=8, sequence_parallel=True,
                                                        zero=3)), ("experts", "tp 1")),
])
def test_torchtitan_cannot_say_everything(launch, words):
    message = one_line_error(to_torchtitan, launch)
    for word in words:
        assert word in message


def megatron_named(config, seq_len: int):
    """A preset's configuration as read from Megatron's arguments: named megatron-model, with
    the job's sequence length."""
    return attrs.evolve(config, name=MEGATRON_MODEL, seq_len=seq_len)


MEGATRON_LAUNCHES = [
    # GPT-3's 50,257 rows padded as Megatron pads them at tp 8 (the padding has its own test).
    Launch(model=attrs.evolve(megatron_named(gpt2.GPT3_175B, 2048), vocab=51200), seq_len=2048,
           recompute="selective",
           fuse="elementwise",
           parallel=Parallel(tp=8, pp=8, gpus=64, global_batch=64, virtual_stages=3,
                             sequence_parallel=True)),
    Launch(model=megatron_named(llama.LLAMA3_8B, 8192), seq_len=8192, recompute="full",
           precision="fp8",
           parallel=Parallel(tp=8, pp=4, cp=2, gpus=512, micro_batch=2, global_batch=1024,
                             sequence_parallel=True, async_tp=True, zero=1,
                             overlap_param_gather=True,
                             first_stage_layers=7, last_stage_layers=7)),
    # the distributed optimizer in 4 replicas (--num-distributed-optimizer-instances)
    Launch(model=megatron_named(llama.LLAMA3_8B, 8192), seq_len=8192,
           parallel=Parallel(tp=2, gpus=64, micro_batch=1, global_batch=256, zero=1,
                             replicate=4)),
    Launch(model=megatron_named(llama.MIXTRAL_8X7B, 4096), seq_len=4096,
           parallel=Parallel(tp=2, ep=8, gpus=64, global_batch=256, zero=3)),
    Launch(model=megatron_named(llama.QWEN2_7B, 8192), seq_len=8192, recompute="selective",
           parallel=Parallel(gpus=16, micro_batch=4, zero=2)),
    Launch(model=megatron_named(llama.LLAMA3_2_1B, 2048), seq_len=2048,
           parallel=Parallel(gpus=1)),
    # --grad-reduce-in-bf16
    Launch(model=megatron_named(llama.LLAMA3_2_1B, 2048), seq_len=2048,
           parallel=Parallel(gpus=8, zero=1, grad_reduce_dtype="bf16")),
    # --attention-backend flash and fused (cuDNN's)
    Launch(model=megatron_named(llama.LLAMA3_2_1B, 2048), seq_len=2048,
           parallel=Parallel(gpus=8, attention_library="flash")),
    Launch(model=megatron_named(llama.LLAMA3_2_1B, 2048), seq_len=2048,
           parallel=Parallel(gpus=8, attention_library="cudnn")),
    # multi-head latent attention, a dense first layer, shared and routed experts
    Launch(model=megatron_named(deepseek.DEEPSEEK_V2_LITE, 4096), seq_len=4096,
           parallel=Parallel(tp=2, ep=8, gpus=64, global_batch=256, zero=1)),
    # the experts folded into the tensor-parallel ranks (--expert-tensor-parallel-size 1)
    Launch(model=megatron_named(deepseek.DEEPSEEK_V2_LITE, 4096), seq_len=4096,
           parallel=Parallel(tp=2, ep=16, gpus=16, global_batch=16, zero=1, expert_tp=1,
                             sequence_parallel=True)),
    # uneven end stages: --decoder-first-pipeline-num-layers counts the dense layer too
    Launch(model=megatron_named(deepseek.DEEPSEEK_V2_LITE, 4096), seq_len=4096,
           parallel=Parallel(pp=2, ep=8, gpus=64, global_batch=256, zero=1,
                             first_stage_layers=12, last_stage_layers=14)),
    # Llama 3 405B as the paper ran it: interleaved, the end stages one layer short
    # (--pipeline-model-parallel-layout, the first chunk the embedding alone)
    Launch(model=megatron_named(llama.LLAMA3_1_405B, 8192), seq_len=8192,
           parallel=Parallel(tp=8, pp=16, gpus=8192, global_batch=2048, virtual_stages=8,
                             sequence_parallel=True, zero=1, first_stage_layers=7,
                             last_stage_layers=7)),
    # every stage's count said (nanotron's kind of split), as a layout string
    Launch(model=megatron_named(llama.LLAMA3_2_1B, 2048), seq_len=2048,
           parallel=Parallel(pp=4, gpus=4, stage_layers=(6, 4, 3, 3))),
    # interleaved and uneven with a dense first layer
    Launch(model=megatron_named(deepseek.DEEPSEEK_V2_LITE, 4096), seq_len=4096,
           parallel=Parallel(pp=4, ep=2, gpus=8, global_batch=8, virtual_stages=2,
                             first_stage_layers=5, last_stage_layers=5)),
    # a low-rank query, every layer with experts, multi-token prediction (DeepSeek-V3's form)
    Launch(model=attrs.evolve(megatron_named(deepseek.DEEPSEEK_V2_LITE, 4096), q_lora_rank=768,
                              first_dense=0, mtp_depth=1), seq_len=4096,
           parallel=Parallel(ep=4, gpus=8)),
]


@pytest.mark.parametrize("launch", MEGATRON_LAUNCHES)
def test_megatron_round_trip(launch):
    again = read_megatron(to_megatron(launch), gpus=launch.parallel.gpus)
    assert again == _running(launch, "megatron")
    assert again.unknown == ()


def test_megatron_counts_a_first_stages_dense_layers():
    """DeepSeek-V2-Lite's 27 layers are 1 dense and 26 of experts; the pipeline splits the 26,
    the dense one on the first stage. Megatron's --decoder-first-pipeline-num-layers counts
    every decoder layer there: 12 of the stack are 13 of Megatron's, and 1 (the dense layer
    alone) is refused in one line."""
    launch = Launch(model=megatron_named(deepseek.DEEPSEEK_V2_LITE, 4096), seq_len=4096,
                    parallel=Parallel(pp=2, gpus=2, first_stage_layers=12,
                                      last_stage_layers=14))
    text = to_megatron(launch)
    args = shlex.split(text)
    assert args[args.index("--decoder-first-pipeline-num-layers") + 1] == "13"
    assert args[args.index("--decoder-last-pipeline-num-layers") + 1] == "14"
    alone = text.replace("--decoder-first-pipeline-num-layers 13",
                         "--decoder-first-pipeline-num-layers 1")
    assert "no layer of experts" in one_line_error(read_megatron, alone, gpus=2)


def test_megatron_reads_megatron_bridges_deepseek_v3_layout():
    """Megatron-Bridge lays DeepSeek-V3's 61 layers (3 dense) and its prediction module out on
    16 stages as the embedding and 4 decoder layers, 14 stages of 4, 1 and the prediction module
    and the loss (recipes/deepseek/deepseek_v3.py, layout_map): opgraph's split stack of 58
    then has 1, 4 x 14, 1 (the dense layers on the first stage beside its 1)."""
    v3 = attrs.evolve(megatron_named(deepseek.DEEPSEEK_V2_LITE, 4096), layers=61,
                      first_dense=3, mtp_depth=1)
    text = to_megatron(Launch(model=v3, seq_len=4096, parallel=Parallel(pp=16, gpus=16)))
    even = "--pipeline-model-parallel-size 16"
    text = text.replace(even, even + " --pipeline-model-parallel-layout 'Etttt|(tttt|)*14tmL'")
    layout = read_megatron(text, gpus=16).parallel
    assert (layout.virtual_stages, layout.first_stage_layers, layout.last_stage_layers) == (
        1, 1, 1)


@pytest.mark.parametrize("layout, words", [
    ("Et|x|L", "E, t, m and L"),
    ("E(t)*99999999|L", "repeats"),
    ("E(t)*" + "9" * 5000 + "|L", "repeats"),  # past Python's digits limit: still one line
    ("Ett|tt|tt|tLt", "embedding (E) opens"),
    ("Ett|ttL|tt", "not a multiple"),
    ("tE|ttt|tt|ttL", "embedding (E) opens"),
    ("Ett|tt|tt|ttLt", "embedding (E) opens"),
    ("Ett|tt|tt|tttL", "holds 18 decoder layers"),
    ("Ett|tttt|t|tL", "split as `chunk_layers` does"),
])
def test_a_megatron_layout_opgraph_cannot_hold_is_one_line(layout, words):
    """--pipeline-model-parallel-layout is parsed (never evaluated) and refused in one line
    where it is malformed or splits the layers as no opgraph layout does (Llama 3.2 1B's 16
    layers on 2 stages of 2 chunks)."""
    text = ("--num-layers 16 --hidden-size 2048 --num-attention-heads 32 --seq-length 2048 "
            "--vocab-size 1000 --micro-batch-size 1 --bf16 --pipeline-model-parallel-size 2 "
            f"--pipeline-model-parallel-layout {shlex.quote(layout.replace('t', 'tt'))}")
    assert words in one_line_error(read_megatron, text, gpus=2)


@pytest.mark.parametrize("modules, policy", [
    ("", "selective"), ("core_attn", "selective"),
    ("core_attn mla_up_proj", "selective:core_attn+mla_up_proj"),
    ("mla_up_proj", "selective:mla_up_proj"),
    ("moe_act layernorm", "selective:layernorm+moe_act")])
def test_megatron_selective_recomputation_reruns_the_listed_modules(modules, policy):
    """Megatron-Core's selective recomputation re-runs the modules --recompute-modules lists,
    the attention core where none are given (TransformerConfig.recompute_modules): opgraph's
    "selective" is the attention core, any other list "selective:" and its modules, which
    Megatron's arguments written back list again."""
    text = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 "
            "--vocab-size 1000 --micro-batch-size 1 --bf16 --recompute-granularity selective"
            + (f" --recompute-modules {modules}" if modules else ""))
    launch = read_megatron(text, gpus=1)
    assert launch.recompute == policy
    assert "--recompute-modules" not in " ".join(launch.unknown)
    assert read_megatron(to_megatron(launch), gpus=1).recompute == policy


def test_an_unknown_megatron_recompute_module_is_one_line():
    text = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 "
            "--vocab-size 1000 --micro-batch-size 1 --bf16 --recompute-granularity selective "
            "--recompute-modules core_attn attn_proj")
    assert "'attn_proj' is not one of Megatron-Core's modules" in one_line_error(
        read_megatron, text, gpus=1)


def test_a_reduce_dtype_neither_framework_runs_is_refused():
    launch = Launch(model="llama3-8b", seq_len=8192,
                    parallel=Parallel(gpus=8, zero=3, grad_reduce_dtype="fp16"))
    assert "not fp16" in one_line_error(to_torchtitan, launch)
    assert "not fp16" in one_line_error(to_megatron, launch)


def test_an_attention_kernel_a_framework_does_not_run_is_refused_or_said():
    """Megatron-LM's --attention-backend names FlashAttention (flash) or cuDNN's (fused); auto,
    its default, leaves the framework's; unfused and local are not modelled, and said so.
    Neither framework runs flash-attn's Triton kernel, and torchtitan's config names none."""
    launch = Launch(model="llama3-8b", seq_len=8192,
                    parallel=Parallel(gpus=8, attention_library="triton"))
    assert "no triton attention kernel" in one_line_error(to_megatron, launch)
    assert "triton attention has no torchtitan form" in one_line_error(to_torchtitan, launch)
    args = shlex.split(to_megatron(Launch(model="llama3-8b", seq_len=8192,
                                          parallel=Parallel(gpus=8))))
    assert "--attention-backend" not in args
    text = shlex.join(args)
    auto = read_megatron(text + " --attention-backend auto", gpus=8)
    assert auto.parallel.attention_library is None and auto.unknown == ()
    unfused = read_megatron(text + " --attention-backend unfused", gpus=8)
    assert unfused.parallel.attention_library is None
    assert unfused.unknown == ("--attention-backend",)


def test_megatron_round_trip_of_the_175b_run():
    launch = read_megatron(MEGATRON_175B)
    assert read_megatron(to_megatron(launch), gpus=64) == launch


def test_megatron_pads_a_vocabulary_tp_does_not_divide():
    launch = Launch(model="gpt3-175b", seq_len=2048, parallel=Parallel(tp=8, gpus=8,
                                                                       sequence_parallel=True))
    assert read_megatron(to_megatron(launch), gpus=8).model.vocab == math.ceil(
        GPT2_BPE_VOCAB / (128 * 8)) * (128 * 8)


def test_megatron_cannot_say_selective_op():
    message = one_line_error(to_megatron, Launch(model="gpt2", recompute="selective-op"))
    assert "selective-op" in message


# --- the record ---------------------------------------------------------------------------------
def test_launch_holds_its_layout_resolved():
    launch = Launch(model="llama3-8b", parallel=Parallel(tp=2, gpus=16, zero=3))
    assert launch.parallel == Parallel(tp=2, dp=8, gpus=16, global_batch=8, zero=3)
    assert Launch(model="gpt2", parallel=Parallel(zero=3)).parallel.zero == 0  # one DP rank
    # the sharding group is dp x cp (`Parallel.size("dp")`): with cp 8 and dp 1 ZeRO stays
    assert Launch(model="llama3-70b", parallel=Parallel(
        tp=4, cp=8, pp=8, gpus=256, zero=1)).parallel.zero == 1


@pytest.mark.parametrize("fields, word", [
    ({"model": "gpt5"}, "gpt5"), ({"model": "gpt2", "recompute": "some"}, "recompute"),
    ({"model": "gpt2", "precision": "fp4"}, "precision"),
    ({"model": "gpt2", "fuse": "all"}, "fuse"), ({"model": "gpt2", "seq_len": 0}, "sequence"),
    ({"model": "gpt2", "parallel": {"tp": 2}}, "Parallel"),
])
def test_launch_rejects_bad_fields(fields, word):
    assert word in one_line_error(Launch, **fields)


def test_a_gpt2_config_of_another_architecture_is_not_launched_as_gpt2():
    """A GPT2Config with OPT's, GPT-NeoX's, BLOOM's or Falcon's flags would be written as plain
    GPT-2 arguments: it is refused, naming the flags."""
    neox_like = attrs.evolve(gpt2.GPT2, positions=None, seq_len=1024, rotary=16, parallel=True)
    with pytest.raises(OpgraphError, match="positions, rotary, parallel"):
        Launch(model=neox_like, seq_len=1024, parallel=Parallel(gpus=1))
    assert Launch(model=gpt2.GPT3_175B, seq_len=2048, parallel=Parallel(gpus=8)).model.name == (
        "gpt3-175b")


DEEPSEEK_ARGS = to_megatron(Launch(model="deepseek-v2-lite", seq_len=4096,
                                   parallel=Parallel(gpus=8, ep=8)))


@pytest.mark.parametrize("freq, dense", [
    ("1", 0), ("[1]*27", 0), ("([0]*3+[1]*24)", 3), ("'([0]*3+[1]*24)'", 3),
    ("[0]*0+[1]*27", 0), ("[0,0," + ",".join(["1"] * 25) + "]", 2),
])
def test_megatron_moe_layer_freq_forms(freq, dense):
    """--moe-layer-freq as Megatron's DeepSeek scripts write it, parsed (Megatron evaluates
    it): the dense layers come first."""
    args = DEEPSEEK_ARGS.replace("'[0]*1+[1]*26'", shlex.quote(freq))
    assert read_megatron(args, gpus=8).model.first_dense == dense


@pytest.mark.parametrize("edit, words", [
    (("'[0]*1+[1]*26'", "2"), "dense layers first"),  # every second layer: not modelled
    (("'[0]*1+[1]*26'", "'[0,1,0]'"), "dense layers first"),
    (("'[0]*1+[1]*26'", "'__import__(\"os\")'"), "dense layers first"),  # never evaluated
    (("'[0]*1+[1]*26'", "'[0]*1+[1]*25'"), "has 26 layers; --num-layers is 27"),
    (("--moe-shared-expert-intermediate-size 2816", "--moe-shared-expert-intermediate-size 2000"),
     "not a whole number of experts"),
    (("--kv-lora-rank 512 ", ""), "lack --kv-lora-rank"),
    (("--disable-bias-linear ", ""), "DeepSeek-V2's form"),
])
def test_megatron_latent_attention_bad_input_is_one_line(edit, words):
    args = DEEPSEEK_ARGS.replace(*edit)
    assert args != DEEPSEEK_ARGS
    assert words in one_line_error(read_megatron, args, gpus=8)


def test_torchtitan_experts_under_tp_are_reported(toml):
    """A DeepSeek file with tp 2: torchtitan runs each expert whole on every TP rank, opgraph
    splits it, so the reader says so rather than quietly modelling another job."""
    text = to_torchtitan(Launch(model="deepseek-v2-lite", parallel=Parallel(gpus=8, zero=3)))
    launch = read_torchtitan(toml(text.replace("tensor_parallel_degree = 1",
                                               "tensor_parallel_degree = 2")))
    assert launch.parallel.tp == 2
    assert any("expert_tensor_parallel_degree" in note for note in launch.unknown)


# --- Megatron-Bridge's recipe runner: the Megatron form of Gemma 2 ------------------------------

BRIDGE_LAUNCHES = [
    Launch(model="gemma2-2b", seq_len=8192, parallel=Parallel(gpus=8, zero=1)),
    Launch(model="gemma2-2b", seq_len=4096,
           parallel=Parallel(tp=2, gpus=16, global_batch=64, micro_batch=2, zero=3,
                             sequence_parallel=True),
           recompute="full", precision="fp8", fuse="elementwise"),
    Launch(model="gemma2-2b", seq_len=8192,
           parallel=Parallel(gpus=8, zero=1, overlap_param_gather=True, virtual_stages=1)),
    Launch(model="gemma2-2b", seq_len=8192,
           parallel=Parallel(tp=1, gpus=8, zero=2, grad_reduce_dtype="bf16",
                             overlap_grad_reduce=False), recompute="selective"),
    Launch(model="gemma2-2b", seq_len=8192, parallel=Parallel(gpus=4, zero=0)),
]


@pytest.mark.parametrize("launch", BRIDGE_LAUNCHES)
def test_megatron_bridge_round_trip(launch):
    """Gemma 2's soft-capping and sandwich norms have no Megatron-LM flag; Megatron-Bridge's
    recipe builds it, and the writer says every field opgraph reads."""
    text = to_megatron(launch)
    assert "scripts/training/run_recipe.py --recipe gemma2_2b_pretrain_config" in text
    again = read_megatron(text)  # the launcher says the GPUs
    assert again == _running(launch, "megatron")
    assert again.unknown == ()


def test_megatron_bridge_reads_the_recipes_own_settings():
    """What the overrides leave alone is as gemma2_2b_pretrain_2gpu_h100_bf16_config sets it
    (Megatron-Bridge recipes/gemma/h100/gemma2.py over recipes/common.py): TP 2, global batch
    32, micro-batch 2, 4,096 tokens, the distributed optimizer, gradients reduced in bf16
    (grad_reduce_in_fp32 False) and not overlapped, no recomputation, bf16_mixed; and, as
    Megatron-Core's TransformerConfig leaves them, the bias fusions off: no fused element-wise
    kernels, as Megatron-LM's arguments read with a --no-...-fusion flag."""
    launch = read_megatron("torchrun --nproc-per-node 4 --nnodes 1 "
                           "scripts/training/run_recipe.py --recipe gemma2_2b_pretrain_config "
                           "--dataset mock -ms 100 --lr 3e-4 checkpoint.save=/tmp/x")
    p = launch.parallel
    assert (launch.model, launch.seq_len, launch.recompute, launch.precision, launch.fuse) == (
        "gemma2-2b", 4096, "none", "bf16", None)
    assert (p.tp, p.pp, p.cp, p.dp, p.gpus, p.global_batch, p.micro_batch, p.zero) == (
        2, 1, 1, 2, 4, 32, 2, 1)
    assert (p.grad_reduce_dtype, p.overlap_grad_reduce, p.overlap_param_gather) == (
        "bf16", False, False)
    assert launch.unknown == ()
    # _pretrain_common's Megatron FSDP default overlaps its parameter gathers: ZeRO-3's prefetch
    fsdp = read_megatron("--recipe gemma2_2b_pretrain_config ddp.use_megatron_fsdp=true "
                         "ddp.data_parallel_sharding_strategy=optim_grads_params "
                         "ddp.overlap_param_gather=true", gpus=4)
    assert (fsdp.parallel.zero, fsdp.parallel.overlap_param_gather) == (3, False)
    # the short forms are the overrides they stand for
    short = read_megatron("--recipe gemma2_2b_pretrain_2gpu_h100_bf16_config -tp 1 -gb 64 "
                          "-mb 1 -sl 8192", gpus=8)
    assert (short.parallel.tp, short.parallel.dp, short.parallel.global_batch,
            short.parallel.micro_batch, short.seq_len) == (1, 8, 64, 1, 8192)


def test_megatron_bridge_keys_it_does_not_model_are_reported():
    launch = read_megatron("--recipe gemma2_2b_pretrain_config model.cuda_graph_impl=full "
                           "model.recompute_granularity=selective "
                           "model.recompute_modules=[core_attn,mlp]", gpus=2)
    assert launch.unknown == ("model.cuda_graph_impl",)
    assert launch.recompute == "selective:core_attn+mlp"  # the modules, modelled


@pytest.mark.parametrize("args, words", [
    ("model.tensor_model_paralel_size=2", "did you mean model.tensor_model_parallel_size?"),
    ("modle.tensor_model_parallel_size=2", "no section for modle.tensor_model_parallel_size"),
    ("model.context_parallel_size=2", "without context parallelism"),
    ("--mode sft", "opgraph models pre-training"),
    ("--tp 2", "has no option --tp"),
    ("model.num_layers_in_first_pipeline_stage=4", "even pipeline splits"),
    ("mixed_precision=bf16_with_mxfp8_mixed", "mixed_precision=bf16_with_mxfp8_mixed"),
    ("model.recompute_granularity=full model.recompute_method=block", "not modelled"),
    ("model.tensor_model_parallel_size=two", "give a whole number"),
    ("model.sequence_parallel=1", "give true or false"),
    ("model.tensor_model_parallel_size=0", "model.tensor_model_parallel_size 0 is not positive"),
    ("model.recompute_granularity=selective model.recompute_modules=[core_attn",
     "give a list of module names"),
    ("model.seq_length=2048", "give dataset.seq_length"),
    ("-tp", "takes a value"),
    ("stray", "neither an option nor a KEY=VALUE override"),
])
def test_megatron_bridge_bad_input_is_one_line(args, words):
    with pytest.raises(OpgraphError, match=re.escape(words)):
        read_megatron(f"--recipe gemma2_2b_pretrain_config {args}", gpus=8)


@pytest.mark.parametrize("text, words", [
    ("scripts/training/run_recipe.py --model gemma2_2b", "give --recipe"),
    ("--recipe llama3_8b_pretrain_config", "opgraph reads gemma2_2b_pretrain_config"),
    ("scripts/training/run_recipe.py -tp 2", "lack --recipe"),
])
def test_megatron_bridge_recipes_it_does_not_read(text, words):
    with pytest.raises(OpgraphError, match=re.escape(words)):
        read_megatron(text, gpus=8)


@pytest.mark.parametrize("layout, words", [
    (Parallel(cp=2, gpus=8), "without context parallelism"),
    (Parallel(pp=13, gpus=13, first_stage_layers=1, last_stage_layers=1), "even pipeline"),
    (Parallel(tp=2, gpus=8, async_tp=True), "comm_overlap"),
])
def test_megatron_bridge_cannot_say_everything(layout, words):
    with pytest.raises(OpgraphError, match=re.escape(words)):
        to_megatron(Launch(model="gemma2-2b", seq_len=8192, parallel=layout))


def test_a_megatron_bridge_script_profiles_from_the_command_line(cli, tmp_path):
    """`profile --megatron-args @run.sh` reads a Megatron-Bridge launch script as written (the
    launcher gives the GPUs), and names on stderr the key it does not model."""
    script = tmp_path / "run.sh"
    script.write_text("torchrun --nproc-per-node 8 --nnodes 2 \\\n"
                      "    scripts/training/run_recipe.py --recipe gemma2_2b_pretrain_config \\\n"
                      "    -tp 2 -gb 64 model.cuda_graph_impl=full\n")
    code, out, err = cli("profile", "--megatron-args", f"@{script}", "--json")
    assert code == 0, err
    assert "model.cuda_graph_impl is not modelled" in err
    got = json.loads(out)
    assert (got["parallel"]["tp"], got["parallel"]["dp"], got["parallel"]["zero"]) == (2, 8, 1)
    assert got["seq_len"] == 4096  # the recipe's own


def test_megatron_bridge_without_a_launcher_needs_the_gpus():
    with pytest.raises(OpgraphError, match=re.escape("give the number of GPUs (--gpus)")):
        read_megatron("scripts/training/run_recipe.py --recipe gemma2_2b_pretrain_config")
    with pytest.raises(OpgraphError, match=re.escape("not divisible by tp x cp x pp = 2")):
        read_megatron("--recipe gemma2_2b_pretrain_config", gpus=3)  # the recipe's TP 2


@pytest.mark.parametrize("write, framework", [(to_torchtitan, "megatron"),
                                              (to_megatron, "torchtitan")])
def test_a_config_is_not_written_for_a_layout_of_another_framework(write, framework):
    """A config reads back as its own framework's job (`read_torchtitan` follows torchtitan,
    `read_megatron` Megatron-LM); a layout that follows another is refused in one line, not
    written as a file that profiles back to other figures."""
    launch = Launch(model="llama3-8b", seq_len=8192,
                    parallel=Parallel(gpus=8, zero=3, framework=framework))
    with pytest.raises(OpgraphError, match=f"follows --framework {framework}"):
        write(launch)
