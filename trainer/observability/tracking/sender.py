"""A background sender per tracker: the training step hands it work and never waits.

Work items run in order on the sender's thread. An item that raises (a tracker down,
slow, or refusing) stays at the head of the queue and is retried with backoff; the first
failure is logged once as a warning, and recovery once as info. The queue is bounded:
past `limit` items the oldest are dropped and counted. `close()` gives the queue a last
deadline and reports what could not be sent; the points stay in metrics.jsonl.

A sender given a `batch` function sends items that carry a payload (metric records)
several at a time: it lets the first wait up to `linger_s` for more, then hands every
such item at the head of the queue (at most `max_batch`) to one call. For MLflow, whose
cost is mostly per call (a transaction on its store), that took the CPU per record from
19 ms to 7 ms here at 18 records a call. A drain or close sends at once.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("trainer.observability.tracking")


@dataclass(eq=False)  # an item is itself: two records with equal values are two items
class Item:
    what: str  # "metrics", "params", "event", ... (for the end-of-run account)
    call: Callable[[], Any] | None
    points: int = 1
    payload: Any = None  # for the sender's `batch` function, in place of `call`
    queued: float = field(default_factory=time.monotonic)


@dataclass
class Outcome:
    name: str
    sent: int
    unsent: int
    dropped: int
    error: str | None


class Sender:
    def __init__(
        self,
        name: str,
        limit: int = 100_000,
        max_backoff_s: float = 30.0,
        batch: Callable[[list[Any]], Any] | None = None,
        linger_s: float = 0.0,
        max_batch: int = 1,
    ):
        self.name = name
        self.limit = limit
        self.max_backoff_s = max_backoff_s
        self.batch, self.linger_s, self.max_batch = batch, linger_s, max(1, max_batch)
        self._queue: collections.deque[Item] = collections.deque()
        self._cv = threading.Condition()
        self._closing = False
        self._stop = False
        self._busy = False
        self._draining = 0
        self.sent = 0
        self.dropped = 0
        self.failing: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"tracker-{name}", daemon=True)
        self._thread.start()

    def put(
        self, what: str, call: Callable[[], Any] | None, points: int = 1, payload: Any = None
    ) -> None:
        """Queue `call`, or, for a sender with a `batch` function, a `payload` for it."""
        if (call is None) == (payload is None) or (payload is not None and self.batch is None):
            raise ValueError(f"sender {self.name}: give a call, or a payload to a batch sender")
        with self._cv:
            if self._closing:
                return
            self._queue.append(Item(what, call, points, payload))
            if len(self._queue) > self.limit:
                # Drop the oldest metric points; never what opens, configures or closes the
                # tracker run (a point dropped here is still in metrics.jsonl).
                old = next((i for i in self._queue if i.what == "metrics"), None)
                if old is not None:
                    self._queue.remove(old)
                    self.dropped += old.points
            self._cv.notify_all()  # the sender, which may be lingering, not a drain

    def _run(self) -> None:
        backoff = 0.5
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    if self._closing:
                        return
                    self._cv.wait()
                if self._stop:
                    return
                items = self._take()
                if self._stop:
                    return
                if not items:  # what lingered was dropped from a full buffer
                    continue
                item = items[0]
                self._busy = True
            try:
                if item.payload is not None:
                    self.batch([i.payload for i in items])  # type: ignore[misc]
                else:
                    item.call()  # type: ignore[misc]
            except Exception as exc:
                text = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                if self.failing is None:
                    log.warning(
                        "tracker %s: %s failed (%s); retrying in the background, training "
                        "goes on and metrics.jsonl keeps every point",
                        self.name,
                        item.what,
                        text[:300],
                    )
                self.failing = text[:300]
                with self._cv:
                    self._busy = False
                    self._cv.wait(timeout=backoff)
                backoff = min(backoff * 2, self.max_backoff_s)
                continue
            if self.failing is not None:
                log.info("tracker %s: reachable again", self.name)
            self.failing = None
            backoff = 0.5
            with self._cv:
                self._busy = False
                for done in items:
                    if self._queue and self._queue[0] is done:
                        self._queue.popleft()
                    elif done in self._queue:
                        self._queue.remove(done)
                    self.sent += done.points
                self._cv.notify_all()

    def _head_batch(self) -> list[Item]:
        out: list[Item] = []
        for i in self._queue:
            if i.payload is None or len(out) == self.max_batch:
                break
            out.append(i)
        return out

    def _take(self) -> list[Item]:
        """The items to send next (called holding the lock): the head item, or the run of
        payload items at the head, once the first has waited `linger_s` for company."""
        head = self._queue[0]
        if head.payload is None:
            return [head]
        while True:
            batch = self._head_batch()
            if not batch:  # dropped from a full buffer meanwhile
                return [self._queue[0]] if self._queue else []
            left = batch[0].queued + self.linger_s - time.monotonic()
            if (
                len(batch) >= self.max_batch
                or left <= 0
                or self._closing
                or self._draining
                or self._stop
            ):
                return batch
            self._cv.wait(timeout=left)

    def drain(self, timeout_s: float) -> bool:
        """Wait until everything queued so far was sent (True) or the timeout passed."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            self._draining += 1  # a lingering batch goes now
            self._cv.notify_all()
            try:
                while self._queue:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cv.wait(timeout=min(left, 0.5))
                return True
            finally:
                self._draining -= 1

    def close(self, timeout_s: float) -> Outcome:
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self.drain(timeout_s)
        with self._cv:
            self._stop = True
            unsent = sum(i.points for i in self._queue)
            error = self.failing
            if error is None and self._queue:
                error = f"no answer yet to {self._queue[0].what}"
            self._cv.notify_all()
        self._thread.join(timeout=5.0)
        return Outcome(self.name, self.sent, unsent, self.dropped, error)
