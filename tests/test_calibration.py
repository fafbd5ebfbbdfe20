"""The calibrated cost model: its formula, its file, its fit to the published runs, and the
accuracy the issue asks of it (in-sample: the runs it was fitted to)."""

import json

import attrs
import pytest
from opgraph.models import preset
from opgraph.passes.evaluate import evaluate

from opgraph.cost import calibration
from opgraph import compile_step, hardware
from opgraph.cost.calibration import Efficiencies
from opgraph.io.cases import load_cases
from opgraph.parallel.cluster import get as get_cluster
from opgraph.cost.costmodel import DEFAULT, CalibratedCostModel, CostModel, cost_model
from opgraph.parallel.distributed import schedule
from opgraph.core.errors import OpgraphError
from opgraph.analysis.fit import compile_cases

H100 = hardware.get("h100-sxm")
E = Efficiencies("hopper", matmul=0.5, matmul_half_flops=1e9, attention=0.25, bandwidth=0.8,
                 launch_s=3e-6, node=0.6, network=0.7, overlap_slowdown=0.2)
MODEL = CalibratedCostModel(table={"hopper": E})


def test_a_kernel_costs_launch_plus_the_slower_of_its_scaled_terms():
    peak, bw = H100.peak_flops, H100.bandwidth
    f, b, n = 4e12, 1e9, 3  # over the op's 3 instances
    assert MODEL.op_time(H100, "matmul", f, b, n, peak) == pytest.approx(
        n * (3e-6 + max((f / n + 1e9) / (0.5 * peak), b / n / (0.8 * bw))))
    assert MODEL.op_time(H100, "flash_attention", f, b, n, peak) == pytest.approx(
        n * (3e-6 + (f / n + 1e9) / (0.25 * peak)))
    small = MODEL.op_time(H100, "rmsnorm", 1e6, 1e9, 1, peak)  # memory-bound
    assert small == pytest.approx(3e-6 + 1e9 / (0.8 * bw))


# --- a matrix multiply's shape: wave quantisation over the SMs ---------------------------------

def test_wave_quantisation_counts_tiles_by_hand():
    """tiles = GEMMs x ceil(M / tm) x ceil(N / tn), waves = ceil(tiles / SMs); the kernel pays
    for waves x SMs x tm x tn output slots. H100: 132 SMs, 128 x 256 tiles (cuBLAS sm90)."""
    from opgraph.cost.costmodel import wave_quantum

    # 8192^2: 64 x 32 = 2,048 tiles, 16 waves (2,112 slots)
    assert wave_quantum(1, 8192, 8192, 132, 128, 256) == 16 * 132 / 2048
    # Llama 3 8B's FFN up-projection, 8,192 tokens, TP-1 (N 14,336): 64 x 56 = 3,584 tiles,
    # 28 waves; TP-8 (N 1,792): 64 x 7 = 448 tiles, 4 waves
    assert wave_quantum(1, 8192, 14336, 132, 128, 256) == 28 * 132 / 3584
    assert wave_quantum(1, 8192, 1792, 132, 128, 256) == 4 * 132 / 448
    # a ragged edge: 100 x 100 fills a part of one tile of one wave
    assert wave_quantum(1, 100, 100, 132, 128, 256) == 132 * 128 * 256 / (100 * 100)
    # 32 heads' 128 x 128 products: 32 tiles half-filled, one wave
    assert wave_quantum(32, 128, 128, 132, 128, 256) == 132 * 128 * 256 / (32 * 128 * 128)
    # the same rule as a formula (sympy.ceiling), for `formula` and `solve`
    import sympy

    m = sympy.Symbol("M", positive=True, integer=True)
    q = wave_quantum(1, m, 1792, 132, 128, 256, ceil=sympy.ceiling)
    assert q.subs(m, 8192) == sympy.Rational(4 * 132, 448)


def test_blackwells_gemm_shape_is_simumaxs_measured_tables():
    """B200: the tile and K overhead `opgraph calibrate --gemms b200` fits to SimuMax's measured
    B200 GEMMs (opgraph/data/gemms_b200.csv), 64 x 64 over 148 SMs and k0 192, close to the
    H200's 184. Llama 3 70B's FFN at TP 8 on 4,096 tokens (N 3,584): 64 x 56 = 3,584 tiles in
    25 waves of 148 (3,700 slots); at TP 1 (N 28,672): 28,672 tiles, 194 waves (28,712)."""
    from opgraph.cost import gemms
    from opgraph.cost.costmodel import wave_quantum

    bw = calibration.catalog()["blackwell"]
    sms = hardware.get("b200").sms
    best = gemms.fit([g for g in gemms.read(gemms.locate("b200"))
                      if gemms.seconds(g) >= gemms.MIN_SECONDS], 2250.0, sms)
    assert (bw.matmul_tile_m, bw.matmul_tile_n, bw.matmul_k_overhead, sms) == (
        best.tile_m, best.tile_n, best.k0, 148) == (64, 64, 192, 148)
    assert "SimuMax" in dict(bw.sources)["matmul_k_overhead"]
    assert wave_quantum(1, 4096, 3584, sms, 64, 64) == 25 * 148 / 3584
    assert wave_quantum(1, 4096, 28672, sms, 64, 64) == 194 * 148 / 28672


HOPPER = calibration.catalog()["hopper"]
# Bekman, Machine Learning Engineering, "Maximum Achievable Matmul FLOPS comparison table":
# cuBLAS BF16 on an H100 SXM, 794.5 of 989 TFLOP/s at its best shape
MAMF_H100 = 794.5 / 989
SUSTAINED = CalibratedCostModel(table={"hopper": attrs.evolve(
    HOPPER, matmul=MAMF_H100, matmul_half_flops=0, launch_s=0)})


def test_hoppers_gemm_shape_is_the_measured_tables():
    """The shipped Hopper tile and K overhead are the ones `opgraph calibrate --gemms` fits to
    the GEMMs measured on an H200 (opgraph/data/gemms_h200.csv), with that source."""
    from opgraph.cost import gemms

    table = gemms.locate("h200")
    best = gemms.fit([g for g in gemms.read(table) if gemms.seconds(g) >= gemms.MIN_SECONDS],
                     989.0, 132)
    assert (HOPPER.matmul_tile_m, HOPPER.matmul_tile_n, HOPPER.matmul_k_overhead) == (
        best.tile_m, best.tile_n, best.k0)
    assert dict(HOPPER.sources)["matmul_k_overhead"].startswith("measured")


def test_hoppers_ceiling_is_the_measured_tables_sustained_rate():
    """Hopper's `matmul_ceiling` is the rate `opgraph calibrate --gemms` fits to the GEMMs run
    back to back at the H200's power limit (with the shipped tile and K overhead), to the
    catalog's three digits, and below the cold burst Bekman's table gives (794.5 of 989)."""
    from opgraph.cost import gemms

    table = gemms.locate("h200")
    best = gemms.fit([g for g in gemms.read(table) if gemms.seconds(g) >= gemms.MIN_SECONDS],
                     989.0, 132)
    assert HOPPER.matmul_ceiling == pytest.approx(best.matmul, abs=5e-4)
    assert HOPPER.matmul_ceiling < MAMF_H100
    assert dict(HOPPER.sources)["matmul_ceiling"].startswith("measured")


def test_blackwells_ceiling_is_its_tables_sustained_rate_as_hoppers_is():
    """Blackwell's `matmul_ceiling`, like Hopper's, is the rate `opgraph calibrate --gemms` fits
    to its table of measured GEMMs (SimuMax's B200 table) with the shipped tile and K
    overhead, to the catalog's three digits: the same measure on both generations, below the
    table's best single GEMM (0.655 of the peak)."""
    from opgraph.cost import gemms

    blackwell = calibration.catalog()["blackwell"]
    part = hardware.get("b200")
    best = gemms.fit([g for g in gemms.read(gemms.locate("b200"))
                      if gemms.seconds(g) >= gemms.MIN_SECONDS],
                     part.peak_flops * part.clock_ratio / 1e12, part.sms)
    assert (best.tile_m, best.tile_n, best.k0) == (
        blackwell.matmul_tile_m, blackwell.matmul_tile_n, blackwell.matmul_k_overhead)
    assert blackwell.matmul_ceiling == pytest.approx(best.matmul, abs=5e-4)
    assert blackwell.matmul_ceiling < 0.655
    assert dict(blackwell.sources)["matmul_ceiling"].startswith("measured")


def _attention_kernels():
    from opgraph.cost import attention_table

    return attention_table.read(attention_table.locate("h200"))


def test_hoppers_attention_is_the_measured_tables():
    """Hopper's attention rates and row overheads are what `opgraph calibrate --attention h200`
    fits to the attention kernels measured on the H200, to the catalog's digits."""
    from opgraph.cost import attention_table

    lines = attention_table.fit(_attention_kernels(), 989.0)
    for name, value in attention_table.efficiencies(lines).items():
        assert getattr(HOPPER, name) == pytest.approx(value, abs=0.6 if "overhead" in name
                                                      else 5e-4), name
        assert dict(HOPPER.sources)[name].startswith("measured"), name


def test_attention_slows_with_short_rows_as_measured():
    """A causal FlashAttention-2 forward and backward at head dim 128, 1,024 to 32,768 tokens
    (the H200's measured kernels, 32,768 tokens a call): the shipped rate and row overheads
    give each sequence length's time within 4% of the measured one, where one rate alone
    (the 8,192-token one) is 35% off at 1,024 tokens."""
    from opgraph.cost.costmodel import row_factor

    kernels = [k for k in _attention_kernels() if (k.backend, k.head_dim) == ("flash", 128)]
    peak = 989e12

    def forward_flops(k):
        """One call's forward FLOPs: 32,768 tokens as 32,768 / seq sequences of 32 heads."""
        return 4 * (32768 // k.seq) * 32 * k.seq ** 2 * 128 / 2

    def modelled(k, passes):
        """Seconds of a forward and its backward, each (FLOPs share, rate, row overhead)."""
        scores, rows = forward_flops(k) / (4 * 128), (32768 // k.seq) * 32 * k.seq
        return sum(share * forward_flops(k) * row_factor(scores, rows, overhead) / (rate * peak)
                   for share, rate, overhead in passes)

    shipped = ((1, HOPPER.attention, HOPPER.attention_kv_overhead),
               (2.5, HOPPER.attention, HOPPER.attention_backward_kv_overhead))
    measured = {k.seq: forward_flops(k) * (1 / k.fwd_tflops + 2.5 / k.bwd_tflops) / 1e12
                for k in kernels}
    misses = [modelled(k, shipped) / measured[k.seq] - 1 for k in kernels]
    assert max(map(abs, misses)) < 0.04
    at_8192 = next(k for k in kernels if k.seq == 8192)
    flat = 3.5 * forward_flops(at_8192) / (measured[8192] * peak)  # one rate, 8,192 tokens'
    short = next(k for k in kernels if k.seq == 1024)
    assert modelled(short, ((3.5, flat, 0),)) / measured[1024] - 1 < -0.3


def test_calibrate_attention_fits_a_table(cli, tmp_path):
    """`opgraph calibrate --attention` prints each backend's line and writes the generation's
    rates and overheads; a table it cannot fit is one line and exit 2."""
    from opgraph.cost import attention_table

    out_file = tmp_path / "cal.toml"
    code, out, _ = cli("calibrate", "--attention", "h200", "--hardware", "h200",
                       "--out", str(out_file))
    # FlashAttention-2's forward at head dim 128, fitted here by numpy: 1/rate against 1/S is a
    # line of intercept 1/rate_inf and slope 2k/rate_inf
    import numpy as np

    mine = [k for k in _attention_kernels() if (k.backend, k.head_dim) == ("flash", 128)]
    slope, intercept = np.polyfit([1 / k.seq for k in mine],
                                  [989.0 / k.fwd_tflops for k in mine], 1)
    row = next(line for line in out.splitlines() if line.startswith("flash ") and
               line.split()[1:3] == ["128", "fwd"])
    assert code == 0 and row.split()[3:5] == [f"{1 / intercept:.3f}",
                                             f"{slope / intercept / 2:.0f}"]
    written = calibration.load(out_file)["hopper"]
    expected = attention_table.efficiencies(attention_table.fit(_attention_kernels(), 989.0))
    assert {n: getattr(written, n) for n in expected} == pytest.approx(expected)
    table = tmp_path / "att.csv"
    for text, message in (
            ("backend,head_dim,seq,fwd_tflops\n", "no bwd_tflops column"),
            ("backend,head_dim,seq,fwd_tflops,bwd_tflops\ntriton,128,1024,200,150\n",
             "backend 'triton'"),
            ("backend,head_dim,seq,fwd_tflops,bwd_tflops\nflash,128,1024,200,150\n",
             "one sequence length"),
            ("backend,head_dim,seq,fwd_tflops,bwd_tflops\nflash,64,1024,200,150\n"
             "flash,64,2048,250,190\n", "no kernel at head dim 128")):
        table.write_text(text)
        code, out, err = cli("calibrate", "--attention", str(table), "--hardware", "h200")
        assert code == 2 and out == "" and message in err and len(err.splitlines()) == 1


def test_an_8192_cubed_gemm_runs_within_the_cited_efficiency():
    """With `matmul` the measured large-GEMM rate, an 8192^3 BF16 GEMM runs at it less its
    waves' idle slots (64 x 64 tiles: 16,384 in 125 waves of 132, 16,500 slots) and its K
    overhead ((8,192 + 184) / 8,192): 0.780 of the peak, within a few percent of the table's
    0.803 (its best shape is one that fills its waves)."""
    n = 8192
    flops, nbytes = 2 * n**3, 3 * n * n * 2
    t = SUSTAINED.op_time(H100, "matmul", flops, nbytes, 1, H100.peak_flops, (1, n, n))
    achieved = flops / t / H100.peak_flops
    assert (HOPPER.matmul_tile_m, HOPPER.matmul_tile_n, HOPPER.matmul_k_overhead) == (64, 64, 184)
    assert achieved == pytest.approx(MAMF_H100 * 16384 / 16500 * 8192 / 8376, rel=1e-12)
    assert 0.75 < achieved <= MAMF_H100


def _per_flop(name: str, tps=(1, 8)) -> dict[int, float]:
    """Seconds per FLOP of one layer op of Llama 3 8B at 8,192 tokens, by TP degree."""
    from opgraph.parallel.distributed import prepare
    from opgraph.parallel.parallel import Parallel

    per_flop = {}
    for tp in tps:
        job = prepare(preset("llama3-8b"), H100, Parallel(tp=tp, micro_batch=1, global_batch=1),
                      values={"S": 8192})
        _, rows = schedule(job, SUSTAINED)
        row = next(r for r in rows if r.name == name)
        per_flop[tp] = row.time_s / row.flops
    return per_flop


def test_a_tensor_parallel_shard_runs_slower_per_flop():
    """Llama 3 8B's up-projection, 8,192 tokens, 64 x 64 tiles: a TP-8 shard (N 1,792) has
    128 x 28 = 3,584 tiles for 28 waves of 132 SMs (3,696 slots), TP-1 (N 14,336) 28,672 for
    218 waves (28,776), so a FLOP costs 3,696 / 3,584 over 28,776 / 28,672 as much (K is 4,096
    in both: the same K overhead); in the compiled step's ops too."""
    per_flop = _per_flop("layers.up_proj")
    assert per_flop[8] / per_flop[1] == pytest.approx((3696 / 3584) / (28776 / 28672), rel=1e-9)


def test_a_row_parallel_shard_pays_its_shorter_k():
    """The down-projection's output (8,192 x 4,096) is the same at every TP degree, so its waves
    are too; its K is the FFN width over TP, 14,336 at TP 1 and 1,792 at TP 8, and a FLOP costs
    (1,792 + 184) / 1,792 over (14,336 + 184) / 14,336 as much."""
    per_flop = _per_flop("layers.down_proj")
    assert per_flop[8] / per_flop[1] == pytest.approx(
        ((1792 + 184) / 1792) / ((14336 + 184) / 14336), rel=1e-9)


def test_attention_scales_by_its_exponentials_against_head_dim_128():
    """An exponential takes 256 tensor FLOPs' time on an H100 (FlashAttention-3, section 3.2:
    989 over 3.9 TFLOP/s). The forward does 2 (d_qk + d_v) FLOPs per score: at head dim 128
    the exponentials add 256 / 512 to it, at 64 256 / 256, at 256 256 / 1024; the published
    `attention` is at 128, so 64 costs (1 + 1) / (1 + 1/2) as much per FLOP, 256 (1 + 1/4) /
    (1 + 1/2). The plate's backward, twice the forward's FLOPs over the same exponentials,
    at 64: (1 + 1/2) / (1 + 1/4)."""
    from opgraph.cost.costmodel import exp_factor

    assert HOPPER.attention_exp_ratio == 256
    scores = 1e6
    assert exp_factor(512 * scores, scores, 256, 256) == 1.0
    assert exp_factor(256 * scores, scores, 128, 256) == pytest.approx(2 / 1.5)
    assert exp_factor(1024 * scores, scores, 512, 256) == pytest.approx(1.25 / 1.5)
    assert exp_factor(512 * scores, scores, 128, 256) == pytest.approx(1.5 / 1.25)
    assert exp_factor(256 * scores, scores, 128, 0) == 1.0  # no exponential rate: no scaling


def test_a_small_head_dim_runs_attention_slower_per_flop():
    """Llama 3 8B (head dim 128) keeps the shipped `attention`; the same model with 64 heads of
    64 does the same attention FLOPs more slowly, by the exponentials' share (4/3 forward,
    6/5 the plate's backward)."""
    from opgraph.core.symbols import H, H_kv, d_h

    model = CalibratedCostModel(table={"hopper": attrs.evolve(HOPPER, launch_s=0)})
    rows = {}
    for heads, dim in ((32, 128), (64, 64)):
        step = compile_step(preset("llama3-8b"))
        values = {"S": 8192, H: heads, H_kv: heads // 4, d_h: dim}
        roofline = {o.name: o for o in evaluate(step, H100, values).ops}
        calibrated = {o.name: o for o in evaluate(step, H100, values, cost=model).ops}
        rows[dim] = {n: calibrated[n].time_s / roofline[n].time_s
                     for n in ("layers.attn.flash", "layers.attn.flash.grad")}
    assert rows[64] and rows[64].keys() == rows[128].keys()
    forward, backward = sorted(rows[64], key=len)
    assert rows[64][forward] / rows[128][forward] == pytest.approx(2 / 1.5, rel=1e-9)
    assert rows[64][backward] / rows[128][backward] == pytest.approx(1.5 / 1.25, rel=1e-9)


def test_a_power_cap_slows_compute_by_the_clock_and_not_memory():
    """At 500 W of 700 the clock is (5/7)^(1/3) of the peak's: a compute-bound kernel takes
    that much longer, a memory-bound one as long (HBM keeps its clock); the roofline is the
    datasheet's ceiling whatever the cap."""
    capped = hardware.with_power_limit(H100, 500)
    clock = (500 / 700) ** (1 / 3)
    assert MODEL.op_time(capped, "matmul", 4e12, 1e9, 1, H100.peak_flops) == pytest.approx(
        3e-6 + (4e12 + 1e9) / (0.5 * clock * H100.peak_flops))
    assert MODEL.op_time(capped, "rmsnorm", 1e6, 1e9, 1, H100.peak_flops) == \
        MODEL.op_time(H100, "rmsnorm", 1e6, 1e9, 1, H100.peak_flops)
    step = compile_step(preset("llama3-8b"))
    assert evaluate(step, capped).step_time_s == evaluate(step, H100).step_time_s


def test_an_fp8_gemm_runs_at_matmul_times_fp8_ratio_of_the_fp8_peak():
    """An FP8 matrix multiply (and its backward's) runs at `matmul` x `fp8_ratio` of the dense
    FP8 peak: the op's time is its launch plus (FLOPs + matmul_half_flops) / (0.5 x 0.8 x FP8
    peak) per instance. The BF16 attention beside it keeps `attention` of the BF16 peak, and the
    roofline is the datasheet's ceiling whatever the ratio."""
    ratio = 0.8
    step = compile_step(preset("llama3-8b"), precision="fp8")
    model = CalibratedCostModel(table={"hopper": attrs.evolve(E, fp8_ratio=ratio)})
    rows = {r.name: r for r in evaluate(step, H100, cost=model).ops}
    plain = {r.name: r for r in evaluate(step, H100, cost=MODEL).ops}
    for name in ("layers.up_proj", "layers.up_proj.dA", "layers.up_proj.dB"):
        r = rows[name]
        assert r.time_s == pytest.approx(r.count * (3e-6 + (r.flops / r.count + 1e9)
                                                    / (0.5 * ratio * H100.fp8_flops)), rel=1e-12)
    assert rows["layers.attn.flash"].time_s == plain["layers.attn.flash"].time_s
    ceiling = {r.name: r for r in evaluate(step, H100).ops}["layers.up_proj"]
    assert ceiling.time_s == pytest.approx(max(ceiling.flops / H100.fp8_flops,
                                               ceiling.bytes / H100.bandwidth), rel=1e-12)


def test_hoppers_and_blackwells_fp8_ratio_is_the_cited_table():
    """The shipped `fp8_ratio`: Bekman's maximum achievable matmul FLOPS, FP8 over BF16 share
    of the dense peaks, on the part each generation's ceiling names: H100 SXM 1,402.6 / 1,979
    against 794.5 / 989, B200 3,432.5 / 4,500 against 1,745.0 / 2,250; no FP8 on Ampere."""
    shipped = calibration.catalog()
    assert shipped["hopper"].fp8_ratio == round((1402.6 / 1979) / (794.5 / 989), 3)
    assert shipped["blackwell"].fp8_ratio == round((3432.5 / 4500) / (1745.0 / 2250), 3)
    assert shipped["ampere"].fp8_ratio == 1


def test_a_calibration_file_round_trips_with_its_tiles(tmp_path):
    from opgraph.analysis.fit import to_toml

    path = tmp_path / "cal.toml"
    path.write_text(to_toml(calibration.catalog(), "# round trip"))
    assert calibration.load(path) == calibration.catalog()
    hopper = calibration.load(path)["hopper"]
    assert hopper.matmul_tile_n == calibration.catalog()["hopper"].matmul_tile_n > 0
    assert hopper.matmul_k_overhead == calibration.catalog()["hopper"].matmul_k_overhead > 0


def test_a_collective_runs_at_its_tiers_achieved_bandwidth():
    # launch_s, then NCCL's Simple protocol at 1 GB (tuning.cc: baseLat 8.4 us, hwLat 3.4 us a
    # NVLink step; one member per node crosses at the tree's 14 us) and the achieved bandwidth
    dgx = get_cluster("dgx-h100")
    node, net = dgx.tiers
    m = 1e9
    assert MODEL.comm_time("all_reduce", m, 8, dgx, 1, H100) == pytest.approx(
        3e-6 + 8.4e-6 + 14 * 3.4e-6 + 2 * 7 / 8 * m / (0.6 * node.bandwidth))
    assert MODEL.comm_time("all_gather", m, 4, dgx, 8, H100) == pytest.approx(
        3e-6 + 8.4e-6 + 3 * 14e-6 + 3 / 4 * m / (0.7 * net.bandwidth))


def test_every_efficiency_one_is_the_roofline_but_flashattentions_backward():
    """With every efficiency 1 each kernel runs at the roofline, but FlashAttention's backward:
    the plate's convention charges it 2 x its forward's FLOPs, and it runs 2.5 x (as its
    efficiency's sources count them), so at `attention` 1 it takes 2.5 / 2 of the roofline's
    compute time; under "derived", which charges the 2.5 itself, exactly the roofline's."""
    ideal = CalibratedCostModel(table={"hopper": Efficiencies("hopper")})
    step = compile_step(preset("llama3-8b"))
    mine = {r.name: r for r in evaluate(step, H100, cost=ideal).ops}
    roof = {r.name: r for r in evaluate(step, H100).ops}
    flash = {op.name for op in step.ops() if op.kind == "flash_attention_backward"}
    assert flash
    for name, r in roof.items():
        ratio = 2.5 / 2 if name in flash else 1
        assert mine[name].time_s == pytest.approx(r.time_s * ratio, rel=1e-12), name
    derived = CalibratedCostModel(backward="derived", table={"hopper": Efficiencies("hopper")})
    assert evaluate(step, H100, cost=derived).step_time_s == pytest.approx(
        evaluate(step, H100, cost=CostModel(backward="derived")).step_time_s, rel=1e-12)


def test_the_shipped_file_names_a_source_for_every_value():
    for generation, e in calibration.catalog().items():
        assert {name for name, _ in e.sources} == set(calibration.FIELDS), generation
        for name in e.fitted:
            assert dict(e.sources)[name].startswith("fitted"), (generation, name)
    for part in hardware.catalog().values():
        assert part.generation in calibration.catalog(), part.id


@pytest.mark.parametrize("text, says", [
    ("[g]\nmatmul = 1.5\n", "fraction above 0 and at most 1"),
    ("[g]\nmatmul = 0.5\nwarp = 1\n", "warp"),
    ("[g]\nmatmul = 0.5\nlaunch_s = -1\n", "0 or more"),
    ("[g]\nmatmul = 0.5\nfitted = [\"speed\"]\n", "fitted must be a list"),
])
def test_a_bad_calibration_file_is_one_line(tmp_path, text, says):
    path = tmp_path / "cal.toml"
    path.write_text(text)
    with pytest.raises(OpgraphError, match=says) as e:
        calibration.load(path)
    assert "\n" not in str(e.value)


def test_the_cli_refuses_what_it_cannot_do(cli, tmp_path):
    code, _, err = cli("solve", "--cost", "calibrated", "--op", "layers.q_proj", "--ridge")
    assert code == 2 and "roofline's formulas" in err
    code, _, err = cli("profile", "--calibration", "x.toml")
    assert code == 2 and "--cost calibrated" in err
    part = tmp_path / "gpu.toml"
    part.write_text("[gpu]\nbf16_tflops = 100\nbandwidth_tbs = 1\n")
    code, _, err = cli("profile", "--hardware", str(part), "--cost", "calibrated")
    assert code == 2 and "names no generation" in err


def test_profile_says_which_cost_model(cli):
    _code, out, _ = cli("profile", "--cost", "calibrated", "--json")
    calibrated = json.loads(out)
    _, out, _ = cli("profile", "--json")
    roofline = json.loads(out)
    assert (calibrated["cost"], roofline["cost"]) == ("calibrated", "roofline")
    assert calibrated["step_time_s"] > roofline["step_time_s"]


# --- the published runs -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def jobs():
    return compile_cases(load_cases())


def _errors(jobs, model):
    return {case.id: schedule(job, model)[0].step_time_s / case.measured_step_time_s - 1
            for case, job in jobs}


def test_calibrated_is_slower_than_the_roofline_on_every_run(jobs):
    calibrated = cost_model("calibrated")
    for case, job in jobs:
        assert schedule(job, calibrated)[0].step_time_s > schedule(job, DEFAULT)[0].step_time_s, \
            case.id


def test_the_accuracy_on_the_published_runs(jobs):
    """In-sample (the shipped efficiencies were fitted to these runs): mean absolute error at
    most 25% over the 80 runs of seven families, none off by more than a factor of two. The
    left-out error (`opgraph validate --cv family`, benchmarks/bench_physics.py) is the real
    test; this guards the shipped fit against a regression."""
    errors = _errors(jobs, cost_model("calibrated"))
    assert len(errors) == 80
    assert sum(map(abs, errors.values())) / 80 <= 0.25
    assert max(map(abs, errors.values())) <= 1.0


def test_the_shipped_efficiencies_are_the_fits_minimum(jobs):
    """`opgraph calibrate --fit shipped` (minutes: benchmarks/bench_physics.py reruns it) gave
    the shipped values: the fit's loss is lower there than with the shared matmul efficiency
    moved 3% either way, and every generation that fits it reaches the same share of its own
    measured ceiling (`matmul_ceiling`)."""
    from opgraph.analysis.fit import loss

    shipped = calibration.catalog()
    fitting = [g for g, e in shipped.items() if "matmul" in e.fitted]
    shares = [shipped[g].matmul / shipped[g].matmul_ceiling for g in fitting]
    assert len(fitting) >= 3 and max(shares) == pytest.approx(min(shares), rel=1e-9)

    def moved(factor):
        return {g: attrs.evolve(e, matmul=e.matmul * factor) if g in fitting else e
                for g, e in shipped.items()}

    here = loss(jobs, shipped)
    assert here < loss(jobs, moved(0.97)) and here < loss(jobs, moved(1.03))


def test_the_fit_runs_from_any_folder_on_the_shipped_file(cli, tmp_path, monkeypatch):
    """`--fit shipped` names the installed case file, so the command runs from any folder
    (two runs of one family: the full refit takes minutes)."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "calibration.toml"
    code, _, err = cli("calibrate", "--fit", "shipped", "--select", "korthikanti22_tab5_22B",
                       "--out", str(out), "--json")
    assert code == 0, err
    rebuilt = calibration.load(out)
    assert rebuilt.keys() == calibration.catalog().keys()
    assert 0 < rebuilt["ampere"].matmul <= 1


def test_validate_uses_a_users_calibration(cli, tmp_path):
    table = calibration.catalog()
    slower = {g: attrs.evolve(e, matmul=e.matmul / 2) for g, e in table.items()}
    from opgraph.analysis.fit import to_toml

    path = tmp_path / "slow.toml"
    path.write_text(to_toml(slower, "# half the matmul efficiency"))
    cases = tmp_path / "cases.json"  # an A100 run and an H100 run
    two = [c for c in load_cases() if c.id in ("narayanan21_tab1_18B", "torchtitan_t1_fsdp_8gpu")]
    cases.write_text(json.dumps({"cases": [c.to_json() for c in two]}))
    _, out, _ = cli("validate", "--cases", str(cases), "--json")
    _, slow, _ = cli("validate", "--cases", str(cases), "--calibration", str(path), "--json")
    a, b = json.loads(out)["cases"], json.loads(slow)["cases"]
    assert all(y["predicted_step_time_s"] > x["predicted_step_time_s"] for x, y in zip(a, b))


def test_a_calibrated_sweep_is_profile_at_every_point(cli):
    """The sweep's arrays follow the same formula as `profile --cost calibrated`, each point at
    its part's generation."""
    code, out, err = cli("sweep", "--tokens", "8192:32768:x2", "--hardware",
                         "h100-sxm,a100-sxm-80gb", "--cost", "calibrated")
    assert code == 0 and "MFU (calibrated)" in out, err
    from opgraph.analysis.sweep import compile_sweep, make_grid, run_grid
    from opgraph.core.symbols import S

    step = compile_step(preset("llama3-8b"))
    model = cost_model("calibrated")
    parts = [hardware.get("h100-sxm"), hardware.get("a100-sxm-80gb")]
    import numpy as np

    grid = make_grid({"tokens": np.array([8192, 16384, 32768])}, parts, step.seq_len)
    rows = run_grid(compile_sweep(step, cost=model), grid)
    for i in range(len(grid)):
        part = parts[int(rows["hardware"][i])]
        expect = evaluate(step, part, {"tokens": int(rows["tokens"][i]), S: step.seq_len},
                          cost=model).step_time_s
        assert rows["step_time_s"][i] == pytest.approx(expect, rel=1e-9)


def test_an_unaligned_gemm_runs_at_the_measured_fraction():
    """A GEMM whose N is not a multiple of 8 (GPT-2's 50,257-token head) runs cuBLAS's align-1
    kernels, on Hopper at `matmul_unaligned` of the aligned rate (0.16: measured on an H200,
    the head of benchmarks/device/h200/trace_gpt-4096-16l.json.gz at 0.123 of the peak where its
    layers ran at 0.770); Llama 3's 128,256 is aligned and pays only its waves and K overhead."""
    from opgraph.cost.costmodel import wave_quantum

    h200 = hardware.get("h200")
    e = attrs.evolve(HOPPER, launch_s=0, host_s=0, matmul_half_flops=0)
    cost = CalibratedCostModel(table={"hopper": e})

    def time(n):
        flops = 2 * 8192 * 4096 * n
        return cost.op_time(h200, "matmul", flops, 0, 1, h200.peak_flops, (1, 8192, n))

    def by_hand(n):  # 64 x 64 tiles over 132 SMs, K = 4,096 with 184 more a tile
        return (2 * 8192 * 4096 * n * wave_quantum(1, 8192, n, 132, 64, 64)
                * (4096 + 184) / 4096 / (e.matmul * h200.peak_flops))

    assert HOPPER.matmul_unaligned == 0.16
    assert time(128256) == pytest.approx(by_hand(128256), rel=1e-12)
    assert time(50257) == pytest.approx(by_hand(50257) / 0.16, rel=1e-12)
    assert calibration.catalog()["ampere"].matmul_unaligned == 1  # not measured there


def test_every_interpreter_pays_gpt2s_unaligned_head():
    """evaluate, the formula (a piecewise of N mod 8 over a symbolic N) and the sweep agree on
    GPT-2 under the calibrated model, whose head and its weight gradient have N = 50,257."""
    import numpy as np

    from opgraph.cost.formula import formula, value
    from opgraph.passes.evaluate import resolve
    from opgraph.analysis.sweep import compile_sweep

    step, cost, point = compile_step(preset("gpt2")), CalibratedCostModel(), {"B": 2, "S": 1024}
    one = evaluate(step, H100, point, cost=cost).step_time_s
    time = float(value(formula(step, "time", hardware=H100, cost=cost), resolve(step, point)))
    swept = compile_sweep(step, cost=cost).run(
        {"B": np.array([2.0]), "S": np.array([1024.0])}, H100.peak_flops, H100.bandwidth,
        H100.fp8_flops, cost.figures(H100))["step_time_s"][0]
    assert [time, swept] == pytest.approx([one, one], rel=1e-9)


def test_bench_shares_free_node_model_takes_what_the_schedule_passes():
    """`benchmarks/bench_shares.py --free-node` (docs/calibration.md's "Two camps" runs it)
    costs collectives inside a node at nothing and the others as shipped, called as
    `distributed._times` calls `comm_time` (with each collective's calls and launches)."""
    import importlib.util
    from pathlib import Path

    from opgraph import hardware
    from opgraph.cost.costmodel import cost_model
    from opgraph.parallel import cluster as clusters

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_shares.py"
    spec = importlib.util.spec_from_file_location("bench_shares", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    part = hardware.get("h100-sxm")
    cluster = clusters.for_hardware(part)
    shipped = cost_model("calibrated")
    free = module.FreeNode(table=shipped.table)
    inside, across = 8, 16  # GPUs of one node, of two
    assert free.comm_time("all_reduce", 2 ** 28, inside, cluster, 1, part, 1.0, 3) == 0.0
    assert free.comm_time("all_reduce", 2 ** 28, across, cluster, 1, part, 0.5, 3) == \
        shipped.comm_time("all_reduce", 2 ** 28, across, cluster, 1, part, 0.5, 3) > 0
