"""The hardware catalog against its datasheets, `opgraph hardware`, and users' own files."""

import json

import attrs
import pytest

from opgraph import hardware

# Datasheet figures. NVIDIA and AMD print tensor-core peaks with 2:4 structured sparsity
# (NVIDIA marks them with an asterisk); the dense peak the catalog stores is half of that, or the
# dense figure where the datasheet prints one beside it (L40S).
# id: (BF16 TFLOP/s dense, FP8 TFLOP/s dense or None, bandwidth TB/s, memory GB)
DATASHEETS = {
    "h100-sxm": (1979 / 2, 3958 / 2, 3.35, 80),  # NVIDIA H100 datasheet, H100 SXM
    "h100-pcie": (1513 / 2, 3026 / 2, 2.0, 80),  # NVIDIA H100 datasheet, H100 PCIe
    "h200": (1979 / 2, 3958 / 2, 4.8, 141),  # NVIDIA H200 datasheet, H200 SXM
    "a100-sxm-80gb": (624 / 2, None, 2.039, 80),  # NVIDIA A100 datasheet, A100 80GB SXM
    "a100-sxm-40gb": (624 / 2, None, 1.555, 40),  # NVIDIA A100 datasheet, A100 40GB SXM
    "b200": (4500 / 2, 9000 / 2, 7.7, 180),  # NVIDIA HGX B200 datasheet, per GPU
    # NVIDIA GB200 NVL72 datasheet, per rack of 72 GPUs: 360 PFLOPS BF16* and 720 FP8*, 576 TB/s,
    # up to 13.4 TB of HBM3e (186 GB a GPU, rounded down)
    "gb200": (360e3 / 72 / 2, 720e3 / 72 / 2, 576 / 72, 186),
    # NVIDIA GB300 NVL72, per rack, as third-party pages quote it (the part's source names
    # them): the GB200 NVL72's 360 and 720 PFLOPS with sparsity, 576 TB/s, up to 20 TB
    "gb300": (360e3 / 72 / 2, 720e3 / 72 / 2, 576 / 72, 277),
    "mi300x": (2614.9 / 2, 5229.8 / 2, 5.3, 192),  # AMD Instinct MI300X datasheet
    # AMD Instinct MI325X, as third-party pages quote its datasheet (the part's source names them)
    "mi325x": (2614.9 / 2, 5229.8 / 2, 6.0, 256),
    "l40s": (362.05, 733, 0.864, 48),  # NVIDIA L40S datasheet: 362.05 | 733*, 733 | 1,466*
    "l4": (242 / 2, 485 / 2, 0.3, 24),  # NVIDIA L4 datasheet (GDDR6)
    # H800: no datasheet; the H100 SXM5's die and figures with NVLink cut (DeepSeek-V3 report)
    "h800": (1979 / 2, 3958 / 2, 3.35, 80),
    # Meta's Grand Teton H100: no datasheet; torchtitan's benchmark page gives 96 GB of HBM2e
    # at 2.4 TB/s, the SXM5's peaks assumed
    "h100-sxm-96gb": (1979 / 2, 3958 / 2, 2.4, 96),
}


@pytest.mark.parametrize("part_id", sorted(DATASHEETS))
def test_catalog_stores_dense_datasheet_figures(part_id):
    bf16, fp8, bandwidth, memory = DATASHEETS[part_id]
    part = hardware.get(part_id)
    assert part.peak_flops == pytest.approx(bf16 * 1e12, rel=1e-3)
    if fp8 is None:
        assert part.fp8_flops is None
    else:
        assert part.fp8_flops == pytest.approx(fp8 * 1e12, rel=1e-3)
    assert part.bandwidth == pytest.approx(bandwidth * 1e12)
    assert part.memory_bytes == pytest.approx(memory * 1e9)
    assert "datasheet" in part.source


# Dense BF16 FLOP per clock per SM (AMD: per CU): A100 whitepaper, 1,024 FP16 FMA/clock/SM;
# H100 whitepaper, twice A100's per SM per clock; Ada, 512 FMA; MI300X, 2,048 per CU.
PER_SM_CLOCK = {"ampere": 2048, "hopper": 4096, "ada": 1024, "cdna3": 2048}


@pytest.mark.parametrize("part_id", sorted(DATASHEETS))
def test_the_peak_is_sms_times_their_rate_at_the_boost_clock(part_id):
    part = hardware.get(part_id)
    assert part.sms and part.tdp_w, part_id  # every part can be power-capped
    if part.boost_mhz is not None:
        assert part.peak_flops == pytest.approx(
            part.sms * PER_SM_CLOCK[part.generation] * part.boost_mhz * 1e6, rel=2e-3)


def test_a_power_cap_scales_the_clock_as_its_cube_root():
    """Dynamic power C V^2 f with V ~ f: a part capped at P of its TDP sustains (P / TDP)^(1/3)
    of its clock; torchtitan's 500 W H100s (TDP 700 W) about 89%."""
    h100 = hardware.get("h100-sxm")
    assert h100.clock_ratio == 1.0
    capped = hardware.with_power_limit(h100, 500)
    assert capped.clock_ratio == pytest.approx((500 / 700) ** (1 / 3))
    assert capped.peak_flops == h100.peak_flops  # the datasheet's peak, MFU's denominator
    assert "capped at 500 W" in capped.describe()
    assert hardware.with_power_limit(h100, 700).clock_ratio == 1.0
    assert hardware.with_clock(h100, 1830 / 2).clock_ratio == pytest.approx(0.5)


@pytest.mark.parametrize("call, says", [
    (lambda p: hardware.with_power_limit(p, 800), "at most its TDP, 700 W"),
    (lambda p: hardware.with_power_limit(p, 0), "above 0"),
    (lambda p: hardware.with_clock(p, 2000), "at most its boost clock, 1830 MHz"),
    (lambda p: hardware.with_headroom(p, 80), "leaves nothing of h100-sxm's 80 GB"),
    (lambda p: hardware.with_headroom(p, -1), "from 0 to below it"),
    (lambda p: hardware.with_headroom(attrs.evolve(p, memory_bytes=None), 8), "no memory_gb"),
])
def test_a_bad_power_limit_clock_or_headroom_is_one_line(call, says):
    from opgraph.core.errors import OpgraphError

    with pytest.raises(OpgraphError, match=says) as e:
        call(hardware.get("h100-sxm"))
    assert "\n" not in str(e.value)


def test_catalog_has_every_part():
    assert set(hardware.catalog()) == set(DATASHEETS)


def test_hardware_command(cli):
    code, out, _ = cli("hardware", "--json")
    assert code == 0
    rows = {r["id"]: r for r in json.loads(out)}
    assert set(rows) == set(DATASHEETS)
    assert rows["mi300x"]["bf16_flops_dense"] == pytest.approx(1307.45e12, rel=1e-3)
    assert rows["a100-sxm-80gb"]["fp8_flops_dense"] is None
    code, out, _ = cli("hardware")
    assert code == 0 and "dense" in out
    for part_id in DATASHEETS:
        assert f"\n{part_id} " in out


def test_a_users_file_is_listed(cli, tmp_path):
    path = tmp_path / "parts.toml"
    path.write_text('[a]\nbf16_tflops = 100\nbandwidth_tbs = 1\n'
                    '[b]\nname = "B"\nbf16_tflops = 200\nbandwidth_tbs = 2\nmemory_gb = 16\n')
    code, out, _ = cli("hardware", str(path), "--json")
    assert code == 0
    rows = json.loads(out)
    assert [r["id"] for r in rows] == ["a", "b"]
    assert rows[1]["memory_bytes"] == 16e9 and rows[0]["memory_bytes"] is None


@pytest.mark.parametrize("text, needle", [
    ("[gpu\n", "not valid TOML"),
    ("[gpu]\nbf16_tflops = 100\n", "missing bandwidth_tbs"),
    ("[gpu]\nbf16_tflops = -5\nbandwidth_tbs = 2\n", "bf16_tflops = -5"),
    ("[gpu]\nbf16_tflops = 'fast'\nbandwidth_tbs = 2\n", "bf16_tflops = 'fast'"),
    ("[gpu]\nbf16_tflops = 100\nbandwidth_tbs = 2\nmemory_gb = true\n", "memory_gb"),
    ("", "defines no part"),
    ("x = 1\n[gpu]\nbf16_tflops = 100\nbandwidth_tbs = 2\n", "[x] must be a table"),
])
def test_a_malformed_file_is_one_line(cli, tmp_path, text, needle):
    path = tmp_path / "gpu.toml"
    path.write_text(text)
    for argv in (["hardware", str(path)], ["profile", "--hardware", str(path)]):
        code, out, err = cli(*argv)
        assert code == 2 and out == ""
        assert err.count("\n") == 1 and err.startswith("opgraph: error: ")
        assert needle in err and str(path) in err


def test_a_misspelt_key_in_a_hardware_file_is_an_error(tmp_path, cli):
    """A typo must not leave a figure at its default silently (memory_gbs: capacity unknown)."""
    path = tmp_path / "mine.toml"
    path.write_text("[mine]\nbf16_tflops = 100\nbandwidth_tbs = 2\nmemory_gbs = 40\n")
    code, _out, err = cli("profile", "--hardware", str(path))
    assert code == 2 and err.count("\n") == 1 and "unknown key 'memory_gbs'" in err
