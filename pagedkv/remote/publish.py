"""The publisher: a background thread that sends committed pages to the remote tier.

The store's commit hands it copies of the pages it made durable (``Item``), so the
thread never touches the store: no store lock, no pool slot, no LMDB. The queue is
bounded in page bytes; a page that does not fit is skipped and counted, so a slow
or absent tier never blocks ``append``, ``step`` or ``commit``. Each batch asks
which pages the tier holds already (pipelined ``EXISTS``), encodes the others
and sends them with ``SET NX`` (a page another host sent meanwhile stays theirs).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
import numpy as np

from ..geometry import Geometry
from ..storage.codec import page_checksum
from . import record
from .client import PUBLISH, RemoteClient
from .counters import Counters

log = logging.getLogger("pagedkv.remote")
KNOWN_PAGES = 1 << 16  # remote hashes remembered as present, so they are not even asked about again


@dataclass(slots=True)
class Item:
    """One committed page to publish: a private copy of its bytes and what its value needs."""

    key: bytes  # its Redis key
    digest: bytes  # its remote hash
    parent: bytes  # its parent's remote hash
    token_ids: np.ndarray  # its page_size token ids
    page: np.ndarray  # a copy of its bytes, (layers, 2, page_size, kv_heads, head_dim)
    uid: int  # its local uid, for the check below
    csum: int | None  # its local checksum over the full page, checked before sending (None: checked already)


class Publisher:
    """A bounded queue of ``Item`` and the thread that empties it."""

    def __init__(self, client: RemoteClient, counters: Counters, geom: Geometry, salt: bytes,
                 seed: int, codec: str, queue_bytes: int, batch: int, name: str) -> None:
        self._client, self._counters, self._geom = client, counters, geom
        self._salt, self._seed, self._codec = salt, seed, codec
        self._limit, self._batch, self._name = queue_bytes, batch, name
        self._cond = threading.Condition()
        self._queue: deque[Item] = deque()
        self._queued_bytes = 0
        self._in_flight = 0  # items taken by the thread and not yet done
        self._stop = False
        self._thread: threading.Thread | None = None
        self._known: dict[bytes, None] = {}  # insertion-ordered: the oldest is forgotten first

    # -- the caller's side ------------------------------------------------------
    def known(self, digest: bytes) -> bool:
        """Whether the tier is known to hold the page of ``digest`` (sent, fetched or found there)."""
        with self._cond:
            return digest in self._known

    def remember(self, digest: bytes) -> None:
        """Note that the tier holds the page of ``digest``."""
        with self._cond:
            self._remember(digest)

    def put(self, item: Item) -> bool:
        """Queue ``item``; False (nothing queued) when the queue is full or stopping."""
        with self._cond:
            if self._stop or self._queued_bytes + item.page.nbytes > self._limit:
                return False
            self._queue.append(item)
            self._queued_bytes += item.page.nbytes
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"pagedkv-remote-{self._name}",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()
            return True

    def room(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more page bytes would fit in the queue now."""
        with self._cond:
            return not self._stop and self._queued_bytes + nbytes <= self._limit

    def pending(self) -> int:
        """Pages queued or being sent."""
        with self._cond:
            return len(self._queue) + self._in_flight

    def drain(self, timeout: float) -> bool:
        """Wait until what is queued is sent (or skipped), at most ``timeout`` s; whether it was."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while (self._queue or self._in_flight) and self._thread is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def stop(self, join_timeout: float) -> None:
        """Stop the thread after the batch in flight; what is still queued is skipped (counted)."""
        with self._cond:
            self._stop = True
            left_over = len(self._queue)
            self._queue.clear()
            self._queued_bytes = 0
            self._cond.notify_all()
            thread = self._thread
        if left_over:
            self._counters.add("remote_skipped", left_over)
        if thread is not None:
            thread.join(join_timeout)  # a send in flight ends within its socket timeouts

    # -- the thread -------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                batch = [self._queue.popleft() for _ in range(min(self._batch, len(self._queue)))]
                self._queued_bytes -= sum(item.page.nbytes for item in batch)
                self._in_flight = len(batch)
            try:
                self._send(batch)
            except Exception:  # never let the thread die silently: a bug here must not stop publishing
                log.exception("remote tier %s: a publish batch failed", self._client.url.redacted)
                self._counters.add("remote_skipped", len(batch))
            finally:
                with self._cond:
                    self._in_flight = 0
                    self._cond.notify_all()

    def _send(self, batch: list[Item]) -> None:
        counters = self._counters
        if not self._client.available(PUBLISH):
            counters.add("remote_skipped", len(batch))
            return
        present = self._client.exists_many([item.key for item in batch])
        if present is None:
            counters.add("remote_skipped", len(batch))
            return
        todo: list[tuple[Item, bytes]] = []
        for item, there in zip(batch, present):
            if there:
                counters.add("remote_present")
                self.remember(item.digest)
                continue
            if item.csum is not None and page_checksum(item.page, self._geom.page_size, item.uid,
                                                       self._seed) != item.csum:
                # The slot changed after the commit (written outside a step?): never publish it.
                log.warning("remote tier %s: page %d no longer holds its committed bytes; not published",
                            self._client.url.redacted, item.uid)
                counters.add("remote_skipped")
                continue
            todo.append((item, record.encode(self._geom, self._salt, item.digest, item.parent,
                                             item.token_ids, item.page, self._codec)))
        if not todo:
            return
        done = self._client.set_many([(item.key, value) for item, value in todo])
        if done is None:
            counters.add("remote_skipped", len(todo))
            return
        for (item, value), sent in zip(todo, done):
            if sent:
                counters.add("remote_published")
                counters.add("remote_bytes_sent", len(value))
            else:
                counters.add("remote_present")  # another host sent it between EXISTS and SET
            self.remember(item.digest)

    def _remember(self, digest: bytes) -> None:
        known = self._known
        known[digest] = None
        if len(known) > KNOWN_PAGES:
            del known[next(iter(known))]
