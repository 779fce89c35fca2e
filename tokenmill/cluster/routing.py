"""Which replica serves a request: the policies, free of Ray so they are tested alone.

- `affinity` (the default): a prompt's leading full KV blocks, hashed in a chain salted
  by tenant and cache_salt exactly as the engine's prefix cache isolates them, map to
  the replica that last served them; the longest known chain wins. A preferred
  replica more than `imbalance` requests busier than the least busy one is passed
  over for the least busy (the load guard), and the chain then points at the new one.
  A prompt with no known chain goes to the least busy replica (of equals, the one sent
  fewer requests so far, so new prefixes spread evenly).
- `round_robin`: each replica in turn.
- `p2c`: power of two choices: two replicas at random, the less busy of them.

"Busy" is the requests this router has sent to a replica that have not finished: the
ingress sees every request, so its count is exact and never stale.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Hashable, Sequence

POLICIES = ("affinity", "round_robin", "p2c")


def prefix_chain(token_ids: Sequence[int], block_size: int, salt: Hashable, max_blocks: int) -> list[int]:
    """Hashes of the first 1..k full blocks (k <= max_blocks), each covering all before it."""
    chain: list[int] = []
    parent: Hashable = ("tokenmill-prefix", salt)
    for i in range(min(len(token_ids) // block_size, max_blocks)):
        parent = hash((parent, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        chain.append(parent)
    return chain


class Router:
    def __init__(self, policy: str = "affinity", block_size: int = 16, max_blocks: int = 64, imbalance: int = 4,
                 capacity: int = 100_000, rng: random.Random | None = None):
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.imbalance = imbalance
        self.capacity = capacity  # chain entries remembered (LRU)
        self.rng = rng or random.Random()
        self.owner: OrderedDict[int, Hashable] = OrderedDict()  # chain hash -> replica
        self.load: dict[Hashable, int] = {}
        self.total: dict[Hashable, int] = {}  # requests ever sent: ties go to the one with fewer
        self._next = 0
        self.decisions = {"hit": 0, "miss": 0, "load_guard": 0}

    def choose(self, replicas: Sequence[Hashable], token_ids: Sequence[int] = (), salt: Hashable = None) -> Hashable:
        """The replica for this request (counted busy from `sent` until `done`)."""
        if not replicas:
            raise ValueError("no replicas to route to")
        replicas = list(replicas)
        if self.policy == "round_robin":
            choice = replicas[self._next % len(replicas)]
            self._next += 1
        elif self.policy == "p2c":
            pair = self.rng.sample(replicas, 2) if len(replicas) > 1 else replicas
            choice = min(pair, key=self._busy)
        else:
            choice = self._affinity(replicas, token_ids, salt)
        return choice

    def sent(self, replica: Hashable) -> None:
        self.load[replica] = self._busy(replica) + 1
        self.total[replica] = self.total.get(replica, 0) + 1

    def done(self, replica: Hashable) -> None:
        if self.load.get(replica, 0) > 0:
            self.load[replica] -= 1

    def forget(self, replica: Hashable) -> None:
        """A replica that died: its cache is gone with it."""
        self.load.pop(replica, None)
        self.total.pop(replica, None)
        for h in [h for h, r in self.owner.items() if r == replica]:
            del self.owner[h]

    def _busy(self, replica: Hashable) -> int:
        return self.load.get(replica, 0)

    def _affinity(self, replicas: list[Hashable], token_ids: Sequence[int], salt: Hashable) -> Hashable:
        chain = prefix_chain(token_ids, self.block_size, salt, self.max_blocks)
        least = min(replicas, key=lambda r: (self._busy(r), self.total.get(r, 0), self.rng.random()))
        preferred = None
        for h in reversed(chain):  # the longest prefix some live replica holds
            r = self.owner.get(h)
            if r is not None and r in replicas:
                preferred = r
                break
        if preferred is None:
            choice = least
            if chain:
                self.decisions["miss"] += 1
        elif self._busy(preferred) > self._busy(least) + self.imbalance:
            choice = least
            self.decisions["load_guard"] += 1
        else:
            choice = preferred
            self.decisions["hit"] += 1
        for h in chain:
            self.owner[h] = choice
            self.owner.move_to_end(h)
        while len(self.owner) > self.capacity:
            self.owner.popitem(last=False)
        return choice
