"""python -m elasticep.bench --moe-layer (python/elasticep/moe_bench.py) on the CPU backend at a small
shape: the report's structure, its arithmetic (shares, totals, the communication share from the
stage medians), the scenario it ran, the table next to a JSON file, and one-line usage errors.
The --deepgemm mode needs a Hopper GPU and deep_gemm (tests/python/test_deepgemm.py covers its FFN)."""

import json
import os
import subprocess
import sys

import pytest

np = pytest.importorskip("numpy")
ep = pytest.importorskip("elasticep")

SMALL = ["--moe-layer", "--backend", "cpu", "--hidden", "256", "--intermediate", "128", "--experts", "8", "--topk",
         "2", "--tokens", "5", "--rounds", "3", "--warmup", "1"]


def bench(*args, check_rc=0):
    proc = subprocess.run([sys.executable, "-m", "elasticep.bench", *args], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ))
    if check_rc is not None:
        assert proc.returncode == check_rc, proc.stdout + proc.stderr
    return proc


def check_report(rep, phase, ranks, quant):
    sc = rep["scenario"]
    assert (sc["phase"], sc["ranks"], sc["tokens"], sc["hidden"], sc["intermediate"], sc["experts"], sc["topk"],
            sc["quant"], sc["rounds"]) == (phase, ranks, 5, 256, 128, 8, 2, quant, 3)
    assert rep["backend"] == "cpu" and rep["agreement"] is None
    [p] = rep["paths"]
    assert p["path"] == "reference" and p["gemm"].startswith("cpu-loops")
    assert list(p["stages"]) == ["dispatch", "experts", "combine"]
    for s in p["stages"].values():
        assert 0 < s["min_us"] <= s["median_us"] <= s["max_us"]
    total = sum(s["median_us"] for s in p["stages"].values())
    assert p["total_us"] == pytest.approx(total)
    assert sum(s["share"] for s in p["stages"].values()) == pytest.approx(1.0)
    comm = (p["stages"]["dispatch"]["median_us"] + p["stages"]["combine"]["median_us"]) / total
    assert p["communication_share"] == pytest.approx(comm)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("quant", ["fp8", "none"])
def test_moe_layer_bench_on_cpu(phase, quant):
    rep = json.loads(bench(*SMALL, "--phase", phase, "--quant-config", quant, "--ranks", "2", "--json").stdout)
    check_report(rep, phase, 2, quant)


def test_table_and_json_file(tmp_path):
    f = tmp_path / "moe.json"
    out = bench(*SMALL, "--ranks", "4", "--json", str(f)).stdout
    rep = json.loads(f.read_text())
    check_report(rep, "prefill", 4, "fp8")
    share = "%.1f%%" % (100 * rep["paths"][0]["communication_share"])
    assert "communication (dispatch + combine) " + share in out, out


def test_usage_errors_are_one_line():
    for args, want in ((["--experts", "7", "--ranks", "2"], "--experts 7 is not a multiple of --ranks 2"),
                       (["--hidden", "200"], "multiples of 128"),
                       (["--deepgemm"], "--deepgemm needs the CUDA backend"),
                       (["--tokens", "9", "--capacity", "8"], "below --tokens")):
        proc = bench("--moe-layer", "--backend", "cpu", *args, check_rc=2)
        assert proc.stderr.strip().count("\n") == 0 and want in proc.stderr, proc.stderr
