"""What a store's commits write, and bare replays of the same writes (B7's like-for-like floors).

``recording(store)`` logs every put and delete of the store's write
transactions while it is active, per database, with the values' bytes: no
public figure says what a commit writes, so the bench wraps the store's own
transaction entry point (``SpillStore.write``, and the hook it calls inside
each transaction) for the untimed commit it counts. ``SameRecords`` then
writes exactly those records (same databases, keys and value sizes) into a
bare LMDB environment holding a copy of the store's records, in one
transaction: unsynced, the floor of a nosync commit of that step.

A durable commit syncs twice: the pool bytes it wrote, then LMDB.
``flushes()`` records the byte ranges of ``pool.bin`` a commit msyncs (through
the flush recorder the power-loss tests use), and ``TwoSyncFloor`` replays a
commit bare: the step's writes into a mapping of a file the size of
``pool.bin`` (untimed), msync of the same ranges, then a synced commit of the
same records.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, cast

import lmdb
import numpy as np

from .. import faults
from ..storage.pool import HEADER_NBYTES
from ..storage.spill import DB_NAMES
from ..store import KVStore


@dataclass
class TxnLog:
    """One write transaction: (database, key, value) puts and (database, key) deletes, in order."""

    puts: list[tuple[bytes, bytes, bytes]] = field(default_factory=list)
    deletes: list[tuple[bytes, bytes]] = field(default_factory=list)

    @property
    def records(self) -> int:
        """Records written (puts and deletes)."""
        return len(self.puts) + len(self.deletes)

    @property
    def put_bytes(self) -> int:
        """Bytes of keys and values put."""
        return sum(len(key) + len(value) for _, key, value in self.puts)

    def by_db(self) -> dict[str, int]:
        """Puts per database, by name (for the row's metrics)."""
        out: dict[str, int] = {}
        for db, _, _ in self.puts:
            out[db.decode()] = out.get(db.decode(), 0) + 1
        return out


class _Cursor:
    def __init__(self, cursor: Any, db: bytes, log: TxnLog) -> None:
        self._cursor, self._db, self._log = cursor, db, log

    def putmulti(self, items: Any, *args: Any, **kwargs: Any) -> Any:
        items = [(bytes(key), bytes(value)) for key, value in items]
        self._log.puts.extend((self._db, key, value) for key, value in items)
        return self._cursor.putmulti(items, *args, **kwargs)

    def put(self, key: bytes, value: bytes, *args: Any, **kwargs: Any) -> Any:
        self._log.puts.append((self._db, bytes(key), bytes(value)))
        return self._cursor.put(key, value, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cursor, name)


class _Txn:
    """A write transaction that logs its puts and deletes (everything else passes through)."""

    def __init__(self, txn: Any, names: dict[int, bytes], log: TxnLog) -> None:
        self._txn, self._names, self._log = txn, names, log

    def _name(self, db: Any) -> bytes:
        return self._names[id(db)]

    def put(self, key: bytes, value: bytes, *args: Any, db: Any = None, **kwargs: Any) -> Any:
        self._log.puts.append((self._name(db), bytes(key), bytes(value)))
        return self._txn.put(key, value, *args, db=db, **kwargs)

    def replace(self, key: bytes, value: bytes, db: Any = None) -> Any:
        self._log.puts.append((self._name(db), bytes(key), bytes(value)))
        return self._txn.replace(key, value, db=db)

    def delete(self, key: bytes, value: bytes = b"", db: Any = None) -> Any:
        self._log.deletes.append((self._name(db), bytes(key)))
        return self._txn.delete(key, value, db=db)

    def cursor(self, db: Any = None) -> _Cursor:
        return _Cursor(self._txn.cursor(db=db), self._name(db), self._log)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._txn, name)


@contextlib.contextmanager
def recording(store: KVStore) -> Iterator[list[TxnLog]]:
    """Log the write transactions ``store`` commits inside the block (one ``TxnLog`` each)."""
    spill = store._spill
    names = {id(db): name for name, db in spill.dbs.items()}
    done: list[TxnLog] = []
    current = [TxnLog()]
    real_write, real_hook = spill.write, spill.on_write

    def write(body: Callable[[Any], Any], what: str = "commit") -> Any:
        def logged(txn: Any) -> Any:
            current[0] = TxnLog()  # a body run again after map growth is one transaction
            return body(_Txn(txn, names, current[0]))
        result = real_write(logged, what)
        done.append(current[0])
        return result

    setattr(spill, "write", write)
    if real_hook is not None:
        hook = real_hook
        spill.on_write = lambda txn: hook(cast(Any, _Txn(txn, names, current[0])))
    try:
        yield done
    finally:
        delattr(spill, "write")
        spill.on_write = real_hook


class SameRecords:
    """A bare LMDB environment holding a copy of a store's records, replaying one transaction's writes."""

    def __init__(self, path: str, store: KVStore, log: TxnLog, sync: bool = False) -> None:
        os.makedirs(path, exist_ok=True)
        # The options pagedkv's spill store opens its environment with.
        self.env = lmdb.open(path, map_size=1 << 30, subdir=True, sync=sync, metasync=sync, writemap=False,
                             readahead=False, max_dbs=len(DB_NAMES))
        self.dbs = {name: self.env.open_db(name, create=True) for name in DB_NAMES}
        spill = store._spill
        with spill.env.begin(buffers=True) as source, self.env.begin(write=True) as txn:
            for name in DB_NAMES:
                with source.cursor(db=spill.dbs[name]) as cursor:
                    txn.cursor(db=self.dbs[name]).putmulti(
                        (bytes(key), bytes(value)) for key, value in cursor)
        self.groups: list[tuple[Any, list[tuple[bytes, bytes]]]] = []
        for name, key, value in log.puts:  # consecutive puts into one database: one putmulti, as pagedkv does
            if not self.groups or self.groups[-1][0] is not self.dbs[name]:
                self.groups.append((self.dbs[name], []))
            self.groups[-1][1].append((key, value))
        self.deletes = [(self.dbs[name], key) for name, key in log.deletes]
        self.restore: list[tuple[Any, bytes, bytes]] = []  # what the deletes remove, put back between rounds
        with self.env.begin() as txn:
            for db, key in self.deletes:
                held = txn.get(key, db=db)
                if held is not None:
                    self.restore.append((db, key, bytes(held)))

    def commit_ms(self) -> float:
        """Write the logged records in one transaction and commit it; milliseconds."""
        if self.restore:  # untimed: the keys a delete takes must exist again
            with self.env.begin(write=True) as txn:
                for db, key, value in self.restore:
                    txn.put(key, value, db=db)
        started = time.perf_counter()
        with self.env.begin(write=True) as txn:
            for db, items in self.groups:
                txn.cursor(db=db).putmulti(items)
            for db, key in self.deletes:
                txn.delete(key, db=db)
        return (time.perf_counter() - started) * 1e3

    def close(self) -> None:
        """Close the environment."""
        self.env.close()


@contextlib.contextmanager
def flushes(store: KVStore) -> Iterator[list[tuple[int, int]]]:
    """The byte ranges of ``store``'s pool file msynced inside the block, in order (a list it fills)."""
    target = store._pool_file
    ranges: list[tuple[int, int]] = []

    def record(flushed: Any, start: int, end: int) -> None:
        if flushed is target:
            ranges.append((start, end))

    faults.set_flush_recorder(record)
    try:
        yield ranges
    finally:
        faults.set_flush_recorder(None)


class TwoSyncFloor:
    """A durable commit's two syncs, bare: the pool ranges it flushed, then a synced commit of its records.

    The file is reserved like ``pool.bin`` and holds the same slots at the same
    offsets, so the step's writes (``written``) dirty the same file pages and
    each msync writes back what the store's did.
    """

    def __init__(self, path: str, store: KVStore, log: TxnLog) -> None:
        os.makedirs(path, exist_ok=True)
        self.records = SameRecords(os.path.join(path, "records"), store, log, sync=True)
        pool = store.pool
        fd = os.open(os.path.join(path, "pool.bin"), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, HEADER_NBYTES + pool.nbytes)
            self._mm = mmap.mmap(fd, HEADER_NBYTES + pool.nbytes)
        finally:
            os.close(fd)
        self.pool: np.ndarray = np.frombuffer(self._mm, pool.dtype, offset=HEADER_NBYTES).reshape(pool.shape)
        self.flush_ms: list[float] = []  # each round's two parts, for the row's metrics
        self.commit_ms: list[float] = []

    def round_ms(self, written: tuple[np.ndarray, np.ndarray, np.ndarray], ranges: list[tuple[int, int]]) -> float:
        """Write what the step wrote (untimed), msync ``ranges``, commit the records synced; milliseconds."""
        slots, offsets, token = written
        self.pool[slots, :, :, offsets] = token
        started = time.perf_counter()
        for start, end in ranges:
            self._mm.flush(start, end - start)
        self.flush_ms.append((time.perf_counter() - started) * 1e3)
        self.commit_ms.append(self.records.commit_ms())
        return self.flush_ms[-1] + self.commit_ms[-1]

    def close(self) -> None:
        """Unmap the file and close the environment."""
        del self.pool  # the mapping cannot close while a view exports it
        self._mm.close()
        self.records.close()
