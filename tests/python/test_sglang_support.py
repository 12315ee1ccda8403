"""What the SGLang dispatcher builds on, without torch (numpy, CPU backend): Buffer.settings, the
configuration as a structure (MoeDispatcher reads E, K, H, C, payload and scale format from it), and
MoeDispatcher.release, which drops a refused dispatch so the next one works."""

import numpy as np
import pytest

from conftest import ep, run_ranks

S = ep.serving


@pytest.mark.parametrize("payload,fmt", [("bf16", "f32_g128"), ("fp8", "f32_g128"), ("fp8", "ue8m0_g128"),
                                         ("fp8", "ue8m0_g32")])
def test_settings_are_the_buffers_configuration(payload, fmt):
    def body(r, g):
        b = ep.Buffer(g, 6, 3, 256, 5, payload=payload, scale_format=fmt, backend="cpu", timeout=12.5, num_sms=7)
        s = b.settings
        assert isinstance(s, ep._C.BufferConfig)
        assert (s.num_experts, s.num_topk, s.hidden, s.max_tokens_per_rank) == (6, 3, 256, 5)
        assert (s.payload, s.scale_format, s.topology, s.num_sms, s.timeout) == (payload, fmt, "direct", 7, 12.5)
        # a copy: changing it does not change the buffer
        s.num_topk = 1
        assert b.settings.num_topk == 3
        # the dispatcher reads its numbers from it
        d = S.MoeDispatcher(b)
        assert d._cfg == dict(num_experts=6, num_topk=3, hidden=256, max_tokens_per_rank=5, payload=payload,
                              scale_format=fmt)
        return True

    assert run_ranks(2, body) == [True, True]


def test_release_drops_the_pending_dispatch():
    g = ep.ThreadGroup(1)[0]
    d = S.MoeDispatcher(ep.Buffer(g, 4, 2, 128, 4, backend="cpu"))
    assert d.release() is False
    x = np.zeros((2, 128), np.uint16)
    idx = np.array([[0, 1], [2, 3]], np.int64)
    d.dispatch(x, idx, phase="decode")
    assert d.pending and d.release() is True and not d.pending
    with pytest.raises(ep.InvalidArgumentError, match="no dispatch is waiting"):
        d.combine(np.zeros((4, 4, 128), np.uint16))
    out = d.dispatch(x, idx, phase="prefill")  # the buffer takes a new dispatch: the handle was consumed
    assert d.combine(np.zeros(out.hidden_states.shape, np.uint16)).shape == (2, 128)
