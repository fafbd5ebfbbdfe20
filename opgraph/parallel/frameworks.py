"""What each training framework does differently when it runs a layout, as one table.

`Parallel.framework` names a row of `FRAMEWORKS`; the passes read its traits (`traits(layout)`),
never the name. None is opgraph's generic model, which every trait's default keeps as it was:
gradients reduced in FP32, ZeRO-3 weights gathered again for a recomputation, the gathered input
of a sequence-parallel column matmul kept for its backward, gradients reduced under the
backward.

    traits(Parallel(framework="deepspeed")).grad_reduce_dtype  # "bf16"
    reduce_dtype(Parallel(framework="deepspeed", grad_reduce_dtype="fp32"))  # "fp32"

Each trait, with where each framework's code says so:

- `grad_reduce_dtype`: the dtype of the data-parallel gradient reduction's message.
  torchtitan: `mixed_precision_reduce = "float32"` (`torchtitan/config/job_config.py`, handed
  to FSDP2's `MixedPrecisionPolicy(reduce_dtype=...)`). Megatron-LM: BF16 training sets
  `accumulate_allreduce_grads_in_fp32 = True` unless `--grad-reduce-in-bf16`
  (`megatron/training/arguments.py`), the gradient buffer then FP32
  (`megatron/core/distributed/param_and_grad_buffer.py`). DeepSpeed: `communication_data_type`
  falls back to FP16 or BF16 when either is enabled (`deepspeed/runtime/engine.py`), so a BF16
  run reduces in BF16. nanotron: `OptimizerArgs.accumulate_grad_in_fp32`
  (`src/nanotron/config/config.py`; its examples set it True, `examples/config_tiny_llama.py`),
  the all-reduce then runs on the FP32 accumulation buffers
  (`src/nanotron/optim/gradient_accumulator.py`).
- `regather_in_recompute`: whether a ZeRO-3 / FSDP weight is all-gathered again for the
  recomputation of its layer. FSDP2 (torchtitan) does not: its pre-forward hook returns at once
  while the module's state is PRE_BACKWARD, "the pre-backward hook is responsible for the
  unshard" (`torch/distributed/fsdp/_fully_shard/_fsdp_state.py`, `_pre_forward`), so the
  recomputation reads the backward's gathered copy. Nor does PyTorch's FSDP1, which Composer
  (LLM Foundry's trainer) runs: its pre-backward hook unshards the module's `FlatParameter`
  and the re-run forward finds it unsharded. DeepSpeed ZeRO-3 does: its pre-forward
  module hook fetches the sub-module's parameters whenever the forward runs, the checkpointed
  re-run included (`deepspeed/runtime/zero/parameter_offload.py`, `_pre_forward_module_hook`
  -> `PartitionedParameterCoordinator.fetch_sub_module`).
- `sp_saves_shard`: under sequence parallelism, whether the column-parallel matmul saves its
  sequence-sharded input and all-gathers it again in the backward (Korthikanti et al. 2022,
  section 4.2.2) instead of keeping the gathered one. Megatron-LM does
  (`megatron/core/tensor_parallel/layers.py`, `LinearWithGradAccumulationAndAsyncCommunication`:
  forward saves `input`, backward all-gathers it again before the weight gradient). torchtitan's
  sequence parallelism is a DTensor redistribution before `nn.Linear`, whose autograd saves the
  gathered input, so it keeps S x D per matmul input
  (`torchtitan/models/llama3/infra/parallelize.py`, `SequenceParallel` + `ColwiseParallel`).
  nanotron does as Megatron in its REDUCE_SCATTER mode with `tp_recompute_allgather` (its
  default: `src/nanotron/parallel/tensor_parallel/functional.py`, `column_linear`, whose
  backward "allgathers the inputs again"). DeepSpeed has no sequence parallelism of this kind
  (Ulysses splits attention heads instead): the generic model.
- `unshards_once_with_pp`: with pipeline parallelism, whether FSDP (ZeRO-3) gathers a stage's
  parameters once per step and reduce-scatters its gradients once, rather than per
  micro-batch. torchtitan does: its default `reshard_after_forward = not pp_enabled`
  (`torchtitan/models/llama3/infra/parallelize.py`, `apply_fsdp`: "do not reshard after forward
  to avoid per-microbatch all-gathers"), and PyTorch's pipeline stage turns off resharding after
  backward and gradient sync for every backward but the last
  (`torch/distributed/pipelining/stage.py`, `set_reshard_after_backward(False)`,
  `set_requires_gradient_sync(False)`). A stage then holds its full BF16 parameters and
  gradients and shards the optimizer: ZeRO-1's memory and traffic (`sharding`), the gather
  placed after the update rather than under the next step's first forward.
- `reduce_after_flush`: with pipeline parallelism, whether the gradient reduction waits for the
  pipeline to drain rather than running under the backward. DeepSpeed's pipeline engine issues
  `ReduceGrads` after the last micro-batch's backward (`deepspeed/runtime/pipe/schedule.py`,
  `TrainSchedule.steps`; `deepspeed/runtime/pipe/engine.py`, `_exec_reduce_grads`).
- `blocking_p2p`: a pipeline stage's point-to-point transfers block its compute stream: each
  activation or gradient it sends, and each it receives, runs on the stage's critical path
  (`passes.split_stages` writes the receives too; `schedule.plan` makes the next compute op
  wait). DeepSpeed's pipeline engine sends and receives with `p2p.send` / `p2p.recv`, which
  assert `async_op == False` and call `torch.distributed.send` / `recv`
  (`deepspeed/runtime/pipe/p2p.py`); with NCCL each makes the current stream wait for the
  transfer, which needs the neighbour at its matching receive or send. Megatron-LM's
  schedules post them as batched `isend`/`irecv` and wait only where the data is needed; the
  generic model and the others send asynchronously. (Both neighbours waiting on a transfer
  does not make DeepSpeed's `TrainSchedule` run in lockstep: simulated step by step with
  pairwise rendezvous, equal stages take 1F1B's span plus the transfers.)
- `syncs_tp_grads`: tensor parallelism's reduction of a column-parallel matmul's input
  gradient (an all-reduce, a reduce-scatter under sequence parallelism) starts only when the
  layer's backward reaches the op that reads it (`schedule`'s deferred groups), not as soon
  as the input gradient is written: it runs after the matmul's weight gradient, exposed.
  Megatron-LM as Megatron-DeepSpeed forked it: `ColumnParallelLinear` runs
  `copy_to_tensor_model_parallel_region` and then `F.linear`, so autograd computes the
  linear's input and weight gradients in one node and only then the copy's backward, a
  synchronous `torch.distributed.all_reduce` (bigscience-workshop/Megatron-DeepSpeed 119a0d2d,
  `megatron/mpu/layers.py`, the code of BLOOM's training; Megatron-Turing NLG's of 2021 too).
  Megatron-LM added the overlap as `--async-tensor-model-parallel-allreduce`, opt-in, in
  September 2021 (NVIDIA/Megatron-LM 16c90445e7, `ColumnParallelLinearWithAsyncAllreduce`:
  the input gradient's all-reduce issued before the weight-gradient GEMM) and later made it
  the default: the generic model, which starts it when written (nanotron's
  `_ColumnLinearAsyncCommunication.backward` too: its reduce-scatter is launched before the
  weight gradient). The DeepSpeed rows stand for the tensor parallelism of those runs; a later
  Megatron-DeepSpeed, merged with Megatron-LM's newer layers, overlaps it as Megatron-LM does,
  which no row here says. torchtitan: PyTorch's DTensor tensor parallelism
  (`ColwiseParallel`) redistributes the input in an autograd node of its own before the
  matmul, so the input gradient's reduce-scatter (or all-reduce) is that node's backward, run
  after the matmul's node has computed both gradients (`torch/distributed/tensor/parallel/
  style.py`, `_prepare_input_fn`; `torch/distributed/tensor/_redistribute.py`,
  `Redistribute.backward`). Not under async TP (`--async-tp`), whose compiled kernels run the
  collective inside the matmul (`deferred_groups`).
- `partitions_p2p`: with tensor parallelism (and no sequence parallelism, which shards the
  activations already), each rank of a stage's tensor-parallel group sends and receives only
  its 1/tp slice of each activation and gradient, and the receiving stage all-gathers the
  slices over its group before using them. DeepSpeed's pipeline engine: `pipe_partitioned`
  and `grad_partitioned`, on by default (`deepspeed/runtime/config.py`), wrap what a stage
  sends in a `PartitionedTensor` over the slice-parallel group and rebuild it with `.full()`
  on arrival (`deepspeed/runtime/pipe/engine.py`). It applies where the transfers block
  (`blocking_p2p`), which writes the receives that gather.
- `overlaps_reduce_at`: the ZeRO stages at which the gradient reduction runs under the
  backward by default; at the others it runs after the backward, exposed. DeepSpeed's
  `zero_optimization.overlap_comm` defaults to True at stage 3 only
  (`deepspeed/runtime/zero/config.py`, `DeepSpeedZeroConfig.overlap_comm_valid`); below it the
  reduction runs after the backward (stage 0: the engine's `allreduce_gradients`) or blocks it
  bucket by bucket (stages 1-2): exposed whole either way. nanotron wraps the model in DDP,
  whose hook reduces the FP32 accumulation buffers under the last backward, only without ZeRO:
  with `accumulate_grad_in_fp32` and `zero_stage` > 0 it builds no DDP (`trainer.py`,
  `_init_model`: `make_ddp = data_parallel_size > 1 and not (accumulate_grad_in_fp32 and
  zero_stage > 0)`, from January 2024 to June 2025, the playbook's runs among them) and
  all-reduces the gradients after the backward (`sync_gradients_across_dp(...,
  reduce_scatter=False)`, "This is too memory hungry, instead we run all_reduce"): see
  `zero1_all_reduces`.
- `zero1_all_reduces`: under ZeRO-1, the gradients are all-reduced whole (each rank then
  updates its shard of the optimizer and all-gathers its updated weights), not
  reduce-scattered: nanotron, as `overlaps_reduce_at` says.
- `ddp_buckets`: without ZeRO the gradients are all-reduced through PyTorch DDP, whose reducer
  allocates its buckets when the model is wrapped and keeps them: a copy of every gradient in
  the parameters' dtype, resident all step beside the gradients the job keeps (`gradient_as_
  bucket_view` off, DDP's default; "the saved memory size will be equal to the total gradients
  size" where it is on, `torch.nn.parallel.DistributedDataParallel`'s documentation). The
  all-reduce carries a `bucket` parameter (its dtype) and `memory.resident_tensors` holds the
  copy among the gradients. nanotron wraps the model in DDP without that option whenever the
  data-parallel size is above 1 and no ZeRO stage runs (`trainer.py`, `_init_model`,
  `DistributedDataParallel(model, process_group=..., broadcast_buffers=False,
  bucket_cap_mb=...)`), its FP32 accumulation then reading the BF16 buckets in its hook
  (`optim/gradient_accumulator.py`, `get_fp32_accum_hook`). Megatron-LM's DDP keeps its
  gradients in the bucket itself (`param.main_grad` a view of its grad buffer), and FSDP has
  no such copy: the generic model.
- `flattens_gathers`: under ZeRO-1, the updated weights are all-gathered in one call over all
  of them that flattens each side into buffers of its own, held while the call runs: the
  rank's shards packed into one input, one packed output per rank (the whole weights between
  them) and, because those outputs are a list, the process group's own flat output (the whole
  weights again), which it then copies out. nanotron: `ZeroDistributedOptimizer.step` ->
  `_all_gather_params` -> `all_gather_coalesced` (`src/nanotron/optim/zero.py`,
  `src/nanotron/distributed.py`: `_flatten_dense_tensors` of the inputs and of each rank's
  outputs, then `dist.all_gather` on the list), whose NCCL process group gathers equal-sized
  list outputs into `newLikeFlat(outputTensors)` and copies each out
  (`torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp`, `allgather`). PyTorch's caching
  allocator keeps the segments it allocates, and these, the size of a stage's whole weights,
  are larger than any block the forward and backward free: opgraph stacks them on the
  liveness peak unless that passes the part's memory (`memory.buffer_tensors`, `Memory`: 2 x
  the weights + their shard; both nanotron files as they were from early 2024 to 2411b022),
  which is what the playbook's ZeRO-1 runs measure above that peak (its 1B at one sequence a
  micro-batch on one stage: 4.1-5.5 GB at DP 8 to 64, while the sharded states shrink, where
  2 x 2.68 GB of BF16 weights make 5.4). Megatron-LM's
  distributed optimizer gathers into its persistent parameter buffer and FSDP per module: the
  generic model.
- `adds_grads_in_fp32`: each micro-batch's weight gradients are written in BF16 and added
  into FP32 buffers by kernels of their own (`passes.accumulate_grads`), rather than
  accumulated in FP32 by the weight-gradient GEMM itself. nanotron: its
  `FP32GradientAccumulator` (`src/nanotron/optim/gradient_accumulator.py`, `backward`:
  `fp32_grad.add_(half_param.grad)` for every parameter after `loss.backward()`), which
  `accumulate_grad_in_fp32` turns on (its examples and the playbook's benchmark script set it).
  DeepSpeed training in BF16 (the row "deepspeed-bf16"): its `BF16_Optimizer`, which a BF16
  job runs with `zero_optimization.stage` 0 as its own ZeRO-1, adds every gradient into its FP32
  copy after each micro-batch's backward (`deepspeed/runtime/bf16_optimizer.py`,
  `update_hp_grads`: `hp_grad.add_(lp.grad.to(hp_grad.dtype))`, called by the pipeline
  engine's `_exec_backward_pass` from its BF16 support, #1801, April 2022). Its FP16 path
  accumulates in FP16 (the row "deepspeed").
  Megatron-LM's `--gradient-accumulation-fusion` (on by default) accumulates in the GEMM: the
  generic model.
- `eager`: the op kinds the framework runs as eager PyTorch, each as the several kernels its
  Python code launches (`rules.EAGER_BYTES`, marked by `passes.decompose`), where the others run
  one fused kernel. A compiled run (`fuse` "elementwise": torch.compile) generates its own
  kernels instead (`passes.fuse_elementwise` drops the mark). torchtitan: its default
  `norm_type = "rmsnorm"` is a Python `RMSNorm` (`torchtitan/models/norms.py`), RoPE is
  `apply_rotary_emb`'s complex product on an FP32 copy and the MLP is
  `F.silu(self.w1(x)) * self.w3(x)` (`torchtitan/models/llama/model.py`), all eager unless
  `compile = true` (`train_configs/llama3_8b.toml`); its loss is
  `F.cross_entropy(pred.float(), labels)` (`train.py`, `loss_fn`). nanotron: its MLP's
  `GLUActivation` runs `self.act(gate) * up` in two kernels (`src/nanotron/models/llama.py`)
  and its loss is `sharded_cross_entropy(..., dtype=torch.float)`, Megatron's vocab-parallel
  kernels on FP32 logits; its RMSNorm (`TritonRMSNorm`) and its training RoPE (flash-attn's
  rotary kernel) are fused. Megatron-LM fuses the norms, SwiGLU and RoPE (Transformer
  Engine's norms; the SwiGLU and RoPE fusions are on unless `--no-bias-swiglu-fusion` or
  `--no-rope-fusion`, `megatron/training/arguments.py`): the generic model. Its
  vocab-parallel cross-entropy is eager too unless `--cross-entropy-loss-fusion`
  (`megatron/core/tensor_parallel/cross_entropy.py`), but no layout field says which a run
  used (SimuMax's B200 runs set it), so Megatron's loss is left fused here. Composer's MPT
  (LLM Foundry) runs flash-attn's fused cross-entropy unless its config says otherwise
  (`loss_fn` defaults to `fused_crossentropy`, `llmfoundry/models/mpt/modeling_mpt.py`; its
  `gpu` extras install the kernel, `xentropy-cuda-lib`): the generic model.
- `compiles_blocks_only`: torch.compile covers the transformer blocks alone, so the ops outside
  the layer stack (the final norm, the loss) stay eager in a compiled run, but for the kinds
  `compiles_outside_blocks` names, which it compiles beside them. torchtitan: `apply_compile`
  compiles each `TransformerBlock` (`torchtitan/models/llama3/infra/parallelize.py`), and since
  April 2025 its loss too (`build_cross_entropy_loss`, pytorch/torchtitan@bbb1b616e; later
  `compile.components`, whose default is the model and the loss), so its FP32 copies of the
  logits are not made; the final norm stays eager. The row "torchtitan-2024" is torchtitan
  before that, as its December 2024 benchmark runs ran it (9dec370, whose `train.py` keeps the
  loss uncompiled: "compiling loss function causes CUDA errors").
- `balances_stages`: a pipeline's layers are split by the blocks' compute costs rather than
  evenly. nanotron's `build_model` (`src/nanotron/models/base.py`) sums each pipeline block's
  cost from `get_block_compute_costs` (a decoder layer: its linear layers' weights,
  4 h^2 + 3 h F for Llama; the LM head: V h; the rest nothing) and gives stage r the blocks up
  to the first whose running sum passes (r + 1) / pp of the total, so the stage with the head
  takes fewer layers (the playbook's 1B, 16 layers on 2 stages: 11 and 5). `own_split`
  computes it with nanotron's formula from the model's dimensions; `end_split` says it as a
  layout's first and last stages where it can (else `Parallel.stage_layers` says it).

- `buckets_grads`: the data-parallel gradient reductions (and ZeRO-1's gathers of the
  updated weights) run in buckets of many weights, one NCCL call each, rather than a call per
  weight. Megatron-LM: with `--overlap-grad-reduce`, buckets of max(40 M, 1 M x the data-
  parallel size) parameters ("make buckets larger to ensure that chunks used in NCCL
  ring-reduce implementations are large enough to remain bandwidth-bound rather than
  latency-bound", `megatron/core/distributed/distributed_data_parallel.py`); the parameter
  gathers use the same buffers' buckets. Each weight then pays its share of a call's latency
  (`reduces_in_buckets`, `bucket_share`, `costmodel.Cost.calls`). Without the overlap
  Megatron reduces one bucket per model chunk, and so does an interleaved pipeline's every chunk
  after the first (`megatron/training/training.py`, `get_model`: "Turn off bucketing for model_chunk
  2 onwards");
  neither is modelled (a call per weight without the overlap, as the other frameworks here;
  the first chunk's buckets for every chunk).

- `caches_fp8_weights`: under FP8, each weight is cast to FP8 once a step and the copy reused
  by every micro-batch (`passes.cache_fp8_weights`), rather than cast in every forward and kept
  for that micro-batch's backward. Megatron-LM: Transformer Engine casts on the step's first
  micro-batch only (`is_first_microbatch`, passed by Megatron-LM's TE layers,
  `megatron/core/extensions/transformer_engine.py`). torchtitan's torchao `Float8Linear`
  casts in every forward: not cached.

- `gemm_per_expert`: an expert layer's grouped GEMM runs as one GEMM per local expert, each
  issued by the host (`passes.unroll_expert_gemms`), rather than as one kernel. Megatron-LM:
  `TEGroupedMLP` runs Transformer Engine's `GroupedLinear`, which calls cuBLAS once per GEMM on
  4 streams unless the part is a Hopper and `NVTE_USE_CUTLASS_GROUPED_GEMM` is set
  (`transformer_engine/common/gemm/cublaslt_gemm.cu`, `nvte_multi_tensor_gemm`);
  `SequentialMLP` loops over the experts. DeepSpeed: `deepspeed/moe/experts.py`, `Experts`,
  loops over its local experts. torchtitan: one `torch._grouped_mm` (`GroupedExperts`). nanotron
  keeps the generic one kernel (not checked).

- `attention_library`: the kernels the attention core runs, "flash" (FlashAttention-2, the
  generic model's), "cudnn" (cuDNN's fused attention, at its generation's `attention_fused`
  efficiency), "triton" (flash-attn's Triton FlashAttention) or "flash1" (FlashAttention 1),
  the last two at FlashAttention-2's efficiency over Dao 2023's ratios
  (`costmodel.SLOWER_THAN_FLASH2`; `passes.pick_attention_kernel`). Megatron-LM: Transformer
  Engine's `DotProductAttention` prefers cuDNN's FusedAttention on Hopper and later
  (`transformer_engine/pytorch/attention/dot_product_attention/utils.py`,
  `get_attention_backend`). torchtitan calls PyTorch's SDPA, nanotron flash-attn: FlashAttention.
  No framework here defaults to Triton's; a job says it with the layout's `attention_library`
  (LLM Foundry's 2023 benchmarks: `submit_benchmarks.py` defaults `--attn_impl` to triton,
  whose kernel, `llmfoundry/models/layers/flash_attn_triton.py`, is flash-attn's
  `flash_attn_triton.py` copied).

- `groups_by_module`: FSDP gathers a wrapped module's sharded parameters, and reduce-scatters
  their gradients, in one call per module (a transformer block; the embedding, final norm and
  head of the root together), not one per weight; each weight then pays its share of that call
  (its parameters over the module's, `costmodel.Cost.calls`). torchtitan: `apply_fsdp` calls
  `fully_shard` on each `TransformerBlock` and then on the whole model
  (`torchtitan/models/llama3/infra/parallelize.py`), and FSDP2 copies a module's shards into one
  buffer for one all-gather (`torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py`,
  `foreach_all_gather`) and reduces its gradients in one reduce-scatter (`foreach_reduce`).
  PyTorch's FSDP1 flattens a wrapped module's parameters into one `FlatParameter`
  (`torch/distributed/fsdp/_flat_param.py`), gathered and reduced whole; Composer wraps each
  transformer block so (its models' `fsdp_wrap_fn`). Without FSDP (ZeRO-0) the gradients'
  all-reduce stays a call per weight (DDP's 25 MB buckets are not modelled).
- `copies_out_gathers`: each ZeRO-3 weight's gather lands in one flat buffer of its module,
  which a copy kernel on the compute stream splits into the unsharded parameters before they
  are read: every gather is followed by a memory-bound copy of the whole weight (read and
  written), and the flat buffer is live until it runs. FSDP2 (torchtitan):
  `foreach_all_gather_copy_out` waits for the all-gather on the current stream and copies
  its output into each parameter's all-gather outputs with `split_with_sizes_copy`
  (`torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py`, called from
  `FSDPParamGroup.wait_for_unshard`). FSDP1 gathers into its `FlatParameter`'s storage, of
  which the parameters are views: no copy (the generic model).
- `list_collectives`: each ZeRO-3 weight's all-gather and gradient reduce-scatter is a
  `torch.distributed` call on a list of one tensor per rank, whose NCCL process group copies
  every rank's piece out of (or into) one flat buffer by a copy of its own, on the collective's
  stream: a call then runs 1 + n kernels over n ranks (`Cost.launches` of the collective, each
  further kernel at the calibrated `launch_s`, `CostModel.comm_time`). DeepSpeed from ZeRO-3's
  first release (v0.3.12, March 2021) to v0.5.4: `Init._allgather_param` gathers each parameter
  by `torch.distributed.all_gather(partitions, ...)` into `world_size` narrowed views, and
  `_reduce_scatter_gradient` reduces each gradient by `torch.distributed.reduce_scatter(
  input_list[rank], input_list)` (`deepspeed/runtime/zero/partition_parameters.py` at v0.3.13);
  PyTorch's `ProcessGroupNCCL::allgather` copies the flat result to each output tensor in turn
  ("Copy the flattened output tensors to the outputs") and `reduce_scatter` each input into
  its flat buffer (`torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp`). DeepSpeed v0.5.5 gathers
  into one flat tensor where PyTorch has `_all_gather_base` (#1188, "ZeRO3, improved parameter
  all-gather operation"), v0.6.0 reduce-scatters coalesced through `_reduce_scatter_base`
  (`deepspeed/runtime/comm/coalesced_collectives.py`, #1453, whose fallback warns that the
  list-form `torch.distributed.reduce_scatter` "will result in suboptimal performance"): the
  row "deepspeed-0.3" is DeepSpeed before them (Narayanan et al.'s ZeRO-3 runs, April 2021),
  "deepspeed" after.
- `syncs_before_gather`: a ZeRO-3 weight's gather waits until the compute queued before it
  has run, rather than being prefetched a layer ahead (`schedule.simulate`'s `prefetch` off):
  the weights' gathers and the compute run one after the other. DeepSpeed's first ZeRO-3
  (the row "deepspeed-0.3", as `list_collectives` says): `Init._allgather_param` calls
  `torch.cuda.synchronize()` before it issues each parameter's gather, and the stage-3
  coordinator's `fetch_sub_module` waits on the gathers in flight, its comm stream and the
  device (`_synchronize_communication`) before the sub-module runs and only then prefetches
  the next sub-modules' parameters, each gather after a synchronize of its own
  (`deepspeed/runtime/zero/stage3.py` at v0.3.13); so at most the last gather of a prefetch
  runs beside the compute that follows, which opgraph leaves out. Later DeepSpeed drops the
  synchronize (#1188).
- `vocab_multiple`: the vocabulary is padded to a multiple of this x the tensor-parallel
  degree, so that it splits over the TP group (`padded_vocab_shard`); None: not padded, and
  the vocabulary must divide by the degree. Megatron-LM: `--make-vocab-size-divisible-by`,
  default 128, times the TP size (`megatron/training/arguments.py`;
  `_vocab_size_with_padding`, `megatron/training/tokenizer/tokenizer.py`), so GPT-2's 50,257
  tokens run as 51,200 at TP 8 and Llama 3's 128,256 as 129,024. nanotron:
  `make_vocab_size_divisible_by` x the TP size (`src/nanotron/helpers.py`,
  `_vocab_size_with_padding`), 1 in its configs (`examples/config_tiny_llama.yaml`).
  torchtitan shards an uneven vocabulary as DTensor does; DeepSpeed splits none: not padded.
  Only a split vocabulary is padded here: at TP 1 the model's own size is kept (Megatron pads
  GPT-2's to 50,304 there, 0.1% more).
- `replicates_at`: the ZeRO stages at which the framework runs HSDP's replicas (the layout's
  `replicate`: shard within a replica, all-reduce the shards across replicas). torchtitan:
  `data_parallel_replicate_degree` beside `data_parallel_shard_degree`, FSDP2 over a 2-D mesh
  (`torchtitan/distributed/parallel_dims.py`), ZeRO-3. Megatron-LM:
  `--num-distributed-optimizer-instances`, its distributed optimizer over intra-instance
  groups whose gradients are then all-reduced across instances
  (`megatron/core/parallel_state.py`), ZeRO-1. Composer: FSDP1's `HYBRID_SHARD`, ZeRO-3.
  DeepSpeed (whose ZeRO++ keeps a second copy of the weights, not replicated shards) and
  nanotron: none. The generic model: ZeRO-1 to 3.
- `zero_stages`: the ZeRO stages the framework runs where there is data parallelism, which
  `plan` searches. torchtitan: DDP (0) or FSDP2's `fully_shard` (3), and FSDP over dp x cp
  wherever context parallelism runs (`torchtitan/distributed/parallel_dims.py`; its launch
  writer refuses the rest, `io.launch.torchtitan`). nanotron: DDP (0) or its
  `ZeroDistributedOptimizer`, which shards the optimizer states alone (1; `zero_stage > 0` in
  `src/nanotron/helpers.py`). Composer: DDP (0) or FSDP1's `SHARD_GRAD_OP` (2) and
  `FULL_SHARD` (3). The others: all four.
- `zero_stages_under_cp`: those of them it runs with context parallelism (`plan` searches
  the stages in both). torchtitan: FSDP alone, over dp x cp (`parallel_dims.py`'s
  `dp_shard_cp` mesh). The others: every one of `zero_stages`.
- `cp_comms`: how its context parallelism moves the attention's inputs (`Parallel.cp_comm`).
  torchtitan: ring attention alone (PyTorch's `context_parallel`,
  `torch/distributed/tensor/experimental/_attention.py`: its K/V rotated by all-gather or
  all-to-all, no head-sharding all-to-all). The others: both.
- `tp_shards_sequence`: its tensor parallelism always shards the sequence between the blocks
  (sequence parallelism). torchtitan (its TP plan's `SequenceParallel` norms; its launch writer
  refuses TP without it).

- `sorts_by_local_expert`: its expert-parallel dispatcher sorts the tokens a GPU receives by
  local expert before the expert GEMMs and restores their order before sending them back
  (`passes.sort_local_experts`), one copy each way where a GPU holds more than one expert.
  Megatron-LM's all-to-all dispatcher (`sort_chunks_by_idxs` in `dispatch_postprocess` and
  `combine_preprocess`, `megatron/core/transformer/moe/token_dispatcher.py`); the other
  frameworks' dispatchers are the generic one here.

- `repeats_kv_heads`: under grouped-query attention its model copies the keys and values to
  every query head before the attention kernel (`passes.repeat_kv_heads`), so the kernel keeps
  H / H_kv times the keys and values for its backward and context parallelism's ring gathers
  them at that size. torchtitan's Llama (`repeat_kv`, an expand whose reshape copies,
  `torchtitan/models/llama/model.py` at 9dec370, the commit of its published runs; still so in
  its release v0.2.1); from v0.2.2 it passes SDPA `enable_gqa` instead ("GQA without kv
  repeats", ff0829c10, 2026-01-27), which this table does not follow. Megatron-LM (Transformer
  Engine, cuDNN and FlashAttention take grouped heads) and nanotron (flash-attn) do not.

- `sums_tp_partials`: under async TP, its matmul reduce-scatter exchanges the partial products
  and sums them in a kernel of its own (`passes.sum_tp_partials`). PyTorch's micro-pipelined
  TP, which torchtitan's `enable_async_tensor_parallel` runs
  (`torch/distributed/_symmetric_memory/__init__.py`: `_fused_matmul_reduce_scatter_impl`
  computes each rank's block of the product into a symmetric buffer, copies the blocks
  between the GPUs, `_pipelined_produce_and_all2all`, and sums the group's blocks of its own
  shard on the compute stream, `reduce_partials`). Megatron-LM's TP communication overlap
  (Transformer Engine's userbuffers) reduces on its communication kernels' SMs, as NCCL
  does: not it.
- `precisions`: the precisions its linears run (`passes.precision`). Row-wise FP8 is torchao's
  recipe (`Float8LinearConfig.from_recipe_name("rowwise")`), which torchtitan runs
  (`float8.recipe_name`); Transformer Engine, which Megatron-LM, DeepSpeed and Composer run
  FP8 with, scales per tensor (delayed or current scaling) or per block (MXFP8, 1x128 blocks),
  never per row (`transformer_engine/common/recipe/__init__.py`); nanotron's FP8 is its own.
  The generic model and torchtitan run every precision.

Megatron-LM's distributed optimizer is `zero=1`, its `--overlap-grad-reduce` the layout's
`overlap_grad_reduce`, its TP communication overlap `async_tp`: those are layout fields already;
the table holds what no field says.
"""

from __future__ import annotations

import attrs
import sympy

from ..core.choices import CP_COMMS, PRECISIONS
from ..core.errors import OpgraphError
from .parallel import Parallel


@attrs.frozen
class Traits:
    grad_reduce_dtype: str = "fp32"
    regather_in_recompute: bool = True
    sp_saves_shard: bool = False
    unshards_once_with_pp: bool = False
    reduce_after_flush: bool = False
    overlaps_reduce_at: frozenset[int] = frozenset({0, 1, 2, 3})
    zero1_all_reduces: bool = False
    flattens_gathers: bool = False
    adds_grads_in_fp32: bool = False
    eager: frozenset[str] = frozenset()
    compiles_blocks_only: bool = False
    compiles_outside_blocks: frozenset[str] = frozenset()
    balances_stages: bool = False
    buckets_grads: bool = False
    vocab_multiple: int | None = None
    caches_fp8_weights: bool = False
    gemm_per_expert: bool = False
    attention_library: str = "flash"
    groups_by_module: bool = False
    list_collectives: bool = False
    syncs_before_gather: bool = False
    ddp_buckets: bool = False
    copies_out_gathers: bool = False
    blocking_p2p: bool = False
    syncs_tp_grads: bool = False
    partitions_p2p: bool = False
    replicates_at: frozenset[int] = frozenset({1, 2, 3})
    zero_stages: frozenset[int] = frozenset({0, 1, 2, 3})
    zero_stages_under_cp: frozenset[int] = frozenset({0, 1, 2, 3})
    cp_comms: frozenset[str] = frozenset(CP_COMMS)
    tp_shards_sequence: bool = False
    repeats_kv_heads: bool = False
    sorts_by_local_expert: bool = False
    sums_tp_partials: bool = False
    precisions: frozenset[str] = frozenset(PRECISIONS)


_TENSORWISE = frozenset({"bf16", "fp8"})  # Transformer Engine's scaling, and nanotron's own
_DEEPSPEED = Traits(grad_reduce_dtype="bf16", reduce_after_flush=True, precisions=_TENSORWISE,
                    overlaps_reduce_at=frozenset({3}), gemm_per_expert=True, blocking_p2p=True,
                    partitions_p2p=True, syncs_tp_grads=True, replicates_at=frozenset())
_TORCHTITAN = Traits(regather_in_recompute=False, unshards_once_with_pp=True,
                     eager=frozenset({"rmsnorm", "rope", "swiglu", "cross_entropy"}),
                     compiles_blocks_only=True,
                     compiles_outside_blocks=frozenset({"cross_entropy"}),
                     groups_by_module=True, copies_out_gathers=True,
                     replicates_at=frozenset({3}), zero_stages=frozenset({0, 3}),
                     zero_stages_under_cp=frozenset({3}), cp_comms=frozenset({"ring"}),
                     tp_shards_sequence=True, syncs_tp_grads=True, repeats_kv_heads=True,
                     sums_tp_partials=True)
FRAMEWORKS: dict[str | None, Traits] = {
    None: Traits(),
    "composer": Traits(regather_in_recompute=False, groups_by_module=True, precisions=_TENSORWISE,
                       replicates_at=frozenset({3}), zero_stages=frozenset({0, 2, 3})),
    "torchtitan": _TORCHTITAN,
    "torchtitan-2024": attrs.evolve(_TORCHTITAN, compiles_outside_blocks=frozenset()),
    "megatron": Traits(sp_saves_shard=True, buckets_grads=True, vocab_multiple=128,
                       caches_fp8_weights=True, gemm_per_expert=True,
                       attention_library="cudnn", replicates_at=frozenset({1}),
                       sorts_by_local_expert=True, precisions=_TENSORWISE),
    "deepspeed": _DEEPSPEED,
    "deepspeed-0.3": attrs.evolve(_DEEPSPEED, list_collectives=True, syncs_before_gather=True),
    "deepspeed-bf16": attrs.evolve(_DEEPSPEED, adds_grads_in_fp32=True),
    "nanotron": Traits(sp_saves_shard=True, eager=frozenset({"swiglu", "cross_entropy"}),
                       balances_stages=True, vocab_multiple=1,
                       overlaps_reduce_at=frozenset({0}), zero1_all_reduces=True,
                       flattens_gathers=True, adds_grads_in_fp32=True, ddp_buckets=True,
                       replicates_at=frozenset(), zero_stages=frozenset({0, 1}),
                       precisions=_TENSORWISE),
}


def traits(layout: Parallel) -> Traits:
    """The traits of `layout`'s framework (see the module)."""
    try:
        return FRAMEWORKS[layout.framework]
    except KeyError:
        raise OpgraphError(f"framework {layout.framework!r}: choose one of "
                           f"{', '.join(k for k in FRAMEWORKS if k)}") from None


def check_precision(framework: str | None, precision: str) -> None:
    """OpgraphError, one line, where `framework` runs no `precision` linears (`precisions`)."""
    runs = FRAMEWORKS.get(framework, FRAMEWORKS[None]).precisions
    if precision not in runs:
        raise OpgraphError(f"--framework {framework} runs no {precision} linears (row-wise FP8 "
                           "is torchao's recipe, which torchtitan runs); give --precision "
                           f"{' or '.join(p for p in PRECISIONS if p in runs)}")


def attention_library(layout: Parallel) -> str:
    """The attention kernels `layout`'s job runs: its `attention_library`, else its framework's
    (see the module)."""
    return layout.attention_library or traits(layout).attention_library


def reduce_dtype(layout: Parallel) -> str:
    """The dtype data-parallel gradients travel in: the layout's `grad_reduce_dtype`, else its
    framework's default."""
    return layout.grad_reduce_dtype or traits(layout).grad_reduce_dtype


# The groups whose gradient reductions `defers_grad_reduce` holds back to their reader.
DEFERRED_GROUPS = ("dp", "dpr", "edp")


def deferred_groups(layout: Parallel) -> tuple[str, ...]:
    """The groups whose backward collectives wait for the op that reads them (`schedule`'s
    `deferred`): the data-parallel ones where the gradient reduction waits
    (`defers_grad_reduce`), and tensor parallelism's where the framework reduces an input
    gradient after the weight gradient (`Traits.syncs_tp_grads`; not under async TP, whose
    kernels run the collective inside the matmul)."""
    tp = ("tp",) if traits(layout).syncs_tp_grads and layout.tp > 1 and not layout.async_tp \
        else ()
    return (DEFERRED_GROUPS if defers_grad_reduce(layout) else ()) + tp


def defers_grad_reduce(layout: Parallel) -> bool:
    """Whether the gradient reduction waits for the backward to end: the layout says so
    (`overlap_grad_reduce` off), or its framework reduces after the pipeline's flush, or does
    not overlap it at the layout's ZeRO stage."""
    t = traits(layout)
    return (not layout.overlap_grad_reduce or (layout.pp > 1 and t.reduce_after_flush)
            or layout.zero not in t.overlaps_reduce_at)


def padded_vocab_shard(vocab, layout: Parallel, degree=None):
    """One tensor-parallel rank's share of the vocabulary `vocab` (a number or a symbol) under
    `layout`'s framework: ceil(vocab / (multiple x degree)) x multiple where it pads
    (`Traits.vocab_multiple`), else vocab / degree. `degree` is the TP degree, a number or the
    `tp` symbol (default: the layout's)."""
    degree = layout.tp if degree is None else degree
    multiple = traits(layout).vocab_multiple
    if multiple is None:
        return vocab / degree
    return sympy.ceiling(vocab / (multiple * degree)) * multiple


# Megatron-LM's default bucket: max(BUCKET_FLOOR, BUCKET_PER_RANK x the data-parallel size)
# parameters (`megatron/core/distributed/distributed_data_parallel.py`)
BUCKET_FLOOR = 40_000_000
BUCKET_PER_RANK = 1_000_000


def reduces_in_buckets(layout: Parallel) -> bool:
    """Whether the layout's data-parallel reductions run in buckets (`Traits.buckets_grads`:
    Megatron-LM with `--overlap-grad-reduce`), each weight paying `bucket_share` of a call;
    else each weight is reduced in a call of its own."""
    return traits(layout).buckets_grads and layout.overlap_grad_reduce


def groups_by_module(layout: Parallel) -> bool:
    """Whether the layout's sharded parameters are gathered and reduced one call per wrapped
    module (`Traits.groups_by_module`: FSDP) rather than one per weight."""
    return traits(layout).groups_by_module and sharding(layout) >= 1


def bucket_params(ranks):
    """Megatron-LM's bucket over `ranks` data-parallel GPUs, in parameters."""
    return sympy.Max(BUCKET_FLOOR, BUCKET_PER_RANK * ranks)


def bucket_share(numel, ranks):
    """A weight of `numel` parameters' share of its bucket's one call: numel / bucket, and
    1 for a weight as large as a bucket (a bucket holds whole weights). Written
    1 / Max(1, bucket / numel): sympy (1.14) takes c / (ep x tp) - 40,000,000 to be
    nonnegative for positive integer degrees, so Min(1, numel / bucket) and Max(bucket,
    numel) collapse, wrongly, once the model's dimensions are numbers and the degrees are
    not (the planner's formulas); the degrees in the numerator leave it nothing to collapse."""
    return 1 / sympy.Max(1, bucket_params(ranks) / numel)


def sharding(layout: Parallel) -> int:
    """The ZeRO stage the job runs: the layout's, but 1 where the framework keeps FSDP's
    parameters gathered over a pipeline's micro-batches (`Traits.unshards_once_with_pp`)."""
    if layout.zero == 3 and layout.pp > 1 and traits(layout).unshards_once_with_pp:
        return 1
    return layout.zero


def own_split(forward, stages: int, framework: str | None) -> tuple[int, ...] | None:
    """Every stage's layers, first to last, where the framework splits a pipeline by its
    blocks' costs (`Traits.balances_stages`); None where it does not (or `stages` is 1)."""
    if stages == 1 or not FRAMEWORKS[framework].balances_stages:
        return None
    return tuple(_balanced(*_block_costs(forward), stages))


def end_split(per_stage) -> tuple[int | None, int | None] | None:
    """`per_stage` (every stage's layers) as a layout's end stages, `(first_stage_layers,
    last_stage_layers)`: (None, None) where even, None in a pair where an end takes what a
    middle stage takes; None where the middle stages are unequal or a stage holds no layer,
    which only the layout's `stage_layers` can say."""
    if len(set(per_stage)) == 1:
        return (None, None)  # even
    middle = set(per_stage[1:-1])
    if len(middle) > 1 or 0 in per_stage:
        return None
    each = middle.pop() if middle else None
    first, last = per_stage[0], per_stage[-1]
    return (None if first == each else first, None if last == each else last)


def _block_costs(forward) -> tuple[int, int, int]:
    """(layers, one layer's cost, the head's cost) as nanotron's `get_block_compute_costs`
    weighs them (`src/nanotron/models/llama.py`): a decoder layer 4 H d_h D + 3 F D (q, k, v
    and o each counted at the query heads' size, grouped-query attention or not), the head
    V D. A model without those dimensions is weighed by the weights its linear layers hold
    (matmul kinds' weight operands), inside the layer stack and after it."""
    import sympy

    from ..core.ir import Phase, Role
    from ..core.rules import GEMM_GRIDS
    from ..core.symbols import D, F, H, V, d_h
    from ..passes.split_stages import layer_stack

    region = layer_stack(forward)
    layers = int(sympy.sympify(region.count).xreplace(forward.dims))
    dims = forward.dims
    if all(s in dims for s in (D, F, H, V, d_h)):
        return (layers, int(4 * dims[H] * dims[d_h] * dims[D] + 3 * dims[F] * dims[D]),
                int(dims[V] * dims[D]))
    layer = head = 0
    for op in forward.ops():
        if op.phase is not Phase.FORWARD or op.kind not in GEMM_GRIDS:
            continue
        held = sum(int(t.numel.xreplace(forward.dims)) for t in map(forward.tensor, op.inputs)
                   if t.role is Role.WEIGHT)
        if forward.within(op.region, region.name):
            layer += held
        else:
            head += held
    return layers, layer, head


def _balanced(layers: int, layer: int, head: int, stages: int) -> list[int]:
    """Layers per stage as nanotron assigns its blocks: each to the current stage, which moves
    on once the running cost passes its share of the total."""
    total = layers * layer + head
    out, stage, running = [0] * stages, 0, 0
    for i in range(layers + 1):  # the layers, then the head
        running += layer if i < layers else head
        if i < layers:
            out[stage] += 1
        if running * stages > total * (stage + 1) and stage < stages - 1:
            stage += 1
    return out
