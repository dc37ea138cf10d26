"""Growing a step's rows: fresh pages in one batch, copy-on-write, page by page growth, and the
token ids written into the pages a step fills (one indexed write per decode step)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .core import StoreCore
from .datapath import cow_last
from .pages.prefix import write_tokens
from .pages.sequence import Sequence
from .pages.directory import HAS_TOKENS
from .stepstate import StepState


def fresh_pages(store: StoreCore, step: StepState, seqs: list[Sequence], rows: np.ndarray,
                 counts: np.ndarray, npages: np.ndarray, tables: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """One new page for each of ``rows``, holding its new tokens, in one batch.

    With token ids, each row has one new token (``Step.ordered_ids``). Returns the
    pages and, with ids, their slab rows of token ids.
    """
    mgr = store._mgr
    pids = mgr.new_pages(counts[rows])
    slab = None if step.ordered_ids is None else mgr.start_tokens(pids, step.ordered_ids[rows])
    slots = mgr.slot[pids]
    mgr.pin(slots)
    step._extra.extend(slots.tolist())
    tables[rows, npages[rows]] = slots
    for row, pid in zip(rows.tolist(), pids.tolist()):
        seqs[row].push(pid)
    return pids, slab


def grow(store: StoreCore, step: StepState, seq: Sequence, count: int, row: np.ndarray) -> None:
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
            pin_one(mgr, step, slot)
        take = min(count, page_size - offset)
        mgr.mark_written(last, offset + take)
        write_tokens(mgr, last, offset, None if token_ids is None else token_ids[:take])
        done = take
    while done < count:
        pid = mgr.new_page()
        slot = int(mgr.slot[pid])
        pin_one(mgr, step, slot)
        seq.push(pid)
        row[seq.npages - 1] = slot
        take = min(count - done, page_size)
        mgr.mark_written(pid, take)
        write_tokens(mgr, pid, 0, None if token_ids is None else token_ids[done:done + take])
        done += take


def pin_one(mgr: Any, step: StepState, slot: int) -> None:
    mgr.pin_slot(slot)
    step._extra.append(slot)


def inplace_tokens(store: StoreCore, step: StepState, seqs: list[Sequence], rows: np.ndarray,
                    pids: np.ndarray, offsets: np.ndarray, hint: np.ndarray | None) -> np.ndarray | None:
    """Token ids of tokens written into existing last pages (only where ids are involved).

    One token per row into a page whose earlier ids are in memory (a decode step)
    is one indexed write for all such rows; the rest go page by page. ``hint``: the
    pages' slab rows as the batch's last step left them. Returns the slab rows of
    ``pids`` where the indexed write found them (-1 elsewhere), or None.
    """
    mgr = store._mgr
    if hint is not None and step.ordered_ids is not None:
        rows_now = _all_hinted(mgr, pids, offsets[rows], hint)
        if rows_now is not None:  # the steady decode step: every row continues where the batch left it
            mgr.page_tokens.write_one_each(rows_now, offsets[rows], step.ordered_ids[rows])
            return rows_now
    with_ids = (mgr.flags[pids] & HAS_TOKENS) != 0
    todo = np.flatnonzero(with_ids | step.has_ids)
    found = None
    if step.ordered_ids is not None and len(todo):
        slab_rows = mgr.page_tokens.rows_hinted(pids[todo], None if hint is None else hint[todo])
        at = offsets[rows[todo]]
        fast = (slab_rows >= 0) & with_ids[todo]
        fast[fast] = mgr.page_tokens.lens[slab_rows[fast]] == at[fast]
        if fast.any():
            mgr.page_tokens.write_one_each(slab_rows[fast], at[fast], step.ordered_ids[rows[todo[fast]]])
            found = np.full(len(pids), -1, np.int64)
            found[todo[fast]] = slab_rows[fast]
            todo = todo[~fast]
    for index in todo.tolist():
        seq_id = seqs[int(rows[index])].seq_id
        write_tokens(mgr, int(pids[index]), int(offsets[rows[index]]), step.token_ids.get(seq_id))
    return found


def _all_hinted(mgr: Any, pids: np.ndarray, at: np.ndarray, hint: np.ndarray) -> np.ndarray | None:
    """The slab rows of ``pids`` if every page holds its ids in memory, ``at`` of them, in its hinted row.

    A slab row owned by a page is that page's only row, so a hint clipped into the
    slab is right wherever its owner matches. Else None: ``inplace_tokens`` then
    sorts the rows out one check at a time.
    """
    tokens = mgr.page_tokens
    if not len(tokens.owner):
        return None
    rows = hint.clip(0, len(tokens.owner) - 1)
    ok = (tokens.owner[rows] == pids) & (tokens.lens[rows] == at)
    return rows if ok.all() and (mgr.flags[pids] & HAS_TOKENS).all() else None
