"""KVStore: sequences over paged KV, the public face of pagedkv."""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Mapping, TypeVar

import numpy as np

from . import faults, persist, step as step_mod
from .check import check_store
from .errors import (PagedKVError, PoolExhausted, ReadOnlyStore, SequenceBusy, SequenceExists,
                     SequenceNotFound, StoreClosed, StoreFull, StoreIOError)
from .geometry import Geometry
from .manager import BlockManager
from .pool import PagePool
from .sequence import SeqId, Sequence, seq_key
from .spill import SpillStore
from .stats import Stats
from .step import Step

F = TypeVar("F", bound=Callable[..., Any])
DURABILITY = ("durable", "nosync", "volatile")


def _op(write: bool) -> Callable[[F], F]:
    """Serialise a public operation on the store lock and check the handle is usable."""

    def wrap(fn: F) -> F:
        def inner(self: KVStore, *args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self._usable(write)
                try:
                    return fn(self, *args, **kwargs)
                except (StoreIOError, StoreFull) as exc:
                    if write:
                        self._poisoned = str(exc)  # the last commit stays intact on disk
                    raise

        inner.__name__, inner.__doc__, inner.__wrapped__ = fn.__name__, fn.__doc__, fn  # type: ignore
        return inner  # type: ignore[return-value]

    return wrap


class KVStore:
    """A persistent paged KV store; obtain one with ``pagedkv.open``."""

    def __init__(self, path: str, pool: PagePool, spill: SpillStore, superblock: dict[str, Any],
                 durability: str, readonly: bool, evict_batch: int, lock: Any) -> None:
        self.path = path
        self.geometry: Geometry = pool.geom
        self.pool_pages = pool.pool_pages
        self.durability = durability
        self.readonly = readonly
        self.uuid = pool.uuid.hex()
        self.superblock = superblock
        self._pool_file, self._spill, self._writer_lock = pool, spill, lock
        self._lock = threading.RLock()
        self._no_steps = threading.Condition(self._lock)
        self._active_steps: dict[int, int] = {}
        self._stats = Stats()
        self._mgr = BlockManager(pool.geom, pool, spill, int.from_bytes(pool.uuid[:8], "little"),
                                 durability == "durable", evict_batch, self._stats)
        self._dirty: set[bytes] = set()
        self._dropped: set[bytes] = set()
        self._closed = False
        self._poisoned: str | None = None
        self._pid = os.getpid()
        self._seqs, self._state = persist.load(self._mgr, writer=not readonly)

    # -- handle state --------------------------------------------------------
    def _usable(self, write: bool) -> None:
        if self._closed:
            raise StoreClosed(f"{self.path}: the store is closed")
        if os.getpid() != self._pid:
            raise StoreClosed(f"{self.path}: opened in process {self._pid}; reopen it in this one")
        if self._poisoned and write:
            raise StoreClosed(f"{self.path}: an earlier I/O failure poisoned this handle "
                              f"({self._poisoned}); reopen the store")
        if write and self.readonly:
            raise ReadOnlyStore(f"{self.path}: opened read-only")

    def _seq(self, seq_id: SeqId) -> Sequence:
        seq = self._seqs.get(seq_key(seq_id))
        if seq is None:
            raise SequenceNotFound(f"no sequence {seq_id!r}")
        return seq

    def _idle_seq(self, seq_id: SeqId) -> Sequence:
        seq = self._seq(seq_id)
        if seq.busy:
            raise SequenceBusy(f"sequence {seq_id!r} is in an active step")
        return seq

    @property
    def pool(self) -> np.ndarray:
        """The pool slots: ndarray ``(pool_pages, layers, 2, page_size, kv_heads, head_dim)``."""
        self._usable(False)
        return self._mgr.pool

    # -- sequences -----------------------------------------------------------
    @_op(write=True)
    def create(self, seq_id: SeqId, tokens: Any = None) -> int:
        """Create an empty sequence; return the number of reused tokens (0 without a prefix cache).

        Raises ``SequenceExists`` if the id is taken.
        """
        key = seq_key(seq_id)
        if key in self._seqs:
            raise SequenceExists(f"sequence {seq_id!r} already exists")
        self._seqs[key] = Sequence(seq_id, key)
        self._dirty.add(key)
        self._dropped.discard(key)
        return 0

    @_op(write=True)
    def append(self, seq_id: SeqId, k: np.ndarray, v: np.ndarray, tokens: Any = None) -> None:
        """Append ``n`` tokens of K and V, each ``(layers, n, kv_heads, head_dim)`` in the store dtype.

        Pages fill in order, spanning page boundaries; a shared partial last page
        is copied first. The sequence may grow beyond the pool: earlier pages spill.
        """
        geom = self.geometry
        count = self._check_kv(k, v)
        seq = self._idle_seq(seq_id)
        if self._mgr.available() < 2:
            raise PoolExhausted("every pool slot is pinned by active steps")
        mgr, page_size, pos = self._mgr, geom.page_size, 0
        while pos < count:
            offset = seq.length % page_size
            if offset:
                pid = int(seq.pids[seq.npages - 1])
                if mgr.ref[pid] > 1:
                    pid = self._cow_last(seq)
                else:
                    mgr.ensure_resident(np.array([pid]))
                    mgr.verify(pid)
            else:
                pid = mgr.new_page()
                seq.push(pid)
            take = min(page_size - offset, count - pos)
            page = mgr.pool[mgr.slot[pid]]
            page[:, 0, offset:offset + take] = k[:, pos:pos + take]
            page[:, 1, offset:offset + take] = v[:, pos:pos + take]
            mgr.mark_written(pid, offset + take)
            faults.crashpoint("append.after_write")
            seq.length += take
            pos += take
        self._dirty.add(seq.key)
        self._stats.add("tokens_appended", count)

    def _check_kv(self, k: Any, v: Any) -> int:
        geom = self.geometry
        for name, arr in (("k", k), ("v", v)):
            if not isinstance(arr, np.ndarray):
                raise PagedKVError(f"{name} must be a numpy array, got {type(arr).__name__}")
            if arr.dtype != geom.np_dtype:
                raise PagedKVError(f"{name} has dtype {arr.dtype}, the store holds {geom.dtype}; "
                                   f"convert it with .astype() first")
            if arr.ndim != 4 or arr.shape[0] != geom.layers or arr.shape[2:] != geom.token_shape:
                raise PagedKVError(f"{name} has shape {arr.shape}; expected "
                                   f"({geom.layers}, n, {geom.kv_heads}, {geom.head_dim})")
        if k.shape != v.shape or k.shape[1] < 1:
            raise PagedKVError(f"k and v must have one shape with n >= 1 tokens, got {k.shape}, {v.shape}")
        return int(k.shape[1])

    def _cow_last(self, seq: Sequence) -> int:
        """Replace a shared last page by a private copy (copy-on-write)."""
        old = int(seq.pids[seq.npages - 1])
        new = self._mgr.copy_page(old)
        seq.pids[seq.npages - 1] = new
        self._mgr.decref(np.array([old]))
        return new

    def _truncate(self, seq: Sequence, length: int, npages: int, last: int, last_fill: int) -> None:
        """Roll a sequence back to an earlier length (its later tokens were never committed)."""
        mgr = self._mgr
        extra = seq.pids[npages:seq.npages].copy()
        seq.npages = npages
        if npages and int(seq.pids[npages - 1]) != last:
            extra = np.append(extra, seq.pids[npages - 1])
            seq.pids[npages - 1] = last
            mgr.incref(np.array([last]))
        elif npages and mgr.fill[last] != last_fill:
            mgr.mark_written(last, last_fill)
        if len(extra):
            mgr.decref(extra)
        seq.length = length

    @_op(write=False)
    def read(self, seq_id: SeqId, start: int = 0, stop: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Copies of K and V for tokens ``[start, stop)``, each ``(layers, n, kv_heads, head_dim)``.

        Spilled pages are restored on the way; a range longer than the pool
        streams through it. Raises ``PageCorrupt`` if a page fails its checksum.
        """
        seq = self._seq(seq_id)
        stop = seq.length if stop is None else stop
        for name, value in (("start", start), ("stop", stop)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise PagedKVError(f"{name} must be an int")
        if not 0 <= start <= stop <= seq.length:
            raise PagedKVError(f"range [{start}, {stop}) is outside sequence {seq_id!r} "
                               f"of length {seq.length}")
        geom, mgr, page_size = self.geometry, self._mgr, self.geometry.page_size
        shape = (geom.layers, stop - start, geom.kv_heads, geom.head_dim)
        out_k, out_v = np.empty(shape, geom.np_dtype), np.empty(shape, geom.np_dtype)
        first, last = start // page_size, -(-stop // page_size)

        def copy_out(index: int, page: np.ndarray) -> None:
            a, b = max(start, index * page_size), min(stop, (index + 1) * page_size)
            base = index * page_size
            out_k[:, a - start:b - start] = page[:, 0, a - base:b - base]
            out_v[:, a - start:b - start] = page[:, 1, a - base:b - base]

        if self.readonly:
            self._read_in_place(seq.pids[first:last].copy(), first, copy_out)
        else:
            chunk = mgr.available()
            if stop > start and chunk < 1:
                raise PoolExhausted("every pool slot is pinned by active steps")
            for lo in range(first, last, max(chunk, 1)):
                pids = seq.pids[lo:min(last, lo + chunk)].copy()
                slots = mgr.ensure_resident(pids)
                mgr.verify_many(pids)
                for index, slot in enumerate(slots.tolist(), lo):
                    copy_out(index, mgr.pool[slot])
        self._stats.add("tokens_read", stop - start)
        return out_k, out_v

    def _read_in_place(self, pids: np.ndarray, first: int,
                       copy_out: Callable[[int, np.ndarray], None]) -> None:
        """Serve pages where they lie (pool or spill record): a read-only handle moves nothing."""
        mgr = self._mgr
        with self._spill.begin_read() as txn:
            for index, pid in enumerate(pids.tolist(), first):
                if mgr.slot[pid] >= 0:
                    mgr.verify(pid)
                    self._stats.add("resident_hits")
                    copy_out(index, mgr.pool[mgr.slot[pid]])
                else:
                    page, _ = mgr.read_record(txn, pid)
                    self._stats.add("spill_hits")
                    copy_out(index, page)

    @_op(write=True)
    def fork(self, src: SeqId, dst: SeqId) -> None:
        """Make ``dst`` a copy of ``src`` sharing every page (copy-on-write on later appends)."""
        seq = self._idle_seq(src)
        key = seq_key(dst)
        if key in self._seqs:
            raise SequenceExists(f"sequence {dst!r} already exists")
        table = seq.table.copy()
        self._mgr.incref(table)
        self._seqs[key] = Sequence(dst, key, table, seq.length)
        self._dirty.add(key)
        self._dropped.discard(key)

    @_op(write=True)
    def drop(self, seq_id: SeqId) -> None:
        """Delete a sequence; pages no other sequence references are freed."""
        seq = self._idle_seq(seq_id)
        del self._seqs[seq.key]
        self._mgr.decref(seq.table[::-1].copy())  # tail first, like the free order of vLLM
        faults.crashpoint("drop.after_free")
        self._dirty.discard(seq.key)
        self._dropped.add(seq.key)

    @_op(write=False)
    def length(self, seq_id: SeqId) -> int:
        """Tokens in the sequence."""
        return self._seq(seq_id).length

    @_op(write=False)
    def sequences(self) -> list[SeqId]:
        """Every sequence id, in creation order for this session (load order after reopen)."""
        return [seq.seq_id for seq in self._seqs.values()]

    # -- steps ---------------------------------------------------------------
    def step(self, new_tokens: Mapping[SeqId, int]) -> Step:
        """A step adding ``new_tokens[seq]`` tokens to each sequence; use it as a context manager."""
        return Step(self, new_tokens)

    @_op(write=False)
    def can_step(self, new_tokens: Mapping[SeqId, int]) -> bool:
        """Whether ``step(new_tokens)`` would find room for all its pages at once right now."""
        seqs = [self._seq(seq_id) for seq_id in new_tokens]
        if any(seq.busy for seq in seqs):
            return False
        needed = step_mod.pages_needed(self, seqs, [int(n) for n in new_tokens.values()])
        return needed <= self._mgr.available()

    @_op(write=True)
    def _enter_step(self, step: Step) -> None:
        step_mod.begin(self, step)
        faults.crashpoint("step.after_begin")
        me = threading.get_ident()
        self._active_steps[me] = self._active_steps.get(me, 0) + 1
        self._stats.add("steps")
        self._stats.add("tokens_appended", sum(step.new_tokens))

    def _exit_step(self, step: Step, ok: bool) -> None:
        with self._lock:
            me = threading.get_ident()
            try:
                step_mod.end(self, step, ok)
                faults.crashpoint("step.after_end")
            finally:
                self._active_steps[me] -= 1
                if not self._active_steps[me]:
                    del self._active_steps[me]
                self._no_steps.notify_all()

    def _wait_no_steps(self, what: str) -> None:
        if self._active_steps.get(threading.get_ident()):
            raise SequenceBusy(f"{what} inside an active step of this thread")
        while self._active_steps:
            self._no_steps.wait()

    # -- persistence ---------------------------------------------------------
    @_op(write=True)
    def commit(self) -> None:
        """Make everything so far durable (per the durability mode) and atomic.

        Waits for steps of other threads to finish; raises ``SequenceBusy`` if
        called inside a step of this thread.
        """
        self._wait_no_steps("commit()")
        self._commit()

    def _commit(self) -> None:
        if self.durability == "volatile":
            return
        self._state.update(next_uid=self._mgr.next_uid, tick=self._mgr.tick, time=time.time(),
                           commits=int(self._state.get("commits", 0)) + 1,
                           durability=self.durability)
        persist.commit(self._mgr, self._seqs, self._dirty, self._dropped, self._state,
                       durable=self.durability == "durable")
        self._stats.add("commits")

    def close(self) -> None:
        """Commit (unless read-only, volatile or poisoned), then release every resource."""
        with self._lock:
            if self._closed:
                return
            try:
                if not self.readonly and not self._poisoned and os.getpid() == self._pid:
                    self._wait_no_steps("close()")
                    self._commit()
                    faults.crashpoint("close.after_commit")
            finally:
                self._release()

    def _abandon(self) -> None:
        """Drop the handle without committing: an in-process crash, for tests."""
        with self._lock:
            self._release()

    def _release(self) -> None:
        self._closed = True
        self._spill.close()
        self._pool_file.close()
        if self._writer_lock is not None:
            self._writer_lock.release()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._seqs)} sequences"
        return f"<KVStore {self.path!r} {state}>"

    # -- observability -------------------------------------------------------
    @_op(write=False)
    def stats(self) -> dict[str, float]:
        """A flat dict of counters, restore latency (ms) and pool occupancy."""
        mgr = self._mgr
        out = self._stats.snapshot()
        used = int(np.count_nonzero(mgr.slot_pid >= 0))
        out.update(
            pool_pages=self.pool_pages, pool_used=used, pool_free=len(mgr.free_slots),
            pool_pending=int(np.count_nonzero((mgr.slot_pid < 0) & (mgr.slot_cpid >= 0))),
            pool_pinned=int(np.count_nonzero(mgr.pins)),
            spilled_pages=int(np.count_nonzero(mgr.live & (mgr.slot < 0))),
            pages=int(np.count_nonzero(mgr.live)), sequences=len(self._seqs),
            tokens=sum(seq.length for seq in self._seqs.values()),
        )
        return out

    @_op(write=False)
    def check(self) -> list[str]:
        """Verify every checksum and invariant; return the problems found ([] when consistent)."""
        return check_store(self)
