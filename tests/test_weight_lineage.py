"""Staleness counts optimizer updates along the run's lineage, not version numbers."""
from clawrl.weight_lineage import lag_counter


def test_without_restarts_lag_is_the_version_difference():
    lag = lag_counter({}, current=9)
    assert [lag(v) for v in (9, 8, 5, 0)] == [0, 1, 4, 9]


def test_a_re_served_version_adds_no_lag_and_an_abandoned_branch_counts_its_own_updates():
    # served 0..6, crashed, resumed the step-2 checkpoint (version 2) as version 7, then trained 7 -> 8 -> 9
    lag = lag_counter({7: 2}, current=9)
    assert lag(9) == 0 and lag(7) == 2 and lag(2) == 2  # 2 == 7 in weights: two updates behind 9
    assert lag(1) == 3 and lag(0) == 4
    assert lag(4) == 4  # version 4 left the line at 2: two updates up the dead branch, two down the live one
    assert lag(6) == 6


def test_chained_restarts_compose():
    # 0..3, restart re-serves 0 as 4; 4..6, restart re-serves 5 as 7
    lag = lag_counter({4: 0, 7: 5}, current=7)
    assert lag(5) == 0 and lag(4) == 1 and lag(0) == 1 and lag(3) == 4 and lag(6) == 1
