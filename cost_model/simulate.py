"""Seeded event simulation of one serverless pool: arrivals, start-ups, queueing, idle windows.

Each request is routed to the lowest-numbered running container with a free slot (the same
"fill in order" routing the closed forms assume). With none free it joins a container that is
still starting and has room, else a new container starts (up to the maximum), else it waits in
one FIFO queue for the next free slot. A container that has been idle for the scale-down window
stops; minimum containers never stop and never start cold.

Simplification, stated: a request's speed is fixed when it starts, from the number of streams
then on its container (the throughput curve at that level). Streams that join or leave later do
not change it. This keeps every event O(log n) instead of touching every stream on the GPU.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

FINISH, READY, STOP = 0, 1, 2
DOWN, STARTING, UP = 0, 1, 2


@dataclass(frozen=True)
class PoolConfig:
    """Autoscaler settings in force for one simulated pool."""

    concurrency: int
    window_s: float
    min_containers: int
    max_containers: int
    cold_start_s: float


@dataclass
class SliceTotals:
    """Raw sums over one simulated slice (seconds are container-seconds)."""

    setup_s: float = 0.0
    flex_up_s: float = 0.0
    flex_busy_s: float = 0.0
    pinned_busy_s: float = 0.0
    starts: int = 0
    waited_start: int = 0
    queued: int = 0
    peak_containers: int = 0


class _Pool:
    """Mutable state of the simulation; one instance per slice."""

    def __init__(self, cfg: PoolConfig, ttft: list[float], service: list[float], warm: int) -> None:
        self.cfg, self.ttft, self.service = cfg, ttft, service
        self.state: list[int] = []
        self.inflight: list[int] = []
        self.ready_at: list[float] = []
        self.busy_since: list[float] = []
        self.epoch: list[int] = []
        self.pending: list[list[float]] = []
        self.events: list[tuple[float, int, int, int]] = []
        self.free: list[int] = []  # running containers with a free slot (lazy: checked on use)
        self.down: list[int] = []  # stopped container ids, reused lowest first
        self.starting: deque[int] = deque()  # starting containers that still have room
        self.queue: deque[float] = deque()
        self.live = 0
        self.tot = SliceTotals()
        self.ttft_obs: list[float] = []
        self.e2e_obs: list[float] = []
        for cid in range(max(cfg.min_containers, warm)):
            self._new_id()
            self._count_live()
            self._set_up(cid, 0.0)

    # -- container lifecycle -------------------------------------------------------------
    def _new_id(self) -> int:
        if self.down:
            return heapq.heappop(self.down)
        self.state.append(DOWN)
        self.inflight.append(0)
        self.ready_at.append(0.0)
        self.busy_since.append(0.0)
        self.epoch.append(0)
        self.pending.append([])
        return len(self.state) - 1

    def _pinned(self, cid: int) -> bool:
        return cid < self.cfg.min_containers

    def _count_live(self) -> None:
        self.live += 1
        self.tot.peak_containers = max(self.tot.peak_containers, self.live)

    def _set_up(self, cid: int, t: float) -> None:
        self.state[cid] = UP
        self.ready_at[cid] = t
        heapq.heappush(self.free, cid)
        if not self._pinned(cid):
            self._schedule_stop(cid, t)

    def _schedule_stop(self, cid: int, t: float) -> None:
        self.epoch[cid] += 1
        heapq.heappush(self.events, (t + self.cfg.window_s, STOP, cid, self.epoch[cid]))

    def _cold_start(self, t: float, arrival: float) -> None:
        cid = self._new_id()
        self.state[cid] = STARTING
        self.pending[cid] = [arrival]
        self._count_live()
        self.tot.starts += 1
        self.tot.waited_start += 1
        self.tot.setup_s += self.cfg.cold_start_s
        heapq.heappush(self.events, (t + self.cfg.cold_start_s, READY, cid, 0))
        if self.cfg.concurrency > 1:
            self.starting.append(cid)

    # -- requests ------------------------------------------------------------------------
    def _begin(self, cid: int, t: float, arrival: float) -> None:
        n = self.inflight[cid] + 1
        self.inflight[cid] = n
        if n == 1:
            self.busy_since[cid] = t
            self.epoch[cid] += 1  # cancels a pending scale-down
        wait = t - arrival
        self.ttft_obs.append(wait + self.ttft[n])
        self.e2e_obs.append(wait + self.service[n])
        heapq.heappush(self.events, (t + self.service[n], FINISH, cid, 0))

    def _free_slot(self) -> int | None:
        free, cap = self.free, self.cfg.concurrency
        while free:
            cid = free[0]
            if self.state[cid] == UP and self.inflight[cid] < cap:
                return cid
            heapq.heappop(free)
        return None

    def _room_while_starting(self) -> int | None:
        while self.starting:
            cid = self.starting[0]
            if self.state[cid] == STARTING and len(self.pending[cid]) < self.cfg.concurrency:
                return cid
            self.starting.popleft()
        return None

    def arrive(self, t: float) -> None:
        cid = self._free_slot()
        if cid is not None:
            self._begin(cid, t, t)
            return
        joining = self._room_while_starting()
        if joining is not None:
            self.pending[joining].append(t)
            self.tot.waited_start += 1
        elif self.live < self.cfg.max_containers:
            self._cold_start(t, t)
        else:
            self.queue.append(t)
            self.tot.queued += 1

    # -- events --------------------------------------------------------------------------
    def _ready(self, cid: int, t: float) -> None:
        waiting, self.pending[cid] = self.pending[cid], []
        self._set_up(cid, t)
        for arrival in waiting:
            self._begin(cid, t, arrival)
        self._drain_queue(cid, t)

    def _finish(self, cid: int, t: float) -> None:
        was_full = self.inflight[cid] == self.cfg.concurrency
        self.inflight[cid] -= 1
        self._drain_queue(cid, t)
        if was_full and self.inflight[cid] < self.cfg.concurrency:
            heapq.heappush(self.free, cid)
        if self.inflight[cid] == 0:
            self._add_busy(cid, t)
            if not self._pinned(cid):
                self._schedule_stop(cid, t)

    def _drain_queue(self, cid: int, t: float) -> None:
        while self.queue and self.inflight[cid] < self.cfg.concurrency:
            self._begin(cid, t, self.queue.popleft())

    def _stop(self, cid: int, t: float, epoch: int) -> None:
        if self.epoch[cid] != epoch or self.inflight[cid] or self.state[cid] != UP:
            return
        self.state[cid] = DOWN
        self.live -= 1
        self.tot.flex_up_s += t - self.ready_at[cid]
        heapq.heappush(self.down, cid)

    def _add_busy(self, cid: int, t: float) -> None:
        busy = t - self.busy_since[cid]
        if self._pinned(cid):
            self.tot.pinned_busy_s += busy
        else:
            self.tot.flex_busy_s += busy

    def advance(self, until: float) -> None:
        events = self.events
        while events and events[0][0] <= until:
            t, kind, cid, epoch = heapq.heappop(events)
            if kind == FINISH:
                self._finish(cid, t)
            elif kind == READY:
                self._ready(cid, t)
            else:
                self._stop(cid, t, epoch)

    def close(self, horizon: float) -> SliceTotals:
        """Count everything still running up to the horizon; later work is not billed here."""
        self.advance(horizon)
        for cid, state in enumerate(self.state):
            if state == UP and not self._pinned(cid):
                self.tot.flex_up_s += horizon - self.ready_at[cid]
            if state == UP and self.inflight[cid]:
                self._add_busy(cid, horizon)
        return self.tot


def run_slice(
    arrivals: np.ndarray,
    horizon: float,
    cfg: PoolConfig,
    ttft: list[float],
    service: list[float],
    warm: int = 0,
) -> tuple[SliceTotals, list[float], list[float]]:
    """Simulate sorted arrival times in [0, horizon); return totals and per-request latencies."""
    pool = _Pool(cfg, ttft, service, min(warm, cfg.max_containers))
    for t in arrivals.tolist():
        pool.advance(t)
        pool.arrive(t)
    totals = pool.close(horizon)
    return totals, pool.ttft_obs, pool.e2e_obs


def tables(
    concurrency: int, ttft_at: Callable[[int], float], seconds_at: Callable[[int], float]
) -> tuple[list[float], list[float]]:
    """TTFT and request seconds for 1..concurrency streams (index 0 unused)."""
    ttft = [0.0] + [ttft_at(k) for k in range(1, concurrency + 1)]
    service = [0.0] + [seconds_at(k) for k in range(1, concurrency + 1)]
    return ttft, service
