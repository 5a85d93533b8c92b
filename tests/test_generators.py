"""Fixed schedules reach the papers' bubble and memory figures at equal costs (pure Python)."""

import sys

import numpy as np
import pytest

from zbjax.errors import ScheduleError
from zbjax.schedules import (
    SCHEDULE_NAMES,
    Costs,
    build,
    parse_actions,
    simulate,
    span_bubble_rate,
    v_placement,
)
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
        for m in [p, p + 1, 2 * p - 1, 2 * p, 2 * p + 1, 3 * p + 1, 4 * p]:
            s = zb_v(2 * p, m)
            r = simulate(s, UNIT)
            assert r.bubble_rate == pytest.approx((p - 1) / (6 * m + p - 1)), (p, m)
            # 2p stage units = p units of a whole device's model, the paper's p M_B.
            assert max(r.peak_memory) <= 2 * p


def test_zb_v_has_no_bubble_inside_any_device_span_for_m_at_least_2p():
    for p in range(2, 13):
        for m in [2 * p, 2 * p + 1, 3 * p + 1, 4 * p]:
            s = zb_v(2 * p, m)
            assert span_bubble_rate(s, simulate(s, UNIT)) == pytest.approx(0.0, abs=1e-12)


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


# ---------------------------------------------------------------- build(): names, defaults, errors

# PyTorch's pipelining test grid: (stages per device, microbatches, devices).
TORCH_GRID = [
    (2, 2, 2), (2, 4, 4), (2, 8, 2), (2, 8, 4), (2, 8, 8), (4, 4, 4), (4, 8, 4), (4, 8, 8),
    (4, 16, 4), (4, 32, 4), (4, 64, 4), (4, 16, 16), (4, 32, 32), (4, 128, 64), (3, 2, 2),
    (3, 8, 2), (3, 12, 4), (4, 6, 3), (4, 10, 5), (2, 3, 4), (2, 10, 4), (2, 15, 4),
]  # fmt: skip


def test_schedule_names_are_the_contract():
    assert SCHEDULE_NAMES == (
        "gpipe",
        "1f1b",
        "interleaved-1f1b",
        "zb-h1",
        "zb-h2",
        "zb-v",
        "zb-auto",
    )


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "zb-h2"])
def test_single_stage_schedules_run_on_the_torch_grid(name):
    for _, m, p in TORCH_GRID:
        s = build(name, p, m)
        r = simulate(s)
        assert s.num_devices == p and r.makespan > 0
        assert sum(r.busy) == pytest.approx(3 * p * m)


def test_interleaved_runs_on_the_torch_grid_with_its_stages_per_device():
    for v, m, p in TORCH_GRID:
        s = build("interleaved-1f1b", v * p, m, num_devices=p)
        r = simulate(s)
        assert s.placement == tuple(st % p for st in range(v * p))
        assert sum(r.busy) == pytest.approx(3 * v * p * m)


def test_zb_v_runs_on_the_torch_grid_where_a_device_holds_2_stages_and_says_why_elsewhere():
    for v, m, p in TORCH_GRID:
        if v == 2:
            s = build("zb-v", 2 * p, m)
            assert s.num_devices == p
            assert simulate(s).makespan >= 6 * m
        else:
            with pytest.raises(ScheduleError, match="exactly 2 stages per device"):
                build("zb-v", v * p, m, num_devices=p)


def test_built_schedules_record_the_memory_limit_and_w_mem():
    s = build("zb-h1", 4, 8, mem_limit=4.0, w_mem=0.25)
    assert s.mem_limit == 4.0 and s.w_mem == 0.25
    assert build("1f1b", 4, 8).mem_limit is None


def test_a_tighter_memory_limit_shrinks_the_zero_bubble_warm_up():
    for name, p, default in (("zb-h1", 4, 4.0), ("zb-h2", 4, 7.0), ("zb-v", 8, 8.0)):
        for limit in (2.0, 3.0, default):
            s = build(name, p, 12, mem_limit=limit)
            assert max(simulate(s).peak_memory) <= limit, (name, limit)
    tight = simulate(build("zb-h2", 4, 12, mem_limit=4.0))
    assert tight.bubble_rate > simulate(build("zb-h2", 4, 12)).bubble_rate


def test_interleaved_defaults_to_two_stages_per_device_and_explains_odd_counts():
    assert build("interleaved-1f1b", 8, 8).num_devices == 4
    with pytest.raises(ScheduleError, match="pass num_devices"):
        build("interleaved-1f1b", 5, 8)
    with pytest.raises(ScheduleError, match="not a multiple of num_devices = 4"):
        build("interleaved-1f1b", 10, 8, num_devices=4)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(name="zb-h3", num_stages=4, num_microbatches=8), "zb-h1, zb-h2, zb-v"),
        (dict(name="1f1b", num_stages=0, num_microbatches=8), "num_stages = 0"),
        (dict(name="zb-h1", num_stages=4, num_microbatches=0), "num_microbatches = 0"),
        (dict(name="gpipe", num_stages=4, num_microbatches=8, num_devices=2), "one stage per"),
        (dict(name="zb-v", num_stages=6, num_microbatches=8, num_devices=2), "2 stages per"),
        (dict(name="zb-h1", num_stages=4, num_microbatches=8, w_mem=1.5), "w_mem = 1.5"),
        (dict(name="1f1b", num_stages=4, num_microbatches=8, mem_limit=0.5), "at least 1"),
        (
            dict(name="1f1b", num_stages=4, num_microbatches=8, mem_limit=3.0),
            "raise mem_limit to 4, or choose a schedule that shapes itself to the limit (zb-h1",
        ),
        (
            dict(name="gpipe", num_stages=2, num_microbatches=8, mem_limit=4.0),
            "raise mem_limit to 8, use fewer microbatches, or choose",
        ),
        (dict(name="zb-v", num_stages=8, num_microbatches=8, mem_limit=1.5), "too small"),
        (dict(name="zb-h1", num_stages=4, num_microbatches=8, foo=1), "no options"),
        (dict(name="zb-h1", num_stages=4.0, num_microbatches=8), "num_stages = 4.0; it must"),
        (dict(name="1f1b", num_stages=4, num_microbatches=True), "num_microbatches = True;"),
        (
            dict(name="zb-h1", num_stages=4, num_microbatches=8, costs=Costs(f=[1.0, 2.0])),
            "costs.f has 2 entries but there are 4 stages",
        ),
        (
            dict(name="zb-h1", num_stages=2, num_microbatches=8, costs=Costs(b=(1.0, -1.0))),
            "costs.b = -1.0 is negative",
        ),
    ],
)
def test_bad_requests_raise_schedule_error_naming_the_value(kwargs, words):
    with pytest.raises(ScheduleError) as info:
        build(**kwargs)
    assert words in str(info.value)
    assert isinstance(info.value, ValueError)


def test_numpy_integer_sizes_are_integers():
    """np.int64(4) was refused as "not an integer >= 1" (zbjax.pipeline took it)."""
    built = build("zb-h1", np.int64(4), np.int32(8), num_devices=np.int64(4))
    assert built == build("zb-h1", 4, 8)
    assert type(built.num_stages) is int and type(built.num_microbatches) is int
    # A 0-d NumPy or JAX number is a number too (jnp.float32(2.0) was "not a number").
    assert build("zb-h1", 4, 8, mem_limit=np.asarray(3.0)).mem_limit == 3.0


def test_zb_auto_is_built_validated_and_records_its_limit():
    costs = Costs(f=1.0, b=1.0, w=1.0, comm=0.0)
    s = build("zb-auto", 4, 8, costs=costs, mem_limit=4.0, w_mem=0.5)
    assert s.mem_limit == 4.0 and s.num_devices == 4
    r = simulate(s, costs)
    assert max(r.peak_memory) <= 4.0
    assert r.bubble_rate <= simulate(build("1f1b", 4, 8), costs).bubble_rate + 1e-9


def test_every_schedule_builds_without_deadlock_for_small_shapes_and_any_m():
    # build() validates: any deadlock or broken rule would raise here.
    for m in range(1, 14):
        for p in range(1, 7):
            for name in ("gpipe", "1f1b", "zb-h1", "zb-h2"):
                build(name, p, m)
            build("zb-v", 2 * p, m)
            for v in range(1, 5):
                build("interleaved-1f1b", v * p, m, num_devices=p)


def test_zb_auto_without_its_module_says_which_schedules_remain(monkeypatch):
    monkeypatch.setitem(sys.modules, "zbjax.schedules.auto", None)
    with pytest.raises(ScheduleError, match="zb-auto is not available.*gpipe, 1f1b"):
        build("zb-auto", 4, 8, mem_limit=4.0)
