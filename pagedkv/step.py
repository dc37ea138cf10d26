"""One engine step: block tables, slot mapping and sequence lengths over pinned pages."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from .errors import PagedKVError, PoolExhausted, SequenceBusy
from .prefix import as_token_ids, seal, write_tokens
from .sequence import SeqId, Sequence

if TYPE_CHECKING:
    from .store import KVStore


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

    def __init__(self, store: KVStore, new_tokens: Mapping[SeqId, int],
                 tokens: Mapping[SeqId, Any] | None = None) -> None:
        counts = parse_counts(new_tokens)
        tokens = tokens or {}
        if not isinstance(tokens, Mapping) or not set(tokens) <= set(new_tokens):
            raise PagedKVError("step tokens= must map sequences of the step to their new token ids")
        self.token_ids = {seq_id: as_token_ids(ids, int(new_tokens[seq_id]))
                          for seq_id, ids in tokens.items()}
        self._store = store
        self.seq_ids: list[SeqId] = list(new_tokens)
        self.new_tokens = counts
        self.block_tables = np.empty((0, 0), np.int32)
        self.slot_mapping = np.empty(0, np.int64)
        self.seq_lens = np.empty(0, np.int32)
        self._seqs: list[Sequence] = []
        self._undo: list[tuple[Sequence, int, int, int, int]] = []
        self._pinned = np.empty(0, np.int64)
        self._owner: Any = None

    def __enter__(self) -> Step:
        self._store._enter_step(self)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._store._exit_step(self, ok=exc_type is None)


def parse_counts(new_tokens: Any) -> list[int]:
    """Validate a step's mapping of sequence id -> new token count; return the counts."""
    if not isinstance(new_tokens, Mapping) or not new_tokens:
        raise PagedKVError("step() takes a non-empty mapping of sequence id -> new token count")
    counts = []
    for count in new_tokens.values():
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
            raise PagedKVError(f"new token counts must be ints >= 0, got {count!r}")
        counts.append(int(count))
    return counts


def pages_needed(store: KVStore, seqs: list[Sequence], new_tokens: list[int]) -> int:
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


def begin(store: KVStore, step: Step) -> None:
    """Plan and pin a step (called with the store lock held)."""
    mgr, page_size = store._mgr, store.geometry.page_size
    seqs = [store._seq(seq_id) for seq_id in step.seq_ids]
    for seq in seqs:
        if seq.busy:
            raise SequenceBusy(f"sequence {seq.seq_id!r} is already in an active step")
    needed = pages_needed(store, seqs, step.new_tokens)
    if needed > mgr.available():
        raise PoolExhausted(
            f"step needs {needed} resident pages at once; {mgr.available()} slots are not pinned")
    existing = np.concatenate([seq.table for seq in seqs])
    slots = mgr.ensure_resident(existing)
    mgr.verify_many(existing)
    pinned = [slots]
    np.add.at(mgr.pins, slots, 1)
    step._pinned = slots
    try:
        for seq, count in zip(seqs, step.new_tokens):
            seq.busy = True
            step._seqs.append(seq)
            if count:
                step._undo.append((seq, seq.length, seq.npages, int(seq.pids[seq.npages - 1])
                                   if seq.npages else -1, _last_fill(mgr, seq)))
                pinned.append(_grow(store, seq, count, step.token_ids.get(seq.seq_id)))
    except BaseException:
        step._pinned = np.concatenate(pinned)
        end(store, step, ok=False)
        raise
    step._pinned = np.concatenate(pinned)
    mgr.touch(step._pinned)
    _build_outputs(store, step, seqs, page_size)


def _last_fill(mgr: Any, seq: Sequence) -> int:
    return int(mgr.fill[seq.pids[seq.npages - 1]]) if seq.npages else 0


def _grow(store: KVStore, seq: Sequence, count: int, token_ids: np.ndarray | None) -> np.ndarray:
    """Give ``seq`` room for ``count`` more tokens; return the newly pinned slots."""
    mgr, page_size = store._mgr, store.geometry.page_size
    new_slots = []
    offset, done = seq.length % page_size, 0
    if offset:
        last = int(seq.pids[seq.npages - 1])
        if mgr.ref[last] > 1:
            last = store._cow_last(seq)
            new_slots.append(int(mgr.slot[last]))
            mgr.pins[mgr.slot[last]] += 1
        take = min(count, page_size - offset)
        mgr.mark_written(last, offset + take)
        write_tokens(mgr, last, offset, None if token_ids is None else token_ids[:take])
        done = take
        seq.length += take
    while done < count:
        pid = mgr.new_page()
        mgr.pins[mgr.slot[pid]] += 1
        new_slots.append(int(mgr.slot[pid]))
        seq.push(pid)
        take = min(count - done, page_size)
        mgr.mark_written(pid, take)
        write_tokens(mgr, pid, 0, None if token_ids is None else token_ids[done:done + take])
        done += take
        seq.length += take
    store._dirty.add(seq.key)
    return np.asarray(new_slots, np.int64)


def _build_outputs(store: KVStore, step: Step, seqs: list[Sequence], page_size: int) -> None:
    mgr = store._mgr
    npages = np.fromiter((seq.npages for seq in seqs), np.int64, len(seqs))
    tables = np.concatenate([seq.table for seq in seqs])
    slots = mgr.slot[tables]
    width = int(npages.max()) if len(npages) else 0
    block_tables = np.full((len(seqs), width), -1, np.int32)
    rows = np.repeat(np.arange(len(seqs)), npages)
    starts = np.cumsum(npages) - npages
    cols = np.arange(len(tables)) - np.repeat(starts, npages)
    block_tables[rows, cols] = slots
    lens = np.fromiter((seq.length for seq in seqs), np.int64, len(seqs))
    new = np.asarray(step.new_tokens, np.int64)
    first = lens - new
    # Positions of every new token, then the slot of the page each one falls in.
    token_rows = np.repeat(np.arange(len(seqs)), new)
    positions = np.arange(int(new.sum())) - np.repeat(np.cumsum(new) - new, new) + first[token_rows]
    page_slots = block_tables[token_rows, positions // page_size].astype(np.int64)
    step.block_tables = block_tables
    step.slot_mapping = page_slots * page_size + positions % page_size
    step.seq_lens = lens.astype(np.int32)


def end(store: KVStore, step: Step, ok: bool) -> None:
    """Unpin a step's pages; on failure, roll its new tokens back."""
    mgr, page_size = store._mgr, store.geometry.page_size
    try:
        if not ok:
            for seq, length, npages, last, last_fill in reversed(step._undo):
                store._truncate(seq, length, npages, last, last_fill)
        else:
            # Pages are hashed (and so shareable) only once the engine wrote their K/V.
            for seq, length, _, _, _ in step._undo:
                for index in range(length // page_size, seq.length // page_size):
                    seal(mgr, int(seq.pids[index]), int(seq.pids[index - 1]) if index else -1)
    finally:
        np.subtract.at(mgr.pins, step._pinned, 1)
        for seq in step._seqs:
            seq.busy = False
        step._pinned = np.empty(0, np.int64)
