"""A store's remote tier: remote hashes of its pages, fetch into the local cache, publish after commit.

The store calls five verbs, all under its lock: ``on_seal`` (a page just got its
local prefix hash), ``extend`` (the local prefix match of a prompt stopped: fetch
what follows), ``carry`` and ``committed`` (around each commit), and ``close``.
Fetched pages are verified (see ``record.py``) before they are placed, and become
ordinary local cache pages: hashed, refcount 0 unless a ``create`` takes them,
resident until evicted, committed by the next commit. Pages reach the tier only
after the commit that made them durable, copied into the publisher's bounded
queue; a page the tier is known to hold is not sent again.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Sequence

import numpy as np

from ..core import StoreCore
from ..errors import PageCorrupt, PagedKVError, PoolExhausted
from ..geometry import Geometry
from ..pages.directory import HASHED, NOWHERE, ONE
from ..pages.prefix import ROOT, chain_hash, seal, write_tokens
from ..pages.tokens import TOKEN_DTYPE
from ..pages.restore import fetch_record
from . import record
from .client import FETCH, PUBLISH, RemoteClient
from .config import RemoteConfig
from .counters import GAUGES, STATE_KEY, Counters
from .publish import Item, Publisher

log = logging.getLogger("pagedkv.remote")
_ENVELOPE_BYTES = 256  # above the envelope and record header of any page


class RemoteTier:
    """The remote tier of one open store (see ``attach``)."""

    def __init__(self, store: StoreCore, config: RemoteConfig) -> None:
        model = store.model
        if store.readonly:
            raise PagedKVError("remote= needs a writable store: a read-only handle cannot take fetched pages")
        if not model:
            raise PagedKVError("remote= needs a model fingerprint (pagedkv.open(..., model=...)): pages "
                               "are shared only between stores of one model")
        self._store = store
        self.config = config
        self.geom = geom = store.geometry
        self.salt = record.remote_salt(config.namespace, model, geom)
        self.counters = Counters()
        self.client = RemoteClient(config, self.counters)
        codec = config.codec or store.spill_codec
        self.publisher = Publisher(self.client, self.counters, geom, self.salt, store._mgr.seed, codec,
                                   config.queue_bytes, config.publish_batch, os.path.basename(store.path))
        self._pid = os.getpid()
        self._sealed: list[tuple[int, int, bytes, bytes, np.ndarray]] = []  # since the last commit
        self._digest_uid = np.zeros(0, np.uint64)  # per page row: the uid whose remote hash is below
        self._digest = np.zeros(0, "V16")
        self._refusals: set[str] = set()  # reasons logged already
        self._closed = False
        record_bytes = geom.page_nbytes + 4 * geom.page_size + _ENVELOPE_BYTES
        self._window = max(1, config.fetch_bytes // record_bytes)  # pages per fetch round trip
        store._mgr.on_seal = self.on_seal

    # -- remote hashes of local pages -----------------------------------------------
    def key(self, digest: bytes) -> bytes:
        """The Redis key of the page of remote hash ``digest``."""
        return record.remote_key(self.config.key_prefix, self.config.namespace, self.salt, digest)

    def digest_of(self, pid: int) -> bytes | None:
        """The remote hash of page row ``pid``, if known this session."""
        mgr = self._store._mgr
        if pid < len(self._digest) and self._digest_uid[pid] == mgr.uid[pid] and mgr.live[pid]:
            return bytes(self._digest[pid])
        return None

    def _remember(self, pid: int, digest: bytes) -> None:
        if pid >= len(self._digest):
            size = max(64, pid + 1, 2 * len(self._digest))
            self._digest_uid = np.concatenate([self._digest_uid, np.zeros(size - len(self._digest), np.uint64)])
            self._digest = np.concatenate([self._digest, np.zeros(size - len(self._digest), "V16")])
        self._digest_uid[pid] = self._store._mgr.uid[pid]
        self._digest[pid] = digest

    def on_seal(self, pid: int, parent: int) -> None:
        """A page just got its local prefix hash (``parent``: the previous page, -1 for the first)."""
        if self._closed or self.digest_of(pid) is not None:
            return  # a fetched page: the tier has it
        mgr = self._store._mgr
        token_ids = mgr.page_tokens_of(pid)
        up = ROOT if parent < 0 else self.digest_of(parent) or self._rechain(parent)
        if up is None or token_ids is None:
            return
        digest = chain_hash(up, self.salt, token_ids)
        self._remember(pid, digest)
        if self.config.publish:
            self._sealed.append((pid, int(mgr.uid[pid]), digest, up, token_ids.copy()))  # a view of memory the page table reuses

    def _rechain(self, pid: int) -> bytes | None:
        """The remote hash of a page sealed before this session, from a sequence that holds it."""
        mgr, size = self._store._mgr, self.geom.page_size
        for seq in self._store._seqs.values():
            table = seq.pids[:seq.npages]
            at = np.flatnonzero(table == pid)
            if not len(at):
                continue
            up = ROOT
            for row in table[:int(at[0]) + 1].tolist():
                digest = self.digest_of(row)
                if digest is None:
                    token_ids = mgr.page_tokens_of(row)
                    if not mgr.flags[row] & HASHED or token_ids is None or len(token_ids) != size:
                        return None
                    digest = chain_hash(up, self.salt, token_ids)
                    self._remember(row, digest)
                up = digest
            return up
        return None

    # -- fetch ----------------------------------------------------------------
    def extend(self, token_ids: np.ndarray, pids: list[int], max_pages: int) -> list[int]:
        """``pids`` (the local match of ``token_ids``) followed by the pages fetched after it.

        Called with the store lock held. Fetched pages are placed as cache pages
        (refcount 0), verified; the run stops at the first page the tier lacks or
        that fails a check. Never raises for the tier's sake: a failure is a miss.
        """
        start = len(pids)
        if (start >= max_pages or self._closed or not self.config.fetch or os.getpid() != self._pid
                or not self.client.available(FETCH)):
            return pids
        mgr, size = self._store._mgr, self.geom.page_size
        digests = record.chain(self.salt, token_ids, size, max_pages)
        for index, pid in enumerate(pids):
            if self.digest_of(pid) is None:
                self._remember(pid, digests[index])
        held = np.asarray(pids, np.int64)
        np.add.at(mgr.ref, held, ONE)  # placing pages evicts: the matched ones must stay
        placed: list[int] = []
        try:
            index = start
            while index < max_pages:
                count = min(self._window, max_pages - index)
                pages = self._fetch(token_ids, digests, index, count)
                parent = placed[-1] if placed else (pids[-1] if pids else -1)
                got = self._place(token_ids, digests, index, pages, parent)
                placed += got
                if len(got) < count:
                    break
                index += count
        finally:
            np.subtract.at(mgr.ref, held, ONE)
            np.subtract.at(mgr.ref, np.asarray(placed, np.int64), ONE)
        return list(pids) + placed

    def _fetch(self, token_ids: np.ndarray, digests: list[bytes], first: int,
               count: int) -> list[tuple[np.ndarray, int]]:
        """Verified pages ``first ..`` of one pipelined round trip, up to the first miss or refusal."""
        started = time.perf_counter()
        values = self.client.get_many([self.key(digest) for digest in digests[first:first + count]])
        if values is None:
            return []
        self.counters.fetch_latency(time.perf_counter() - started)
        size, out = self.geom.page_size, []
        for offset, value in enumerate(values):
            index = first + offset
            if value is None:
                self.counters.add("remote_fetch_misses")
                break
            try:
                page = record.decode(self.geom, value, self.salt, digests[index],
                                     digests[index - 1] if index else ROOT,
                                     token_ids[index * size:(index + 1) * size])
            except record.Refused as exc:
                self.counters.add("remote_rejected")
                if exc.reason not in self._refusals:
                    self._refusals.add(exc.reason)
                    log.warning("remote tier %s: refused the value of %s: %s", self.client.url.redacted,
                                self.key(digests[index]).decode(), exc.reason)
                break
            out.append((page, len(value)))
        return out

    def _place(self, token_ids: np.ndarray, digests: list[bytes], first: int,
               pages: list[tuple[np.ndarray, int]], parent: int) -> list[int]:
        """Make verified pages local: fresh pages, their bytes and ids written, sealed in order."""
        mgr, size = self._store._mgr, self.geom.page_size
        placed: list[int] = []
        chunk = max(1, mgr.evict_batch)
        for low in range(0, len(pages), chunk):
            part = pages[low:low + chunk]
            try:
                pids = mgr.new_pages(np.full(len(part), size, np.int32)).tolist()
            except PoolExhausted:
                break  # every slot pinned: what is placed so far is reused
            for pid, (page, nbytes), index in zip(pids, part, range(first + low, first + low + len(part))):
                mgr.pool[mgr.slot[pid]] = page
                write_tokens(mgr, pid, 0, token_ids[index * size:(index + 1) * size].copy())
                self._remember(pid, digests[index])
                self.publisher.remember(digests[index])
                seal(mgr, pid, parent)
                if not mgr.flags[pid] & HASHED:  # cannot happen while the parent is hashed; never leak it
                    mgr.decref(np.asarray(pids[pids.index(pid):], np.int64))
                    return placed
                placed.append(pid)
                parent = pid
                self.counters.add("remote_fetched")
                self.counters.add("remote_bytes_fetched", nbytes)
        return placed

    # -- publish ---------------------------------------------------------------
    def carry(self, state: dict[str, Any]) -> None:
        """Write the tier's section (URL without secrets, counter totals) into the state a commit records."""
        previous = state.get(STATE_KEY)
        totals = previous.get("counters") if isinstance(previous, dict) else None
        state[STATE_KEY] = {"url": self.client.url.redacted, "namespace": self.config.namespace,
                            "cluster": self.client.url.cluster,
                            "counters": self.counters.carry(totals if isinstance(totals, dict) else {})}

    def committed(self) -> None:
        """Queue the pages sealed since the last commit that it made durable (copies of their bytes)."""
        sealed, self._sealed = self._sealed, []
        if not sealed or self._closed or os.getpid() != self._pid:
            return
        store = self._store
        mgr, volatile = store._mgr, store.durability == "volatile"
        skipped = 0
        spilled: list[tuple[int, bytes, bytes, bytes, np.ndarray]] = []
        for pid, uid, digest, up, token_ids in sealed:
            if not (mgr.live[pid] and int(mgr.uid[pid]) == uid and mgr.flags[pid] & HASHED
                    and (volatile or mgr.c_where[pid] != NOWHERE)):
                continue  # gone (dropped, truncated) before it was committed
            if self.publisher.known(digest):
                self.counters.add("remote_present")
                continue
            if not self.client.available(PUBLISH) or not self.publisher.room(self.geom.page_nbytes):
                skipped += 1
                continue
            slot = int(mgr.slot[pid])
            if slot < 0:
                spilled.append((pid, self.key(digest), digest, up, token_ids))
                continue
            csum = int(mgr.csum[pid]) if mgr.csum_ok[pid] and mgr.fill[pid] == self.geom.page_size else None
            item = Item(self.key(digest), digest, up, token_ids, mgr.pool[slot].copy(), uid, csum)
            skipped += not self.publisher.put(item)
        if spilled:
            skipped += self._queue_spilled(spilled)
        if skipped:
            self.counters.add("remote_skipped", skipped)

    def _queue_spilled(self, pages: list[tuple[int, bytes, bytes, bytes, np.ndarray]]) -> int:
        """Queue pages evicted before their commit, read back from their spill records; return those skipped."""
        mgr, skipped = self._store._mgr, 0
        with mgr.spill.begin_read() as txn:
            for pid, key, digest, up, token_ids in pages:
                uid = int(mgr.uid[pid])
                try:
                    page, _ = fetch_record(mgr, txn, uid, int(mgr.fill[pid]), int(mgr.csum[pid]))
                except PageCorrupt:
                    skipped += 1
                    continue
                skipped += not self.publisher.put(Item(key, digest, up, token_ids, np.array(page), uid, None))
        return skipped

    # -- the rest ------------------------------------------------------------------
    def stats(self) -> dict[str, int | float]:
        """The remote keys of ``stats()``."""
        out = self.counters.snapshot()
        out[GAUGES[0]] = self.publisher.pending()
        return out

    def drain(self) -> bool:
        """Send what is queued (at most ``close_timeout`` s); whether counters moved since the last carry."""
        if self._closed or os.getpid() != self._pid:
            return False
        self.publisher.drain(self.config.close_timeout)
        return self.counters.moved()

    def close(self) -> None:
        """Stop the publisher (what is still queued is skipped, counted) and close the connections."""
        if self._closed:
            return
        self._closed = True
        mgr = self._store._mgr
        if mgr.on_seal == self.on_seal:
            mgr.on_seal = None
        if os.getpid() == self._pid:
            self.publisher.stop(2 * (self.config.publish_timeout + self.config.connect_timeout))
            self.client.close()


class Probe:
    """Which pages the remote tier holds, asked without a store (an engine's scheduler, in its own process).

    Holding is not validity: a held page is only worth planning a load for, and the
    store's fetch verifies every page it places (a refused one is a load error and
    a recompute, never served).

    Params:
        remote: a URL or a ``RemoteConfig`` (the store's own ``remote=``).
        model: the model fingerprint of the engine's store.
        geom: the store geometry.
    """

    def __init__(self, remote: Any, model: str, geom: Geometry) -> None:
        self.config = RemoteConfig.of(remote)
        self.page_size = geom.page_size
        self.salt = record.remote_salt(self.config.namespace, model, geom)
        self.counters = Counters()
        self.client = RemoteClient(self.config, self.counters)

    def chain(self, token_ids: Any, pages: int) -> list[bytes]:
        """Remote hashes of the first ``pages`` pages of ``token_ids`` (the store's ids, namespace page first)."""
        ids = np.ascontiguousarray(token_ids, TOKEN_DTYPE)
        return record.chain(self.salt, ids, self.page_size, min(pages, len(ids) // self.page_size))

    def held(self, digests: Sequence[bytes]) -> int | None:
        """How many of ``digests``, from the first on, the tier holds: one pipelined EXISTS round trip.

        It runs on the fetch connection, under the fetch timeouts and backoff; None
        when the tier could not be asked (failure counted, never raised).
        """
        if not digests:
            return 0
        if not self.config.fetch or not self.client.available(FETCH):
            return None
        keys = [record.remote_key(self.config.key_prefix, self.config.namespace, self.salt, digest)
                for digest in digests]

        def run(client: Any) -> list[bool]:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            return [bool(found) for found in pipe.execute()]

        found = self.client._run(FETCH, run)
        if found is None:
            return None
        count = found.index(False) if False in found else len(found)
        if count < len(found):
            self.counters.add("remote_fetch_misses")
        return count

    def close(self) -> None:
        """Close the connection."""
        self.client.close()


def attach(store: StoreCore, remote: Any) -> RemoteTier:
    """The remote tier of ``store`` for ``remote`` (a URL or a ``RemoteConfig``)."""
    return RemoteTier(store, RemoteConfig.of(remote))
