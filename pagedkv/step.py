"""One engine step: block tables, slot mapping and sequence lengths over pinned pages.

The per-sequence work is a handful of attribute reads; everything else is
vectorised over the batch. Like a persistent batch in an engine, the block table
of the previous step is kept and only grown rows are rewritten, as long as no
page of the batch has moved and no block table has changed since.
"""

from __future__ import annotations

import threading
from typing import Any, Mapping, cast

import numpy as np

from . import datapath, faults
from .core import StoreCore, _op
from .datapath import cow_last
from .errors import PagedKVError, PoolExhausted
from .pages.prefix import as_token_ids, seal, write_tokens
from .pages.sequence import PerSequence, SeqId, Sequence
from .pages.directory import HAS_TOKENS


class Step:
    """A context manager over one scheduling step.

    Inside the ``with`` block the pages of every sequence in the step are
    resident and pinned. ``block_tables`` (int32, ``(num_seqs, max_pages)``, -1
    padded) index ``store.pool``; ``slot_mapping`` (int64, one entry per new
    token, ``slot * page_size + offset``) says where the engine writes each new
    token's K/V; ``seq_lens`` (int32) include the new tokens. Rows follow the
    order of the mapping given to ``KVStore.step``. If the block raises, the
    step's new tokens are rolled back.
    """

    def __init__(self, store: StoreCore, new_tokens: PerSequence[int],
                 tokens: PerSequence[Any] | None = None) -> None:
        counts = parse_counts(new_tokens)
        tokens = tokens or {}
        if not isinstance(tokens, Mapping) or not set(tokens) <= set(new_tokens):
            raise PagedKVError("step tokens= must map sequences of the step to their new token ids")
        counts_of = cast("Mapping[SeqId, int]", new_tokens)  # keys were checked against new_tokens just above
        self.token_ids = {seq_id: as_token_ids(ids, int(counts_of[seq_id]))
                          for seq_id, ids in tokens.items()}
        self._store = store
        self.seq_ids: list[SeqId] = list(new_tokens)
        self.new_tokens = counts
        self.block_tables = np.empty((0, 0), np.int32)
        self.slot_mapping = np.empty(0, np.int64)
        self.seq_lens = np.empty(0, np.int32)
        self._seqs: list[Sequence] = []
        self._undo: tuple[np.ndarray, ...] = ()  # lengths, pages, last pages, their fills
        self._pins = np.zeros(0, np.int32)
        self.members: frozenset[Sequence] = frozenset()  # the sequences, while the step is active

    def __enter__(self) -> Step:
        _enter_step(self._store, self)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        _exit_step(self._store, self, ok=exc_type is None)

    def length_before(self, seq: Sequence) -> int:
        """The length ``seq`` (a member of this active step) had when the step began."""
        return int(self._undo[0][self._seqs.index(seq)])


@_op(write=True)
def _enter_step(store: StoreCore, step: Step) -> None:
    """Begin ``step`` on ``store``: an operation of its own (locked, checked, I/O errors typed)."""
    begin(store, step)
    faults.crashpoint("step.after_begin")
    me = threading.get_ident()
    store._active_steps[me] = store._active_steps.get(me, 0) + 1
    store._stats.add("steps")
    store._stats.add("tokens_appended", sum(step.new_tokens))


def _exit_step(store: StoreCore, step: Step, ok: bool) -> None:
    """End ``step``: keep its tokens (``ok``) or roll them back, and wake a waiting commit."""
    with store._lock:
        me = threading.get_ident()
        try:
            end(store, step, ok)
            faults.crashpoint("step.after_end")
        finally:
            store._active_steps[me] -= 1
            if not store._active_steps[me]:
                del store._active_steps[me]
            store._no_steps.notify_all()


def parse_counts(new_tokens: Any) -> list[int]:
    """Validate a step's mapping of sequence id -> new token count; return the counts."""
    if not isinstance(new_tokens, Mapping) or not new_tokens:
        raise PagedKVError("step() takes a non-empty mapping of sequence id -> new token count")
    counts = list(new_tokens.values())
    if set(map(type, counts)) != {int} or min(counts) < 0:
        for count in counts:
            if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
                raise PagedKVError(f"new token counts must be ints >= 0, got {count!r}")
        counts = [int(count) for count in counts]
    return counts


# Up to this many rows, per-row scalar updates cost less than numpy's per-call overhead.
_FEW = 4


class _Batch:
    """The previous step's sequences and block table, reusable while nothing they depend on changed.

    ``lengths`` and ``npages`` are the sequences' state after that step; with the
    set of its sequences and their keys they spare the next step of the same
    batch one Python pass per sequence each.
    """

    def __init__(self, seq_ids: list[SeqId], seqs: list[Sequence], tables: np.ndarray,
                 table_epoch: int, evict_epoch: int, lengths: np.ndarray, npages: np.ndarray,
                 members: frozenset[Sequence], by_key: dict[bytes, Sequence]) -> None:
        self.seq_ids, self.seqs, self.tables = seq_ids, seqs, tables
        self.table_epoch, self.evict_epoch = table_epoch, evict_epoch
        self.lengths, self.npages, self.members, self.by_key = lengths, npages, members, by_key


def pages_needed(store: StoreCore, seqs: list[Sequence], new_tokens: list[int]) -> int:
    """Slots a step needs at once: distinct existing pages, copies and new pages."""
    mgr, page_size = store._mgr, store.geometry.page_size
    existing = np.concatenate([seq.table for seq in seqs]) if seqs else np.empty(0, np.int64)
    total = len(np.unique(existing))
    for seq, count in zip(seqs, new_tokens):
        if not count:
            continue
        total += -(-(seq.length + count) // page_size) - seq.npages
        if seq.length % page_size and mgr.ref[seq.pids[seq.npages - 1]] > 1:
            total += 1
    return total


def fits(store: StoreCore, new_tokens: PerSequence[int]) -> bool:
    """``KVStore.can_step``: no sequence busy, and room for every page of the step at once."""
    counts = parse_counts(new_tokens)
    seqs = [store._seqs.find(seq_id) for seq_id in new_tokens]
    if any(not frozenset(seqs).isdisjoint(active.members) for active in store._seqs.busy.values()):
        return False
    return pages_needed(store, seqs, counts) <= store._mgr.available()


def begin(store: StoreCore, step: Step) -> None:
    """Plan and pin a step (called with the store lock held)."""
    mgr, page_size = store._mgr, store.geometry.page_size
    batch = store._seqs.batch
    if batch is None or batch.table_epoch != store._seqs.epoch or batch.seq_ids != step.seq_ids:
        batch = None
        get = store._seqs.get
        found = [get(seq_id) for seq_id in step.seq_ids]
        if None in found or not set(map(type, step.seq_ids)) <= {str, int}:
            seqs = [store._seqs.find(seq_id) for seq_id in step.seq_ids]  # typed errors, subclasses
        else:
            seqs = cast("list[Sequence]", found)
        members = frozenset(seqs)
        lengths = np.fromiter((seq.length for seq in seqs), np.int64, len(seqs))
        npages = np.fromiter((seq.npages for seq in seqs), np.int64, len(seqs))
    else:  # the same batch as the last step, and no block table changed since
        seqs, members, lengths, npages = batch.seqs, batch.members, batch.lengths, batch.npages
    store._seqs.check_idle(members)
    count = len(seqs)
    counts = np.asarray(step.new_tokens, np.int64)
    new_npages = -(-(lengths + counts) // page_size)
    new_pages = int((new_npages - npages).sum())
    tables, reused = _tables(store, step, seqs, npages, int(new_npages.max()), batch, new_pages)
    rows = np.arange(count)
    last_slots = tables[rows, np.maximum(npages - 1, 0)]
    last_pids = np.where(npages > 0, mgr.slot_pid[last_slots], -1)
    partial = (lengths % page_size != 0) & (counts > 0)
    cow = partial & (mgr.ref[last_pids] > 1)
    held = tables[tables >= 0]
    if reused:
        mgr.stats.add("resident_hits", len(held))
    needed = len(held) + new_pages + int(cow.sum())
    if needed > mgr.available():
        needed = pages_needed(store, seqs, step.new_tokens)
        if needed > mgr.available():
            raise PoolExhausted(
                f"step needs {needed} resident pages at once; {mgr.available()} slots are not pinned")
    step._pins = np.bincount(held, minlength=mgr.pool_pages).astype(np.int32)
    mgr.pins += step._pins
    step._seqs = seqs
    grows = np.flatnonzero((new_npages > npages) | cow)
    last_fill = np.where(npages > 0, mgr.fill[last_pids], 0)
    step._undo = (lengths, npages, last_pids, last_fill)
    try:
        if len(grows) and not step.token_ids:
            # Rows that start exactly one fresh page (decode crossing a page boundary)
            # get their pages in one batch; the others go page by page.
            fresh = (lengths[grows] % page_size == 0) & (new_npages[grows] == npages[grows] + 1)
            _fresh_pages(store, step, seqs, grows[fresh], counts, npages, tables)
            grows = grows[~fresh]
        for row in grows.tolist():
            _grow(store, step, seqs[row], step.new_tokens[row], tables[row])
        inplace = np.flatnonzero(partial & ~cow & (new_npages == npages))
        if len(inplace):
            pids = last_pids[inplace]
            fills = last_fill[inplace] + counts[inplace]
            if len(inplace) <= _FEW:
                for pid, fill in zip(pids.tolist(), fills.tolist()):
                    mgr.mark_written(pid, fill)
            else:
                mgr.mark_written_many(pids, fills)
            if step.token_ids or mgr.tokens_seen:
                _inplace_tokens(store, step, seqs, inplace, pids, lengths % page_size)
    except BaseException:
        end(store, step, ok=False)
        raise
    after = lengths + counts
    for seq, length in zip(seqs, after.tolist()):
        seq.length = length
    step.members = members
    store._seqs.busy[id(step)] = step
    by_key = batch.by_key if batch is not None else {seq.key: seq for seq in seqs}
    if counts.all():
        store._seqs.dirty.update(by_key)
    else:
        store._seqs.dirty.update((seqs[row].key, seqs[row]) for row in np.flatnonzero(counts).tolist())
    store._seqs.batch = _Batch(step.seq_ids, seqs, tables, store._seqs.epoch, mgr.evict_epoch,
                          after, new_npages, members, by_key)
    _outputs(store, step, tables, lengths, counts, new_npages, held)


def _tables(store: StoreCore, step: Step, seqs: list[Sequence], npages: np.ndarray,
            width: int, batch: _Batch | None, new_pages: int) -> tuple[np.ndarray, bool]:
    """Slots of every existing page, (num_seqs, >= width), -1 padded; restores what is spilled.

    Also says whether the table is the last step's (its pages counted as hits here).
    """
    mgr = store._mgr
    if batch is not None and batch.evict_epoch == mgr.evict_epoch:
        tables = batch.tables
        if tables.shape[1] >= width:
            return tables, True
        wider = np.full((len(seqs), max(width, 2 * tables.shape[1])), -1, np.int32)
        wider[:, :tables.shape[1]] = tables
        return wider, True
    pids = np.concatenate([seq.table for seq in seqs])
    if len(pids) + new_pages + len(seqs) > mgr.available():  # shared pages and copies: count exactly
        needed = pages_needed(store, seqs, step.new_tokens)
        if needed > mgr.available():
            raise PoolExhausted(
                f"step needs {needed} resident pages at once; {mgr.available()} slots are not pinned")
    slots = mgr.ensure_resident(pids) if len(pids) else pids.astype(np.int32)
    mgr.verify_many(pids)
    tables = np.full((len(seqs), max(width, 1)), -1, np.int32)
    starts = np.cumsum(npages) - npages
    rows = np.repeat(np.arange(len(seqs)), npages)
    tables[rows, np.arange(len(pids)) - starts[rows]] = slots
    return tables, False


def _fresh_pages(store: StoreCore, step: Step, seqs: list[Sequence], rows: np.ndarray,
                 counts: np.ndarray, npages: np.ndarray, tables: np.ndarray) -> None:
    """One new page for each of ``rows``, holding its new tokens, in one batch (no token ids)."""
    if not len(rows):
        return
    mgr = store._mgr
    pids = mgr.new_pages(counts[rows])
    slots = mgr.slot[pids]
    mgr.pins[slots] += 1
    step._pins[slots] += 1
    tables[rows, npages[rows]] = slots
    for row, pid in zip(rows.tolist(), pids.tolist()):
        seqs[row].push(pid)


def _grow(store: StoreCore, step: Step, seq: Sequence, count: int, row: np.ndarray) -> None:
    """Give ``seq`` room for ``count`` more tokens, writing new slots into its table row."""
    mgr, page_size = store._mgr, store.geometry.page_size
    token_ids = step.token_ids.get(seq.seq_id)
    length, done = seq.length, 0
    offset = length % page_size
    if offset:
        last = int(seq.pids[seq.npages - 1])
        if mgr.ref[last] > 1:
            last = cow_last(store, seq)
            slot = int(mgr.slot[last])
            row[seq.npages - 1] = slot
            _pin(mgr, step, slot)
        take = min(count, page_size - offset)
        mgr.mark_written(last, offset + take)
        write_tokens(mgr, last, offset, None if token_ids is None else token_ids[:take])
        done = take
    while done < count:
        pid = mgr.new_page()
        slot = int(mgr.slot[pid])
        _pin(mgr, step, slot)
        seq.push(pid)
        row[seq.npages - 1] = slot
        take = min(count - done, page_size)
        mgr.mark_written(pid, take)
        write_tokens(mgr, pid, 0, None if token_ids is None else token_ids[done:done + take])
        done += take


def _pin(mgr: Any, step: Step, slot: int) -> None:
    mgr.pins[slot] += 1
    step._pins[slot] += 1


def _inplace_tokens(store: StoreCore, step: Step, seqs: list[Sequence], rows: np.ndarray,
                    pids: np.ndarray, offsets: np.ndarray) -> None:
    """Token ids of tokens written into existing last pages (only where ids are involved)."""
    mgr = store._mgr
    with_ids = (mgr.flags[pids] & HAS_TOKENS) != 0
    for index in np.flatnonzero(with_ids | bool(step.token_ids)).tolist():
        seq_id = seqs[int(rows[index])].seq_id
        write_tokens(mgr, int(pids[index]), int(offsets[rows[index]]), step.token_ids.get(seq_id))


def _outputs(store: StoreCore, step: Step, tables: np.ndarray, lengths: np.ndarray,
             counts: np.ndarray, new_npages: np.ndarray, held: np.ndarray) -> None:
    mgr, page_size = store._mgr, store.geometry.page_size
    width = int(new_npages.max())
    step.block_tables = tables[:, :width].copy()  # the batch cache keeps mutating ``tables``
    total = int(counts.sum())
    if total == len(counts) and counts.max() == 1:  # decode: one token each
        positions = lengths
        page_slots = tables[np.arange(len(counts)), positions // page_size]
    else:
        token_rows = np.repeat(np.arange(len(counts)), counts)
        positions = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts) + lengths[token_rows]
        page_slots = tables[token_rows, positions // page_size]
    step.slot_mapping = page_slots.astype(np.int64) * page_size + positions % page_size
    step.seq_lens = (lengths + counts).astype(np.int32)
    mgr.touch(held)  # the step's new pages were stamped as they were placed


def end(store: StoreCore, step: Step, ok: bool) -> None:
    """Unpin a step's pages; on failure, roll its new tokens back."""
    mgr, page_size = store._mgr, store.geometry.page_size
    try:
        if step._undo:
            lengths, npages, last_pids, last_fill = step._undo
            changed = np.flatnonzero(np.asarray(step.new_tokens) > 0).tolist() \
                if not ok or step.token_ids else []
            if not ok:
                for row in reversed(changed):
                    store._seqs.epoch += 1
                    datapath.truncate(store, step._seqs[row], int(lengths[row]), int(npages[row]),
                                      int(last_pids[row]), int(last_fill[row]))
            elif step.token_ids:
                # Pages are hashed (and so shareable) only once the engine wrote their K/V.
                for row in changed:
                    seq = step._seqs[row]
                    for index in range(int(lengths[row]) // page_size, seq.length // page_size):
                        seal(mgr, int(seq.pids[index]), int(seq.pids[index - 1]) if index else -1)
    finally:
        mgr.pins -= step._pins
        step._pins = np.zeros(0, np.int32)
        store._seqs.busy.pop(id(step), None)
