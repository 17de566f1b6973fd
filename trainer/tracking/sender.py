"""A background sender per tracker: the training step hands it work and never waits.

Work items run in order on the sender's thread. An item that raises (a tracker down,
slow, or refusing) stays at the head of the queue and is retried with backoff; the first
failure is logged once as a warning, and recovery once as info. The queue is bounded:
past `limit` items the oldest are dropped and counted. `close()` gives the queue a last
deadline and reports what could not be sent; the points stay in metrics.jsonl.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("trainer.tracking")


@dataclass
class Item:
    what: str  # "metrics", "params", "event", ... (for the end-of-run account)
    call: Callable[[], Any]
    points: int = 1


@dataclass
class Outcome:
    name: str
    sent: int
    unsent: int
    dropped: int
    error: str | None


class Sender:
    def __init__(self, name: str, limit: int = 100_000, max_backoff_s: float = 30.0):
        self.name = name
        self.limit = limit
        self.max_backoff_s = max_backoff_s
        self._queue: collections.deque[Item] = collections.deque()
        self._cv = threading.Condition()
        self._closing = False
        self._stop = False
        self._busy = False
        self.sent = 0
        self.dropped = 0
        self.failing: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"tracker-{name}", daemon=True)
        self._thread.start()

    def put(self, what: str, call: Callable[[], Any], points: int = 1) -> None:
        with self._cv:
            if self._closing:
                return
            self._queue.append(Item(what, call, points))
            if len(self._queue) > self.limit:
                # Drop the oldest metric points; never what opens, configures or closes the
                # tracker run (a point dropped here is still in metrics.jsonl).
                old = next((i for i in self._queue if i.what == "metrics"), None)
                if old is not None:
                    self._queue.remove(old)
                    self.dropped += old.points
            self._cv.notify()

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
                item = self._queue[0]
                self._busy = True
            try:
                item.call()
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
                if self._queue and self._queue[0] is item:
                    self._queue.popleft()
                elif item in self._queue:
                    self._queue.remove(item)
                self.sent += item.points
                self._cv.notify_all()

    def drain(self, timeout_s: float) -> bool:
        """Wait until everything queued so far was sent (True) or the timeout passed."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._queue:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(timeout=min(left, 0.5))
            return True

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
