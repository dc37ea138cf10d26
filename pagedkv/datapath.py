"""Moving K/V between a caller's arrays and a sequence's pages: append, read, copy-on-write."""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Iterator, TypeVar

import numpy as np
from numpy.exceptions import TooHardError

from .core import StoreCore
from . import faults
from .errors import PageCorrupt, PagedKVError, PoolExhausted
from .storage.lockfile import lock_holder
from .pages.directory import HAS_TOKENS, HASHED, NOWHERE
from .geometry import Geometry
from .pages.prefix import seal, write_tokens
from .pages.sequence import Sequence
from .pages.restore import read_record, resident_slot

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
    if not mgr.has_room(1):
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
    if type(start) is int and type(stop) is int and 0 <= start <= stop <= limit:
        return start, stop
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


def check_out(geom: Geometry, pool: np.ndarray, out: Any, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Validate a caller's ``(k_out, v_out)`` for ``count`` tokens (``KVStore.read(..., out=)``); return it.

    Each must be a writable numpy array of the store's dtype and of shape
    ``(layers, count, kv_heads, head_dim)``, any strides; the two must not
    overlap each other or the store's pool.
    """
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise PagedKVError(f"out must be a (k_out, v_out) pair of numpy arrays, got {type(out).__name__}")
    shape = (geom.layers, count, geom.kv_heads, geom.head_dim)
    for name, arr in zip(("k_out", "v_out"), out):
        if not isinstance(arr, np.ndarray):
            raise PagedKVError(f"{name} must be a numpy array, got {type(arr).__name__}")
        if arr.dtype != geom.np_dtype:
            raise PagedKVError(f"{name} has dtype {arr.dtype}, the store holds {geom.dtype}")
        if arr.shape != shape:
            raise PagedKVError(f"{name} has shape {arr.shape}; {count} tokens need {shape}")
        if not arr.flags.writeable:
            raise PagedKVError(f"{name} is read-only")
        if np.may_share_memory(arr, pool):
            raise PagedKVError(f"{name} lies in the store's pool")
    k_out, v_out = out
    if np.may_share_memory(k_out, v_out):
        try:
            overlap = bool(np.shares_memory(k_out, v_out, max_work=1 << 16))
        except TooHardError:  # strides too tangled to decide cheaply: refused as overlapping
            overlap = True
        if overlap:
            raise PagedKVError("k_out and v_out overlap")
    return k_out, v_out


def read(store: StoreCore, seq: Sequence, start: int, stop: int,
         out: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """K and V of tokens ``[start, stop)``: into ``out`` (checked by ``check_out``), else new arrays.

    New arrays are the two halves of one allocation, as large as a page-layout
    copy of the same tokens would be: fresh memory costs its page faults, and
    one block of it costs fewer than two. Pages stream through the pool, a
    chunk of them at a time (``_gather``).
    """
    geom, pool = store.geometry, store._mgr.pool
    page_size = geom.page_size
    first, last = start // page_size, -(-stop // page_size)
    if last - first == 1 and not store.readonly:  # one page: the whole output at once, no chunk machinery
        page = pool[resident_slot(store._mgr, seq.pids.item(first))]
        if stop - start < page_size:
            base = first * page_size
            page = page[:, :, start - base:stop - base]
        if out is None:
            # The copy is the one allocation: C order of (K/V, layers, tokens, heads, dim).
            both = page.swapaxes(0, 1).copy()
            return both[0], both[1]
        out_k, out_v = out
        out_k[...] = page[:, 0]
        out_v[...] = page[:, 1]
        return out_k, out_v
    if out is None:
        both = np.empty((2, geom.layers, stop - start, geom.kv_heads, geom.head_dim), pool.dtype)
        outs: tuple[np.ndarray, ...] = (both,)
        out_k, out_v = both[0], both[1]
    else:
        out_k, out_v = out
        outs = out
    if store.readonly:
        def copy_out(index: int, page: np.ndarray) -> None:
            base = index * page_size
            a, b = max(start, base), min(stop, base + page_size)
            _copy_page(outs, page[np.newaxis], 0, a - base, b - base, a - start)

        _read_in_place(store, seq.pids[first:last].copy(), first, copy_out)
    else:
        for lo, slots in _resident_chunks(store, seq, first, last):
            _gather(outs, pool, slots, lo, start, stop, page_size)
    return out_k, out_v


def _gather(outs: tuple[np.ndarray, ...], pool: np.ndarray, slots: np.ndarray, index: int,
            start: int, stop: int, page_size: int) -> None:
    """Copy the tokens of pages ``index, index + 1, ...`` (in ``slots``) that ``[start, stop)`` covers.

    A partly covered first or last page is copied on its own, the full pages
    between them by ``_copy_full_pages``.
    """
    count = len(slots)
    lo, hi = 0, count
    for i in sorted({0, count - 1}):
        base = (index + i) * page_size
        a, b = max(start, base), min(stop, base + page_size)
        if b - a < page_size:
            _copy_page(outs, pool, int(slots[i]), a - base, b - base, a - start)
            lo, hi = (1, hi) if i == 0 else (lo, count - 1)
    if lo < hi:
        _copy_full_pages(outs, pool, slots[lo:hi], (index + lo) * page_size - start)


def _copy_full_pages(outs: tuple[np.ndarray, ...], pool: np.ndarray, slots: np.ndarray, pos: int) -> None:
    """Whole pages (in ``slots``) to output tokens from ``pos`` on, one output row at a time.

    A page holds each (layer, K/V) as one contiguous run of its tokens; with
    the pool seen as rows of such runs, ``np.take`` fills each output row
    (K or V of one layer) in order from the pages' runs: the output is written
    front to back, so each freshly faulted page of it is filled while in
    cache. ``mode="clip"`` because numpy buffers ``out`` for ``"raise"``; the
    rows are valid by construction. Outputs whose token rows are not
    contiguous are copied page by page.
    """
    layers, page_size = pool.shape[1], pool.shape[3]
    count = len(slots)
    span = count * page_size
    rows = pool.reshape(-1, pool[0, 0, 0].size)  # row (slot * layers + layer) * 2 + kv
    first_rows = slots.astype(np.intp) * (2 * layers)
    if len(outs) == 1:
        both = outs[0]
        if pos == 0 and span == both.shape[2]:  # the whole output: one take of every row in order
            offsets = np.arange(2)[:, None] + 2 * np.arange(layers)[None, :]  # (K/V, layer)
            index = (offsets[:, :, None] + first_rows[None, None, :]).reshape(-1)
            np.take(rows, index, axis=0, out=both.reshape(-1, rows.shape[1]), mode="clip")
            return
        arrays: tuple[np.ndarray, ...] = (both[0], both[1])
    else:
        arrays = outs
    if not all(arr[0].flags.c_contiguous for arr in arrays):
        for i, slot in enumerate(slots.tolist()):
            _copy_page(outs, pool, slot, 0, page_size, pos + i * page_size)
        return
    for kv, arr in enumerate(arrays):
        for layer in range(layers):
            np.take(rows, first_rows + (2 * layer + kv), axis=0, mode="clip",
                    out=arr[layer, pos:pos + span].reshape(count, rows.shape[1]))


def _copy_page(outs: tuple[np.ndarray, ...], pool: np.ndarray, slot: int, a: int, b: int, pos: int) -> None:
    """Tokens ``[a, b)`` of the page in ``slot`` to output tokens from ``pos`` on.

    ``outs`` is ``(k_out, v_out)``, or one ``(2, layers, n, heads, dim)`` array
    holding both.
    """
    src = pool[slot, :, :, a:b]  # (layers, 2, tokens, heads, dim)
    end = pos + b - a
    if len(outs) == 1:
        outs[0][:, :, pos:end] = src.swapaxes(0, 1)
    else:
        outs[0][:, pos:end] = src[:, 0]
        outs[1][:, pos:end] = src[:, 1]


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
    if store.readonly:
        _read_in_place(store, seq.pids[first:last].copy(), first, copy_out)
        return
    pool = store._mgr.pool
    for lo, slots in _resident_chunks(store, seq, first, last):
        for index, slot in enumerate(slots.tolist(), lo):
            copy_out(index, pool[slot])


def _resident_chunks(store: StoreCore, seq: Sequence, first: int,
                     last: int) -> Iterator[tuple[int, np.ndarray]]:
    """Pages ``[first, last)`` as ``(first index, slots)`` chunks, each resident and verified when yielded.

    A chunk is as many pages as the pool can hold at once; the next chunk's
    restores may evict the previous one's pages.
    """
    mgr = store._mgr
    chunk = mgr.unpinned_at_least()
    if last > first and chunk < 1:
        raise PoolExhausted("every pool slot is pinned by active steps")
    for lo in range(first, last, max(chunk, 1)):
        pids = seq.pids[lo:min(last, lo + chunk)].copy()
        slots = mgr.ensure_resident(pids)
        mgr.verify_many(pids)
        mgr.verify_committed(pids)
        yield lo, slots


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
