"""A measured GEMM table sets a generation's matmul shape (`opgraph calibrate --gemms`)."""

import math
import pytest

from opgraph.cost import gemms
from opgraph.cost.costmodel import k_overhead, wave_quantum
from opgraph.core.errors import OpgraphError

H200_TABLE = gemms.locate("h200")  # opgraph/data/gemms_h200.csv, installed with opgraph


def test_the_k_overhead_is_k_plus_k0_over_k():
    """A GEMM of inner dimension K whose tiles each spend k0 more K steps outside the loop
    takes (K + k0) / K of its FLOPs' time; K is read back from FLOPs = 2 x count x M x N x K."""
    for count, m, n, k, k0 in ((1, 8192, 8192, 256, 128), (32, 128, 128, 4096, 184),
                               (4, 100, 300, 7, 1)):
        flops = 2 * count * m * n * k
        assert k_overhead(flops, count, m, n, k0) == pytest.approx((k + k0) / k, rel=1e-12)


def _planted(tile_m, tile_n, k0, matmul, peak=989.0, sms=132):
    """A table the shape model makes exactly: each GEMM's rate is matmul x peak over its waves
    and K overhead, written out by hand."""
    rows = []
    for m in (512, 2048, 8192):
        for n in (768, 4096, 14336):
            for k in (256, 1024, 8192):
                tiles = math.ceil(m / tile_m) * math.ceil(n / tile_n)
                waves = math.ceil(tiles / sms) * sms * tile_m * tile_n / (m * n)
                rows.append(gemms.Gemm(m, n, k, matmul * peak / (waves * (k + k0) / k)))
    return rows


def test_a_fit_recovers_the_tile_and_k_overhead_a_table_was_made_with():
    rows = _planted(128, 256, 96, 0.7)
    f = gemms.fit(rows, 989.0, 132)
    assert (f.tile_m, f.tile_n, f.k0) == (128, 256, 96)
    assert f.matmul == pytest.approx(0.7, rel=1e-9)
    assert f.mean_error < 1e-9


def test_judge_scores_a_wrong_model_by_how_far_it_misses():
    """Judged without waves or K overhead, a planted table's spread is the model's error: the
    rates differ by (K + k0) / K alone, so the flat model's worst miss is the extreme ratio
    against their geometric mean."""
    rows = _planted(64, 64, 128, 0.7)  # 64 x 64 tiles: waves near 1 at these sizes
    flat = gemms.judge(rows, 989.0, 132, 0, 0, 0)
    fitted = gemms.judge(rows, 989.0, 132, 64, 64, 128)
    assert fitted.mean_error < 1e-9 < flat.mean_error
    assert flat.worst_error > 0.2  # K = 256 runs 256 / 384 of K = 8192's 8192 / 8320


def test_the_table_reader_takes_columns_in_any_order_and_case(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("TFLOP/s,K,note,N,M,SM_MHz\n650.5,4096,x,4096,8192,1500\n\n")
    assert gemms.read(str(p)) == [gemms.Gemm(8192, 4096, 4096, 650.5, 1500.0)]


@pytest.mark.parametrize("text, message", [
    ("", "empty"),
    ("m,n,k\n1,2,3\n", "no tflops column"),
    ("m,n,k,tflops\n", "no rows"),
    ("m,n,k,tflops\n8192,4096,4096.5,600\n", "is not a whole number"),
    ("m,n,k,tflops\n8192,4096,4096,-1\n", "must be above 0"),
    ("m,n,k,tflops\n8192,4096,4096,nan\n", "must be above 0"),
    ("m,n,k,tflops\n8192,4096\n", "2 values where the header names 4"),
])
def test_a_bad_table_is_one_line_naming_the_place(tmp_path, text, message):
    p = tmp_path / "t.csv"
    p.write_text(text)
    with pytest.raises(OpgraphError, match=message) as e:
        gemms.read(str(p))
    assert "\n" not in str(e.value)


def test_the_cli_refuses_a_bad_table_with_exit_2_and_writes_nothing(cli, tmp_path):
    bad, out = tmp_path / "t.csv", tmp_path / "c.toml"
    bad.write_text("m,n,k\n1,2,3\n")
    code, _, err = cli("calibrate", "--gemms", str(bad), "--hardware", "h200", "--out", str(out))
    assert code == 2 and "no tflops column" in err and err.count("\n") == 1
    assert not out.exists()


def test_the_measured_h200_table_wants_a_k_overhead_and_few_waves():
    """On the GEMMs measured on an H200 (benchmarks/device/h200), the fitted shape explains
    the table better than one rate and better than 128 x 256 tiles without a K overhead (the
    tile cuBLAS's sm90 kernel names suggest): the rates fall with small K, not in waves."""
    rows = [g for g in gemms.read(H200_TABLE) if gemms.seconds(g) >= gemms.MIN_SECONDS]
    best = gemms.fit(rows, 989.0, 132)
    flat = gemms.judge(rows, 989.0, 132, 0, 0, 0)
    tiles = gemms.judge(rows, 989.0, 132, 128, 256, 0)
    assert 100 <= best.k0 <= 300
    assert best.mean_error < 0.6 * min(flat.mean_error, tiles.mean_error)
    assert tiles.mean_error > flat.mean_error  # one kernel's tile fits worse than one rate
    # 700 W holds the clock near 1,500 MHz: full waves run near 0.7 of the 989 TFLOP/s peak
    assert 0.65 < best.matmul < 0.78


def test_a_table_is_named_or_a_file(tmp_path):
    assert {"h200", "b200"} <= set(gemms.shipped())
    p = tmp_path / "mine.csv"
    p.write_text("m,n,k,tflops\n8192,8192,8192,700\n")
    assert gemms.locate(str(p)) == str(p)
    with pytest.raises(OpgraphError, match=r"no GEMM table 'h100'.*\(b200, h200\)"):
        gemms.locate("h100")


def test_calibrate_gemms_writes_a_calibration_the_model_reads(cli, tmp_path):
    from opgraph.cost import calibration

    out = tmp_path / "c.toml"
    code, text, _ = cli("calibrate", "--gemms", "h200", "--hardware", "h200", "--out", str(out))
    assert code == 0 and "fitted (" in text
    hopper = calibration.load(out)["hopper"]
    best = gemms.fit([g for g in gemms.read(H200_TABLE)
                      if gemms.seconds(g) >= gemms.MIN_SECONDS], 989.0, 132)
    assert (hopper.matmul_tile_m, hopper.matmul_tile_n, hopper.matmul_k_overhead) == (
        best.tile_m, best.tile_n, best.k0)
    # hopper's matmul is fitted to published runs, so the table's sustained rate is reported,
    # not written; a generation that does not fit it takes the table's
    assert hopper.matmul == calibration.catalog()["hopper"].matmul
    assert f"{best.matmul:.3f}" in text
    assert "measured" in dict(hopper.sources)["matmul_k_overhead"]


def test_a_calibrated_gemm_pays_its_waves_and_k_overhead():
    """The cost model's time of one GEMM is FLOPs x waves x (K + k0) / K over the sustained
    rate, plus the launch."""
    import attrs

    from opgraph.cost import calibration
    from opgraph import hardware
    from opgraph.cost.costmodel import CalibratedCostModel

    h200 = hardware.get("h200")
    e = attrs.evolve(calibration.catalog()["hopper"], matmul=0.7, matmul_half_flops=0,
                     matmul_tile_m=128, matmul_tile_n=128, matmul_k_overhead=150,
                     host_s=0)
    cost = CalibratedCostModel(table={"hopper": e})
    m, n, k = 8192, 1792, 512
    flops = 2 * m * n * k
    t = cost.op_time(h200, "matmul", flops, 0, 1, h200.peak_flops, (1, m, n))
    waves = wave_quantum(1, m, n, 132, 128, 128)  # 64 x 14 = 896 tiles, 7 waves of 132
    assert waves == 7 * 132 / 896
    assert t == pytest.approx(e.launch_s + flops * waves * (k + 150) / k
                              / (0.7 * h200.peak_flops), rel=1e-12)


def test_a_second_measurement_held_out_of_the_fit_is_predicted_by_the_shipped_shape():
    """The same GEMMs measured again on a fresh H200 (benchmarks/device/h200/results.json,
    run 5), which the shipped shape was not fitted to: Hopper's tile and K overhead predict them
    within 2.5% on average, well under one rate's error, and refit to the same values."""
    import json
    from pathlib import Path

    from opgraph.cost import calibration

    results = (Path(__file__).resolve().parents[1] / "benchmarks" / "device" / "h200"
               / "results.json")
    rows = [gemms.Gemm(g["M"], g["N"], g["K"], g["tflops"])
            for g in json.loads(results.read_text())["run5"]["gemm_clock"]]
    rows = [g for g in rows if gemms.seconds(g) >= gemms.MIN_SECONDS]
    hopper = calibration.catalog()["hopper"]
    shipped = gemms.judge(rows, 989.0, 132, int(hopper.matmul_tile_m), int(hopper.matmul_tile_n),
                          int(hopper.matmul_k_overhead))
    flat = gemms.judge(rows, 989.0, 132, 0, 0, 0)
    assert shipped.mean_error < 0.025 and shipped.mean_error < 0.6 * flat.mean_error
    refit = gemms.fit(rows, 989.0, 132)
    assert (refit.tile_m, refit.tile_n, refit.k0) == (hopper.matmul_tile_m, hopper.matmul_tile_n,
                                                      hopper.matmul_k_overhead)
