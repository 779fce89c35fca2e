"""The waiting queue: which waiting request the scheduler considers next."""

from __future__ import annotations

import bisect

from tokenmill.engine.request import Request


class WaitingQueue:
    """Waiting requests: interactive before batch; within a class, tenants take turns
    (the next pick goes to the tenant with the fewest running requests, then the
    earliest arrival), so one tenant's flood cannot starve another; FCFS within a tenant.
    A preempted request returns to its arrival position."""

    def __init__(self) -> None:
        self._queues: dict[tuple[int, str | None], list[Request]] = {}
        self._len = 0

    def add(self, req: Request) -> None:
        q = self._queues.setdefault((req.priority, req.tenant), [])
        keys = [r.arrival_seq for r in q]
        q.insert(bisect.bisect(keys, req.arrival_seq), req)
        self._len += 1

    def remove(self, req: Request) -> None:
        key = (req.priority, req.tenant)
        q = self._queues[key]
        q.remove(req)
        if not q:
            del self._queues[key]
        self._len -= 1

    def iter_fair(self, running_per_tenant: dict[str | None, int]):
        """Requests in the order they should be considered for admission (a snapshot)."""
        for prio in sorted({p for p, _ in self._queues}):
            lanes = {t: list(q) for (p, t), q in self._queues.items() if p == prio}
            pos = dict.fromkeys(lanes, 0)
            load = {t: running_per_tenant.get(t, 0) for t in lanes}
            while lanes:
                t = min(lanes, key=lambda x: (load[x], lanes[x][pos[x]].arrival_seq))
                yield lanes[t][pos[t]]
                pos[t] += 1
                load[t] += 1
                if pos[t] == len(lanes[t]):
                    del lanes[t]

    def count(self, priority: int) -> int:
        return sum(len(q) for (p, _), q in self._queues.items() if p == priority)

    def oldest_arrival(self, priority: int) -> float | None:
        """The earliest arrival (monotonic) among waiting requests of a class: each lane is
        in arrival order, so its head is its oldest."""
        heads = [q[0].times.arrival for (p, _), q in self._queues.items() if p == priority and q]
        return min(heads) if heads else None

    def __iter__(self):
        return self.iter_fair({})

    def __len__(self) -> int:
        return self._len
