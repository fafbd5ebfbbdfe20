"""Frameworks as they run (`opgraph.parallel.frameworks`): the gradient-reduction dtype, FSDP2's
gathers with recomputation, Megatron-LM's sequence-parallel inputs, DeepSpeed's pipeline reductions,
and `plan` agreeing with `profile` for each. Expected values are the frameworks' own rules
written as formulas (the source of each rule is in `opgraph/parallel/frameworks.py`)."""

import json
from collections import Counter

import attrs
import pytest
import sympy
from opgraph.models import preset
from opgraph.passes.evaluate import resolve
from opgraph.passes.replicate import replicate

from opgraph import compile_step, hardware
from opgraph.cost.costmodel import DEFAULT, cost_model, message_bytes
from opgraph.parallel.distributed import compile_parallel, prepare, profile_parallel
from opgraph.core.errors import OpgraphError
from opgraph.core.ir import Phase
from opgraph.cost.memory import saved
from opgraph.core.symbols import tp
from opgraph.parallel.parallel import Parallel
from opgraph.parallel.search import Searcher, Space, rows
from opgraph.core.symbols import B, D, F, H, H_kv, S, d_h

H100 = hardware.get("h100-sxm")
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


# --- the gradient-reduction dtype ------------------------------------------------------------

@pytest.mark.parametrize("framework, override, dtype", [
    (None, None, "fp32"),  # opgraph's generic model: the FP32 gradient buffer
    ("torchtitan", None, "fp32"),  # mixed_precision_reduce = "float32"
    ("megatron", None, "fp32"),  # bf16 sets accumulate_allreduce_grads_in_fp32
    ("nanotron", None, "fp32"),  # accumulate_grad_in_fp32
    ("deepspeed", None, "bf16"),  # communication_data_type: the training dtype
    ("deepspeed", "fp32", "fp32"),  # the override wins
    ("megatron", "bf16", "bf16"),  # --grad-reduce-in-bf16
    (None, "fp16", "fp16"),
])
@pytest.mark.parametrize("zero", [0, 1])
def test_gradient_messages_are_the_parameters_times_the_reduce_dtype(framework, override,
                                                                     dtype, zero):
    """Every weight's gradient crosses once per step in the framework's reduce dtype: the
    messages sum to Psi x bytes(dtype), an all-reduce under ZeRO-0, a reduce-scatter under
    ZeRO-1 (Megatron's distributed optimizer), but for nanotron, whose ZeRO-1 all-reduces the
    whole gradient (`sync_gradients_across_dp(..., reduce_scatter=False)`)."""
    step = replicate(compile_step(preset("llama3.2-1b")),
                     Parallel(dp=8, zero=zero, framework=framework, grad_reduce_dtype=override))
    reduced = [op for op in step.ops()
               if op.param("group") == "dp" and op.kind in ("all_reduce", "reduce_scatter")]
    whole = zero == 0 or framework == "nanotron"
    assert {op.kind for op in reduced} == {"all_reduce" if whole else "reduce_scatter"}
    subs = resolve(step)
    sent = sum(float((message_bytes(step, op) * op.count).xreplace(subs)) for op in reduced)
    psi = float(preset("llama3.2-1b").parameters().xreplace(subs))
    assert sent == pytest.approx(BYTES[dtype] * psi)
    # the reduced gradient stays in its buffer's dtype (FP32): only the message is cast
    assert {step.tensor(op.outputs[0]).dtype.name for op in reduced} == {"fp32"}


# --- FSDP2 (torchtitan) and DeepSpeed ZeRO-3 with recomputation --------------------------------

@pytest.mark.parametrize("framework, policy, per_weight", [
    ("torchtitan", "none", 2),  # reshard after forward: forward + backward
    ("torchtitan", "full", 2),  # the recomputation reads the backward's unshard
    ("torchtitan", "selective-op", 2),
    ("deepspeed", "none", 2),
    ("deepspeed", "full", 3),  # its pre-forward hook fetches again in the re-run
    (None, "full", 3),  # the generic model, as before
])
def test_fsdp_all_gathers_per_weight(framework, policy, per_weight):
    step = compile_parallel(preset("llama3.2-1b"),
                            Parallel(dp=8, zero=3, framework=framework), recompute=policy)
    gathers = Counter(op.inputs[0] for op in step.ops()
                      if op.kind == "all_gather" and op.param("group") == "dp")
    layer = [w.name for w in step.weights() if w.region is not None]
    assert {gathers[w] for w in layer} == {per_weight}


def test_fsdp2_gathers_before_the_recomputation_and_the_backward_reads_the_same_copy():
    """FSDP2's pre-backward unshard comes before the layer's recomputation; every re-run op
    and backward kernel reading a weight reads that one gathered copy, as FSDP2 copies it out
    of the gathered buffer once (`Traits.copies_out_gathers`)."""
    step = compile_parallel(preset("llama3.2-1b"), Parallel(dp=8, zero=3, framework="torchtitan"),
                            recompute="full")
    order = [op.name for op in step.ops()]
    w = "layers.q_proj.weight"
    (gather,) = [op for op in step.ops() if op.kind == "all_gather" and op.inputs[0] == w
                 and op.phase is not Phase.FORWARD]
    (copy,) = step.consumers(gather.outputs[0])
    assert copy.kind == "reshape" and copy.param("copy")
    readers = [op for op in step.consumers(copy.outputs[0])]
    assert {op.phase for op in readers} == {Phase.RECOMPUTE, Phase.BACKWARD}
    assert order.index(gather.name) < min(order.index(op.name) for op in readers)
    assert order.index(gather.name) < order.index("layers.q_proj.re")


def test_fsdp2_recomputation_moves_a_third_less_than_deepspeed():
    """Per step, ZeRO-3's weight gathers with full recomputation: 2 Psi (FSDP2) against 3 Psi
    (DeepSpeed ZeRO-3), in BF16, the layers' weights."""
    sent = {}
    for framework in ("torchtitan", "deepspeed"):
        step = compile_parallel(preset("llama3.2-1b"), Parallel(dp=8, zero=3,
                                                                 framework=framework),
                                recompute="full")
        subs = resolve(step)
        sent[framework] = sum(float((message_bytes(step, op) * op.count).xreplace(subs))
                              for op in step.ops()
                              if op.kind == "all_gather" and op.region is not None)
    assert sent["torchtitan"] == pytest.approx(sent["deepspeed"] * 2 / 3)


def test_torchtitan_fsdp_over_pipeline_stages_gathers_once_a_step():
    """torchtitan with pipeline parallelism: reshard_after_forward off and the pipeline stage's
    gradient sync on the last backward only, so a stage gathers each weight once a step and
    reduce-scatters each gradient once: ZeRO-1's collectives and memory; without a pipeline,
    FSDP's per-micro-batch gathers (ZeRO-3)."""
    f = preset("llama3.2-1b")
    fsdp = Parallel(pp=2, dp=4, zero=3, global_batch=16, framework="torchtitan")
    as_zero1 = attrs.evolve(fsdp, zero=1)
    steps = [compile_parallel(f, layout) for layout in (fsdp, as_zero1)]
    assert [op.name for op in steps[0].ops()] == [op.name for op in steps[1].ops()]
    gathers = Counter(op.inputs[0].split(".")[0] for op in steps[0].ops()
                      if op.kind == "all_gather" and op.param("group") == "dp")
    assert gathers and all(op.phase is Phase.OPTIMIZER for op in steps[0].ops()
                           if op.kind == "all_gather" and op.param("group") == "dp")
    a, b = (profile_parallel(f, H100, layout).parallel for layout in (fsdp, as_zero1))
    assert a.step_time_s == b.step_time_s and a.memory == b.memory
    alone = compile_parallel(f, attrs.evolve(fsdp, pp=1, global_batch=8))
    assert any(op.kind == "all_gather" and op.phase is Phase.FORWARD for op in alone.ops())


# --- Megatron-LM: the sequence-parallel input saved as its shard ---------------------------------

def _saved_per_token_per_layer(framework):
    step = compile_parallel(preset("llama3-70b"), Parallel(tp=8, sequence_parallel=True,
                                                           framework=framework))
    layer = [t for t in saved(step) if t.region == "layers"]
    return sympy.simplify(sympy.Add(*(t.nbytes for t in layer)) / (B * S)), step


@pytest.mark.parametrize("framework", ["megatron", "nanotron"])  # nanotron: tp_recompute_allgather
def test_the_sharded_input_of_column_parallel_matmuls_is_saved(framework):
    """Korthikanti et al. 2022, section 4.2.2: with sequence parallelism every activation the
    layer saves outside the tensor-parallel regions is S/t of the sequence, the column matmuls'
    inputs included (all-gathered again in the backward): the layer's 34 sbh / t of their GPT
    layer becomes, for a Llama layer with FlashAttention in BF16, per token,
    2 (4 D + 3 F + 2 H d_h + 2 H_kv d_h) / t bytes: the two norms' inputs (the residuals) and
    outputs, the SwiGLU's gate, up and product, Q and the attention output, K and V."""
    megatron, step = _saved_per_token_per_layer(framework)
    assert sympy.simplify(megatron - 2 * (4 * D + 3 * F + 2 * H * d_h + 2 * H_kv * d_h) / tp) == 0
    # the generic model keeps the two gathered norm outputs, S x D each: 2 D (2 - 2 / t) more
    generic, _ = _saved_per_token_per_layer(None)
    # torchtitan's DTensor keeps the gathered inputs too, and its attention keeps the keys and
    # values it copied to every query head (`repeat_kv`): H in place of H_kv, each 2 d_h bytes
    torchtitan, _ = _saved_per_token_per_layer("torchtitan")
    assert sympy.simplify(torchtitan - generic - 2 * 2 * (H - H_kv) * d_h / tp) == 0
    assert sympy.simplify(generic - megatron - 2 * 2 * D * (1 - 1 / tp)) == 0
    # Llama 3 70B at TP 8: about 4.2 D bytes per token per layer against 7.7 D
    subs = resolve(step)
    assert float((megatron / D).xreplace(subs)) == pytest.approx(4.1875)
    assert float((generic / D).xreplace(subs)) == pytest.approx(7.6875)
    # and the gathers run again in the backward: one per column-parallel input per layer
    again = [op for op in step.ops() if op.phase is Phase.RECOMPUTE and op.kind == "all_gather"]
    assert sorted(op.forward for op in again) == ["layers.attn_norm.all_gather.tp",
                                                  "layers.mlp_norm.all_gather.tp"]


def test_megatron_sequence_parallel_memory_per_gpu_falls_by_the_gathered_inputs():
    """The profiled activations fall by 2 x 2 D (1 - 1/t) bytes per token per layer, less
    the saved BF16 logits Megatron's padded vocabulary adds (128,256 -> 129,024 at TP 8)."""
    f = preset("llama3-70b")
    memory = {fw: profile_parallel(f, H100, Parallel(tp=8, sequence_parallel=True,
                                                     framework=fw)).parallel.memory
              for fw in (None, "megatron")}
    tokens, layers, d, t = 8192, 80, 8192, 8
    padding = tokens * 2 * (129_024 - 128_256) // t
    assert memory[None].activations - memory["megatron"].activations == pytest.approx(
        tokens * layers * 2 * 2 * d * (1 - 1 / t) - padding, rel=1e-9)


def test_full_recomputation_already_regathers():
    """Under full recomputation the gathers are re-run anyway: Megatron's rule adds nothing."""
    f = preset("llama3.2-1b")
    steps = [compile_parallel(f, Parallel(tp=8, sequence_parallel=True, framework=fw),
                              recompute="full") for fw in (None, "megatron")]
    assert [op.name for op in steps[0].ops()] == [op.name for op in steps[1].ops()]


# --- DeepSpeed: the pipeline engine reduces after the flush ------------------------------------

def test_deepspeed_pipeline_reduces_gradients_after_the_flush(monkeypatch):
    """DeepSpeed's TrainSchedule issues ReduceGrads after the last backward: the same step as
    a layout whose reduction waits for the backward (in FP32, to compare like with like; its
    blocking transfers, tested below, left out)."""
    from opgraph.parallel import frameworks

    monkeypatch.setattr(frameworks, "FRAMEWORKS", _without("deepspeed", blocking_p2p=False))
    f = preset("llama3.2-1b")
    base = Parallel(pp=2, dp=4, global_batch=16)
    deepspeed = profile_parallel(f, H100, attrs.evolve(base, framework="deepspeed",
                                                       grad_reduce_dtype="fp32")).parallel
    waits = profile_parallel(f, H100, attrs.evolve(base, overlap_grad_reduce=False)).parallel
    overlaps = profile_parallel(f, H100, base).parallel
    assert deepspeed.step_time_s == pytest.approx(waits.step_time_s, rel=1e-12)
    assert deepspeed.step_time_s > overlaps.step_time_s


def test_deepspeed_pipeline_transfers_block_the_compute_stream():
    """DeepSpeed's pipeline engine sends and receives with blocking torch.distributed calls
    (deepspeed/runtime/pipe/p2p.py): every stage receives what its neighbour sends, and each
    transfer, sent or received, is waited out whole on the compute stream. On two stages of
    m micro-batches, the first sends m activations and receives m gradients, the last the
    reverse; the generic model's m sends run beside the compute."""
    from opgraph.passes.split_stages import split_stages

    f = preset("llama3.2-1b")
    m = 4
    base = Parallel(pp=2, dp=1, micro_batch=1, global_batch=m)
    runs = {fw: profile_parallel(f, H100, attrs.evolve(base, framework=fw)).parallel
            for fw in ("deepspeed", None)}
    step = compile_parallel(f, attrs.evolve(base, framework="deepspeed"))
    layout = attrs.evolve(base, framework="deepspeed")
    for stage, names in ((0, {"pp.send_forward", "pp.recv_backward"}),
                         (1, {"pp.recv_forward", "pp.send_backward"})):
        ops = [op for op in split_stages(step, layout, stage).ops() if op.kind == "send_recv"]
        assert {op.name for op in ops} == names
        assert all(op.param("blocking") for op in ops)
    ds = [t for t in runs["deepspeed"].communication if t.group == "pp"]
    generic = [t for t in runs[None].communication if t.group == "pp"]
    assert sum(t.count for t in ds) == 2 * m and sum(t.count for t in generic) == m
    for t in ds:
        assert t.exposed_s + t.queued_s == pytest.approx(t.time_s, rel=1e-9)
    assert sum(t.exposed_s for t in generic) == 0
    assert runs["deepspeed"].step_time_s > runs[None].step_time_s


@pytest.mark.parametrize("framework, adds", [("deepspeed-bf16", True), ("deepspeed", False)])
def test_deepspeeds_bf16_optimizer_adds_each_micro_batchs_gradients_into_fp32(framework, adds):
    """DeepSpeed's BF16_Optimizer adds every BF16 gradient into its FP32 copy after each
    micro-batch's backward (bf16_optimizer.py, update_hp_grads); its FP16 path accumulates in
    FP16: an add a weight on the one, none on the other."""
    f = preset("llama3.2-1b")
    step = compile_parallel(f, Parallel(pp=2, dp=2, global_batch=8, framework=framework))
    adds_ = [op for op in step.ops() if op.name.startswith("accumulate.")]
    assert len(adds_) == (len(f.weights()) if adds else 0)


def test_deepspeed_partitions_pipeline_transfers_over_tensor_parallelism():
    """DeepSpeed's pipeline engine sends each tensor-parallel rank's 1/tp of an activation or
    gradient (its `pipe_partitioned` / `grad_partitioned` defaults) and the receiving stage
    all-gathers them over its tensor-parallel group before use."""
    from opgraph.passes.split_stages import split_stages

    f = preset("llama3.2-1b")
    layout = Parallel(tp=2, pp=2, dp=1, micro_batch=1, global_batch=4, framework="deepspeed")
    step = compile_parallel(f, layout)
    first, second = (split_stages(step, layout, i) for i in (0, 1))
    send = first.op("pp.send_forward")
    recv, gather = second.op("pp.recv_forward"), second.op("pp.recv_forward.gather")
    subs = resolve(first)
    sliced = first.producer(send.inputs[0])  # the view the send reads
    full = first.tensor(sliced.inputs[0]).nbytes
    assert float(message_bytes(first, send).xreplace(subs)) == pytest.approx(
        float(full.xreplace(subs)) / 2)
    assert float(message_bytes(second, recv).xreplace(resolve(second))) == pytest.approx(
        float(full.xreplace(subs)) / 2)
    assert (gather.kind, gather.param("group")) == ("all_gather", "tp")
    assert float(message_bytes(second, gather).xreplace(resolve(second))) == pytest.approx(
        float(full.xreplace(subs)))  # the gathered activation
    # with sequence parallelism the activation is sharded already: no slice, no gather
    sp = attrs.evolve(layout, sequence_parallel=True)
    ops = {op.name for op in split_stages(compile_parallel(f, sp), sp, 1).ops()}
    assert "pp.recv_forward" in ops and "pp.recv_forward.gather" not in ops


@pytest.mark.parametrize("fields, words", [
    ({"zero": 2}, "ZeRO 0 or 1 only"),
    ({"virtual_stages": 2, "global_batch": 8}, "no interleaving"),
])
def test_deepspeed_pipelines_run_what_its_engine_runs(fields, words):
    """DeepSpeed's pipeline engine refuses ZeRO-2 and -3 (deepspeed/runtime/pipe/engine.py)
    and runs one chunk of layers a stage (TrainSchedule: no interleaving); a layout and the
    planner's space both keep to that."""
    from opgraph.parallel import cluster as clusters

    with pytest.raises(OpgraphError, match=words):
        Parallel(pp=2, dp=2, framework="deepspeed", **fields)
    found = rows(preset("llama3.2-1b"), H100, Space(gpus=8, batch=32, pp=2,
                                                    framework="deepspeed"), 2048,
                 clusters.for_hardware(H100))
    assert found and {r.virtual_stages for r in found} == {1}
    assert max(r.zero for r in found) <= 1


@pytest.mark.parametrize("zero, overlapped", [(0, False), (1, False), (2, False), (3, True)])
def test_deepspeed_overlaps_the_reduction_at_zero_3_only(zero, overlapped):
    """DeepSpeed's overlap_comm defaults to True at ZeRO stage 3 only: below it the step is a
    layout's whose reduction waits for the backward; at 3, one that overlaps it."""
    f = preset("llama3.2-1b")
    base = Parallel(dp=8, zero=zero, global_batch=16)
    deepspeed = profile_parallel(f, H100, attrs.evolve(base, framework="deepspeed",
                                                       grad_reduce_dtype="fp32")).parallel
    generic = profile_parallel(f, H100, attrs.evolve(base, overlap_grad_reduce=overlapped))
    assert deepspeed.step_time_s == pytest.approx(generic.parallel.step_time_s, rel=1e-12)


def test_async_tp_runs_the_input_gradients_reduction_inside_the_matmul():
    """Under async TP the reduction is a kernel of the matmul's own (compiled micro-pipelining),
    so it is not held back to its reader; nor where the framework issues it before the weight
    gradient, nor without tensor parallelism."""
    from opgraph.parallel.frameworks import deferred_groups

    def tp_deferred(**fields):
        return "tp" in deferred_groups(Parallel(dp=1, global_batch=2, **fields))

    assert tp_deferred(tp=2, gpus=2, sequence_parallel=True, framework="torchtitan")
    assert not tp_deferred(tp=2, gpus=2, sequence_parallel=True, async_tp=True,
                           framework="torchtitan")
    assert tp_deferred(tp=2, gpus=2, framework="deepspeed")
    assert not tp_deferred(tp=2, gpus=2, framework="megatron")
    assert not tp_deferred(tp=1, gpus=1, framework="deepspeed")


@pytest.mark.parametrize("cost", ["roofline", "calibrated"])
@pytest.mark.parametrize("framework, sp, collective", [
    ("deepspeed", False, "all_reduce"),  # Megatron-DeepSpeed's copy_to_..._region backward
    ("torchtitan", True, "reduce_scatter"),  # DTensor's Redistribute backward, Shard(1) input
])
def test_a_tp_input_gradient_reduced_after_the_weight_gradient_is_exposed(
        cost, framework, sp, collective, monkeypatch):
    """Megatron-DeepSpeed's ColumnParallelLinear all-reduces its input's gradient in the
    backward of `copy_to_tensor_model_parallel_region`, and DTensor's ColwiseParallel reduces
    it in the backward of the input's redistribution, each after autograd's linear backward
    has computed the weight gradient too: each backward tensor-parallel collective is waited
    out whole (exposed = its time). With the trait off (the generic model: the collective
    issued as the input gradient is written) the same collectives run under the
    weight-gradient GEMMs, at least in part, and the step is shorter; nothing else moves: the
    forward's collectives, and every collective's own time, are the same."""
    from opgraph.parallel import frameworks

    f = preset("llama3.2-1b")
    layout = Parallel(tp=2, dp=1, gpus=2, global_batch=2, sequence_parallel=sp,
                      framework=framework)
    on = profile_parallel(f, H100, layout, cost=cost_model(cost)).parallel
    monkeypatch.setattr(frameworks, "FRAMEWORKS", _without(framework, syncs_tp_grads=False))
    off = profile_parallel(f, H100, layout, cost=cost_model(cost)).parallel
    synced, overlapped = ({t.name: t for t in run.communication if t.group == "tp"}
                          for run in (on, off))
    assert synced.keys() == overlapped.keys()
    backward = [name for name in synced if name.endswith(".grad")]
    assert backward and collective in {synced[n].collective for n in backward}
    for name, t in synced.items():
        assert t.time_s == pytest.approx(overlapped[name].time_s, rel=1e-12)
        if name in backward:
            assert t.exposed_s + t.queued_s == pytest.approx(t.time_s, rel=1e-9)
        else:
            assert t.exposed_s == pytest.approx(overlapped[name].exposed_s, rel=1e-9, abs=1e-15)
    assert sum(overlapped[n].exposed_s for n in backward) < sum(synced[n].exposed_s
                                                               for n in backward)
    assert off.step_time_s < on.step_time_s


# --- nanotron: FP32 accumulation apart, ZeRO-1 all-reduced after the backward ------------------

def _without(framework: str, **traits):
    """`framework`'s row of the table with `traits` changed, for one comparison."""
    from opgraph.parallel import frameworks

    return {**frameworks.FRAMEWORKS, framework: attrs.evolve(frameworks.FRAMEWORKS[framework],
                                                             **traits)}


def test_nanotron_adds_each_micro_batchs_gradients_into_fp32(monkeypatch):
    """nanotron's FP32GradientAccumulator adds every BF16 gradient into its FP32 buffer after
    each micro-batch's backward: 2 + 4 bytes read and 4 written a parameter, 10 x Psi bytes a
    micro-batch, and on the roofline the step grows by m x 10 Psi / the HBM bandwidth."""
    from opgraph.parallel import frameworks

    f = preset("llama3.2-1b")
    layout = Parallel(micro_batch=1, global_batch=4, framework="nanotron")  # 4 micro-batches
    step = compile_parallel(f, layout)
    adds = [op for op in step.ops() if op.name.startswith("accumulate.")]
    assert len(adds) == len(f.weights())
    subs = resolve(step)
    costs = cost_model("roofline").op_costs(step)
    psi = float(f.parameters().xreplace(subs))
    moved = sum(float((costs[op.name].bytes * op.count).xreplace(subs)) for op in adds)
    assert moved == pytest.approx((2 + 4 + 4) * psi)
    with_adds = profile_parallel(f, H100, layout).parallel.step_time_s
    monkeypatch.setattr(frameworks, "FRAMEWORKS", _without("nanotron", adds_grads_in_fp32=False))
    without = profile_parallel(f, H100, layout).parallel.step_time_s
    assert with_adds - without == pytest.approx(4 * 10 * psi / H100.bandwidth, rel=1e-9)


@pytest.mark.parametrize("zero", [0, 1])
def test_nanotron_zero_1_all_reduces_the_gradients_after_the_backward(zero, monkeypatch):
    """Without ZeRO nanotron's DDP hook all-reduces the FP32 buffers under the last backward,
    as the generic model does; with ZeRO-1 it builds no DDP and all-reduces them whole after the
    backward (`sync_gradients_across_dp(..., reduce_scatter=False)`): the step of a generic
    layout whose reduction waits for the backward, with all-reduces of 2 (dp - 1) / dp x the
    FP32 gradients on the wire where a reduce-scatter sends half that."""
    from opgraph.parallel import frameworks

    f = preset("llama3.2-1b")
    layout = Parallel(dp=8, zero=zero, global_batch=16, framework="nanotron")
    monkeypatch.setattr(frameworks, "FRAMEWORKS", _without("nanotron", adds_grads_in_fp32=False))
    mine = profile_parallel(f, H100, layout).parallel
    reduced = [t for t in mine.communication if t.group == "dp" and t.collective != "all_gather"]
    assert {t.collective for t in reduced} == {"all_reduce"}
    monkeypatch.setattr(frameworks, "FRAMEWORKS", _without(
        "nanotron", overlaps_reduce_at=frozenset({0, 1, 2, 3}), zero1_all_reduces=False))
    overlapped = profile_parallel(f, H100, layout).parallel
    waits = profile_parallel(f, H100, attrs.evolve(layout, overlap_grad_reduce=False)).parallel
    if zero == 0:
        assert mine.step_time_s == pytest.approx(overlapped.step_time_s, rel=1e-12)
    else:
        assert mine.step_time_s > waits.step_time_s > overlapped.step_time_s
        scattered = sum(t.time_s for t in waits.communication
                        if t.group == "dp" and t.collective == "reduce_scatter")
        assert sum(t.time_s for t in reduced) > 1.9 * scattered


def test_deepspeed_refuses_zero_2_and_3_with_pipelines():
    with pytest.raises(OpgraphError, match="ZeRO 0 or 1"):
        Parallel(pp=2, zero=2, framework="deepspeed")
    Parallel(pp=1, zero=3, framework="deepspeed")


@pytest.mark.parametrize("layout, bucketed", [
    (Parallel(tp=2, dp=8, zero=1, framework="megatron"), True),
    (Parallel(tp=2, dp=64, zero=1, framework="megatron"), True),  # a 64 M-parameter bucket
    (Parallel(tp=2, dp=8, zero=1, framework="megatron", overlap_grad_reduce=False), False),
    (Parallel(tp=2, dp=8, zero=0, framework="torchtitan"), False),  # DDP: a call per weight
    (Parallel(tp=2, dp=8, zero=0), False),
])
def test_megatron_reduces_gradients_in_buckets(layout, bucketed):
    """Megatron-LM with --overlap-grad-reduce reduces gradients, and gathers its updated weights,
    in buckets of max(40 M, 1 M x dp) parameters, one NCCL call each
    (megatron/core/distributed/distributed_data_parallel.py): each weight pays its share of a
    call, min(1, its parameters / the bucket's), a weight larger than a bucket a whole one.
    Without the overlap, or under another framework without FSDP, each weight is a call of its
    own."""
    step = compile_parallel(preset("llama3-8b"), layout)
    subs = resolve(step, {})
    costs = cost_model("calibrated").op_costs(step)
    dp_ops = [op for op in step.ops()
              if op.kind in ("reduce_scatter", "all_reduce", "all_gather")
              and op.param("group") == "dp"]
    assert len(dp_ops) >= 9  # a reduction per weight (and ZeRO-1's gathers)
    bucket = max(40e6, 1e6 * layout.dp)
    for op in dp_ops:
        # a weight's parameters on this TP rank: a reduction reads its whole gradient, a gather
        # its 1/dp shard of the updated weight
        numel = float(step.tensor(op.inputs[0]).numel.xreplace(subs)) * (
            layout.dp if op.kind == "all_gather" else 1)
        share = min(1.0, numel / bucket) if bucketed else 1.0
        assert float(costs[op.name].calls.xreplace(subs)) == pytest.approx(share, rel=1e-12)
    if bucketed:  # the embedding and the head (262 M parameters a TP rank) are calls of their own
        whole = [op for op in dp_ops
                 if float(costs[op.name].calls.xreplace(subs)) == 1.0]
        assert {step.tensor(op.inputs[0]).numel.xreplace(subs)
                * (layout.dp if op.kind == "all_gather" else 1) for op in whole} == {
            128256 * 4096 // 2}


# --- the command line, and `plan` agreeing with `profile` --------------------------------------

def test_profile_takes_the_framework_flags(cli):
    code, out, _ = cli("profile", "--model", "llama3.2-1b", "--dp", "8", "--zero", "3",
                       "--framework", "torchtitan", "--grad-reduce-dtype", "bf16", "--json")
    assert code == 0
    p = json.loads(out)["parallel"]
    assert (p["framework"], p["grad_reduce_dtype"]) == ("torchtitan", "bf16")
    code, _, err = cli("profile", "--framework", "chainer", "--dp", "8")
    assert code == 2 and "chainer" in err


@pytest.mark.parametrize("framework, constraints", [
    ("torchtitan", {"zero": 3, "pp": 1, "recompute": ("full",)}),
    ("torchtitan", {"zero": 3, "pp": 2, "recompute": ("none",)}),  # gathered once a step
    ("megatron", {"tp": 8, "sequence_parallel": True, "zero": 1, "recompute": ("none",)}),
    ("deepspeed", {"pp": 2, "tp": 4, "zero": 1, "recompute": ("selective",)}),
    ("deepspeed-0.3", {"pp": 1, "zero": 3, "recompute": ("full",)}),  # a copy per rank
    ("nanotron", {"pp": 1, "zero": 0, "recompute": ("none",)}),  # DDP's buckets
    ("nanotron", {"pp": 2, "zero": 1, "recompute": ("none",)}),  # the packed gather's buffers
])
def test_plan_figures_are_profiles_for_each_framework(framework, constraints):
    forward, cost = preset("llama3.2-1b"), cost_model("calibrated")
    searcher = Searcher(forward, H100, seq_len=4096, cost=cost)
    space = Space(gpus=16, batch=64, framework=framework, precision=("bf16",), micro_batch=1,
                  **constraints)
    found = rows(forward, H100, space, 4096, searcher.cluster)
    assert found
    for row in found[:2]:
        candidate = row.candidate()
        assert candidate.layout.framework == framework
        mine = searcher.one(candidate).result
        theirs = profile_parallel(forward, H100, candidate.layout, values={"S": 4096},
                                  cost=cost, recompute=candidate.recompute,
                                  precision=candidate.precision).parallel
        for name in ("step_time_s", "mfu", "bubble_s", "exposed_communication_s"):
            assert getattr(mine, name) == pytest.approx(getattr(theirs, name), rel=1e-9,
                                                        abs=1e-12), (name, candidate)
        assert mine.memory == theirs.memory


# --- padded vocabularies (`Traits.vocab_multiple`) -------------------------------------------

@pytest.mark.parametrize("framework, degree, per_rank", [
    ("megatron", 4, 12_672),   # ceil(50,257 / (128 x 4)) x 128: 50,688 over 4
    ("megatron", 2, 25_216),   # ceil(50,257 / 256) x 128: 50,432 over 2
    ("nanotron", 4, 12_565),   # ceil(50,257 / 4): 50,260 over 4
])
def test_a_framework_pads_the_vocabulary_to_split_it(framework, degree, per_rank):
    """GPT-2's 50,257 tokens divide by no TP degree: Megatron-LM pads the vocabulary to a
    multiple of 128 x TP, nanotron to a multiple of TP (`_vocab_size_with_padding` in each),
    and each rank holds its share of the padded rows."""
    g = compile_parallel(preset("gpt2"), Parallel(tp=degree, framework=framework))
    subs = resolve(g, {B: 1, S: 1024})
    table = g.tensor("wte.weight") if g.has_tensor("wte.weight") else next(
        w for w in g.weights() if w.shape and sympy.sympify(w.shape[0]).has(sympy.ceiling))
    assert sympy.Mul(*table.shape).xreplace(subs) == per_rank * 768


def test_an_unpadded_vocabulary_must_divide():
    with pytest.raises(OpgraphError, match="V = 50257 is not divisible by --tp 4.*pads it"):
        compile_parallel(preset("gpt2"), Parallel(tp=4))


def _plans_as_it_profiles(forward, space: Space, seq: int, first: int) -> None:
    """The first `first` rows the search lists for `space` carry `profile`'s step time and
    memory (the calibrated model)."""
    cost = cost_model("calibrated")
    searcher = Searcher(forward, H100, seq_len=seq, cost=cost)
    found = rows(forward, H100, space, seq, searcher.cluster)
    assert found
    for row in found[:first]:
        candidate = row.candidate()
        mine = searcher.one(candidate).result
        theirs = profile_parallel(forward, H100, candidate.layout, values={"S": seq},
                                  cost=cost, recompute=candidate.recompute,
                                  precision=candidate.precision).parallel
        assert mine.step_time_s == pytest.approx(theirs.step_time_s, rel=1e-9)
        assert mine.memory.total == theirs.memory.total


def test_a_padded_vocabulary_plans_as_it_profiles():
    _plans_as_it_profiles(preset("gpt2"), Space(gpus=8, batch=16, framework="megatron", tp=4,
                                                precision=("bf16",), recompute=("none",)),
                          1024, 6)


# --- FP8 weights cast once a step (`Traits.caches_fp8_weights`) --------------------------------

def test_megatron_casts_each_weight_to_fp8_once_a_step():
    """Transformer Engine (Megatron-LM) casts a weight to FP8 on the step's first micro-batch
    and reuses the copy: the copies are resident with the weights, one a weight, where torchao
    (the generic model here) keeps one per micro-batch in flight until its backward; and the
    weights' amax and cast run once a step. llama3.2-1b on 2 stages of 8 layers, 8
    micro-batches: each layer's FP8 matmuls read 2 D H d_h + 2 D H_kv d_h + 3 D F weights."""
    forward = preset("llama3.2-1b")

    def run(framework):
        layout = Parallel(pp=2, dp=1, micro_batch=1, global_batch=8, framework=framework)
        return profile_parallel(forward, H100, layout, values={"S": 4096},
                                precision="fp8")

    generic, megatron = run(None).parallel, run("megatron").parallel
    d, h, kv, head, ffn = 2048, 32, 8, 64, 8192
    layer = 2 * d * h * head + 2 * d * kv * head + 3 * d * ffn  # one byte each in FP8
    # resident: 8 layers' copies, and each cast's FP32 amax (7 a layer)
    assert generic.memory_stage == megatron.memory_stage == 0
    assert megatron.memory.weights - generic.memory.weights == 8 * (layer + 7 * 4)
    # kept per micro-batch in flight (2 on stage 0): the waiting one keeps every layer's; at
    # the peak, the SwiGLU's backward, the layer being run backward has used its down
    # projection's copy (D F) already
    assert generic.in_flight == 2
    assert generic.memory.activations - megatron.memory.activations == 8 * layer + (
        8 * layer - d * ffn)
    counts = {r.name: r.count for r in run("megatron").ops}
    assert counts["fp8.layers.q_proj.weight.cast"] == 8  # once a step for each of 8 layers
    assert {r.name: r.count for r in run(None).ops}["fp8.layers.q_proj.weight.cast"] == 64
    # the search plans them as profile runs them
    _plans_as_it_profiles(forward, Space(gpus=8, batch=8, framework="megatron", pp=2,
                                         precision=("fp8",), recompute=("none",),
                                         micro_batch=1), 4096, 4)


# --- eager PyTorch's kernels (`Traits.eager`, `passes.decompose`) -------------------------------

def _norm_bytes(framework, fuse=None):
    """The forward attn_norm's bytes, and its backward's, on Llama 3 8B at B=1, S=4096, DP 8."""
    from opgraph.core.pipeline import fusion_passes

    g = compile_parallel(preset("llama3-8b"), Parallel(dp=8, zero=3, framework=framework),
                         extra_passes=fusion_passes(fuse))
    cost, values = cost_model("roofline"), {B: 1, S: 4096}
    subs = resolve(g, values)
    norm = g.op("layers.attn_norm")
    backward = next(o for o in g.ops() if o.phase is Phase.BACKWARD and o.forward == norm.name)
    weight = g.tensor(norm.inputs[1]).nbytes.xreplace(subs)
    return (cost.op_cost(g, norm).bytes.xreplace(subs),
            cost.op_cost(g, backward).bytes.xreplace(subs), weight)


def test_torchtitan_rmsnorm_costs_its_eager_kernels():
    # torchtitan's RMSNorm (torchtitan/models/norms.py): x.float() (2 read, 4 written per
    # element), .pow(2) (4 + 4), .mean(-1) (4), x * rsqrt(...) (4 + 4), .type_as(x) (4 + 2),
    # * weight (2 + 2): 36 bytes per element; each row's mean, + eps, rsqrt: 7 x 4 bytes
    n, rows = 4096 * 4096, 4096
    forward, backward, weight = _norm_bytes("torchtitan")
    assert forward == 36 * n + 7 * 4 * rows + weight
    assert backward == 2 * forward  # the plate's convention: twice its forward


@pytest.mark.parametrize("framework", [None, "megatron", "nanotron"])
def test_fused_norms_move_their_tensor_once(framework):
    # one kernel reads x and the weight and writes y: 2 + 2 bytes per element
    forward, _, weight = _norm_bytes(framework)
    assert forward == 4 * 4096 * 4096 + weight


def test_eager_kinds_per_framework():
    def marked(framework):
        g = compile_parallel(preset("llama3-8b"), Parallel(dp=2, framework=framework))
        return {op.kind for op in g.ops() if op.param("eager")}

    assert marked("torchtitan") == {"rmsnorm", "rope", "swiglu", "cross_entropy"}
    # TritonRMSNorm and flash-attn's rotary are fused; the loss runs on FP32 logits
    assert marked("nanotron") == {"swiglu", "cross_entropy"}
    assert marked("megatron") == marked(None) == set()


@pytest.mark.parametrize("tp_degree", [1, 4])
def test_an_eager_loss_holds_its_fp32_copies_of_the_logits_while_it_runs(tp_degree):
    """nanotron's loss runs on FP32 logits (`cast_to_fp32`, then `_ShardedCrossEntropy`): at
    its division, the BF16 logits, their FP32 copy and the max-shifted FP32 copy (the softmax
    kept for the backward) are live, 2 + 4 + 4 bytes per logit; its backward turns the softmax
    into the FP32 gradient before casting it. A fused loss (opgraph's generic model) writes
    neither FP32 tensor."""
    from opgraph.cost.memory import liveness

    def live_at(framework, name):
        layout = Parallel(tp=tp_degree, framework=framework)
        g = compile_parallel(preset("llama3.2-1b"), layout)
        live = liveness(g)
        at = {op.name: i for i, op in enumerate(live.ops)}
        subs = resolve(g, {B: 2, S: 4096})
        return live.moment(at[name]).transient.xreplace(subs), g

    logits = 2 * 4096 * 128256 // tp_degree  # B x S x V / TP, the vocabulary-parallel shard
    for name, extra in (("loss", (4 + 4) * logits), ("loss.grad", 4 * logits)):
        eager, g = live_at("nanotron", name)
        fused, _ = live_at(None, name)
        assert g.op("loss").param("eager")
        assert eager - fused == extra, name


@pytest.mark.parametrize("recompute, kept", [("none", 1), ("selective-op", 0)])
def test_an_eager_swiglu_keeps_its_silu_for_the_backward(recompute, kept):
    """nanotron's `act(gate) * up`: the product's autograd keeps silu(gate), B S F bytes x 2 a
    layer that a fused SwiGLU never writes, from the forward to the backward in every layer;
    where the SwiGLU is re-run (torchtitan's per-op checkpointing re-runs all but the matmuls
    and attention), the forward keeps nothing and the re-run's copy lives one layer at a time."""
    from opgraph.cost.memory import liveness

    def at_loss(framework):
        g = compile_parallel(preset("llama3.2-1b"), Parallel(framework=framework),
                             recompute=recompute)
        live = liveness(g)
        i = next(i for i, op in enumerate(live.ops) if op.name == "loss")
        return live.moment(i).activations.xreplace(resolve(g, {B: 1, S: 4096}))

    layers, ffn = 16, 8192
    assert at_loss("nanotron") - at_loss(None) == kept * layers * 4096 * ffn * 2


def test_torchtitans_eager_layer_keeps_its_fp32_copies():
    """torchtitan without torch.compile or checkpointing: each RMSNorm keeps the FP32 copy of
    its input (4 D bytes a token), RoPE the FP32 copies of Q and K (4 (H + H_kv) d_h), the
    SwiGLU its silu (2 F), and the attention its keys and values at every query head
    (`repeat_kv`: 2 x 2 (H - H_kv) d_h more); the final norm, outside the layers, once."""
    from opgraph.cost.memory import liveness

    def at_loss(framework):
        g = compile_parallel(preset("llama3.2-1b"), Parallel(framework=framework))
        live = liveness(g)
        i = next(i for i, op in enumerate(live.ops) if op.name == "loss")
        return live.moment(i).activations.xreplace(resolve(g, {B: 1, S: 4096}))

    layers, d, ffn, heads, kv, head_dim = 16, 2048, 8192, 32, 8, 64
    per_layer = 2 * 4 * d + 4 * (heads + kv) * head_dim + 2 * ffn + 2 * 2 * (heads - kv) * head_dim
    assert at_loss("torchtitan") - at_loss(None) == 4096 * (layers * per_layer + 4 * d)


def test_eager_swiglu_is_two_kernels():
    # silu(gate): reads and writes F per token; * up: reads both, writes one: 5 x 2 bytes
    # per element of the gate, against one kernel's 3 x 2
    g = compile_parallel(preset("llama3-8b"), Parallel(dp=2, framework="nanotron"))
    subs = resolve(g, {B: 1, S: 4096})
    cost = cost_model("roofline").op_cost(g, g.op("layers.swiglu")).bytes.xreplace(subs)
    assert cost == 5 * 2 * 4096 * 14336


def test_torchtitan_eager_is_slower_than_compiled_as_measured():
    # torchtitan's Llama 3.1 8B on 8 H100s: 5,762 tokens/s per GPU eager, 6,667 compiled
    # (benchmarks/llama3_h100_202412_torchtitan.md): eager 1.157 x slower. The eager
    # kernels' traffic explains more than half of that slowdown, and not more than all of it
    from opgraph.io.cases import load_cases
    from opgraph.io.cases import resolve as resolve_cases
    from opgraph.analysis.validate import predict

    cases = {c.id: c for c in load_cases(resolve_cases(None))}
    eager, compiled = (predict(cases[f"torchtitan_t1_fsdp{run}_8gpu"], cost_model("calibrated"))
                       .predicted_step_time_s for run in ("", "_compile"))
    measured = 6667 / 5762
    assert 1 + (measured - 1) / 2 < eager / compiled < measured


def test_eager_loss_moves_megatrons_vocab_parallel_kernels():
    # Megatron's _VocabParallelCrossEntropy, as nanotron runs it on FP32 logits: forward
    # .float() (2 + 4 per logit), max (4), - max in place (4 + 4), exp in place (4 + 4),
    # sum (4), / sum in place (4 + 4); backward: * dloss in place (4 + 4), then FP32 back to
    # BF16 (4 + 2). Logits of Llama 3 8B at B=1, S=4096: 4096 x 128256
    g = compile_parallel(preset("llama3-8b"), Parallel(dp=2, framework="nanotron"))
    subs = resolve(g, {B: 1, S: 4096})
    cost = cost_model("roofline")
    loss = next(op for op in g.ops() if op.kind == "cross_entropy" and op.phase is Phase.FORWARD)
    backward = [o for o in g.ops() if o.phase is Phase.BACKWARD and o.forward == loss.name]
    n, targets = 4096 * 128256, g.tensor(loss.inputs[1]).nbytes.xreplace(subs)
    assert cost.op_cost(g, loss).bytes.xreplace(subs) == (6 + 4 + 8 + 8 + 4 + 8) * n + targets
    assert sum(cost.op_cost(g, o).bytes.xreplace(subs) for o in backward) == (8 + 6) * n


def test_torchtitan_compiles_its_blocks_and_since_april_2025_its_loss():
    """apply_compile compiles each TransformerBlock and the final norm stays eager; torchtitan
    compiles its loss beside them since bbb1b616e (build_cross_entropy_loss), where December
    2024's (9dec370, the row torchtitan-2024) left it eager too. Eager, the loss holds two FP32
    copies of the logits while it runs (`rules.EAGER_WORKSPACE`: the upcast and the softmax),
    4 bytes each for the 8B's 128,256 logits of each of its 8,192 tokens; compiled, neither, so
    the step's peak, which the loss sets, is lower by more than one copy and at most both."""
    from opgraph.core.pipeline import fusion_passes
    from opgraph.parallel.distributed import prepare, step_figures

    peaks = {}
    for framework, eager in (("torchtitan", {"final_norm"}),
                             ("torchtitan-2024", {"final_norm", "loss"})):
        layout = Parallel(dp=8, zero=3, framework=framework, micro_batch=1, global_batch=8)
        g = compile_parallel(preset("llama3-8b"), layout, extra_passes=fusion_passes("elementwise"))
        assert {op.name for op in g.ops() if op.param("eager")} == eager, framework
        assert not [op for op in g.ops() if op.region is not None and op.param("eager")]
        job = prepare(preset("llama3-8b"), H100, layout, values={"S": 8192},
                      extra_passes=fusion_passes("elementwise"))
        peaks[framework] = step_figures(job, DEFAULT).memory.total
    copy = 128256 * 8192 * 4
    assert copy < peaks["torchtitan-2024"] - peaks["torchtitan"] <= 2 * copy


# --- nanotron's pipeline split (`Traits.balances_stages`) ----------------------------------------

def _nanotron_split(layers, layer, head, stages):
    """nanotron's build_model (src/nanotron/models/base.py), written out: blocks in order, each
    on the current stage, which moves on once the running cost passes (r + 1) / pp of the
    total; the costs are get_block_compute_costs' (src/nanotron/models/llama.py)."""
    total, out, rank, running = layers * layer + head, [0] * stages, 0, 0
    for cost in [layer] * layers + [head]:
        running += cost
        out[rank] += cost == layer
        if running > total * (rank + 1) / stages:
            rank += 1
    return out


def test_nanotron_splits_a_pipeline_by_its_blocks_costs():
    from opgraph.parallel.frameworks import end_split, own_split

    f = preset("llama3.2-1b")  # 16 layers, d 2048, 32 heads of 64, 8 KV heads, F 8192
    # get_block_compute_costs: 4 x num_attention_heads x d_qkv x hidden + 3 x d_ff x hidden
    # (k and v at the query heads' size, though this model has 8 KV heads); the head V x hidden
    layer = 4 * 32 * 64 * 2048 + 3 * 8192 * 2048
    head = 128256 * 2048
    assert _nanotron_split(16, layer, head, 2) == [10, 6]
    assert own_split(f, 2, "nanotron") == (10, 6) and end_split((10, 6)) == (10, 6)
    assert own_split(f, 2, "megatron") is None  # Megatron splits evenly unless told
    # on 4 stages the middle ones equal the first: only the last differs
    assert _nanotron_split(16, layer, head, 4) == [5, 5, 5, 1]
    assert own_split(f, 4, "nanotron") == (5, 5, 5, 1)
    assert end_split((5, 5, 5, 1)) == (None, 1)
    # on 8, unequal middle stages and the head alone on the last: only every stage's count
    # (`Parallel.stage_layers`) says that
    assert _nanotron_split(16, layer, head, 8) == [3, 2, 3, 2, 3, 2, 1, 0]
    assert own_split(f, 8, "nanotron") == (3, 2, 3, 2, 3, 2, 1, 0)
    assert end_split((3, 2, 3, 2, 3, 2, 1, 0)) is None


def test_nanotron_profiles_a_split_only_every_stages_count_says():
    """llama3.2-1b on 8 stages: nanotron's 3/2/3/2/3/2/1/0 (worked above), the last stage the
    head alone; `profile` runs it, each stage as many layers as the split gives it, and `plan`
    (first, middle and last stages) refuses that --pp in one line."""
    forward, cost = preset("llama3.2-1b"), cost_model("calibrated")
    layout = Parallel(pp=8, dp=1, micro_batch=1, global_batch=32, framework="nanotron")
    r = profile_parallel(forward, H100, layout, values={"S": 4096}, cost=cost).parallel
    assert r.layout.stage_layers == (3, 2, 3, 2, 3, 2, 1, 0)
    times = r.stage_times_s
    # the middle stages of 2 layers take one time, those of 3 another, 1.5 x the 2-layer one's
    # compute less their sends, which are the same
    assert times[1] == times[3] == times[5] and times[2] == times[4]
    assert times[2] > times[1] > times[6]
    job = prepare(forward, H100, r.layout, values={"S": 4096}, cost=cost)
    last = job.stages[job.kinds[7]]
    assert all(op.region is None for op in last.graph.ops())  # no layer: the head alone
    # its weights: the tied table the head reads (V x D) and the final norm's, in BF16
    assert last.memory.weights == 2 * (128256 * 2048 + 2048)
    searcher = Searcher(forward, H100, seq_len=4096, cost=cost)
    space = Space(gpus=8, batch=32, framework="nanotron", pp=8)
    with pytest.raises(OpgraphError, match="3/2/3/2/3/2/1/0, which plan's first, middle and last"):
        rows(forward, H100, space, 4096, searcher.cluster)
    # unconstrained, the search leaves pp 8 out (pp 2 and 4 split by their ends) and says so
    from opgraph.parallel.search import unsplit_degrees

    free = Space(gpus=8, batch=32, framework="nanotron")
    assert unsplit_degrees(forward, free) == {8: (3, 2, 3, 2, 3, 2, 1, 0)}
    assert {row.pp for row in rows(forward, H100, free, 4096, searcher.cluster)} == {1, 2, 4}


def test_plan_says_which_pipeline_degrees_it_left_out(cli):
    code, _out, err = cli("plan", "--model", "llama3.2-1b", "--gpus", "8", "--global-batch",
                          "32", "--framework", "nanotron", "--top", "1")
    assert code == 0 and "not searched: pp 8 (3/2/3/2/3/2/1/0)" in err
    code, _out, err = cli("plan", "--model", "llama3.2-1b", "--gpus", "8", "--global-batch",
                          "32", "--top", "1")
    assert code == 0 and "not searched" not in err


@pytest.mark.parametrize("stages, split", [(2, (10, 6)), (4, (None, 1))])  # as worked above
def test_nanotron_pipelines_profile_and_plan_with_its_split(stages, split):
    forward, cost = preset("llama3.2-1b"), cost_model("calibrated")
    layout = Parallel(pp=stages, dp=8 // stages, micro_batch=1, global_batch=32,
                      framework="nanotron")
    r = profile_parallel(forward, H100, layout, values={"S": 4096}, cost=cost).parallel
    assert (r.layout.first_stage_layers, r.layout.last_stage_layers) == split
    searcher = Searcher(forward, H100, seq_len=4096, cost=cost)
    space = Space(gpus=8, batch=32, framework="nanotron", pp=stages, precision=("bf16",),
                  micro_batch=1, recompute=("none",))
    found = rows(forward, H100, space, 4096, searcher.cluster)
    assert found and {(row.first_stage_layers, row.last_stage_layers) for row in found} == {split}
    for row in found:  # every layout listed, interleaved or not, profiles as the plan says
        candidate = row.candidate()
        mine = searcher.one(candidate).result
        theirs = profile_parallel(forward, H100, candidate.layout, values={"S": 4096},
                                  cost=cost, recompute=candidate.recompute,
                                  precision=candidate.precision)
        assert mine.step_time_s == pytest.approx(theirs.parallel.step_time_s, rel=1e-9)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_fsdp_gathers_and_reduces_one_call_per_module(zero):
    """torchtitan's FSDP (`fully_shard` on each TransformerBlock, then on the model) gathers a
    module's parameters in one all-gather and reduces their gradients in one reduce-scatter:
    each weight pays its share of its module's call, its parameters over the module's, so the
    shares of a layer's 9 weights, and of the root's embedding, final norm and head, add up to
    one call per collective. The generic model keeps a call per weight."""
    layout = Parallel(tp=2, dp=8, zero=zero, framework="torchtitan")
    step = compile_parallel(preset("llama3-8b"), layout)
    subs = resolve(step, {})
    costs = cost_model("calibrated").op_costs(step)
    calls: dict = {}
    for op in step.ops():
        if op.param("group") == "dp" and op.kind in ("reduce_scatter", "all_gather"):
            key = (op.kind, op.phase, op.region is None)
            calls.setdefault(key, []).append(float(costs[op.name].calls.xreplace(subs)))
    assert calls
    for key, shares in calls.items():
        assert len(shares) == (3 if key[2] else 9), key
        assert sum(shares) == pytest.approx(1.0, rel=1e-12), key
        assert all(0 < s < 1 for s in shares)
    generic = compile_parallel(preset("llama3-8b"), Parallel(tp=2, dp=8, zero=zero))
    gathers = [c for op, c in cost_model("calibrated").op_costs(generic).items()
               if generic.op(op).kind in ("reduce_scatter", "all_gather")]
    assert gathers and all(float(c.calls) == 1.0 for c in gathers)


def test_a_layouts_attention_library_overrides_its_frameworks():
    """The layout's `attention_library` names the kernels the job runs, else its framework's:
    Megatron-LM's cuDNN, FlashAttention-2 elsewhere; a name that is none is one line."""
    from opgraph import OpgraphError
    from opgraph.parallel.frameworks import attention_library

    assert attention_library(Parallel(framework="megatron")) == "cudnn"
    assert attention_library(Parallel(framework="torchtitan")) == "flash"
    assert attention_library(Parallel(framework="megatron", attention_library="triton")) == \
        "triton"
    with pytest.raises(OpgraphError, match="attention library 'xformers': choose one of flash, "
                                          "cudnn, triton, flash1"):
        Parallel(attention_library="xformers")


@pytest.mark.parametrize("flags, says", [
    (["--framework", "megatron"], "fused attention (cuDNN)"),
    (["--attention-library", "triton"], "fused attention (Triton FlashAttention)"),
    (["--framework", "megatron", "--attention-library", "flash"], "fused attention, "),
])
def test_the_report_names_the_attention_kernels(cli, flags, says):
    """A many-GPU profile's header names the attention kernels where they are not
    FlashAttention-2's: Megatron-LM's cuDNN, or a library the layout names."""
    code, out, _ = cli("profile", "--model", "llama3.2-1b", "--gpus", "8", *flags)
    assert code == 0 and says in out


def test_plan_says_the_attention_library_it_searched_with(cli):
    """`plan --attention-library` names the kernels in its first line, as profile's report
    does; without the flag the line is as before."""
    code, out, _ = cli("plan", "--model", "llama3.2-1b", "--gpus", "8", "--global-batch", "16",
                       "--attention-library", "triton", "--top", "1")
    assert code == 0 and out.splitlines()[0].endswith("; attention: Triton FlashAttention")
    code, out, _ = cli("plan", "--model", "llama3.2-1b", "--gpus", "8", "--global-batch", "16",
                       "--top", "1")
    assert code == 0 and out.splitlines()[0].endswith("cost model")


# --- DeepSpeed before v0.5.5: list-form ZeRO-3 collectives, a copy per rank ---------------------

@pytest.mark.parametrize("cost", ["roofline", "calibrated"])
def test_early_deepspeed_copies_each_ranks_piece_beside_every_zero3_collective(cost,
                                                                              monkeypatch):
    """DeepSpeed v0.3's ZeRO-3 gathers and reduce-scatters each weight through torch.distributed's
    list calls, whose NCCL process group copies each of the n ranks' pieces by a kernel of its
    own: every data-parallel all-gather and reduce-scatter takes n x launch_s longer than
    later DeepSpeed's (the generation's `launch_s`, the gap a kernel adds), and nothing else
    changes (its synchronize before each gather left out here: the next test); on the
    roofline, which charges a kernel only its bytes, nothing does."""
    from opgraph.cost.calibration import for_hardware
    from opgraph.parallel import frameworks

    monkeypatch.setattr(frameworks, "FRAMEWORKS",
                        _without("deepspeed-0.3", syncs_before_gather=False))
    f, dp = preset("llama3.2-1b"), 8
    runs = {fw: profile_parallel(f, H100, Parallel(dp=dp, zero=3, global_batch=16, framework=fw),
                                 cost=cost_model(cost)).parallel
            for fw in ("deepspeed", "deepspeed-0.3")}
    later, early = ({t.name: t for t in runs[fw].communication}
                    for fw in ("deepspeed", "deepspeed-0.3"))
    assert later.keys() == early.keys() and later
    copy_s = for_hardware(H100).launch_s if cost == "calibrated" else 0.0
    for name, t in early.items():
        assert t.collective in ("all_gather", "reduce_scatter") and t.group == "dp"
        assert t.time_s - later[name].time_s == pytest.approx(t.count * dp * copy_s, rel=1e-9,
                                                              abs=1e-15)
    if cost == "roofline":
        assert runs["deepspeed-0.3"].step_time_s == runs["deepspeed"].step_time_s
    else:
        assert runs["deepspeed-0.3"].step_time_s > runs["deepspeed"].step_time_s


def test_early_deepspeed_gathers_each_weight_after_the_compute_before_it():
    """DeepSpeed v0.3 synchronizes the device before each ZeRO-3 gather and waits on it before
    the sub-module runs: no gather runs beside compute, so the compute stream waits out every
    weight gather whole (its exposed time is its time), where later DeepSpeed prefetches a
    layer ahead and hides most of it. (A backward gather may also queue behind the
    reduce-scatters on the data-parallel stream: that wait is its `queued_s`, apart.)"""
    f = preset("llama3.2-1b")
    runs = {fw: profile_parallel(f, H100, Parallel(dp=8, zero=3, global_batch=16, framework=fw),
                                 cost=cost_model("calibrated")).parallel
            for fw in ("deepspeed", "deepspeed-0.3")}
    gathers = {fw: [t for t in r.communication if t.collective == "all_gather"]
               for fw, r in runs.items()}
    assert gathers["deepspeed-0.3"]
    for t in gathers["deepspeed-0.3"]:
        assert t.exposed_s == pytest.approx(t.time_s, rel=1e-9)
    later = gathers["deepspeed"]
    assert sum(t.exposed_s for t in later) < 0.5 * sum(t.time_s for t in later)


# --- nanotron's DDP: a bucket copy of every gradient ---------------------------------------------

@pytest.mark.parametrize("zero, dp, buckets", [(0, 8, True), (1, 8, False), (0, 1, False)])
def test_nanotron_without_zero_keeps_ddps_buckets_beside_its_fp32_gradients(zero, dp, buckets):
    """nanotron wraps the model in PyTorch DDP when it runs more than one data-parallel rank and
    no ZeRO stage; DDP's reducer keeps its buckets, a BF16 copy of every gradient, all step,
    beside nanotron's FP32 gradient buffers: 4 + 2 bytes a parameter resident for gradients,
    where ZeRO-1 (no DDP) or one rank keeps the 4."""
    f = preset("llama3.2-1b")
    layout = Parallel(dp=dp, zero=zero, global_batch=16, framework="nanotron")
    memory = profile_parallel(f, H100, layout).parallel.memory
    params = memory.weights // 2  # BF16 weights, whole on every data-parallel rank
    assert memory.gradients == (4 + 2 * buckets) * params


# --- nanotron's ZeRO-1: the updated weights gathered through packed buffers ---------------------

@pytest.mark.parametrize("framework, zero, packed", [
    ("nanotron", 1, True), ("nanotron", 0, False), ("megatron", 1, False), (None, 1, False)])
def test_nanotrons_zero1_gather_packs_the_weights_twice_and_the_allocator_keeps_them(
        framework, zero, packed):
    """nanotron's ZeRO-1 gathers the updated weights in one call that packs the rank's shards
    into one input and each rank's into an output of its own, and NCCL's process group gathers
    those list outputs through a flat buffer of its own: the shard plus twice the whole BF16
    weights, (2 + 1/dp) x 2 bytes a parameter. The caching allocator keeps their segments on
    top of what the forward and backward reserved: the reported peak is the liveness peak plus
    the buffers, while what is allocated at once (what decides whether it fits) is the
    liveness peak. Megatron's distributed optimizer gathers into its own parameter buffer, and
    ZeRO-0 gathers nothing: no buffers."""
    dp = 8
    layout = Parallel(dp=dp, zero=zero, global_batch=16, framework=framework)
    memory = profile_parallel(preset("llama3.2-1b"), H100, layout).parallel.memory
    liveness = (memory.weights + memory.gradients + memory.optimizer + memory.activations
                + memory.transient)
    expected = (2 + 1 / dp) * memory.weights if packed else 0  # BF16 weights, whole on each rank
    assert memory.buffers == pytest.approx(expected, rel=1e-6)
    assert memory.allocated == liveness
    assert memory.total == liveness + memory.buffers
    assert memory.fits is (liveness <= memory.capacity)


def test_reserved_memory_falls_back_to_what_is_allocated_where_it_would_pass_the_capacity():
    """Where stacking the gather's buffers on the forward and backward's segments would pass
    the part's memory, the allocator frees its unused cached blocks and allocates again: the
    reserved peak is then the most allocated at once, the larger of the liveness peak and the
    resident parts with the buffers. Numbers and arrays alike."""
    import numpy as np

    from opgraph.cost.memory import Memory, reserved

    GB = 10**9
    # liveness peak 70 GB, resident 40 GB, buffers 20 GB
    fits = Memory("loss", "forward", 20 * GB, 10 * GB, 10 * GB, 20 * GB, 10 * GB,
                  capacity=100 * GB, buffers=20 * GB)
    assert (fits.total, fits.allocated, fits.fits) == (90 * GB, 70 * GB, True)
    over = attrs.evolve(fits, capacity=80 * GB)
    assert (over.total, over.allocated, over.fits) == (70 * GB, 70 * GB, True)
    heavy = attrs.evolve(over, buffers=35 * GB)  # the update's moment is the larger: 75 GB
    assert (heavy.total, heavy.allocated) == (75 * GB, 75 * GB)
    allocated, total = reserved(np.array([70.0, 70.0]), np.array([40.0, 40.0]),
                                np.array([20.0, 5.0]), 80.0)
    assert allocated.tolist() == [70.0, 70.0] and total.tolist() == [70.0, 75.0]
    # the report says which: stacked on the peak, or not kept
    from opgraph.io.outputs.report import format_memory

    assert format_memory(fits.to_json()).endswith(", + gather buffers 20.00 GB)")
    assert format_memory(over.to_json()).endswith(", gather buffers 20.00 GB not kept)")


# --- FSDP2: the gathered buffer copied out into the parameters ----------------------------------

def test_fsdp2_copies_each_gathered_weight_out_on_the_compute_stream(monkeypatch):
    """FSDP2's `foreach_all_gather_copy_out` splits each gathered buffer into the unsharded
    parameters by a copy on the compute stream: per gather, every micro-batch, the weight read
    and written, 2 x its bytes, and on the roofline that over the HBM bandwidth more compute
    time than without the copy."""
    from opgraph.parallel import frameworks

    f, layout = preset("llama3.2-1b"), Parallel(dp=8, zero=3, global_batch=16,
                                                framework="torchtitan")
    with_copy = profile_parallel(f, H100, layout)
    step = compile_parallel(f, layout)
    subs = resolve(step)
    gathers = [op for op in step.ops() if op.kind == "all_gather"]
    moved = layout.micro_batches * sum(
        float((2 * step.tensor(op.outputs[0]).nbytes * op.count).xreplace(subs))
        for op in gathers)
    copies = [r for r in with_copy.ops if r.name.endswith(".out.copy")]
    assert len(copies) == len(gathers)
    assert sum(r.bytes for r in copies) == pytest.approx(moved, rel=1e-12)
    monkeypatch.setattr(frameworks, "FRAMEWORKS", _without("torchtitan", copies_out_gathers=False))
    without = profile_parallel(f, H100, layout)
    assert not [r for r in without.ops if r.name.endswith(".out.copy")]
    assert with_copy.parallel.compute_s - without.parallel.compute_s == pytest.approx(
        moved / H100.bandwidth, rel=1e-9)


def test_a_torchtitan_search_tries_only_the_zero_stages_torchtitan_runs():
    """torchtitan runs DDP (ZeRO-0) or FSDP2 (ZeRO-3), FSDP wherever context parallelism runs
    (`Traits.zero_stages`; its launch writer refuses the rest): its plan lists no other, and a
    constraint asking for one is a one-line error."""
    from opgraph import hardware
    from opgraph.core.errors import OpgraphError
    from opgraph.models import preset
    from opgraph.parallel import cluster
    from opgraph.parallel.search import Space, rows

    found = rows(preset("llama3.2-1b"), hardware.get("h100-sxm"),
                 Space(gpus=16, batch=32, framework="torchtitan", precision=("bf16",),
                       recompute=("none",), pp=1), 8192, cluster.get("dgx-h100"))
    data_parallel = [r for r in found if r.size("dp") > 1]
    assert data_parallel and {r.zero for r in data_parallel} == {0, 3}
    assert all(r.zero == 3 for r in found if r.cp > 1)
    with pytest.raises(OpgraphError, match="runs no ZeRO-1: give --zero 0 or 3"):
        Space(gpus=16, batch=32, framework="torchtitan", zero=1)
    # and its tensor parallelism always shards the sequence
    assert all(r.sequence_parallel for r in found if r.tp > 1) and any(r.tp > 1 for r in found)
    with pytest.raises(OpgraphError, match="always shards the sequence"):
        Space(gpus=16, batch=32, framework="torchtitan", sequence_parallel=False)


@pytest.mark.parametrize("framework, stages", [("nanotron", {0, 1}), ("composer", {0, 2, 3})])
def test_context_parallelism_adds_no_zero_stage_a_framework_does_not_run(framework, stages):
    """A framework's ZeRO stages bound its context-parallel layouts too: nanotron's search
    under CP tries ZeRO-0 and 1 alone, Composer's 0, 2 and 3 (`Traits.zero_stages_under_cp`
    narrows `zero_stages`, never widens it)."""
    from opgraph.models import preset

    from opgraph.parallel import cluster

    found = rows(preset("llama3.2-1b"), hardware.get("h100-sxm"),
                 Space(gpus=16, batch=32, framework=framework, precision=("bf16",),
                       recompute=("none",), pp=1, tp=1), 8192, cluster.get("dgx-h100"))
    under_cp = {r.zero for r in found if r.cp > 1 and r.cp * r.size("dp") > 1}
    assert under_cp and under_cp <= stages


@pytest.mark.parametrize("framework, zero, runs", [
    ("nanotron", 2, "0 or 1"), ("nanotron", 3, "0 or 1"), ("composer", 1, "0 or 2 or 3")])
def test_a_zero_stage_a_framework_does_not_run_is_no_plan_constraint(framework, zero, runs):
    """nanotron shards optimizer states alone (ZeRO-1) or nothing; Composer's FSDP1 shards
    gradients (2) or everything (3), or runs DDP (`Traits.zero_stages`)."""
    from opgraph.core.errors import OpgraphError
    from opgraph.parallel.search import Space

    with pytest.raises(OpgraphError, match=f"runs no ZeRO-{zero}: give --zero {runs}"):
        Space(gpus=16, batch=32, framework=framework, zero=zero)


# --- torchtitan: grouped-query attention's keys and values copied to every head -------------------

def _attention(step):
    (flash,) = [op for op in step.ops() if op.kind == "flash_attention"]
    return flash


def test_torchtitan_copies_the_keys_and_values_to_every_query_head():
    """torchtitan's `repeat_kv` (model.py at 9dec370): the attention reads K and V at H heads,
    each through one copy that reads H_kv d_h and writes H d_h per token (BF16), no FLOPs; its
    backward sums the copies' gradients (one add per element of dY) and moves the same bytes.
    Frameworks whose kernels take grouped heads, and a model whose heads are not grouped, run
    none; the step's FLOPs are the same either way."""
    from opgraph.cost.costmodel import CostModel

    f = preset("llama3-8b")
    step = compile_parallel(f, Parallel(framework="torchtitan"))
    flash = _attention(step)
    assert flash.inputs[1:] == ("layers.k_rope@repeat", "layers.v_proj@repeat")
    assert flash.param("kv_heads") == H
    for source in ("layers.k_rope", "layers.v_proj"):
        copy = step.op(f"{source}.repeat")
        assert copy.kind == "repeat_heads" and copy.count == step.op("layers.attn.flash").count
        assert step.tensor(copy.outputs[0]).shape == (B, S, H * d_h)
        moved = 2 * B * S * (H_kv + H) * d_h
        assert sympy.expand(step.op_bytes(copy) - moved) == 0
        assert CostModel().op_cost(step, copy).flops == 0
        (grad,) = [op for op in step.ops() if op.forward == copy.name]
        assert sympy.expand(CostModel().op_cost(step, grad).bytes - moved) == 0
        derived = CostModel(backward="derived").op_cost(step, grad).flops
        assert sympy.expand(derived - B * S * H * d_h) == 0
    for framework in (None, "megatron", "nanotron"):
        other = compile_parallel(f, Parallel(framework=framework))
        assert not any(op.kind == "repeat_heads" for op in other.ops())
        assert _attention(other).param("kv_heads") == H_kv
    gpt2 = compile_parallel(preset("gpt2"), Parallel(framework="torchtitan"))
    assert not any(op.kind == "repeat_heads" for op in gpt2.ops())  # 12 heads, 12 groups

    def flops(g):
        return sympy.expand(sum((CostModel().op_cost(g, op).flops * op.count
                                 for op in g.ops()), sympy.Integer(0)))
    assert flops(step) == flops(compile_parallel(f, Parallel()))


def test_torchtitans_ring_gathers_the_copied_keys_and_values():
    """Under tensor parallelism the copies split by heads as the queries do; under context
    parallelism torchtitan's ring (PyTorch's ring attention, after `repeat_kv`) gathers K and V
    at every query head: H / H_kv times the bytes the generic model's ring gathers."""
    f = preset("llama3-8b")
    tp2 = compile_parallel(f, Parallel(tp=2, sequence_parallel=True, framework="torchtitan"))
    copy = tp2.op("layers.k_rope.repeat")
    assert sympy.simplify(tp2.tensor(copy.outputs[0]).shape[-1] - H * d_h / tp) == 0

    def gathered(framework):
        step = compile_parallel(f, Parallel(cp=2, zero=3, framework=framework))
        return sympy.Add(*(message_bytes(step, op) for op in step.ops()
                           if op.kind == "all_gather" and op.param("group") == "cp"
                           and op.phase is Phase.FORWARD))
    assert sympy.simplify(gathered("torchtitan") / gathered(None) - H / H_kv) == 0


# --- Megatron-LM: the dispatcher sorts what it receives by local expert ---------------------

def test_megatrons_dispatcher_sorts_received_tokens_by_local_expert():
    """`sort_chunks_by_idxs` (token_dispatcher.py): after the dispatch all-to-all the received
    K copies of each token are concatenated by local expert, and before the return they are put
    back: one copy each way, reading and writing B S K D BF16 elements each, and the same for the
    gradients. Where a GPU holds one expert (E / ep = 1) Megatron-LM skips both: no bytes. The
    generic model, torchtitan and a layout without expert parallelism have none."""
    from opgraph.cost.costmodel import CostModel

    f = preset("mixtral-8x7b")  # 8 experts, top 2
    step = compile_parallel(f, Parallel(ep=4, dp=4, framework="megatron"))
    sort = step.op("layers.experts.permute.all_to_all.ep.sort")
    unsort = step.op("layers.experts.down_proj.unsort")
    assert step.op("layers.experts.gate_proj").inputs[0] == sort.outputs[0]
    assert step.op("layers.experts.down_proj.all_to_all.ep").inputs[0] == unsort.outputs[0]
    # under TP the tokens are put back before the tensor-parallel reduction, as in
    # `combine_preprocess`: the reduce-scatter reads the unsorted expert outputs
    tp2 = compile_parallel(f, Parallel(tp=2, ep=4, dp=4, sequence_parallel=True,
                                       framework="megatron"))
    assert tp2.op("layers.experts.down_proj.unsort").inputs == ("layers.experts.down_proj",)
    assert tp2.op("layers.experts.down_proj.reduce_scatter.tp").inputs[0] == \
        tp2.op("layers.experts.down_proj.unsort").outputs[0]
    from opgraph.core.symbols import K

    copy = 2 * 2 * B * S * K * D
    for op in (sort, unsort):
        (grad,) = [o for o in step.ops() if o.forward == op.name]
        for kernel in (op, grad):
            cost = CostModel().op_cost(step, kernel)
            assert cost.flops == 0
            for ep_, runs in ((4, 1), (8, 0)):  # two experts a GPU, then one
                values = resolve(step, {"ep": ep_})
                assert cost.bytes.xreplace(values) == runs * copy.xreplace(values)
    for layout in (Parallel(ep=4, dp=4), Parallel(ep=4, dp=4, framework="torchtitan"),
                   Parallel(dp=4, framework="megatron")):
        assert not any(o.kind == "moe_sort" for o in compile_parallel(f, layout).ops())


def test_a_bucket_share_keeps_its_floor_over_two_degrees():
    """Megatron-LM's bucket is at least 40 M parameters: an expert weight of 469,762,048 / (ep
    x tp) parameters (Mixtral's gate projections) at ep 2, tp 8 is 0.734 of one, whether the
    dimensions are put in first (the planner) or with the degrees (profile). sympy 1.14 drops
    the floor from Max(40e6, c / (ep x tp)) for positive integer degrees, which made the
    planner charge every such weight a call of its own."""
    from opgraph.core.symbols import edp, ep, tp
    from opgraph.parallel.frameworks import bucket_share

    share = bucket_share(469_762_048 / (ep * tp), edp)
    assert float(share.xreplace({ep: 2, tp: 8, edp: 2})) == pytest.approx(469_762_048 / 16 / 40e6)
    assert float(share.xreplace({ep: 1, tp: 1, edp: 2})) == 1.0  # a weight past a bucket
