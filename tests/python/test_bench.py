"""python -m elasticep.bench (python/elasticep/bench.py) and the `elasticep` launcher (__main__.py):
byte counts recomputed here from the scenario, the same counts as the C++ `elasticep bench` for the
same options (when the CLI is built: ELASTICEP_CLI), a comparison that can fail, one-line errors."""

import json
import os
import subprocess
import sys

import pytest

np = pytest.importorskip("numpy")
ep = pytest.importorskip("elasticep")

TINY = ["--framework", "numpy", "--rounds", "2", "--warmup", "1", "--no-progress", "--backend", "cpu"]


def bench(*args, check_rc=0):
    proc = subprocess.run([sys.executable, "-m", "elasticep.bench", *args], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ))
    if check_rc is not None:
        assert proc.returncode == check_rc, proc.stdout + proc.stderr
    return proc


def round16(v):
    return (v + 15) // 16 * 16


def test_every_token_to_every_rank_counts_by_hand():
    # K = E: each token goes to all R ranks: R*T*(R-1) peer and R*T local messages, K*R*T routes
    r, t, h, k = 3, 5, 64, 6
    out = bench("--ranks", str(r), "--tokens", str(t), "--hidden", str(h), "--experts", "6", "--topk", str(k),
                "--payload", "bf16", "--json", *TINY)
    rep = json.loads(out.stdout)
    row = rep["results"][0]
    msg = round16(h * 2) + 2 * round16(k * 4) + 16
    assert row["message_bytes"] == msg
    assert row["traffic"]["peer_messages"] == r * t * (r - 1)
    assert row["traffic"]["local_messages"] == r * t
    assert row["routes_per_round"] == r * t * k
    d, c = row["phases"]["dispatch"], row["phases"]["combine"]
    assert d["peer_bytes"] == r * t * (r - 1) * msg
    assert c["peer_bytes"] == r * t * (r - 1) * h * 2
    # rows written once: x (bf16) + every received row; every row of y + the output
    assert d["hbm_min_bytes"] == r * t * h * 2 + k * r * t * h * 2
    assert c["hbm_min_bytes"] == k * r * t * h * 2 + r * t * h * 2
    assert len(d["latency_us"]["rounds"]) == 2 and len(d["back_to_back_us"]["rounds"]) == 2
    assert rep["verified"] is None  # the CPU backend is the reference: nothing independent to compare with


def test_rows_follow_the_token_list():
    out = bench("--ranks", "2", "--tokens", "4,0,3", "--hidden", "128", "--experts", "4", "--topk", "2",
                "--payload", "fp8", "--json", *TINY)
    rows = json.loads(out.stdout)["results"]
    assert [r["tokens"] for r in rows] == [4, 0, 3]
    assert rows[1]["traffic"]["routes"] == 0 and rows[1]["phases"]["dispatch"]["peer_bytes"] == 0
    # fp8 f32_g128 at H=128: payload 128 + one fp32 scale (16) + ids 16 + weights 16 + source 16
    assert rows[0]["message_bytes"] == 128 + 16 + 16 + 16 + 16


def test_comparison_passes_and_catches_an_altered_byte():
    args = ["--ranks", "3", "--tokens", "6", "--hidden", "256", "--experts", "6", "--topk", "3", "--verify-cpu", *TINY]
    ok = bench(*args, "--layout", "masked")
    assert "summary: PASS" in ok.stdout, ok.stdout
    for phase in ("dispatch", "combine"):
        bad = bench(*args, "--inject-mismatch", phase, check_rc=1)
        assert "summary: FAIL" in bad.stdout and ("rank 0 round 1 %s" % phase) in bad.stdout, bad.stdout


@pytest.mark.parametrize("argv, message", [
    (["--ranks", "0"], "error: --ranks must be >= 1, got 0"),
    (["--topk", "40"], "error: --topk must be in [1, 32], got 40"),
    (["--alignment", "100000"], "error: --alignment must be in [1, 65536], got 100000"),
    (["--tokens", "8", "--capacity", "4"], "error: --max-tokens-per-rank 4 is below --tokens 8"),
    (["--experts", "9"], "error: --experts 9 is not a multiple of --ranks 8"),
    # the library's own check, raised inside the rank threads: one line, no traceback
    (["--hidden", "100", "--payload", "bf16", "--tokens", "2", "--ranks", "2", "--experts", "4", "--topk", "2"],
     "error: hidden=100 must be a multiple of 8"),
])
def test_errors_are_one_line(argv, message):
    proc = bench(*argv, *TINY, check_rc=2)
    assert proc.stderr.startswith(message), proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr


def test_json_into_a_missing_folder_fails_before_the_run(tmp_path):
    proc = bench("--json", str(tmp_path / "no" / "such" / "out.json"), *TINY, check_rc=2)
    assert "cannot open it for writing" in proc.stderr and proc.stdout == "", proc.stdout + proc.stderr


def test_json_file_and_table(tmp_path):
    path = tmp_path / "out.json"
    out = bench("--ranks", "2", "--tokens", "3", "--hidden", "64", "--experts", "4", "--topk", "2", "--payload",
                "bf16", "--json", str(path), *TINY)
    assert "summary:" in out.stdout
    assert json.loads(path.read_text())["results"][0]["tokens"] == 3


@pytest.mark.skipif(not os.environ.get("ELASTICEP_CLI"), reason="ELASTICEP_CLI (the C++ elasticep) not given")
def test_same_counts_as_the_cpp_bench():
    # the old Python bench estimated 14.68 MB where the C++ one counted 13.65 MB for one shape; both now
    # use the library's count over the same routing generator
    shape = ["--ranks", "4", "--tokens", "16,5", "--hidden", "512", "--experts", "32", "--topk", "8", "--payload",
             "fp8", "--skew", "0.8", "--drop", "0.1", "--seed", "3", "--rounds", "1", "--warmup", "0", "--backend",
             "cpu"]
    py = json.loads(bench(*shape, "--framework", "numpy", "--json").stdout)
    cpp = subprocess.run([os.environ["ELASTICEP_CLI"], "bench", *shape, "--json", "--no-progress"],
                         capture_output=True, text=True, timeout=300)
    assert cpp.returncode == 0, cpp.stdout + cpp.stderr
    cpp = json.loads(cpp.stdout)
    for a, b in zip(py["results"], cpp["results"]):
        for key in ("tokens", "routes", "peer_messages", "local_messages", "message_bytes", "dispatch_peer_bytes",
                    "combine_peer_bytes", "dispatch_hbm_bytes", "combine_hbm_bytes", "dispatch_min_hbm_bytes",
                    "combine_min_hbm_bytes"):
            assert a["traffic"][key] == b["traffic"][key], (key, a["traffic"], b["traffic"])
        assert b["verified"] is True


def test_launcher_without_the_cpp_cli(monkeypatch, capsys):
    from elasticep import __main__ as launcher

    monkeypatch.setattr(launcher, "_cli", lambda: None)
    assert launcher.main(["info"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("elasticep %s\n" % ep.__version__) and "backends compiled:" in text
    assert launcher.main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err
    assert launcher.main(["bench", "--ranks", "2", "--tokens", "2", "--hidden", "64", "--experts", "4", "--topk",
                          "2", "--payload", "bf16", *TINY]) == 0
    assert "summary:" in capsys.readouterr().out
