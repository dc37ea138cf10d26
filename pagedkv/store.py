"""KVStore: sequences over paged KV, the public face of pagedkv."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterable

import numpy as np
from numpy.typing import NDArray

from . import datapath, describe as describe_mod, faults, step as step_mod
from .background.prefetch import Prefetch, Prefetcher
from .background.writebehind import WriteBehind
from .check import Problem, check_store
from .core import StoreCore, _op
from .describe import CommitInfo, PageContent, PageInfo, SequenceInfo, SpillInfo, StoreSummary
from .errors import PagedKVError, SequenceBusy, SequenceExists
from .options import DURABILITY, PERSISTED_COUNTERS, StoreOptions
from .pages import evict, persist
from .pages.prefix import as_token_ids, match_prefix, share_prefix
from .pages.sequence import PerSequence, SeqId, Sequence, seq_key
from .remote import tier as remote_tier
from .stats import CacheDrop, StoreStats, store_stats
from .step import Step
from .storage.pool import PagePool
from .storage.spill import SpillStore

__all__ = ["KVStore", "StoreOptions", "DURABILITY"]

log = logging.getLogger(__name__)


class KVStore(StoreCore):
    """A persistent paged KV store; obtain one with ``pagedkv.open``."""

    def __init__(self, path: str, pool: PagePool, spill: SpillStore, superblock: dict[str, Any],
                 options: StoreOptions, lock: Any) -> None:
        super().__init__(path, pool, spill, superblock, options, lock)
        self._prefetcher = Prefetcher(self.background_host)
        # Write-behind does not plan around a spill cap, so a capped store spills in the foreground.
        self._write_behind = (WriteBehind(self.background_host) if options.write_behind and not options.readonly
                              and options.spill_limit is None else None)
        self._remote: Any = None  # the shared remote tier (pagedkv.remote), if opened with one
        if not self.readonly and options.spill_limit is not None:
            evict.enforce_cap_at_open(self._mgr)  # a lowered cap holds from the open on
        if self._write_behind is not None:
            spill.share_writes()  # its thread writes, and grows the map, off the store lock
            self._write_behind.attach()
        if options.remote is not None:
            self._remote = remote_tier.attach(self, options.remote)

    # -- handle state --------------------------------------------------------
    @property
    def pool(self) -> np.ndarray:
        """The pool slots: ndarray ``(pool_pages, layers, 2, page_size, kv_heads, head_dim)``."""
        self._usable(False)
        self._mgr.pool_exposed = True  # from now on reads re-check committed bytes (see verify_committed)
        return self._mgr.pool

    # -- sequences -----------------------------------------------------------
    @_op(write=True)
    def create(self, seq_id: SeqId, tokens: Any = None) -> int:
        """Create a sequence; with a prompt's ``tokens``, start it with the longest cached prefix.

        The cached full pages are shared (refcount up, no copy) and the number of
        reused tokens is returned: at most ``len(tokens) - 1``, so the engine
        always has a token left to compute; it appends the rest itself. Without
        ``tokens`` the sequence is empty and 0 is returned.
        Raises ``SequenceExists`` if the id is taken.
        """
        key = seq_key(seq_id)
        if seq_id in self._seqs:
            raise SequenceExists(f"sequence {seq_id!r} already exists")
        seq = Sequence(seq_id, key)
        if tokens is not None:
            share_prefix(self._mgr, seq, as_token_ids(tokens), self._remote and self._remote.extend)
        self._seqs.add(seq)
        return seq.length

    @_op(write=False)
    def lookup(self, tokens: Any) -> int:
        """How many leading tokens of ``tokens`` are cached in full pages (possibly all); creates nothing.

        With a remote tier, pages it holds after the local match are fetched and
        kept as local cache pages, so the ``create`` that follows finds them here.
        """
        token_ids = as_token_ids(tokens)
        page_size = self.geometry.page_size
        extend = self._remote and self._remote.extend
        return len(match_prefix(self._mgr, token_ids, len(token_ids) // page_size, extend)) * page_size

    @_op(write=True)
    def append(self, seq_id: SeqId, k: np.ndarray, v: np.ndarray, tokens: Any = None) -> None:
        """Append ``n`` tokens of K and V, each ``(layers, n, kv_heads, head_dim)`` in the store dtype.

        Pages fill in order, spanning page boundaries; a shared partial last page
        is copied first. The sequence may grow beyond the pool: earlier pages spill.
        ``tokens`` (n token ids) make full pages reusable by ``create(tokens=...)``.
        """
        count = datapath.check_kv(self.geometry, k, v)
        token_ids = None if tokens is None else as_token_ids(tokens, count)
        seq = self._seqs.idle(seq_id)
        self._seqs.changed(seq)
        datapath.append(self, seq, k, v, token_ids)
        self._stats.add("tokens_appended", count)

    @_op(write=True)
    def truncate(self, seq_id: SeqId, length: int) -> None:
        """Roll a sequence back to its first ``length`` tokens (rejected speculative tokens, say).

        The kept tokens keep their K/V and token ids, so kept full pages stay
        reusable prefixes. Pages past the new end are released like ``drop``
        releases them (hashed ones stay as cache). A page shared with a fork or
        the prefix cache is never modified: a partly kept last page that is
        shared (or that would lose committed tokens) is replaced by a private
        copy of its kept tokens. Like every change, it is durable at the next
        ``commit()``; a crash before that shows the sequence as last committed.

        Params:
            length: the new length, in ``[0, length(seq_id)]``; equal is a no-op.
        Raises:
            SequenceNotFound, SequenceBusy (the sequence is in an active step),
            PagedKVError (``length`` is not an int or is outside the range),
            PoolExhausted (a copy is needed and every slot is pinned), PageCorrupt.
        """
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)):
            raise PagedKVError(f"length must be an int, got {type(length).__name__}")
        seq = self._seqs.idle(seq_id)
        if not 0 <= length <= seq.length:
            raise PagedKVError(f"length {length} is outside [0, {seq.length}] of sequence {seq_id!r}")
        if length == seq.length:
            return
        self._seqs.changed(seq)
        datapath.shorten(self, seq, int(length))

    @_op(write=False)
    def read(self, seq_id: SeqId, start: int = 0, stop: int | None = None, *,
             out: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Copies of K and V for tokens ``[start, stop)``, each ``(layers, n, kv_heads, head_dim)``.

        Spilled pages are restored on the way; a range longer than the pool
        streams through it. Raises ``PageCorrupt`` if a page fails its checksum.
        New arrays are the two halves of one allocation. ``out=(k_out, v_out)``
        copies into the caller's arrays instead and returns them: each writable,
        of the store's dtype and exactly that shape (any strides), not
        overlapping each other or ``store.pool``, else ``PagedKVError``; after
        an error their contents are unspecified.
        """
        seq = self._seqs.find(seq_id)
        written = self._seqs.written(seq)
        if stop is not None and written < stop <= seq.length:
            raise SequenceBusy(f"tokens [{written}, {stop}) of {seq_id!r} belong to an active step "
                               "and are not written yet")
        start, stop = datapath.check_range(seq, start, written if stop is None else stop, written, "tokens")
        if out is not None:
            out = datapath.check_out(self.geometry, self._mgr.pool, out, stop - start)
        if self.readonly:  # a stale snapshot is retried on a fresh one
            result = datapath.serve(self, seq, lambda seq: datapath.read(self, seq, start, stop, out),
                                    lambda seq: seq.length >= stop)
        else:
            result = datapath.read(self, seq, start, stop, out)
        self._stats.counts["tokens_read"] += stop - start
        return result

    @_op(write=False)
    def read_pages(self, seq_id: SeqId, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Copies of pages ``[start, stop)`` of a sequence in page layout (no K/V reshuffle).

        Shape ``(n, layers, 2, page_size, kv_heads, head_dim)``, like ``store.pool``:
        what an engine moving whole blocks wants, and one contiguous copy per
        page. Positions past the sequence's last token are zero. Spilled pages
        are restored on the way; raises ``PageCorrupt`` like ``read``.
        """
        seq = self._seqs.find(seq_id)
        written = self._seqs.written(seq)
        pages = -(-written // self.geometry.page_size)
        if stop is not None and pages < stop <= seq.npages:
            raise SequenceBusy(f"pages [{pages}, {stop}) of {seq_id!r} belong to an active step "
                               "and are not written yet")
        start, stop = datapath.check_range(seq, start, pages if stop is None else stop, pages, "pages")
        out = datapath.serve(self, seq, lambda seq: datapath.read_pages(self, seq, start, stop, written),
                          lambda seq: seq.npages >= stop)
        self._stats.add("tokens_read", min(seq.length, stop * self.geometry.page_size)
                        - start * self.geometry.page_size)
        return out

    @_op(write=False)
    def each_page(self, seq_id: SeqId, fn: Callable[[int, np.ndarray], Any], start: int = 0,
                  stop: int | None = None) -> int:
        """Call ``fn(index, page)`` for pages ``[start, stop)`` as they lie in the pool: ``read_pages`` without its copy.

        ``page`` is a read-only ``(layers, 2, page_size, kv_heads, head_dim)`` view,
        verified like a ``read_pages`` page and valid only during the call (copy out
        what you keep); positions past the last written token hold leftovers. For
        an engine moving whole blocks into its own memory. ``fn`` runs under the
        store's lock: it must not call the store. Returns the pages visited; raises
        ``PageCorrupt`` like ``read``, after visiting the pages of earlier batches.
        """
        seq = self._seqs.find(seq_id)
        pages = -(-self._seqs.written(seq) // self.geometry.page_size)
        start, stop = datapath.check_range(seq, start, pages if stop is None else stop, pages, "pages")

        def visit(index: int, page: np.ndarray) -> None:
            view = page.view()
            view.flags.writeable = False
            fn(index, view)

        datapath.serve(self, seq, lambda seq: datapath.each_page(self, seq, start, stop, visit),
                       lambda seq: seq.npages >= stop)
        self._stats.add("tokens_read", min(seq.length, stop * self.geometry.page_size)
                        - start * self.geometry.page_size)
        return stop - start

    @_op(write=True)
    def fork(self, src: SeqId, dst: SeqId) -> None:
        """Make ``dst`` a copy of ``src`` sharing every page (copy-on-write on later appends)."""
        seq = self._seqs.idle(src)
        key = seq_key(dst)
        if dst in self._seqs:
            raise SequenceExists(f"sequence {dst!r} already exists")
        table = seq.table.copy()
        self._mgr.incref(table)
        self._seqs.add(Sequence(dst, key, table, seq.length))

    @_op(write=True)
    def drop(self, seq_id: SeqId) -> None:
        """Delete a sequence; pages no other sequence references are freed."""
        seq = self._seqs.idle(seq_id)
        self._seqs.remove(seq)
        self._mgr.decref(seq.table[::-1].copy())  # tail first, like the free order of vLLM
        faults.crashpoint("drop.after_free")

    @_op(write=False)
    def length(self, seq_id: SeqId) -> int:
        """Tokens in the sequence."""
        return self._seqs.find(seq_id).length

    @_op(write=False)
    def sequences(self) -> list[SeqId]:
        """Every sequence id, in creation order for this session (load order after reopen)."""
        return [seq.seq_id for seq in self._seqs.values()]

    # -- steps ---------------------------------------------------------------
    def step(self, new_tokens: PerSequence[int], tokens: PerSequence[Any] | None = None) -> Step:
        """A step adding ``new_tokens[seq]`` tokens to each sequence; use it as a context manager.

        ``tokens`` optionally maps sequences to the ids of their new tokens, so the
        pages they fill become reusable prefixes once the step ends.
        """
        return Step(self, new_tokens, tokens)

    @_op(write=False)
    def can_step(self, new_tokens: PerSequence[int]) -> bool:
        """Whether ``step(new_tokens)`` would find room for all its pages at once right now."""
        return step_mod.fits(self, new_tokens)

    # -- persistence ---------------------------------------------------------
    @_op(write=True)
    def commit(self) -> None:
        """Make everything so far durable (per the durability mode) and atomic.

        Waits for steps of other threads to finish; raises ``SequenceBusy`` if
        called inside a step of this thread.
        """
        self._wait_no_steps("commit()")
        self._commit()

    def _commit(self, full_sync: bool = False) -> None:
        """Commit; ``full_sync`` (at close) makes even a nosync store durable on disk."""
        if self.durability == "volatile":
            if self._remote is not None:
                self._remote.committed()
            return
        if self._mgr.wait_background is not None:
            self._mgr.wait_background()
        self._stats.carry(self._state, PERSISTED_COUNTERS)  # so inspect shows totals across sessions
        if self._remote is not None:
            self._remote.carry(self._state)
        self._state.update(next_uid=self._mgr.next_uid, tick=self._mgr.tick, time=time.time(),
                           commits=int(self._state.get("commits", 0)) + 1,
                           durability=self.durability)
        persist.commit(self._mgr, self._seqs.dirty, self._seqs.dropped, self._state,
                       durable=self.durability == "durable")
        if self._remote is not None:
            self._remote.committed()  # publish only what this commit made durable
        if full_sync and self.durability != "durable":
            self._sync_all()
        self._stats.add("commits")

    def _sync_all(self) -> None:
        """Flush every pool slot and sync LMDB: nosync commits skipped both."""
        self._pool_file.flush_slots(np.arange(self.pool_pages))
        self._spill.sync()

    @_op(write=True)
    def clear_cache(self, max_bytes: int | None = None) -> CacheDrop:
        """Drop least recently used cache-only pages until their spilled records take at most ``max_bytes``.

        Cache-only pages are the hashed pages kept for prefix reuse after their
        sequences went: refcount 0, referenced by no live or committed sequence,
        pinned by no step. They go oldest first, resident ones included (their
        slots are freed), and every one older than the last that must go goes
        too, so what stays is the most recently used part of the cache. The drop
        is committed at once, in one LMDB transaction of its own (records,
        directory entries and token ids); nothing else uncommitted is. Prompts
        whose pages went miss in ``lookup`` and ``create(tokens=...)`` from now on.

        Params:
            max_bytes: the bytes of spill records the cache may keep; None drops
                every cache-only page.
        Returns:
            ``{"pages": dropped, "bytes": record bytes freed, "slots": pool slots freed}``.
        Raises:
            PagedKVError (``max_bytes`` is not None or an int >= 0), ReadOnlyStore,
            StoreFull or StoreIOError (the transaction failed; the handle is poisoned).
        """
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, (int, np.integer))
                                      or max_bytes < 0):
            raise PagedKVError(f"max_bytes must be None or an int >= 0, got {max_bytes!r}")
        dropped = evict.drop_cache(self._mgr, None if max_bytes is None else int(max_bytes))
        if dropped["pages"]:
            evict.log.info("clear_cache(max_bytes=%s): dropped %d cache-only pages, %d record bytes, "
                           "%d pool slots", max_bytes, dropped["pages"], dropped["bytes"], dropped["slots"])
        return CacheDrop(pages=dropped["pages"], bytes=dropped["bytes"], slots=dropped["slots"])

    @_op(write=False)
    def prefetch(self, seq_ids: Iterable[SeqId]) -> Prefetch:
        """Start restoring the spilled pages of ``seq_ids`` in the background; return at once.

        The handle's ``wait()`` blocks until it is done. A later ``step()`` or
        ``read()`` finds the pages resident, or restores what is still in flight
        itself. Pages restored this way count as ``prefetch_restores`` in stats().
        """
        ids = list(seq_ids)
        for seq_id in ids:
            self._seqs.find(seq_id)  # unknown ids are an error now, not in the thread
        return self._prefetcher.submit(ids)

    def close(self) -> None:
        """Commit (unless read-only, volatile or poisoned), then release every resource."""
        self._close(commit=True)

    def _close(self, commit: bool) -> None:
        """Release the handle; without ``commit``, what changed since the last commit is dropped.

        Either way the last commit is made durable (a nosync store syncs it).
        """
        if self._active_steps.get(threading.get_ident()):
            raise SequenceBusy("close() inside an active step of this thread")
        self._stop_threads()
        with self._lock:
            if self._closed:
                return
            if self._active_steps.get(threading.get_ident()):
                raise SequenceBusy("close() inside an active step of this thread")
            try:
                if not self.readonly and not self._poisoned and self._in_opening_process():
                    self._wait_no_steps("close()")
                    if commit:
                        self._commit(full_sync=True)
                        faults.crashpoint("close.after_commit")
                        if self._remote is not None and self._remote.drain():
                            self._commit(full_sync=True)  # the state record then holds what it sent
                    elif self.durability == "nosync":
                        self._sync_all()
            finally:
                self._release()

    def _abandon(self) -> None:
        """Drop the handle without committing: an in-process crash, for tests."""
        self._stop_threads()
        with self._lock:
            self._release()

    def _stop_threads(self) -> None:
        """End the background threads; they take the store lock, so call this without it."""
        self._prefetcher.stop()
        if self._write_behind is not None:
            self._write_behind.stop()

    def _release(self) -> None:
        self._closed = True
        if self._remote is not None:
            self._remote.close()
            self._remote = None
        self._mgr.pool = None  # type: ignore[assignment]  # our own view must not pin the map
        self._seqs.batch = None
        # Break the store <-> thread-helper cycles, so a dropped handle is freed at once
        # rather than at the next cyclic collection.
        self._mgr.on_take = self._mgr.wait_background = None
        self._spill.close()
        self._pool_file.close()
        if self._writer_lock is not None:
            self._writer_lock.release()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """Commit and close on a clean exit; on an exception, roll back to the last commit and close.

        Like ``sqlite3``'s connection: a block that fails leaves nothing of its
        own changes behind (the handle is closed either way).
        """
        self._close(commit=exc_type is None)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._seqs)} sequences"
        return f"<KVStore {self.path!r} {state}>"

    # -- observability -------------------------------------------------------
    @_op(write=False)
    def stats(self) -> StoreStats:
        """A flat dict of counters, restore latency (ms), pool occupancy and per-codec spill figures.

        Returns:
            a ``pagedkv.StoreStats``: every count an ``int``, latencies (ms) and
            ratios ``float``; counters cover this handle's life.
        """
        return store_stats(self)

    @_op(write=False)
    def check(self, detailed: bool = False) -> list[str] | list[Problem]:
        """Verify every checksum and invariant; return the problems found ([] when consistent).

        Damaged metadata records a read-only handle left out at open come first.
        Each is a one-line str; with ``detailed``, a ``pagedkv.Problem`` (kind, page,
        sequence, message) whose ``message`` is that line.
        """
        problems = [Problem("metadata", f"damaged metadata: {line}") for line in self._damage] + check_store(self)
        return problems if detailed else [problem.message for problem in problems]

    # -- read API (describe.py): typed views that change nothing ---------------
    @_op(write=False)
    def describe(self) -> StoreSummary:
        """Identity, geometry, pool and page occupancy, spill records, sequences and the last commit, now.

        Reads the size of every spill record once; ``spill_info()`` alone reads none.
        """
        return describe_mod.describe(self)

    @_op(write=False)
    def describe_pages(self, uids: Iterable[int] | None = None, check: bool = False) -> list[PageInfo]:
        """A ``pagedkv.PageInfo`` per page of ``uids`` in that order (None: every live page).

        With ``check``, each is checked against its checksum as ``check()`` would
        (``ok``, ``problem``); nothing is restored. Raises ``PageNotFound``.
        """
        return describe_mod.describe_pages(self, uids, check)

    @_op(write=False)
    def describe_sequences(self) -> list[SequenceInfo]:
        """A ``pagedkv.SequenceInfo`` (id, length, page uids, resident count) per sequence, in ``sequences()`` order."""
        return describe_mod.describe_sequences(self)

    @_op(write=False)
    def slot_states(self) -> NDArray[np.int8]:
        """Per pool slot, its state as an index into ``pagedkv.describe.SLOT_STATES`` (a new array)."""
        return describe_mod.slot_states(self)

    @_op(write=False)
    def page_content(self, uid: int) -> PageContent:
        """A copy of page ``uid``'s bytes and, when spilled, its record's header; restores nothing."""
        return describe_mod.page_content(self, uid)

    @_op(write=False)
    def spill_info(self) -> SpillInfo:
        """The LMDB environment's map, last transaction, entry counts and reader table."""
        return describe_mod.spill_info(self)

    @_op(write=False)
    def last_commit(self) -> CommitInfo:
        """When the last commit was made, by which mode, and the counters it totalled over every session."""
        return describe_mod.last_commit(self)

    @_op(write=False)
    def garbage(self) -> list[Problem]:
        """Spill records no page owns (a crashed writer's uncommitted evictions), as ``stray_record`` problems."""
        return describe_mod.garbage(self)
