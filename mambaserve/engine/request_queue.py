"""The scheduler's waiting queue under each scheduling policy (`EngineConfig.scheduling_policy`).

Both queues answer the same calls: `add` (a new request), `requeue` (a preempted one),
`popleft`, `[0]` (the head), `remove`, iteration in admission order, `len`.

- "fcfs": arrival order; a preempted request goes back to the front (it was admitted before
  everything still waiting).
- "priority": ordered by (priority, arrival), a lower priority value first (vLLM's convention,
  default 0), arrival breaking ties; a preempted request goes back to the place its key gives
  it, so a request of higher priority that arrived meanwhile stays ahead of it.
"""

from __future__ import annotations

import bisect
from collections import deque

from mambaserve.config import SCHEDULING_POLICIES
from mambaserve.engine.request import Request


def priority_key(req: Request) -> tuple[int, int]:
    """What the priority policy orders by: the smaller key is served first, and under memory
    pressure the running request with the largest key is preempted first."""
    return req.priority, req.arrival


def check_priority(priority, policy: str) -> None:
    """Raise a one-line ValueError for a request priority `policy` does not take: not an
    integer, or not 0 under "fcfs" (vLLM's rule: only the priority policy reads it)."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    if priority != 0 and policy != "priority":
        raise ValueError(f"got priority {priority} but priority scheduling is not enabled: "
                         f"start the engine with scheduling_policy='priority' "
                         f"(--scheduling-policy priority)")


class FCFSQueue(deque):
    """Arrival order; a preempted request goes back to the front."""

    def add(self, req: Request) -> None:
        self.append(req)

    def requeue(self, req: Request) -> None:
        self.appendleft(req)


class PriorityQueue:
    """Ordered by `priority_key` (a list kept sorted: the queue is short, and iteration in
    admission order, which `Scheduler.prefill_backlog` and the tests use, comes free)."""

    def __init__(self) -> None:
        self._items: list[Request] = []

    def add(self, req: Request) -> None:
        # after the requests of an equal key: ties keep their insertion order
        bisect.insort_right(self._items, req, key=priority_key)

    requeue = add  # a preempted request takes the place its key gives it

    def popleft(self) -> Request:
        return self._items.pop(0)

    def remove(self, req: Request) -> None:
        self._items.remove(req)

    def __getitem__(self, i: int) -> Request:
        return self._items[i]

    def __iter__(self):
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)


def waiting_queue(policy: str) -> FCFSQueue | PriorityQueue:
    if policy not in SCHEDULING_POLICIES:
        raise ValueError(f"scheduling_policy must be fcfs or priority, got {policy!r}")
    return FCFSQueue() if policy == "fcfs" else PriorityQueue()
