"""CTest entry point for the Python tests: exits 77 (CTest: skipped) when pytest or numpy is
missing, else runs pytest with the given arguments."""

import importlib.util
import sys

missing = [m for m in ("pytest", "numpy") if importlib.util.find_spec(m) is None]
if missing:
    print("SKIPPED: python test dependencies missing: %s (pip install %s)" % (", ".join(missing), " ".join(missing)))
    sys.exit(77)
if importlib.util.find_spec("elasticep") is None:
    print("FAILED: the elasticep package is not importable (PYTHONPATH should hold <build>/python)")
    sys.exit(1)

import pytest  # noqa: E402

sys.exit(pytest.main(sys.argv[1:]))
