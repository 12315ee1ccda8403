"""Runs the README's Python example exactly as printed (python/examples/readme_torch.py) when torch is
installed, else its numpy twin (python/examples/readme_numpy.py)."""

import os
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "python", "examples")


def _run(name):
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, name)], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rows per local expert:" in proc.stdout
    counts = eval(proc.stdout.split("rows per local expert:")[1].strip())  # noqa: S307 - our own output
    # every route lands somewhere: the per-rank local counts add up to R * T * K = 2 * 16 * 2
    assert sum(sum(c) for c in counts) == 64, counts
    return proc.stdout


def test_readme_torch_example():
    pytest.importorskip("torch")
    _run("readme_torch.py")


def test_readme_numpy_example():
    pytest.importorskip("ml_dtypes")
    _run("readme_numpy.py")
