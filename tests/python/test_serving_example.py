"""The README's MoE-layer example: the code block under "## MoE layer in Python" is
python/examples/readme_serving.py character for character, and it runs (with torch; without it the
run is skipped, saying so, and the numpy twin python/examples/readme_serving_numpy.py runs instead)."""

import ast
import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
EXAMPLES = os.path.join(ROOT, "python", "examples")
MARKER = "prefill == decode on every rank; expert GEMMs:"


def _block():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    m = re.search(r"^## MoE layer in Python\n(.*?)(?=^## )", text, re.S | re.M)
    assert m, "README.md has no '## MoE layer in Python' section"
    blocks = re.findall(r"^```python\n(.*?)^```", m.group(1), re.S | re.M)
    assert len(blocks) == 1, "expected one python block in the section, found %d" % len(blocks)
    return blocks[0]


def _run(name):
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, name)], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert MARKER in proc.stdout, proc.stdout
    paths = ast.literal_eval(proc.stdout.split(MARKER)[1].strip())
    assert len(paths) == 2 and all(p in ("cpu-loops", "cublaslt-fp8-blockscaled", "cublaslt-dequant-bf16")
                                   for p in paths), paths
    return paths


def test_readme_block_is_the_example_file():
    with open(os.path.join(EXAMPLES, "readme_serving.py"), encoding="utf-8") as f:
        example = f.read()
    assert _block() == example, "README.md's MoE-layer block differs from python/examples/readme_serving.py"


def test_readme_serving_example():
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed: python/examples/readme_serving.py not run "
                    "(test_readme_serving_numpy_example runs its numpy twin)")
    _run("readme_serving.py")


def test_readme_serving_numpy_example():
    pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed (pip install ml_dtypes)")
    assert _run("readme_serving_numpy.py") == ["cpu-loops", "cpu-loops"]
