"""The routing policies on their own (no Ray): affinity, its load guard, round robin, p2c."""

import random

import pytest

from tokenmill.cluster.routing import Router, prefix_chain

A, B, C = "a", "b", "c"


def prompt(system: int, user: int, n_system: int = 64, n_user: int = 24) -> list[int]:
    return [1000 + system * 7 + i % 5 for i in range(n_system)] + [5000 + user * 3 + i % 7 for i in range(n_user)]


def test_prefix_chain_is_per_block_and_salted():
    ids = list(range(40))
    chain = prefix_chain(ids, 16, ("t", None), 64)
    assert len(chain) == 2  # only full blocks
    assert prefix_chain(ids[:32] + [9, 9], 16, ("t", None), 64) == chain  # a different tail keeps the blocks
    assert prefix_chain(ids, 16, ("u", None), 64)[0] != chain[0]  # another tenant: another chain
    assert prefix_chain(ids, 16, ("t", "salt"), 64)[0] != chain[0]
    assert len(prefix_chain(list(range(1000)), 16, None, 8)) == 8


def test_affinity_sends_a_shared_prefix_to_the_replica_that_has_it():
    r = Router("affinity", rng=random.Random(0))
    first = r.choose([A, B], prompt(1, 1), ("t1", None))
    r.sent(first)
    r.done(first)
    for user in range(2, 6):  # same system prompt, other questions
        choice = r.choose([A, B], prompt(1, user), ("t1", None))
        assert choice == first
        r.sent(choice)
        r.done(choice)
    assert r.decisions["hit"] == 4
    r.choose([A, B], prompt(1, 1), ("t2", None))  # the same text from another tenant is new
    assert r.decisions["miss"] == 2


def test_new_prefixes_spread_to_the_least_busy():
    r = Router("affinity", rng=random.Random(0))
    seen = []
    for system in range(4):  # each busy while the next arrives
        choice = r.choose([A, B], prompt(system, 0), ("t", None))
        r.sent(choice)
        seen.append(choice)
    assert seen.count(A) == 2 and seen.count(B) == 2


def test_load_guard_passes_over_a_busy_holder_and_moves_the_prefix():
    r = Router("affinity", imbalance=2, rng=random.Random(0))
    holder = r.choose([A, B], prompt(1, 0), ("t", None))
    other = B if holder == A else A
    for user in range(1, 4):  # three in flight on the holder: 3 > 0 + 2
        assert r.choose([A, B], prompt(1, user), ("t", None)) == holder
        r.sent(holder)
    r.sent(holder)
    assert r.choose([A, B], prompt(1, 9), ("t", None)) == other
    assert r.decisions["load_guard"] == 1
    r.sent(other)
    assert r.choose([A, B], prompt(1, 10), ("t", None)) == other  # the prefix now lives there too


def test_a_dead_replica_is_forgotten():
    r = Router("affinity", rng=random.Random(0))
    holder = r.choose([A, B], prompt(1, 0), ("t", None))
    r.forget(holder)
    survivor = B if holder == A else A
    assert r.choose([survivor], prompt(1, 1), ("t", None)) == survivor
    assert r.decisions["hit"] == 0


def test_round_robin_and_power_of_two():
    rr = Router("round_robin")
    assert [rr.choose([A, B, C]) for _ in range(6)] == [A, B, C, A, B, C]
    p2c = Router("p2c", rng=random.Random(1))
    for _ in range(5):
        p2c.sent(A)
    picks = [p2c.choose([A, B]) for _ in range(20)]
    assert set(picks) == {B}  # of any two, the less busy
    with pytest.raises(ValueError):
        Router("random")
    with pytest.raises(ValueError):
        rr.choose([])
