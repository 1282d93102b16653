"""A backlog makes train steps larger instead of ageing samples past ``train.max_weight_lag``
(``clawrl.step_size``), earliest deadline first; under light load a step is ``train.batch_size``."""
import logging

import pytest

from clawrl.buffer import RolloutBuffer
from clawrl.config import ConfigError, TrainConfig, compose
from clawrl.step_size import step_size
from clawrl.store import TurnStore

from test_buffer import Chat, by_turn, judge_all


@pytest.fixture
def store(tmp_path):
    s = TurnStore(tmp_path)
    yield s
    s.close()


def test_light_load_keeps_the_batch_size():
    assert step_size([], 4) == 4
    assert step_size([4, 4, 3], 4) == 4  # three waiting, each with steps to spare
    assert step_size([4] * 20, 4) == 4  # 20 fit in 5 steps of 4 exactly


def test_a_backlog_is_spread_over_the_steps_its_lag_allows():
    assert step_size([4] * 21, 4) == 5  # 21 within 5 steps
    assert step_size([4] * 300, 4) == 60  # a paused run's backlog: trained in 5 steps, not dropped after 1
    assert step_size([0] * 7, 4) == 7  # every one due now: all in this step
    # 3 due now, 6 more within two steps: the 9 need 5 a step (3 now would leave 6 for one step)
    assert step_size([0, 0, 0, 1, 1, 1, 1, 1, 1], 2) == 5


def test_overdue_samples_count_as_due_now_and_the_cap_bounds_the_step():
    assert step_size([-3, -1, 0], 1) == 3
    assert step_size([4] * 300, 4, cap=32) == 32
    assert step_size([4] * 3, 4, cap=32) == 4


def test_the_cap_may_not_be_below_the_batch_size():
    with pytest.raises(ConfigError, match="train.max_batch_size=2 and train.batch_size=4"):
        compose(["train.batch_size=4", "train.max_batch_size=2"])


def _ready(chat, buffer, n, version, tag):
    turns = [chat.conversation(["thanks"], opening=f"{tag} {i}", versions=(version,) * 3)[0] for i in range(n)]
    judge_all(buffer)
    return turns


def test_a_backlog_trains_whole_where_fixed_steps_drop_most_of_it(tmp_path, caplog):
    """12 samples wait at version 0, max_weight_lag=2, batch_size=2: fixed steps of 2 train 6 and
    drop 6 as stale; deadline-sized steps train all 12 in three steps of 4, each within its lag."""
    caplog.set_level(logging.INFO, logger="clawrl.buffer")
    outcome = {}
    for cap in (2, None):
        store = TurnStore(tmp_path / f"cap{cap}")
        chat, buffer = Chat(store), RolloutBuffer(store, TrainConfig(batch_size=2, max_weight_lag=2,
                                                                     max_batch_size=cap))
        _ready(chat, buffer, 12, 0, "q")
        sizes, lags = [], []
        for version in range(6):
            taken = buffer.take_batch(2, current_version=version)
            sizes.append(len(taken))
            lags += [s.extra["weight_lag"] for s in taken]
        states = [s["skip_reason"] or s["state"] for s in buffer.samples()]
        outcome[cap] = (sizes, states.count("consumed"), states.count("stale"), max(lags))
        store.close()
    assert outcome[2] == ([2, 2, 2, 0, 0, 0], 6, 6, 2)
    assert outcome[None] == ([4, 4, 4, 0, 0, 0], 12, 0, 2)
    # the log says why a step grew
    assert "took 4 sample(s) for training at weight version 0, more than train.batch_size=2: 12 were ready" \
        in caplog.text


def test_the_most_behind_sample_goes_first(store):
    chat, buffer = Chat(store), RolloutBuffer(store, TrainConfig(batch_size=1, max_weight_lag=4))
    fresh = _ready(chat, buffer, 1, 5, "fresh")
    old = _ready(chat, buffer, 1, 2, "old")  # closed later, sampled from older weights
    [first] = buffer.take_batch(1, current_version=5)
    assert first.turn_id == old[0] and first.extra["weight_lag"] == 3
    assert by_turn(buffer)[fresh[0]]["state"] == "ready"


def test_steady_overload_at_the_default_lag_drops_under_a_tenth(tmp_path):
    """Six samples become ready per step while train.batch_size is 4, at the default max_weight_lag:
    fixed-size steps fall behind and drop a growing backlog; deadline-sized ones drop nothing."""
    dropped = {}
    for cap in (4, None):
        store = TurnStore(tmp_path / f"cap{cap}")
        chat, buffer = Chat(store), RolloutBuffer(store, TrainConfig(batch_size=4, max_batch_size=cap))
        for version in range(30):
            _ready(chat, buffer, 6, version, f"v{version}")
            buffer.take_batch(4, current_version=version)
        states = [s["skip_reason"] or s["state"] for s in buffer.samples() if s["state"] != "ready"]
        dropped[cap] = states.count("stale") / len(states)
        store.close()
    assert dropped[None] == 0.0
    assert dropped[4] > 0.2  # a third of the arrivals, once the backlog has aged (from the 6th step on)
