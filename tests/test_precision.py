"""FP8 matmuls as a pass: FP8 operands at the part's FP8 peak, the casts they need costed like any
op, the head and attention left in BF16; and AdamW's precisions as named options."""

import numpy as np
import pytest
import sympy
from opgraph.models import preset
from opgraph.passes.attach_adamw import ADAMW_OPTIONS, AdamW
from opgraph.passes.precision import apply_precision, fp8_matmuls

from opgraph import OpgraphError, Phase, compile_step, derive_backward, evaluate, hardware, verify
from opgraph.cost.costmodel import DEFAULT
from opgraph.cost.formula import BANDWIDTH, PEAK_FP8, formula
from opgraph.cost.memory import footprint
from opgraph.analysis.sweep import compile_sweep
from opgraph.core.symbols import B, D, L, S

H100 = hardware.get("h100-sxm")


@pytest.fixture(scope="module")
def llama():
    return preset("llama3-8b")


@pytest.fixture(scope="module")
def bf16(llama):
    return compile_step(llama)


@pytest.fixture(scope="module")
def fp8(llama):
    return compile_step(llama, precision="fp8")


def test_layer_matmuls_read_fp8_operands_the_head_and_attention_stay_bf16(llama, fp8):
    verify(fp8)
    covered = {op.name for op in fp8_matmuls(derive_backward(llama))}
    assert covered == {f"layers.{p}_proj" for p in ("q", "k", "v", "o", "gate", "up", "down")}
    costs = DEFAULT.op_costs(fp8)
    for op in fp8.ops():
        if op.name in covered or op.forward in covered:
            assert [fp8.tensor(n).dtype.name for n in op.inputs[:2]] == ["fp8", "fp8"], op.name
            assert costs[op.name].compute == "fp8"
    for name in ("lm_head", "layers.attn.flash", "layers.attn.flash.grad"):
        assert costs[name].compute is None
        assert {fp8.tensor(n).dtype.name for n in fp8.op(name).inputs} <= {"bf16", "fp32"}


def test_fp8_halves_compute_bound_matmuls_on_an_h100(bf16, fp8):
    slow, fast = ({o.name: o for o in evaluate(s, H100, {"tokens": 65536}).ops}
                  for s in (bf16, fp8))
    covered = [n for n in slow if n.startswith("layers.") and n.split(".")[1].endswith("_proj")]
    assert len(covered) == 7 * 3  # each forward matmul and its two backward matmuls
    for name in covered:
        assert slow[name].bound == fast[name].bound == "compute", name
        assert fast[name].flops == slow[name].flops
        assert fast[name].time_s / slow[name].time_s == pytest.approx(
            H100.peak_flops / H100.fp8_flops, rel=1e-12)  # 989 / 1979: half


def test_the_casts_are_ops_of_their_own(fp8):
    per_phase = {}
    for op in fp8.ops():
        if op.kind in ("amax", "cast"):
            per_phase[op.kind, op.phase] = per_phase.get((op.kind, op.phase), 0) + 1
            assert op.count == L and op.region == "layers"
    # forward: the normed inputs of QKV and of gate/up, the attention output, the SwiGLU
    # output and the seven weights; backward: the seven output gradients
    assert per_phase == {("amax", Phase.FORWARD): 11, ("cast", Phase.FORWARD): 11,
                         ("amax", Phase.BACKWARD): 7, ("cast", Phase.BACKWARD): 7}
    costs = DEFAULT.op_costs(fp8)
    amax, cast = costs["fp8.layers.attn_norm.amax"], costs["fp8.layers.attn_norm.cast"]
    assert sympy.expand(amax.flops - 2 * B * S * D) == 0  # |x| and max per element
    assert sympy.expand(amax.bytes - (2 * B * S * D + 4)) == 0  # BF16 in, an FP32 amax out
    assert sympy.expand(cast.flops - 2 * B * S * D) == 0  # scale and clamp
    assert sympy.expand(cast.bytes - (2 * B * S * D + 4 + B * S * D)) == 0  # FP8 out


@pytest.fixture(scope="module")
def rowwise(llama):
    return compile_step(llama, precision="fp8-rowwise")


def test_rowwise_casts_each_operand_along_the_axes_its_matmul_contracts(rowwise):
    """torchao's row-wise recipe: y = x W casts x along K and W along K; dX = dY W^T casts dY
    along N and W along N; dW = x^T dY casts x and dY along the tokens. Each copy is an amax
    with one scale per row kept and a cast, from the BF16 tensor."""
    verify(rowwise)
    reads = {name: [(rowwise.tensor(n).dtype.name, rowwise.tensor(n).shape)
                    for n in rowwise.op(name).inputs[:2]]
             for name in ("layers.q_proj", "layers.q_proj.dA", "layers.q_proj.dB")}
    assert all(dtype == "fp8" for pair in reads.values() for dtype, _ in pair)

    def axes(copy):
        return rowwise.op(f"{copy}.amax").param("axes")

    inputs = {name: [axes(n) for n in rowwise.op(name).inputs[:2]] for name in reads}
    assert inputs == {"layers.q_proj": [(2,), (0,)], "layers.q_proj.dA": [(2,), (1,)],
                      "layers.q_proj.dB": [(0, 1), (0, 1)]}
    per_phase = {}
    for op in rowwise.ops():
        if op.kind in ("amax", "cast"):
            per_phase[op.kind, op.phase] = per_phase.get((op.kind, op.phase), 0) + 1
            assert rowwise.tensor(op.inputs[0]).dtype.name in ("bf16", "fp32"), op.name
    # forward as tensor-wise (4 inputs, 7 weights); backward: the 7 weights along N, the 4
    # inputs along the tokens, the 7 output gradients along N and along the tokens
    assert per_phase == {("amax", Phase.FORWARD): 11, ("cast", Phase.FORWARD): 11,
                         ("amax", Phase.BACKWARD): 25, ("cast", Phase.BACKWARD): 25}
    costs = DEFAULT.op_costs(rowwise)
    amax, cast = (costs[f"fp8.layers.attn_norm.over2.{k}"] for k in ("amax", "cast"))
    assert sympy.expand(amax.bytes - (2 * B * S * D + 4 * B * S)) == 0  # an FP32 scale a row
    assert sympy.expand(cast.bytes - (2 * B * S * D + 4 * B * S + B * S * D)) == 0
    columns = costs["fp8.layers.attn_norm.over0_1.amax"]
    assert sympy.expand(columns.bytes - (2 * B * S * D + 4 * D)) == 0  # one a column


def test_rowwise_rescales_each_backward_product(rowwise):
    """Without fast accumulation torchao runs cuBLAS with unit scales and multiplies the product
    by its rows' and columns' inverse scales after (`addmm_float8_unwrapped`): one rescale per
    backward matmul, which also adds the partial gradient the matmul accumulated into."""
    rescales = [op for op in rowwise.ops() if op.kind == "rescale"]
    assert len(rescales) == 7 * 2 and all(op.phase is Phase.BACKWARD for op in rescales)
    assert not any(op.kind == "rescale" for op in compile_step(preset("llama3-8b"),
                                                               precision="fp8").ops())
    da = rowwise.op("layers.q_proj.dA.rescale")
    product, row, column, partial = (rowwise.tensor(n) for n in da.inputs)
    assert rowwise.op("layers.q_proj.dA").outputs == (product.name,)
    assert (product.dtype.name, row.shape, column.shape) == ("bf16", (B, S), (D,))
    cost = DEFAULT.op_costs(rowwise)[da.name]
    written = rowwise.tensor(da.outputs[0])
    assert sympy.expand(cost.flops - 3 * B * S * D) == 0  # 2 scales and the partial's add
    assert sympy.expand(cost.bytes - (2 * B * S * D + 4 * B * S + 4 * D + partial.nbytes
                                      + written.nbytes)) == 0


def test_rowwise_rescales_the_product_not_a_fused_bias_gradient():
    """GPT-2's weight-gradient matmul also writes its bias's gradient (the sum of dY over the
    tokens): the rescale takes the product alone; the bias gradient stays the kernel's."""
    step = compile_step(preset("gpt2"), precision="fp8-rowwise")
    verify(step)
    assert step.op("layers.fc.dB").outputs == ("d.layers.fc.weight.unscaled", "d.layers.fc.bias")
    assert step.op("layers.fc.dB.rescale").outputs == ("d.layers.fc.weight",)


def test_rowwise_gathers_the_sequence_in_bf16(llama):
    """torchtitan applies its Float8 tensor-parallel styles (an FP8 all-gather) to the
    tensor-wise recipe only: under row-wise scaling the sequence-parallel gathers move BF16."""
    from opgraph.parallel.distributed import compile_parallel
    from opgraph.parallel.parallel import Parallel

    layout = Parallel(tp=2, sequence_parallel=True, framework="torchtitan")
    dtypes = {}
    for precision in ("fp8", "fp8-rowwise"):
        g = compile_parallel(llama, layout, precision=precision)
        dtypes[precision] = {g.tensor(op.outputs[0]).dtype.name for op in g.ops()
                             if op.kind == "all_gather" and op.param("group") == "tp"
                             and op.phase is Phase.FORWARD}
    assert dtypes == {"fp8": {"fp8", "bf16"}, "fp8-rowwise": {"bf16"}}


def test_rowwise_is_refused_where_the_framework_has_no_such_recipe(llama, cli):
    """Transformer Engine (Megatron-LM, DeepSpeed, Composer) scales FP8 per tensor or per
    block, never per row: such a job is an error, one line; torchtitan and the generic model
    run it."""
    from opgraph.parallel.distributed import compile_parallel
    from opgraph.parallel.parallel import Parallel

    for framework in ("megatron", "deepspeed", "composer", "nanotron"):
        with pytest.raises(OpgraphError, match=f"--framework {framework} runs no fp8-rowwise"):
            compile_parallel(llama, Parallel(tp=2, framework=framework), precision="fp8-rowwise")
    for framework in ("torchtitan", None):
        compile_parallel(llama, Parallel(tp=2, framework=framework), precision="fp8-rowwise")
    for command in (("profile", "--gpus", "2", "--tp", "2"),
                    ("plan", "--model", "llama3-8b", "--gpus", "8", "--tokens", "65536")):
        code, out, err = cli(*command, "--framework", "megatron", "--precision", "fp8-rowwise")
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
        assert "give --precision bf16 or fp8" in err


def test_torchtitans_rowwise_runs_slower_than_tensorwise():
    """torchtitan's June 2025 async-TP page measured torchao's row-wise recipe below its
    tensor-wise one in all four of its pairs (Llama 3 70B on 256 H100s, 8B on 64, vanilla and
    async TP: 599.6 / 809.8, 624.8 / 942.4, 3,708.5 / 5,078.1, 3,914.9 / 5,570.1 tokens/s per
    GPU); predicted so too, from the bytes its casts, rescales and BF16 gathers move."""
    from opgraph.analysis.validate import validate
    from opgraph.io.cases import load_cases

    runs = [c for c in load_cases("holdout") if c.id.startswith("torchtitan_2506")
            and c.precision != "bf16"]
    step = {p.case.id: p.predicted_step_time_s for p in validate(runs).predictions}
    pairs = [(i, i.replace("fp8rowwise", "fp8")) for i in step if "fp8rowwise" in i]
    assert len(pairs) == 4 and all(step[row] > step[tensor] for row, tensor in pairs)


def test_fp8_time_formula_names_the_fp8_peak(fp8):
    q = formula(fp8, "time", op="layers.q_proj")
    assert PEAK_FP8 in q.free_symbols and sympy.Symbol("peak", positive=True) not in \
        q.free_symbols
    flops = formula(fp8, "flops", op="layers.q_proj")
    nbytes = formula(fp8, "bytes", op="layers.q_proj")
    expected = sympy.Max(flops / PEAK_FP8, nbytes / BANDWIDTH)
    for seq in (16, 8192):  # a memory-bound and a compute-bound point
        at = dict(fp8.dims) | {S: seq, PEAK_FP8: H100.fp8_flops, BANDWIDTH: H100.bandwidth}
        assert float(q.xreplace(at)) == pytest.approx(float(expected.xreplace(at)), rel=1e-12)
    numeric = formula(fp8, "time", hardware=H100)
    p = evaluate(fp8, H100)
    values = {sym: v for sym, v in fp8.dims.items()}
    assert float(numeric.xreplace(values)) == pytest.approx(p.step_time_s, rel=1e-9)


def test_sweep_runs_fp8_terms_at_the_fp8_peak(fp8):
    p = evaluate(fp8, H100)
    row = compile_sweep(fp8).run({"B": np.array([1.0]), "S": np.array([8192.0])},
                                 H100.peak_flops, H100.bandwidth, H100.fp8_flops)
    assert row["step_time_s"][0] == pytest.approx(p.step_time_s, rel=1e-9)
    assert row["hfu_ceiling"][0] == pytest.approx(p.hfu_ceiling, rel=1e-9)


def test_a_part_without_an_fp8_peak_is_an_error(fp8, cli):
    with pytest.raises(OpgraphError, match="no dense FP8 peak"):
        evaluate(fp8, hardware.get("a100-sxm-80gb"))
    code, out, err = cli("profile", "--precision", "fp8", "--hardware", "a100-sxm-80gb")
    assert code == 2 and out == "" and err.startswith("opgraph: error:") and \
        len(err.strip().splitlines()) == 1


def test_bf16_leaves_the_step_alone(llama, bf16):
    step = derive_backward(llama)
    assert str(apply_precision(step, "bf16")) == str(step)
    with pytest.raises(OpgraphError, match="unknown precision"):
        apply_precision(step, "int4")


def test_torchtitans_fp8_speedup(llama):
    """torchtitan's Llama 3.1 8B on 8 H100s, 2 x 8192 tokens per GPU, per-op selective
    recomputation, torch.compile: 6,667 tokens/s per GPU in BF16, 8,532 with tensor-wise FP8
    linears (benchmarks/llama3_h100_202412_torchtitan.md, Table 1): 1.28x. The single-GPU
    roofline of that step (no communication) predicts within a tenth of it."""
    times = [evaluate(compile_step(llama, recompute="selective-op", precision=p), H100,
                      {"tokens": 16384}).step_time_s for p in ("bf16", "fp8")]
    assert times[0] / times[1] == pytest.approx(8532 / 6667, rel=0.1)


@pytest.mark.parametrize("name, per_param", [("mixed", 12), ("bf16-moments", 8),
                                             ("no-master", 8), ("bf16", 4), ("8bit", 6)])
def test_adamw_precisions_are_named_options(llama, name, per_param):
    step = compile_step(llama, adamw=AdamW.named(name))
    assert sympy.expand(footprint(step).optimizer - per_param * llama.parameters()) == 0
    assert set(ADAMW_OPTIONS) == {"mixed", "bf16-moments", "no-master", "bf16", "8bit"}


def test_unknown_adamw_option_is_an_error():
    with pytest.raises(OpgraphError, match="unknown AdamW option"):
        AdamW.named("fp4")


def test_cli_echoes_the_precision(cli):
    import json

    code, out, _err = cli("profile", "--precision", "fp8", "--json")
    data = json.loads(out)
    assert code == 0 and (data["precision"], data["recompute"]) == ("fp8", "none")


def test_solve_turns_an_fp8_matmul_at_the_fp8_peak(fp8, bf16):
    from opgraph.analysis.solve import ridge

    fast, slow = (ridge(s, H100, "layers.q_proj") for s in (fp8, bf16))
    assert fast.ridge_intensity == pytest.approx(H100.fp8_flops / H100.bandwidth)
    assert slow.ridge_intensity == pytest.approx(H100.peak_flops / H100.bandwidth)
    assert "peak_fp8" in fast.expression and "peak_fp8" not in slow.expression


def test_one_gpu_and_many_gpu_profiles_count_fp8_flops_alike(fp8, cli):
    """HFU has one definition (`CostModel.hfu` over `CostModel.busy_flops`): `profile
    --precision fp8` and the same step through the many-GPU path (`--gpus 1`) report the same
    figure, each FP8 FLOP counted as BF16 peak / FP8 peak of one (the many-GPU path used to
    count it whole, and clamp at 100%)."""
    import json

    runs = {}
    for extra in ((), ("--gpus", "1")):
        # one cost model for both (a layout flag alone would make the job's default calibrated)
        code, out, _ = cli("profile", "--precision", "fp8", "--cost", "roofline", "--json",
                           *extra)
        assert code == 0
        runs[extra] = json.loads(out)
    one, many = runs[()], runs[("--gpus", "1")]
    assert many["step_time_s"] == pytest.approx(one["step_time_s"], rel=1e-12)
    assert many["mfu_ceiling"] == pytest.approx(one["mfu_ceiling"], rel=1e-12)
    assert many["hfu_ceiling"] == pytest.approx(one["hfu_ceiling"], rel=1e-12)
    # the figure itself, from the op costs: BF16 FLOPs whole, FP8 FLOPs x peak / FP8 peak
    costs, subs = DEFAULT.op_costs(fp8), dict(fp8.dims)
    busy = 0.0
    for op in fp8.ops():
        flops = float((costs[op.name].flops * op.count).xreplace(subs))
        fp8_op = costs[op.name].compute == "fp8"
        busy += flops * H100.peak_flops / H100.fp8_flops if fp8_op else flops
    expected = busy / (one["step_time_s"] * H100.peak_flops)
    assert expected < 1 and many["hfu_ceiling"] == pytest.approx(expected, rel=1e-9)


def test_a_sequence_parallel_input_is_cast_on_its_shard_and_gathered_in_fp8():
    """Under sequence parallelism the normed input of Q, K, V (and of the MLP's gate and up) is
    cast to FP8 on its S/tp shard and gathered in FP8: the gather moves B S D bytes, one an
    element, where BF16 moves 2 B S D; and Megatron-LM, which keeps the shard for the backward
    and gathers it again (`regather_inputs`), saves the FP8 shard, B (S/tp) D bytes, not an FP8
    copy of the whole sequence."""
    from opgraph.cost.costmodel import message_bytes
    from opgraph.parallel.distributed import compile_parallel
    from opgraph.cost.memory import saved
    from opgraph.core.symbols import tp
    from opgraph.parallel.parallel import Parallel
    from opgraph.core.symbols import B, D, S

    layout = Parallel(tp=2, sequence_parallel=True, framework="megatron")
    steps = {p: compile_parallel(preset("llama3.2-1b"), layout, precision=p)
             for p in ("bf16", "fp8")}
    for precision, per_element in (("bf16", 2), ("fp8", 1)):
        step = steps[precision]
        for norm in ("attn_norm", "mlp_norm"):
            for name in (f"layers.{norm}.all_gather.tp", f"layers.{norm}.all_gather.tp.re"):
                assert message_bytes(step, step.op(name)) == per_element * B * S * D, name
    kept = {t.name: t for t in saved(steps["fp8"])}
    for norm in ("attn_norm", "mlp_norm"):
        assert kept[f"fp8.layers.{norm}"].shape == (B, S / tp, D)
        assert f"fp8.layers.{norm}@all_gather.tp" not in kept
        assert f"layers.{norm}@all_gather.tp" not in kept


def test_a_mixture_of_experts_runs_its_experts_in_fp8():
    """Transformer Engine's GroupedLinear and torchao's float8 grouped matmul run the experts'
    GEMMs in FP8: Mixtral's three expert matmuls and their backward kernels read FP8 operands and
    run at the FP8 peak; the combine stays BF16."""
    step = compile_step(preset("mixtral-8x7b"), precision="fp8")
    costs = DEFAULT.op_costs(step)
    experts = [op for op in step.ops() if op.kind == "expert_matmul"]
    assert len(experts) == 3 * 3  # gate, up, down: forward, dA, dB
    for op in experts:
        assert [step.tensor(n).dtype.name for n in op.inputs[:2]] == ["fp8", "fp8"], op.name
        assert costs[op.name].compute == "fp8", op.name
    assert costs["layers.experts.combine"].compute is None
