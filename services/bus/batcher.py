"""``LocalBatcher``: a node manager's buffer between its workers and the bus.

Workers hand their metrics and events to the node manager over local IPC; the node manager puts them
here, and the batcher publishes them in batches (as TreeML's node managers do) when ``max_messages``
are waiting or the oldest has waited ``max_age_s``, whichever comes first, then flushes the bus so the
batch is stored before the next one starts. A batch goes out as one bundle record per (topic, key)
(``MetricBus.publish_many``), each in the order its messages were added, so a stage batch's messages
keep their order on the bus. ``close()`` publishes what is left.

When the bus is down the batch stays at the head of the buffer and the next flush tries again
(duplicates are possible after a partial failure; aggregators deduplicate on ``msg_id``). The buffer is
bounded: :meth:`LocalBatcher.add` raises ResourceExhausted when ``max_buffered`` messages wait, the batch
being published counted among them (a failed publish puts it back).

Thread-safe: any thread may add; one background thread does the age-based flushes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import Self

from stagetree.bus.base import MetricBus
from stagetree.bus.messages import Message, route
from stagetree.core.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, StagetreeError

logger = logging.getLogger(__name__)


class LocalBatcher:
    """Buffers messages and publishes them to ``bus`` by count or age, under ``router(message)``
    (topic, key): :func:`~stagetree.bus.messages.route` unless the topics are namespaced (tests)."""

    def __init__(
        self,
        bus: MetricBus,
        *,
        max_messages: int = 200,
        max_age_s: float = 0.5,
        max_buffered: int = 100_000,
        router: Callable[[Message], tuple[str, str]] = route,
    ) -> None:
        if max_messages < 1 or max_age_s <= 0 or max_buffered < max_messages:
            raise InvalidArgument(
                "need max_messages >= 1, max_age_s > 0 and max_buffered >= max_messages, got "
                f"{max_messages}, {max_age_s}, {max_buffered}"
            )
        self._bus = bus
        self._route = router  # (topic, key) of a message; stagetree.bus.messages.route unless namespaced
        self._max_messages = max_messages
        self._max_age_s = max_age_s
        self._max_buffered = max_buffered
        self._buffer: deque[tuple[float, Message]] = deque()
        self._cond = threading.Condition()
        # Held while publishing so two flushes never interleave (that would reorder a key's messages).
        self._publish_lock = threading.Lock()
        self._closed = False
        self._urgent = False  # a message added with urgent=True waits for no timer
        # Messages taken out of the buffer by the flush under way: they count against max_buffered, since a
        # failed publish puts them back (without this, adds during each failing publish grow the buffer)
        self._in_flight = 0
        self.published = 0
        self._thread = threading.Thread(target=self._run, name="bus-batcher", daemon=True)
        self._thread.start()

    def add(self, message: Message, *, urgent: bool = False, publish_here: bool = True) -> None:
        """Queue one message; publishes at once when this fills a batch (in the caller's thread, or with
        ``publish_here=False`` in the batcher's: then the call never waits for the bus, and an event loop
        may make it). ``urgent``: the batcher's thread publishes it (and what is queued before it) now
        rather than when the oldest is ``max_age_s`` old; those added while it publishes go together
        next, so a burst of urgent messages costs a few publishes, not one each, and the caller waits for
        none. Bus errors do not reach the caller (the message stays queued); a full buffer raises
        ResourceExhausted."""
        with self._cond:
            if self._closed:
                raise FailedPrecondition("add on a closed batcher")
            waiting = len(self._buffer) + self._in_flight
            if waiting >= self._max_buffered:
                raise ResourceExhausted(
                    f"{waiting} bus messages are waiting (the bus is down or slow); "
                    "the node manager should pause its workers' reporting until the bus recovers"
                )
            self._buffer.append((time.monotonic(), message))
            full = len(self._buffer) >= self._max_messages
            if urgent or (full and not publish_here):
                self._urgent = True
                self._cond.notify()  # publish now
            elif len(self._buffer) == 1:
                self._cond.notify()  # start the age timer
        if full and publish_here:
            try:
                self.flush()
            except StagetreeError as e:  # the message is queued; the timer thread retries
                logger.warning("bus flush failed; will retry", extra={"error": repr(e)})

    def pending(self) -> int:
        """Messages not yet published: those queued and those of a publish under way."""
        with self._cond:
            return len(self._buffer) + self._in_flight

    def flush(self) -> int:
        """Publish everything waiting now, then flush the bus. Returns how many were published."""
        with self._publish_lock:
            with self._cond:
                batch = list(self._buffer)
                self._buffer.clear()
                self._urgent = False
                self._in_flight = len(batch)
            if not batch:
                return 0
            # One bundle per (topic, key): a key's messages keep their order inside it, and a batch of
            # points costs the bus a few records instead of one per point.
            groups: dict[tuple[str, str], list[Message]] = {}
            for _, message in batch:
                groups.setdefault(self._route(message), []).append(message)
            try:
                for (topic, key), messages in groups.items():
                    self._bus.publish_many(topic, key, messages)
                self._bus.flush()
            except StagetreeError:
                with self._cond:
                    self._buffer.extendleft(reversed(batch))
                    self._in_flight = 0
                raise
            finally:
                with self._cond:
                    self._in_flight = 0
            self.published += len(batch)
            logger.debug("published a batch", extra={"messages": len(batch)})
            return len(batch)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._buffer:
                    self._cond.wait()
                if self._closed:
                    return
                wait = 0.0 if self._urgent else self._buffer[0][0] + self._max_age_s - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
            try:
                self.flush()
            except StagetreeError as e:
                logger.warning(
                    "bus flush failed; retrying in %.1f s",
                    self._max_age_s,
                    extra={"pending": self.pending(), "error": repr(e)},
                )
                with self._cond:
                    self._cond.wait(self._max_age_s)

    def close(self) -> None:
        """Stop the timer and publish what is left; raises (keeping the messages) if the bus is down."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        self.flush()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
