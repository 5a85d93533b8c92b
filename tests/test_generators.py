"""Fixed schedules reach the papers' bubble and memory figures at equal costs (pure Python)."""

import pytest

from zbjax.schedules import Costs, build, parse_actions, simulate, span_bubble_rate, v_placement
from zbjax.schedules.generators import (
    gpipe,
    interleaved_one_f_one_b,
    one_f_one_b,
    zb_h1,
    zb_h2,
    zb_v,
)

UNIT = Costs(f=1.0, b=1.0, w=1.0, comm=0.0)
DEVICES = range(2, 17)


def _microbatches(p: int) -> list[int]:
    """Returns a few microbatch counts around the pipeline depth p."""
    return sorted({1, p - 1 or 1, p, p + 1, 2 * p, 3 * p + 2})


def test_gpipe_bubble_is_p_minus_1_over_m_plus_p_minus_1_and_peak_is_m():
    for p in DEVICES:
        for m in _microbatches(p):
            r = simulate(gpipe(p, m), UNIT)
            assert r.bubble_rate == pytest.approx((p - 1) / (m + p - 1))
            assert max(r.peak_memory) == m


def test_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1_and_peak_is_p():
    for p in DEVICES:
        for m in _microbatches(p):
            r = simulate(one_f_one_b(p, m), UNIT)
            assert r.bubble_rate == pytest.approx((p - 1) / (m + p - 1)), (p, m)
            assert max(r.peak_memory) == min(p, m)


def test_zb_h1_bubble_is_p_minus_1_over_3m_plus_p_minus_1_with_1f1b_memory():
    # The formula is the paper's for m >= p; with fewer microbatches the B chain of a single
    # microbatch (2p + 1 actions) is longer than 3m + p - 1.
    for p in DEVICES:
        for m in [p, p + 1, 2 * p - 1, 2 * p, 3 * p + 2]:
            s = zb_h1(p, m)
            r = simulate(s, UNIT)
            assert r.bubble_rate == pytest.approx((p - 1) / (3 * m + p - 1)), (p, m)
            assert max(r.peak_memory) == p


def test_zb_h2_has_no_bubble_inside_any_device_span_for_m_at_least_2p():
    # Device d cannot start before d forwards are done, so the strict bubble keeps that start
    # offset: (p-1)/(3m+p-1), the lower bound of every schedule. Inside each device's span
    # there is no idle time at all (the paper's zero bubble).
    for p in DEVICES:
        for m in [2 * p, 2 * p + 1, 3 * p + 2]:
            s = zb_h2(p, m)
            r = simulate(s, UNIT)
            assert span_bubble_rate(s, r) == pytest.approx(0.0, abs=1e-12), (p, m)
            assert r.bubble_rate == pytest.approx((p - 1) / (3 * m + p - 1))
            assert max(r.peak_memory) <= 2 * p - 1


def test_zb_h1_keeps_idle_time_inside_spans_that_zb_h2_removes():
    p, m = 4, 8
    h1, h2 = zb_h1(p, m), zb_h2(p, m)
    assert span_bubble_rate(h1, simulate(h1, UNIT)) > 0.05
    assert span_bubble_rate(h2, simulate(h2, UNIT)) == pytest.approx(0.0, abs=1e-12)


def test_interleaved_bubble_is_p_minus_1_over_vm_plus_p_minus_1_for_m_a_multiple_of_p():
    for p in range(2, 9):
        for v in (2, 3, 4):
            for m in (p, 2 * p, 3 * p):
                s = interleaved_one_f_one_b(v * p, m, num_devices=p)
                r = simulate(s, UNIT)
                assert r.bubble_rate == pytest.approx((p - 1) / (v * m + p - 1)), (p, v, m)


def test_interleaved_places_stages_in_a_loop_and_defaults_to_two_per_device():
    s = interleaved_one_f_one_b(8, 4)
    assert s.num_devices == 4
    assert s.placement == (0, 1, 2, 3, 0, 1, 2, 3)


def test_zb_v_reaches_the_makespan_lower_bound_6m_plus_p_minus_1():
    # 2p stages of cost 1 each; device p-1 cannot start before p-1 forwards, and then has
    # 6m units of work, so (p-1)/(6m+p-1) is the smallest possible bubble.
    for p in range(2, 13):
        for m in [2 * p, 2 * p + 1, 3 * p + 1, 4 * p]:
            s = zb_v(2 * p, m)
            r = simulate(s, UNIT)
            assert r.bubble_rate == pytest.approx((p - 1) / (6 * m + p - 1)), (p, m)
            # 2p stage units = p units of a whole device's model, the paper's p M_B.
            assert max(r.peak_memory) <= 2 * p


def test_zb_v_places_stages_in_a_v():
    assert v_placement(3) == (0, 1, 2, 2, 1, 0)
    s = zb_v(6, 6)
    assert s.placement == (0, 1, 2, 2, 1, 0)
    assert {a.stage for a in s.actions[0]} == {0, 5}


def test_fused_schedules_use_bw_and_zero_bubble_schedules_use_b_and_w():
    for name in ("gpipe", "1f1b", "interleaved-1f1b"):
        kinds = {a.kind for _, _, a in build(name, 4, 4).all_actions()}
        assert kinds == {"F", "BW"}, name
    for name in ("zb-h1", "zb-h2", "zb-v"):
        kinds = {a.kind for _, _, a in build(name, 4, 4).all_actions()}
        assert kinds == {"F", "B", "W"}, name


def test_1f1b_device_0_warms_up_with_p_minus_1_forwards():
    s = one_f_one_b(4, 8)
    assert s.actions[0][:5] == parse_actions("0F0 0F1 0F2 0F3 0BW0")[0]
    assert s.actions[3][:3] == parse_actions("3F0 3BW0 3F1")[0]
