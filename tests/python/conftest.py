"""Shared helpers: run one function per rank in Python threads (the ThreadGroup model)."""

import os
import sys
import threading

import pytest

sys.path.insert(0, os.path.dirname(__file__))

np = pytest.importorskip("numpy")
ep = pytest.importorskip("elasticep")


def run_ranks_raw(num_ranks, fn, timeout=120.0, group_timeout=20.0):
    """Runs fn(rank, group) in num_ranks threads over one ThreadGroup; returns (results, errors),
    one entry per rank, without raising."""
    groups = ep.ThreadGroup(num_ranks, timeout=group_timeout)
    results = [None] * num_ranks
    errors = [None] * num_ranks

    def body(r):
        try:
            results[r] = fn(r, groups[r])
        except BaseException as e:  # noqa: BLE001 - returned to the caller
            errors[r] = e

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(num_ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a rank thread hung"
    return results, errors


def run_ranks(num_ranks, fn, timeout=120.0, group_timeout=20.0):
    """Runs fn(rank, group) in num_ranks threads; returns the per-rank results, or re-raises the
    first rank's exception (with the rank noted)."""
    results, errors = run_ranks_raw(num_ranks, fn, timeout, group_timeout)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        # the root cause first: a rank that failed on its own, not one that timed out waiting for it
        failed.sort(key=lambda re: isinstance(re[1], ep.TimeoutError))
        r, e = failed[0]
        lines = ["rank %d raised %s: %s" % (q, type(x).__name__, x) for q, x in failed]
        raise AssertionError("\n".join(lines)) from e
    return results


@pytest.fixture
def ranks():
    return run_ranks
