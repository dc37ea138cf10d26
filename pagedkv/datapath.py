"""Moving K/V between a caller's arrays and a sequence's pages: append, read, copy-on-write."""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, TypeVar

import numpy as np

from .core import StoreCore
from . import faults
from .errors import PageCorrupt, PagedKVError, PoolExhausted
from .storage.lockfile import lock_holder
from .pages.directory import HAS_TOKENS, HASHED, NOWHERE
from .geometry import Geometry
from .pages.prefix import seal, write_tokens
from .pages.sequence import Sequence
from .pages.restore import read_record

T = TypeVar("T")
log = logging.getLogger(__name__)


def check_kv(geom: Geometry, k: Any, v: Any) -> int:
    """Validate K and V arrays against the geometry; return their token count."""
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


def append(store: StoreCore, seq: Sequence, k: np.ndarray, v: np.ndarray,
           token_ids: np.ndarray | None) -> None:
    """Write ``k``/``v`` after the sequence's last token, page by page."""
    mgr, page_size = store._mgr, store.geometry.page_size
    count = int(k.shape[1])
    if mgr.available() < 1:
        raise PoolExhausted("every pool slot is pinned by active steps")
    pos = 0
    while pos < count:
        offset = seq.length % page_size
        if offset:
            pid = int(seq.pids[seq.npages - 1])
            if mgr.ref[pid] > 1:
                pid = cow_last(store, seq)
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
        write_tokens(mgr, pid, offset, None if token_ids is None else token_ids[pos:pos + take])
        if offset + take == page_size:
            seal(mgr, pid, int(seq.pids[seq.npages - 2]) if seq.npages > 1 else -1)
        faults.crashpoint("append.after_write")
        seq.length += take
        pos += take


def cow_last(store: StoreCore, seq: Sequence) -> int:
    """Replace a shared last page by a private copy (copy-on-write)."""
    mgr = store._mgr
    old = int(seq.pids[seq.npages - 1])
    new = mgr.copy_page(old)
    seq.pids[seq.npages - 1] = new
    mgr.decref(np.array([old]))
    return new


def truncate(store: StoreCore, seq: Sequence, length: int, npages: int, last: int, last_fill: int) -> None:
    """Roll a sequence back to an earlier length (its later tokens were never committed)."""
    mgr = store._mgr
    extra = seq.pids[npages:seq.npages].copy()
    seq.npages = npages
    if npages and int(seq.pids[npages - 1]) != last:
        extra = np.append(extra, seq.pids[npages - 1])
        seq.pids[npages - 1] = last
        mgr.incref(np.array([last]))
    elif npages and mgr.fill[last] != last_fill:
        mgr.mark_written(last, last_fill)
        if last in mgr.page_tokens:
            mgr.page_tokens.cut(last, last_fill)
    if len(extra):
        mgr.decref(extra)
    seq.length = length


def shorten(store: StoreCore, seq: Sequence, length: int) -> None:
    """Cut ``seq`` back to its first ``length`` tokens (``KVStore.truncate``); ``length`` is checked.

    Pages past the new end are released as ``drop`` releases them (tail first;
    hashed ones stay as cache). A partly kept last page is cut in place only if
    it is this sequence's alone, carries no prefix hash and loses none of its
    committed tokens: a page shared with a fork or the prefix index is never
    modified, and a committed token must stay where the last commit says it is
    until the next commit (a later append would write over it). Otherwise the
    sequence gets a private copy of the kept tokens, made before anything
    changes, so a failure (``PoolExhausted``, ``PageCorrupt``) leaves the
    sequence as it was.
    """
    mgr, page_size = store._mgr, store.geometry.page_size
    npages = -(-length // page_size)
    released = seq.pids[npages:seq.npages][::-1].copy()
    if npages:
        last = int(seq.pids[npages - 1])
        keep = length - (npages - 1) * page_size
        if keep < mgr.fill[last]:
            mgr.ensure_resident(np.array([last]))
            mgr.verify(last)  # never launder a damaged page into a fresh checksum
            committed = int(mgr.c_fill[last]) if mgr.c_where[last] != NOWHERE else 0
            if mgr.ref[last] == 1 and not mgr.flags[last] & HASHED and keep >= committed:
                _cut_tokens(mgr, last, keep, mgr.page_tokens_of(last))
                mgr.mark_written(last, keep)
            else:
                copy = mgr.copy_page(last)
                _cut_tokens(mgr, copy, keep, mgr.page_tokens.get(copy))
                mgr.mark_written(copy, keep)
                seq.pids[npages - 1] = copy
                released = np.append(released, last)
    seq.npages = npages
    seq.length = length
    if len(released):
        mgr.decref(released)


def _cut_tokens(mgr: Any, pid: int, keep: int, token_ids: np.ndarray | None) -> None:
    """Keep the ids of a cut page's first ``keep`` tokens (unknown ids stay unknown)."""
    if not mgr.flags[pid] & HAS_TOKENS:
        return
    if token_ids is None or len(token_ids) < keep:
        mgr.flags[pid] = int(mgr.flags[pid]) & ~HAS_TOKENS
        mgr.page_tokens.drop(pid)
    else:
        mgr.page_tokens.set(pid, token_ids[:keep].copy())


def check_range(seq: Sequence, start: Any, stop: Any, limit: int, unit: str) -> tuple[int, int]:
    """Validate ``[start, stop)`` against ``[0, limit]`` (``limit`` tokens or pages); return ints."""
    for name, value in (("start", start), ("stop", stop)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise PagedKVError(f"{name} must be an int")
    if not 0 <= start <= stop <= limit:
        raise PagedKVError(f"range [{start}, {stop}) is outside sequence {seq.seq_id!r} of {limit} {unit}")
    return int(start), int(stop)


def serve(store: StoreCore, seq: Sequence, fetch: Callable[[Sequence], T],
          enough: Callable[[Sequence], bool]) -> T:
    """``fetch(seq)``; beside a live writer, retried on a fresh snapshot if it went stale.

    ``enough(seq)`` says whether the refreshed sequence still covers the request.
    """
    for attempt in range(5):
        try:
            return fetch(seq)
        except PageCorrupt as exc:
            # Beside a live writer a read-only snapshot goes stale as slots are
            # reused; committed tokens never change, so a fresh snapshot serves them.
            if not store.readonly or attempt == 4 or \
                    lock_holder(os.path.join(store.path, "LOCK")) is None:
                if store.readonly:  # a writer's handle said so where it found the damage
                    log.warning("%s (read-only handle): %s", store.path, exc)
                raise
            store._refresh()
            seq = store._seqs.find(seq.seq_id)
            if not enough(seq):
                raise PagedKVError(f"sequence {seq.seq_id!r} changed under a live writer") from None
    raise AssertionError("unreachable")


def read(store: StoreCore, seq: Sequence, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """Copies of K and V of tokens ``[start, stop)``; pages stream through the pool."""
    geom, page_size = store.geometry, store.geometry.page_size
    shape = (geom.layers, stop - start, geom.kv_heads, geom.head_dim)
    out_k, out_v = np.empty(shape, geom.np_dtype), np.empty(shape, geom.np_dtype)

    def copy_out(index: int, page: np.ndarray) -> None:
        a, b = max(start, index * page_size), min(stop, (index + 1) * page_size)
        base = index * page_size
        out_k[:, a - start:b - start] = page[:, 0, a - base:b - base]
        out_v[:, a - start:b - start] = page[:, 1, a - base:b - base]

    _each_page(store, seq, start // page_size, -(-stop // page_size), copy_out)
    return out_k, out_v


def read_pages(store: StoreCore, seq: Sequence, first: int, last: int, length: int | None = None) -> np.ndarray:
    """Copies of pages ``[first, last)`` in pool layout; positions past ``length`` (default: the
    sequence's) zeroed."""
    geom = store.geometry
    out = np.empty((last - first, *geom.page_shape), geom.np_dtype)

    def copy_out(index: int, page: np.ndarray) -> None:
        out[index - first] = page

    _each_page(store, seq, first, last, copy_out)
    tail = (seq.length if length is None else length) - (last - 1) * geom.page_size
    if last > first and tail < geom.page_size:
        out[-1, :, :, tail:] = 0  # the slot's bytes there are another page's leftovers
    return out


def each_page(store: StoreCore, seq: Sequence, first: int, last: int,
              visit: Callable[[int, np.ndarray], None]) -> None:
    """``visit(index, page)`` for pages ``[first, last)`` where they lie, verified (``KVStore.each_page``)."""
    _each_page(store, seq, first, last, visit)


def _each_page(store: StoreCore, seq: Sequence, first: int, last: int,
               copy_out: Callable[[int, np.ndarray], None]) -> None:
    """Call ``copy_out(index, page)`` for pages ``[first, last)``, verified, restoring as needed."""
    mgr = store._mgr
    if store.readonly:
        _read_in_place(store, seq.pids[first:last].copy(), first, copy_out)
        return
    chunk = mgr.available()
    if last > first and chunk < 1:
        raise PoolExhausted("every pool slot is pinned by active steps")
    for lo in range(first, last, max(chunk, 1)):
        pids = seq.pids[lo:min(last, lo + chunk)].copy()
        slots = mgr.ensure_resident(pids)
        mgr.verify_many(pids)
        mgr.verify_committed(pids)
        for index, slot in enumerate(slots.tolist(), lo):
            copy_out(index, mgr.pool[slot])


def _read_in_place(store: StoreCore, pids: np.ndarray, first: int,
                   copy_out: Callable[[int, np.ndarray], None]) -> None:
    """Serve pages where they lie (pool or spill record): a read-only handle moves nothing."""
    mgr = store._mgr
    with store._spill.begin_read() as txn:
        for index, pid in enumerate(pids.tolist(), first):
            if mgr.slot[pid] >= 0:
                mgr.stats.add("resident_hits")
                copy_out(index, mgr.stable_copy(pid))
            else:
                page, _ = read_record(mgr, txn, pid)
                mgr.stats.add("spill_hits")
                copy_out(index, page)
