"""The README's Python example: the code block under "## Python" is python/examples/readme_torch.py
character for character, and the file runs. Without torch the run is skipped (saying so) and the
numpy twin python/examples/readme_numpy.py, the same program on numpy arrays, runs instead."""

import ast
import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
EXAMPLES = os.path.join(ROOT, "python", "examples")
MARKER = "rows per local expert:"


def _readme_python_blocks():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    m = re.search(r"^## Python\n(.*?)(?=^## )", text, re.S | re.M)
    assert m, "README.md has no '## Python' section"
    return re.findall(r"^```python\n(.*?)^```", m.group(1), re.S | re.M)


def _run(name):
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, name)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert MARKER in proc.stdout, proc.stdout
    counts = ast.literal_eval(proc.stdout.split(MARKER)[1].strip())
    # one list of E_local = 4 counts per rank, and every route lands somewhere: R * T * K = 2 * 16 * 2
    assert len(counts) == 2 and all(len(c) == 4 for c in counts), counts
    assert sum(sum(c) for c in counts) == 64, counts
    return proc.stdout


def test_readme_block_is_the_example_file():
    blocks = _readme_python_blocks()
    assert len(blocks) == 1, "expected one python block in the README's Python section, found %d" % len(blocks)
    with open(os.path.join(EXAMPLES, "readme_torch.py"), encoding="utf-8") as f:
        example = f.read()
    if blocks[0] != example:
        got, want = blocks[0].splitlines(), example.splitlines()
        i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        pytest.fail("README.md's Python block differs from python/examples/readme_torch.py at line %d:\n"
                    "  README: %r\n  file:   %r" % (i + 1, got[i] if i < len(got) else "<end>",
                                                   want[i] if i < len(want) else "<end>"))


def test_readme_torch_example():
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed: README example python/examples/readme_torch.py not run "
                    "(test_readme_numpy_example runs its numpy twin)")
    _run("readme_torch.py")


def test_readme_numpy_example():
    pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed (pip install ml_dtypes)")
    _run("readme_numpy.py")
