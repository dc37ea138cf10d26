"""The references pagedkv is measured against, written for the benchmark.

* ``RefBlockManager``: a pure-Python block manager in the style of the well-known
  ~120-line ones (per sequence a list of block ids, a deque of free blocks, a block
  allocated when a sequence crosses a page boundary, the padded int32 block table
  and the slot mapping built from Python lists every step).
* ``RefHashingBlockManager``: the same with token ids, hashing each block as it
  fills (xxh3-128 chained over the parent's hash) into a prefix-cache dict.
* ``SpillSim``: a minimal LRU spill cache over a memmapped pool with the same
  policy as pagedkv (evict in batches, write an evicted page only when the stored
  copy is stale, restore into a free slot), over a raw backend:
  ``LmdbBackend`` (one transaction per eviction batch, zero-copy gets) or
  ``FileBackend`` (one file per page: the naive baseline).
"""

from __future__ import annotations

import os
import struct
from collections import OrderedDict, deque
from typing import Any, Hashable, Mapping, Protocol, Sequence, TypeVar

import lmdb
import numpy as np
import xxhash

_Seq = TypeVar("_Seq", bound=Hashable)


class RefBlockManager:
    """Block tables and slot mappings the plain-Python way (the B2 reference)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.free: deque[int] = deque(range(num_blocks))
        self.tables: dict[Hashable, list[int]] = {}
        self.lengths: dict[Hashable, int] = {}

    def add(self, seq: Hashable) -> None:
        """Register an empty sequence."""
        self.tables[seq] = []
        self.lengths[seq] = 0

    def step(self, new_tokens: Mapping[_Seq, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Grow each sequence; return (block_tables int32 -1 padded, slot_mapping int64, seq_lens int32)."""
        size = self.block_size
        rows: list[list[int]] = []
        slots: list[int] = []
        lens: list[int] = []
        for seq, count in new_tokens.items():
            table = self.tables[seq]
            start = self.lengths[seq]
            end = start + count
            while len(table) * size < end:  # crossing a page boundary takes a block
                table.append(self.free.popleft())
            for pos in range(start, end):
                slots.append(table[pos // size] * size + pos % size)
            self.lengths[seq] = end
            rows.append(table)
            lens.append(end)
        width = max(len(row) for row in rows)
        block_tables = np.array([row + [-1] * (width - len(row)) for row in rows], dtype=np.int32)
        return block_tables, np.array(slots, dtype=np.int64), np.array(lens, dtype=np.int32)


class RefHashingBlockManager(RefBlockManager):
    """``RefBlockManager`` with token ids: every block is hashed as it fills (the B2 token-id reference).

    Each sequence keeps its token ids and the hash of its last full block; a
    block that fills gets ``xxh3_128(parent hash + its ids as little-endian
    uint32)``, recorded in the prefix cache (hash -> block id) and per block.
    """

    ROOT = bytes(16)  # the parent hash of a sequence's first block

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self.ids: dict[Hashable, list[int]] = {}
        self.last_hash: dict[Hashable, bytes] = {}
        self.prefix_cache: dict[bytes, int] = {}
        self.block_hash: dict[int, bytes] = {}
        self._pack = struct.Struct(f"<{block_size}I").pack

    def add(self, seq: Hashable) -> None:
        """Register an empty sequence."""
        super().add(seq)
        self.ids[seq] = []
        self.last_hash[seq] = self.ROOT

    def step_ids(self, new_tokens: Mapping[_Seq, int], tokens: Mapping[_Seq, Sequence[int]]
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``step`` with each sequence's new token ids: blocks filled by them are hashed and cached."""
        size = self.block_size
        pack = self._pack
        digest = xxhash.xxh3_128_digest
        rows: list[list[int]] = []
        slots: list[int] = []
        lens: list[int] = []
        for seq, count in new_tokens.items():
            table = self.tables[seq]
            start = self.lengths[seq]
            end = start + count
            while len(table) * size < end:
                table.append(self.free.popleft())
            for pos in range(start, end):
                slots.append(table[pos // size] * size + pos % size)
            ids = self.ids[seq]
            ids.extend(tokens[seq])
            full = start // size  # blocks already hashed
            if end // size > full:
                parent = self.last_hash[seq]
                for index in range(full, end // size):
                    parent = digest(parent + pack(*ids[index * size:(index + 1) * size]))
                    self.prefix_cache[parent] = table[index]
                    self.block_hash[table[index]] = parent
                self.last_hash[seq] = parent
            self.lengths[seq] = end
            rows.append(table)
            lens.append(end)
        width = max(len(row) for row in rows)
        block_tables = np.array([row + [-1] * (width - len(row)) for row in rows], dtype=np.int32)
        return block_tables, np.array(slots, dtype=np.int64), np.array(lens, dtype=np.int32)


class Backend(Protocol):
    """Where ``SpillSim`` keeps evicted pages."""

    def put_many(self, items: list[tuple[int, np.ndarray]]) -> int: ...
    def get_many(self, keys: list[int], dests: list[np.ndarray]) -> int: ...
    def close(self) -> None: ...


class LmdbBackend:
    """Raw LMDB: one write transaction per batch, gets through ``buffers=True`` copied into numpy."""

    def __init__(self, env: lmdb.Environment) -> None:
        self.env = env

    def put_many(self, items: list[tuple[int, np.ndarray]]) -> int:
        """Put every (key, page) in one transaction; return the bytes written."""
        total = 0
        with self.env.begin(write=True) as txn:
            for key, page in items:
                txn.put(key.to_bytes(8, "big"), page.data.cast("B"))
                total += page.nbytes
        return total

    def get_many(self, keys: list[int], dests: list[np.ndarray]) -> int:
        """Copy each key's value into its destination page; return the bytes read."""
        total = 0
        with self.env.begin(buffers=True) as txn:
            for key, dest in zip(keys, dests):
                value = txn.get(key.to_bytes(8, "big"))
                if value is None:
                    raise KeyError(f"page {key} was never put")
                np.copyto(dest, np.frombuffer(value, dtype=dest.dtype).reshape(dest.shape))
                total += dest.nbytes
        return total

    def close(self) -> None:
        self.env.close()


class FileBackend:
    """One file per page with plain file I/O; ``durable`` fsyncs every file (the naive baseline)."""

    def __init__(self, path: str, durable: bool) -> None:
        os.makedirs(path, exist_ok=True)
        self.path = path
        self.durable = durable

    def put_many(self, items: list[tuple[int, np.ndarray]]) -> int:
        """Write each page to its own file (open, write, fsync when durable, close)."""
        total = 0
        for key, page in items:
            fd = os.open(os.path.join(self.path, f"{key}.page"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, page.data.cast("B"))
                if self.durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            total += page.nbytes
        return total

    def get_many(self, keys: list[int], dests: list[np.ndarray]) -> int:
        """Read each page's file straight into its destination."""
        total = 0
        for key, dest in zip(keys, dests):
            with open(os.path.join(self.path, f"{key}.page"), "rb", buffering=0) as handle:
                handle.readinto(dest.reshape(-1).view(np.uint8).data)
            total += dest.nbytes
        return total

    def close(self) -> None:
        pass


class SpillSim:
    """A minimal LRU spill cache with pagedkv's eviction policy over a raw backend (the B4 reference)."""

    def __init__(self, pool: np.ndarray, backend: Backend, batch: int) -> None:
        self.pool = pool
        self.backend = backend
        self.batch = batch
        self.free = list(range(len(pool) - 1, -1, -1))
        self.lru: OrderedDict[int, int] = OrderedDict()  # resident key -> slot, oldest first
        self.clean: set[int] = set()  # keys whose stored copy is current
        self.counts = dict.fromkeys(("puts", "gets", "put_bytes", "get_bytes", "batches"), 0)

    def add(self, key: int, page: np.ndarray) -> None:
        """Place a new page (dirty: it has no stored copy yet)."""
        self._room(1, set())
        slot = self.free.pop()
        self.pool[slot] = page
        self.lru[key] = slot

    def access(self, keys: list[int]) -> list[int]:
        """Make ``keys`` resident (restoring spilled ones in one read transaction); return their slots."""
        missing = [key for key in keys if key not in self.lru]
        for key in keys:
            if key in self.lru:
                self.lru.move_to_end(key)
        if missing:
            self._room(len(missing), set(keys))
            slots = [self.free.pop() for _ in missing]
            self.counts["get_bytes"] += self.backend.get_many(missing, [self.pool[s] for s in slots])
            self.counts["gets"] += len(missing)
            for key, slot in zip(missing, slots):
                self.lru[key] = slot
                self.clean.add(key)
        return [self.lru[key] for key in keys]

    def dirty(self, key: int) -> None:
        """The page of ``key`` changed: its stored copy (if any) is stale."""
        self.clean.discard(key)

    def _room(self, count: int, pinned: set[int]) -> None:
        while len(self.free) < count:
            want = max(self.batch, count - len(self.free))
            victims = []
            for key in self.lru:
                if key not in pinned:
                    victims.append(key)
                    if len(victims) == want:
                        break
            if not victims:
                raise RuntimeError("every slot is pinned")
            items = [(key, self.pool[self.lru[key]]) for key in victims if key not in self.clean]
            self.counts["put_bytes"] += self.backend.put_many(items)
            self.counts["puts"] += len(items)
            self.counts["batches"] += 1
            for key in victims:
                self.free.append(self.lru.pop(key))
                self.clean.add(key)

    def summary(self) -> dict[str, Any]:
        """The counters, for the row's metrics."""
        return dict(self.counts)
