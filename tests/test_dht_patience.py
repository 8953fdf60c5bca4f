"""The wait for a DHT peer's answer: from what answers take, backed off when one never comes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dtnode.peers.dht_patience import (
    ANSWER_FACTOR,
    FLOOR_S,
    MIN_SAMPLES,
    SAMPLES,
    AnswerPatience,
)

HIVEMIND_WAIT_S = 3.0


def test_a_node_that_has_measured_nothing_waits_as_long_as_hivemind_does():
    patience = AnswerPatience(HIVEMIND_WAIT_S)
    for _ in range(MIN_SAMPLES - 1):
        patience.answered(0.001)
    assert patience.wait_s() == HIVEMIND_WAIT_S


def test_fast_answers_bring_the_wait_down_to_the_floor_and_slow_ones_up_to_the_ceiling():
    patience = AnswerPatience(HIVEMIND_WAIT_S)
    for _ in range(SAMPLES):
        patience.answered(0.005)
    assert patience.wait_s() == FLOOR_S
    for _ in range(SAMPLES):
        patience.answered(0.5)
    assert patience.wait_s() == pytest.approx(ANSWER_FACTOR * 0.5)
    for _ in range(SAMPLES):
        patience.answered(2.0)
    assert patience.wait_s() == HIVEMIND_WAIT_S


def test_the_slowest_twentieth_of_recent_answers_sets_the_wait():
    patience = AnswerPatience(HIVEMIND_WAIT_S)
    for i in range(SAMPLES):
        patience.answered(0.6 if i % 10 == 0 else 0.01)  # 7 slow of 64: above the 95th percentile's share
    assert patience.wait_s() == pytest.approx(ANSWER_FACTOR * 0.6)


def test_waits_run_out_count_as_answers_that_took_the_whole_wait():
    """An answer that never came is never measured: a swarm that slowed down all at once would be
    given up on at every request. One silent peer among many answers moves nothing; a few put the
    wait at the ceiling, until answers replace them."""
    patience = AnswerPatience(HIVEMIND_WAIT_S)
    for _ in range(SAMPLES):
        patience.answered(0.005)
    silent = SAMPLES - int(0.95 * SAMPLES) - 1  # as many as the 95th percentile steps over
    for _ in range(silent):
        patience.unanswered(waited_s=FLOOR_S, took_s=FLOOR_S)
    assert patience.wait_s() == FLOOR_S
    patience.unanswered(waited_s=FLOOR_S, took_s=FLOOR_S)
    assert patience.wait_s() == HIVEMIND_WAIT_S  # 4 x 1 s, never past hivemind's own wait
    for _ in range(SAMPLES):
        patience.answered(0.005)
    assert patience.wait_s() == FLOOR_S


def test_a_request_refused_at_once_does_not_back_off():
    patience = AnswerPatience(HIVEMIND_WAIT_S)
    for _ in range(SAMPLES):
        patience.answered(0.005)
    patience.unanswered(waited_s=FLOOR_S, took_s=0.002)  # the peer's port closed: it is gone, not slow
    assert patience.wait_s() == FLOOR_S


@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("answer"), st.floats(0.0, 100.0)),
            st.tuples(st.just("silence"), st.floats(0.0, 100.0)),
        ),
        max_size=200,
    )
)
def test_the_wait_stays_between_the_floor_and_hivemind_s_own(events):
    patience = AnswerPatience(HIVEMIND_WAIT_S)
    for kind, seconds in events:
        if kind == "answer":
            patience.answered(seconds)
        else:
            patience.unanswered(waited_s=patience.wait_s(), took_s=seconds)
        assert FLOOR_S <= patience.wait_s() <= HIVEMIND_WAIT_S
