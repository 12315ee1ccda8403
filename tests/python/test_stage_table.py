"""tools/stage_table.py: per-kernel stage times of a hand-made log (two ranks, a "new" and a "base"
section), each figure recomputed here; the real log format of the CUDA backend's stage timer."""

import json
import os
import subprocess
import sys

import pytest

TOOL = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "stage_table.py")


def line(rank, phase, stage, med, mn):
    # the format of src/backends/cuda/stage_timer.cpp
    return "[elasticep] stage times rank %d %-22s median %9.1f us  min %9.1f us  (23 calls)" % (
        rank, phase + " " + stage, med, mn)


def test_medians_minimums_and_change(tmp_path):
    log = "\n".join([
        "### new: decode T=128",
        line(0, "dispatch", "plan", 20.0, 10.0), line(1, "dispatch", "plan", 30.0, 12.0),
        line(2, "dispatch", "plan", 26.0, 9.0),
        line(0, "dispatch", "host read of M", 5.0, 4.0),
        "unrelated output",
        "### base: decode T=128",
        line(0, "dispatch", "plan", 50.0, 40.0), line(1, "dispatch", "plan", 40.0, 30.0),
    ])
    p = tmp_path / "stages.log"
    p.write_text(log)
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, TOOL, str(p), "--json", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    rows = {(r["section"], r["stage"]): r for r in json.load(open(out))["rows"]}
    plan = rows[("new: decode T=128", "plan")]
    assert plan["ranks"] == 3 and plan["median_us"] == 26.0 and plan["min_us"] == 9.0  # median of 20, 26, 30
    assert plan["base_median_us"] == 45.0 and plan["base_min_us"] == 30.0  # median of 40, 50
    assert plan["change"] == pytest.approx((26.0 - 45.0) / 45.0)
    host = rows[("new: decode T=128", "host read of M")]  # a stage name with spaces; no base figure
    assert host["median_us"] == 5.0 and host["base_median_us"] is None
    assert not any(s.startswith("base:") for s, _ in rows)  # base rows are joined, not listed
    assert "| new: decode T=128 | dispatch plan | 3 | 26.0 | 9.0 | 45.0 | 30.0 | -42.2 % |" in proc.stdout


def test_a_log_without_stage_times_is_an_error(tmp_path):
    p = tmp_path / "empty.log"
    p.write_text("### new: decode T=128\nnothing here\n")
    proc = subprocess.run([sys.executable, TOOL, str(p)], capture_output=True, text=True)
    assert proc.returncode != 0 and "no stage times" in proc.stderr
