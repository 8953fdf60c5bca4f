"""Who of a formed group is not in it (peers/presence.py), from the members' `formed` records."""

import asyncio

from dtnode.peers.presence import FORMED_GRACE_S, FORMED_LAG_S, GroupPresence


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_member_with_no_record_is_absent_once_most_of_the_group_published_theirs():
    clock = Clock()
    group = ("me", "a", "b", "x")
    records: dict[str, tuple[str, ...]] = {"me": group}

    async def formed():
        return records

    presence = GroupPresence(group, "me", formed, clock)
    check = asyncio.run
    assert check(presence.absent()) == set()  # nobody has published yet: nothing to compare with
    clock.now += 0.3
    records.update(a=group, b=group)  # most of the others did
    assert check(presence.absent()) == set()
    clock.now += FORMED_LAG_S + 0.1
    assert check(presence.absent()) == {"x"}  # x registered and went silent
    records["x"] = group  # a late record clears it
    clock.now += 1.0
    assert check(presence.absent()) == set()


def test_a_member_still_forming_is_not_absent_for_a_missing_record_but_is_for_one_naming_another_group():
    """A member that answered "still forming the hop's groups" is on its way: past the lag its
    missing record does not make it absent; a record naming another group does."""
    clock = Clock()
    group = ("me", "a", "b", "x")
    records: dict[str, tuple[str, ...]] = {"me": group, "a": group, "b": group}

    async def formed():
        return records

    presence = GroupPresence(group, "me", formed, clock)
    asyncio.run(presence.absent())
    clock.now += FORMED_LAG_S + 0.1
    assert asyncio.run(presence.absent(forming={"x"})) == set()
    assert asyncio.run(presence.absent()) == {"x"}  # not said to be forming: absent, as before
    records["x"] = ("x", "y")
    clock.now += 1.0
    assert asyncio.run(presence.absent(forming={"x"})) == {"x"}


def test_a_member_that_formed_another_group_is_absent_at_once_and_a_pair_waits_its_grace():
    clock = Clock()
    records: dict[str, tuple[str, ...]] = {"b": ("b", "c")}

    async def formed():
        return records

    trio = GroupPresence(("me", "a", "b"), "me", formed, clock)
    assert asyncio.run(trio.absent()) == {"b"}
    pair = GroupPresence(("me", "a"), "me", formed, clock)
    clock.now += 1.0
    assert asyncio.run(pair.absent()) == set()  # one other member: no majority to judge by
    clock.now += FORMED_GRACE_S
    assert asyncio.run(pair.absent()) == {"a"}


def test_a_node_whose_dht_answers_slowly_waits_longer_before_it_calls_a_member_absent():
    """A follower reads its leader's list a poll later than another: with polls of a second, a
    member whose record comes 0.6 s after most of the group's is late, not absent."""
    clock = Clock()
    group = ("me", "a", "b", "x")
    records: dict[str, tuple[str, ...]] = {"a": group, "b": group}

    async def formed():
        return records

    presence = GroupPresence(group, "me", formed, clock, lag=2.0)
    assert asyncio.run(presence.absent()) == set()
    clock.now += FORMED_LAG_S + 0.1
    assert asyncio.run(presence.absent()) == set()
    clock.now += 1.5
    assert asyncio.run(presence.absent()) == {"x"}
    pair = GroupPresence(("me", "a"), "me", lambda: asyncio.sleep(0, {}), clock, lag=2.0)
    clock.now += FORMED_GRACE_S + 1.0
    assert asyncio.run(pair.absent()) == set()  # the grace grows by the lag's excess too
    clock.now += 0.6
    assert asyncio.run(pair.absent()) == {"a"}


def test_a_member_standing_in_several_groups_gets_a_lag_for_each_before_it_is_called_absent():
    """A member that said it stands in 3 groups this hop forms and publishes 3 times: its record
    may come up to 3 lags after most of the group's (32 nodes on 2 cores: one member of 2 groups
    taken for absent split a hop-1 group of 9). One of a single group keeps the single lag."""
    clock = Clock()
    group = ("me", "a", "b", "x", "y")
    records: dict[str, tuple[str, ...]] = {"me": group, "a": group, "b": group}

    async def formed():
        return records

    presence = GroupPresence(group, "me", formed, clock, loads={"x": 3, "y": 1})
    assert asyncio.run(presence.absent()) == set()  # the majority is in from now
    clock.now += FORMED_LAG_S + 0.1
    assert asyncio.run(presence.absent()) == {"y"}
    clock.now += FORMED_LAG_S
    assert asyncio.run(presence.absent()) == {"y"}  # x: 2 lags gone of its 3
    clock.now += FORMED_LAG_S
    assert asyncio.run(presence.absent()) == {"x", "y"}
