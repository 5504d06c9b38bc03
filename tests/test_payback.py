"""``multistep.loops.payback``: the steps left of the loops around a run call, read from
the source, and the rule that decides when a program is built. Plain Python: the loops
here are the test's own."""

import pytest

from multistep.loops import payback


def _left():
    return payback.steps_left()


def test_the_steps_left_of_nested_range_loops_across_frames():
    seen = {}
    for epoch in range(3):
        for i in range(1, 9, 2):
            if (epoch, i) in ((0, 1), (1, 3), (2, 7)):
                seen[epoch, i] = _left()
    # 3 epochs of 4 steps: after the first step 11 are left; after (1, 3): 2 of this
    # epoch and 4 of the next; none after the last
    assert seen == {(0, 1): 11, (1, 3): 6, (2, 7): 0}

    def epoch_of(n):  # the inner loop in a function the outer loop calls
        for step in range(n):
            if step == 1:
                return _left()
        return None

    steps = 5
    assert [epoch_of(steps) for _ in range(1)] == [None]  # (a comprehension's loop)
    for epoch in range(2):
        if epoch == 0:
            assert epoch_of(steps) == 3 + 1 * steps


def test_a_loop_it_cannot_count_gives_none():
    while True:
        assert _left() is None
        break
    for batch in [1, 2]:
        assert _left() is None
    for i in range(4):  # the loop's variable rebound: it no longer tells the position
        i = 100
        assert _left() is None
    for i in range(2):
        for batch in iter([1]):  # any loop around it that is not a range
            assert _left() is None


def test_code_without_source_counts_by_its_bytecode():
    # exec'd code (python -c, a notebook's cell, a test runner's bootstrap): a loop of its
    # own around the call makes the count unknown; code with no loop around it adds none
    scope = {"left": _left}
    exec("for i in range(3):\n    inside = left()\noutside = left()", scope)
    assert scope["inside"] is None
    assert scope["outside"] == 0


def _timing(written, *, timed=payback.TIMED_RUNS):
    timing = payback.Timing()
    for _ in range(payback.UNTIMED_RUNS):
        timing.written(1.0)  # (not timed: a program's first runs are slower)
    for _ in range(timed):
        timing.written(written)
    return timing


def test_no_decision_before_the_steps_are_timed():
    timing = _timing(1e-3, timed=payback.TIMED_RUNS - 1)
    assert timing.written_step is None
    assert not payback.worth_building(timing, 0.0, lambda: 10**9)


def test_the_build_is_paid_only_where_the_steps_left_repay_it():
    timing = _timing(1e-3)  # a step as written: 1 ms; fused, GAIN of it saved
    assert timing.written_step == 1e-3
    build = 0.2
    repays = build / (payback.GAIN * 1e-3)  # steps left from which it repays: 667
    assert not payback.worth_building(timing, build, lambda: int(repays) - 1)
    assert timing.next_decision == timing.written_runs + payback.DECIDE_EVERY
    assert not payback.worth_building(timing, build, lambda: int(repays) + 1)  # (not yet)
    timing.next_decision = 0
    assert payback.worth_building(timing, build, lambda: int(repays) + 1)
    # steps left not known: rent until the time spent as written reaches the build
    spent = timing.written_seconds
    timing.next_decision = 0
    assert not payback.worth_building(timing, spent + 1e-9, lambda: None)
    timing.next_decision = 0
    assert payback.worth_building(timing, spent, lambda: None)


def test_fused_steps_no_faster_than_as_written_go_back():
    timing = _timing(1e-3)
    timing.fused_steps, timing.fused_seconds = payback.COMPARED_STEPS - 1, 0.0
    assert timing.fused_is_slower() is None  # (not enough compared yet)
    timing.fused_steps = payback.COMPARED_STEPS
    timing.fused_seconds = payback.COMPARED_STEPS * 1e-3
    assert timing.fused_is_slower() is True
    timing.fused_seconds /= 2
    assert timing.fused_is_slower() is False
    assert timing.settled and timing.fused_is_slower() is None  # (decided for good)


def test_the_build_estimate_learns_from_the_builds_made(monkeypatch):
    monkeypatch.setattr(payback, "_BUILDS", [0.0, 0])
    assert payback.build_estimate(100) == pytest.approx(100 * payback.BUILD_SECONDS_PER_OP)
    payback.built(0.5, 50)
    assert payback.build_estimate(100) == pytest.approx(1.0)
