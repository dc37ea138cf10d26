"""Planning a step: block tables, slot mapping and sequence lengths over pinned pages.

The per-sequence work is a handful of attribute reads; everything else is
vectorised over the batch, except for decode steps of a few sequences, planned
with Python ints where numpy's per-call cost would dominate. Like a persistent
batch in an engine, the block table of the previous step is kept and only grown
rows are rewritten, as long as no page of the batch has moved and no block table
has changed since; so are each row's last page, its fill and the slab row of its
token ids.
"""

from __future__ import annotations

from typing import cast

import numpy as np

from . import datapath
from .core import StoreCore
from .errors import PoolExhausted
from .pages.prefix import seal, write_tokens
from .pages.sequence import SeqId, Sequence
from .pages.directory import HAS_TOKENS
from .pages.manager import BlockManager
from .stepgrow import fresh_pages, grow, inplace_tokens
from .stepstate import NONE, StepState

# Up to this many rows, per-row scalar updates cost less than numpy's per-call overhead.
_FEW = 4
_ID_TYPES = {str, int}  # the sequence ids a step takes as they are (subclasses go through find)


class _Batch:
    """The previous step's sequences and block table, reusable while nothing they depend on changed.

    ``lengths`` and ``npages`` are the sequences' state after that step; with the
    set of its sequences and their keys they spare the next step of the same
    batch one Python pass per sequence each.
    """

    def __init__(self, seq_ids: list[SeqId], seqs: list[Sequence], tables: np.ndarray,
                 table_epoch: int, evict_epoch: int, lengths: np.ndarray, npages: np.ndarray,
                 members: frozenset[Sequence], by_key: dict[bytes, Sequence], rows: np.ndarray,
                 last_pids: np.ndarray | None, last_fill: np.ndarray | None,
                 last_slab: np.ndarray | None) -> None:
        self.seq_ids, self.seqs, self.tables = seq_ids, seqs, tables
        self.table_epoch, self.evict_epoch = table_epoch, evict_epoch
        self.lengths, self.npages, self.members, self.by_key = lengths, npages, members, by_key
        self.rows = rows  # arange(len(seqs))
        # Each row's last page and its fill: only block-table changes (which end the batch)
        # and steps move them, and a step leaves them here.
        self.last_pids, self.last_fill = last_pids, last_fill
        self.last_slab = last_slab  # their slab rows of token ids (a hint: PageTokens checks it)
        # The LRU clock once the step had stamped its slots: unchanged at the next step, no
        # slot was used since, so the batch's slots are still the most recently used.
        self.tick = -1


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


def begin(store: StoreCore, step: StepState) -> None:
    """Plan and pin a step (called with the store lock held).

    A step's fixed cost is a count of numpy calls (about a microsecond each), so
    each array below is computed once and the decode case (one token per row)
    skips the masks it cannot need.
    """
    mgr, page_size, known = store._mgr, store.geometry.page_size, store._seqs
    batch = known.batch
    # Ids compare equal across types (True == 1 == 1.0): only plain str and int ids may match
    # the last batch's, and any other goes through find's checks, whatever came before.
    plain = set(map(type, step.seq_ids)) <= _ID_TYPES
    if batch is None or batch.table_epoch != known.epoch or not plain or batch.seq_ids != step.seq_ids:
        batch = None
        get = known.get
        found = [get(seq_id) for seq_id in step.seq_ids]
        if None in found or not plain:
            seqs = [known.find(seq_id) for seq_id in step.seq_ids]  # typed errors, subclasses
        else:
            seqs = cast("list[Sequence]", found)
        members = frozenset(seqs)
        lengths = npages = rows = NONE
    else:  # the same batch as the last step, and no block table changed since
        seqs, members, lengths, npages, rows = batch.seqs, batch.members, batch.lengths, batch.npages, batch.rows
    known.check_idle(members)
    if mgr.kept_for is not None and (batch is None or batch.evict_epoch != mgr.evict_epoch
                                     or mgr.kept_for is not batch):
        mgr.release_kept()  # not this step's to take over: nothing may count them as its own
    if step.decode and len(seqs) <= _FEW:
        _begin_few(store, step, seqs, members, batch)
        return
    if rows is NONE:  # a new batch, or one the Python-int plan made: no arrays yet
        lengths = np.fromiter((seq.length for seq in seqs), np.int64, len(seqs))
        npages = np.fromiter((seq.npages for seq in seqs), np.int64, len(seqs))
        rows = np.arange(len(seqs))
    decode = step.decode
    offsets = lengths % page_size
    if decode:  # a row grows exactly when its last page is full (or it has none)
        counts = np.ones(len(seqs), np.int64)
        after = lengths + 1
        growing = offsets == 0
        new_npages = npages + growing
        new_pages = int(np.count_nonzero(growing))
        partial = ~growing
    else:
        counts = np.asarray(step.new_tokens, np.int64)
        after = lengths + counts
        new_npages = (after + (page_size - 1)) // page_size
        growing = new_npages > npages
        new_pages = int((new_npages - npages).sum())
        partial = (offsets != 0) & (counts > 0)
    width = int(new_npages.max())
    tables, reused, resolved = _tables(store, step, seqs, npages, width, batch, new_pages)
    touch = _stamps_held(mgr, batch, reused)
    if batch is not None and batch.last_pids is not None:  # pids and fills as the last step left them
        last_pids, last_fill = batch.last_pids, batch.last_fill
    else:
        last_pids = np.where(npages > 0, mgr.slot_pid[tables[rows, np.maximum(npages - 1, 0)]], -1)
        last_fill = np.where(npages > 0, mgr.fill[last_pids], 0)
    cow = partial & (mgr.ref[last_pids] > 1)
    copies = int(np.count_nonzero(cow))
    held = _hold(store, step, seqs, tables, reused, new_pages + copies, resolved)
    grows = np.flatnonzero(growing | cow if copies else growing)
    step._undo = (lengths, npages, last_pids, last_fill)
    next_pids, next_fill = last_pids.copy(), last_fill.copy()  # the next step's, if it reuses the batch
    ids_known = step.has_ids or mgr.tokens_seen
    # Their slab rows of token ids, where known (no ids anywhere: none to know).
    next_slab = np.full(len(seqs), -1, np.int64) if ids_known else None
    try:
        if len(grows) and (not step.has_ids or step.ordered_ids is not None):
            # Rows that start exactly one fresh page (decode crossing a page boundary)
            # get their pages in one batch; the others go page by page.
            if decode:  # every growing row starts one fresh page; the rows copying on write do not
                fresh = grows[~cow[grows]] if copies else grows
            else:
                fresh = grows[(offsets[grows] == 0) & (new_npages[grows] == npages[grows] + 1)]
            if len(fresh):
                next_pids[fresh], slab = fresh_pages(store, step, seqs, fresh, counts, npages, tables)
                if slab is not None and next_slab is not None:
                    next_slab[fresh] = slab
                next_fill[fresh] = 1 if decode else counts[fresh]
                if not decode:
                    grows = np.setdiff1d(grows, fresh, assume_unique=True)
                else:
                    grows = grows[cow[grows]] if copies else grows[:0]
        for row in grows.tolist():
            seq = seqs[row]
            grow(store, step, seq, step.new_tokens[row], tables[row])
            next_pids[row] = pid = int(seq.pids[seq.npages - 1])
            next_fill[row] = mgr.fill[pid]
        inplace = np.flatnonzero(partial & ~cow & ~growing if copies or not decode else offsets)
        if len(inplace):
            pids = last_pids[inplace]
            fills = last_fill[inplace] + (1 if decode else counts[inplace])
            next_fill[inplace] = fills
            if len(inplace) <= _FEW:
                for pid, fill in zip(pids.tolist(), fills.tolist()):
                    mgr.mark_written(pid, fill)
            else:
                mgr.mark_written_many(pids, fills)
            if ids_known:
                hint = None if batch is None or batch.last_slab is None else batch.last_slab[inplace]
                slab_rows = inplace_tokens(store, step, seqs, inplace, pids, offsets, hint)
                if slab_rows is not None and next_slab is not None:
                    next_slab[inplace] = slab_rows
    except BaseException:
        end(store, step, ok=False)
        raise
    for seq, length in zip(seqs, after.tolist()):
        seq.length = length
    step.members = members
    known.busy[id(step)] = step
    by_key = batch.by_key if batch is not None else {seq.key: seq for seq in seqs}
    if decode or counts.all():
        known.dirty.update(by_key)
    else:
        known.dirty.update((seqs[row].key, seqs[row]) for row in np.flatnonzero(counts).tolist())
    known.batch = _Batch(step.seq_ids, seqs, tables, known.epoch, mgr.evict_epoch,
                         after, new_npages, members, by_key, rows, next_pids, next_fill, next_slab)
    if decode and not copies:
        # Its table changed by new pages alone: the batch's next step holds exactly the
        # slots this one pinned, and may take their pins over (end, keep_pins).
        step._keep_for = known.batch
    _outputs(store, step, tables, lengths, counts, after, offsets, width, held if touch else NONE, rows)
    known.batch.tick = mgr.tick


def _stamps_held(mgr: BlockManager, batch: _Batch | None, reused: bool) -> bool:
    """Whether a step must stamp its held slots as used: not when that would change no LRU choice.

    A table just resolved had its slots stamped by ``ensure_resident``; a reused
    one whose batch stamped them at its last step, with no slot used since, has
    them still the most recently used. Only the step's order among its own slots
    would change, which no eviction outside the batch looks at.
    """
    return reused and not (batch is not None and batch.tick == mgr.tick)


def _begin_few(store: StoreCore, step: StepState, seqs: list[Sequence], members: frozenset[Sequence],
               batch: _Batch | None) -> None:
    """``begin`` for a decode step of at most ``_FEW`` sequences, planned with Python ints.

    The same plan as the vectorised one (``tests/test_step_paths.py`` runs both on
    the same workload): there, a numpy call per array costs more than the rows do.
    """
    mgr, page_size, known = store._mgr, store.geometry.page_size, store._seqs
    # One pass over the rows: a comprehension per list cost more than the rows do.
    lengths: list[int] = []
    npages: list[int] = []
    last_pids: list[int] = []
    last_fill: list[int] = []
    new_pages = width = 0
    fill_of = mgr.fill.item
    for seq in seqs:
        length, n = seq.length, seq.npages
        lengths.append(length)
        npages.append(n)
        pid = seq.pids.item(n - 1) if n else -1
        last_pids.append(pid)
        last_fill.append(fill_of(pid) if pid >= 0 else 0)
        if length % page_size == 0:
            new_pages += 1
            n += 1
        if n > width:
            width = n
    tables, reused, resolved = _tables(store, step, seqs, npages, width, batch, new_pages)
    touch = _stamps_held(mgr, batch, reused)
    grows, inplace, copies = [], [], 0
    for row, (length, pid) in enumerate(zip(lengths, last_pids)):
        if length % page_size == 0:
            grows.append(row)
        elif mgr.ref.item(pid) > 1:  # a shared partial page: copied on write
            grows.append(row)
            copies += 1
        else:
            inplace.append(row)
    held = _hold(store, step, seqs, tables, reused, new_pages + copies, resolved)
    step._undo = (lengths, npages, last_pids, last_fill)
    try:
        for row in grows:
            grow(store, step, seqs[row], 1, tables[row])
        for row in inplace:
            pid = last_pids[row]
            mgr.mark_written(pid, last_fill[row] + 1)
            if step.has_ids or mgr.flags.item(pid) & HAS_TOKENS:
                write_tokens(mgr, pid, lengths[row] % page_size, step.token_ids.get(seqs[row].seq_id))
    except BaseException:
        end(store, step, ok=False)
        raise
    after: list[int] = []
    for seq, length in zip(seqs, lengths):
        seq.length = length + 1
        after.append(length + 1)
    step.members = members
    known.busy[id(step)] = step
    by_key = batch.by_key if batch is not None else {seq.key: seq for seq in seqs}
    known.dirty.update(by_key)
    known.batch = _Batch(step.seq_ids, seqs, tables, known.epoch, mgr.evict_epoch, NONE, NONE,
                         members, by_key, NONE, None, None, None)
    if not copies:  # as in begin: the batch's next step holds exactly these slots
        step._keep_for = known.batch
    step.block_tables = tables[:, :width].copy()
    step.slot_mapping = np.array([tables.item(row, length // page_size) * page_size + length % page_size
                                  for row, length in enumerate(lengths)], np.int64)
    step.seq_lens = np.array(after, np.int32)
    if touch:
        mgr.touch(held)
    known.batch.tick = mgr.tick


def _hold(store: StoreCore, step: StepState, seqs: list[Sequence], tables: np.ndarray,
          reused: bool, extra: int, resolved: np.ndarray | None) -> np.ndarray:
    """Pin the step's slots: the pins the batch's last step kept, if any are (``begin`` gave back
    any that were not this batch's, and then its table is reused) and ``extra`` more slots fit;
    else ``_pin_held``'s fresh pins. Returns the slots held (``end`` keeps or unpins them)."""
    mgr = store._mgr
    if mgr.kept_for is not None and mgr.has_room(extra):
        return _take_kept(store, step, seqs)
    mgr.release_kept()
    return _pin_held(store, step, seqs, tables, reused, extra, resolved)


def _pin_held(store: StoreCore, step: StepState, seqs: list[Sequence], tables: np.ndarray,
              reused: bool, extra: int, resolved: np.ndarray | None = None) -> np.ndarray:
    """Pin the slots of ``tables`` once the step's ``extra`` new pages and copies are known to fit.

    ``resolved``: the table's slots in row order, when ``_tables`` just resolved
    them (they are its entries that are not padding). Returns the slots pinned
    (one per reference): ``end`` unpins them.
    """
    mgr = store._mgr
    held = tables[tables >= 0] if resolved is None else resolved
    if reused:
        mgr.stats.add("resident_hits", len(held))
    needed = len(held) + extra
    if not mgr.has_room(needed):
        needed = pages_needed(store, seqs, step.new_tokens)
        if not mgr.has_room(needed):
            raise PoolExhausted(
                f"step needs {needed} resident pages at once; {mgr.available()} slots are not pinned")
    mgr.pin(held)
    step._held = held
    step._seqs = seqs
    return held


def _take_kept(store: StoreCore, step: StepState, seqs: list[Sequence]) -> np.ndarray:
    """``_pin_held`` for the next step of a batch whose last step kept its pins: they are this step's.

    Its table is the last step's with that step's new pages (only such a step
    keeps), so the kept slots are exactly the ones it holds, each pinned already.
    """
    mgr = store._mgr
    held = mgr.kept
    mgr.kept, mgr.kept_for = held[:0], None
    mgr.stats.add("resident_hits", len(held))
    step._held = held
    step._seqs = seqs
    return held


def _tables(store: StoreCore, step: StepState, seqs: list[Sequence], npages: np.ndarray | list[int],
            width: int, batch: _Batch | None, new_pages: int) -> tuple[np.ndarray, bool, np.ndarray | None]:
    """Slots of every existing page, (num_seqs, >= width), -1 padded; restores what is spilled.

    Also says whether the table is the last step's (its pages counted as hits here),
    and gives the slots it just resolved, in row order (None for the last step's table).
    """
    mgr = store._mgr
    if batch is not None and batch.evict_epoch == mgr.evict_epoch:
        tables = batch.tables
        if tables.shape[1] >= width:
            return tables, True, None
        wider = np.full((len(seqs), max(width, 2 * tables.shape[1])), -1, np.int32)
        wider[:, :tables.shape[1]] = tables
        return wider, True, None
    pids = seqs[0].table if len(seqs) == 1 else np.concatenate([seq.table for seq in seqs])
    if not mgr.has_room(len(pids) + new_pages + len(seqs)):  # shared pages and copies: count exactly
        needed = pages_needed(store, seqs, step.new_tokens)
        if not mgr.has_room(needed):
            raise PoolExhausted(
                f"step needs {needed} resident pages at once; {mgr.available()} slots are not pinned")
    slots = mgr.ensure_resident(pids) if len(pids) else pids.astype(np.int32)
    mgr.verify_many(pids)
    tables = np.empty((len(seqs), max(width, 1)), np.int32)
    tables.fill(-1)  # np.full's Python wrapper costs as much as the array
    if len(seqs) <= _FEW:  # a row at a time: four index arrays cost more than a few slices
        at = 0
        for row, count in enumerate(npages if isinstance(npages, list) else npages.tolist()):
            tables[row, :count] = slots[at:at + count]
            at += count
    else:
        starts = np.cumsum(npages) - npages
        rows = np.repeat(np.arange(len(seqs)), npages)
        tables[rows, np.arange(len(pids)) - starts[rows]] = slots
    return tables, False, slots


def _outputs(store: StoreCore, step: StepState, tables: np.ndarray, lengths: np.ndarray,
             counts: np.ndarray, after: np.ndarray, offsets: np.ndarray, width: int,
             touched: np.ndarray, rows: np.ndarray) -> None:
    mgr, page_size = store._mgr, store.geometry.page_size
    step.block_tables = tables[:, :width].copy()  # the batch cache keeps mutating ``tables``
    if step.decode:  # one token each: at each row's length
        positions, token_rows, within = lengths, rows, offsets
    else:
        total = int(counts.sum())
        token_rows = np.repeat(rows, counts)
        positions = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts) + lengths[token_rows]
        within = positions % page_size
    page_slots = tables[token_rows, positions // page_size]
    step.slot_mapping = page_slots.astype(np.int64) * page_size + within
    step.seq_lens = after.astype(np.int32)
    if len(touched):
        mgr.touch(touched)  # the step's new pages were stamped as they were placed


def end(store: StoreCore, step: StepState, ok: bool) -> None:
    """Unpin a step's pages; on failure, roll its new tokens back."""
    mgr, page_size = store._mgr, store.geometry.page_size
    try:
        if step._undo:
            lengths, npages, last_pids, last_fill = step._undo
            if not ok:
                changed = np.flatnonzero(np.asarray(step.new_tokens) > 0).tolist()
                for row in reversed(changed):
                    store._seqs.epoch += 1
                    datapath.truncate(store, step._seqs[row], int(lengths[row]), int(npages[row]),
                                      int(last_pids[row]), int(last_fill[row]))
            elif step.has_ids:
                # Pages are hashed (and so shareable) only once the engine wrote their K/V.
                before = np.asarray(lengths, np.int64)
                if step.decode:  # one token each: a row filled its page iff that token was the page's last
                    crossed = np.flatnonzero(before % page_size == page_size - 1)
                else:
                    after = before + np.asarray(step.new_tokens, np.int64)
                    crossed = np.flatnonzero(after // page_size > before // page_size)
                for row in crossed.tolist():
                    seq = step._seqs[row]
                    for index in range(int(lengths[row]) // page_size, seq.length // page_size):
                        seal(mgr, int(seq.pids[index]), int(seq.pids[index - 1]) if index else -1)
    finally:
        if ok and step._keep_for is not None:  # for the batch's next step (or any operation) to release
            extra = np.asarray(step._extra, np.int32)
            mgr.keep_pins(np.concatenate([step._held, extra]) if len(extra) else step._held, step._keep_for)
        else:
            if len(step._held):
                mgr.unpin(step._held)
            if step._extra:
                mgr.unpin(step._extra)  # new pages and copies
        step._held, step._extra, step._keep_for = NONE, [], None
        store._seqs.busy.pop(id(step), None)
