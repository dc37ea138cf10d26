"""The page directory: numpy columns over dense, recycled rows, one row per live page.

A row id (``pid``) is reused once its page is gone; a page's public identity is
its ``uid`` (64-bit, never reused). Columns grow in modest steps, a new row is
reset with one assignment per column, and columns only stores that hash pages
need cost nothing until then.

Every column is declared once, on ``Directory``, as a ``Column``: its dtype, the
value a new row starts with and what it holds. Growth, the reset of new rows and
the sparse columns all read that declaration, and so does a type checker: a
``Column[np.uint64]`` attribute reads as an ``NDArray[np.uint64]``.
"""

from __future__ import annotations

from array import array
from typing import Any, Generic, TypeAlias, TypeVar, overload

import numpy as np
from numpy.typing import NDArray

NOWHERE = -2  # c_where of a page no commit has recorded
SPILLED = -1
REC_NONE, REC_CURRENT, REC_STALE = 0, 1, 2
HASHED, HAS_TOKENS = 1, 2  # page flags: full page with a chained hash; every token id known
CODEC_SHIFT = 4  # directory flags bits 4-5: codec of the page's spill record
# One reference or pin, as the int32 of the ref and pin columns: np.add.at with a Python 1
# casts through int64 on numpy's slow path (about 70 ns an element instead of 1).
ONE = np.int32(1)

_Scalar = TypeVar("_Scalar", bound=np.generic)
_Layout: TypeAlias = "tuple[str, np.dtype[Any], object, bool]"
_NARROW_MAX = int(np.iinfo(np.uint16).max)  # the largest page size whose fills fit in a uint16

# The fill columns' dtype is chosen at init: uint16 when a page holds fewer than
# 65,536 tokens (two bytes fewer per row and column), else int32.
FillScalar: TypeAlias = "np.uint16 | np.int32"


class Column(Generic[_Scalar]):
    """One directory column: its dtype, the value a new row is reset to, and what it holds.

    A non-data descriptor (``__get__`` only): ``Directory._grow`` stores each
    column's array in the instance, which then shadows the descriptor, so a read
    costs a plain attribute lookup while a type checker still sees the array's
    type here. ``sparse`` columns are a zero-stride view of ``default`` until the
    store hashes its first page; ``narrow`` columns are uint16 when the page
    size fits (``dtype`` is the wide choice).
    """

    __slots__ = ("name", "dtype", "default", "meaning", "sparse", "narrow")

    def __init__(self, dtype: type[_Scalar] | np.dtype[_Scalar], default: object, meaning: str, *,
                 sparse: bool = False, narrow: bool = False) -> None:
        self.name = ""
        self.dtype: np.dtype[Any] = np.dtype(dtype)
        self.default = default
        self.meaning = meaning
        self.sparse = sparse
        self.narrow = narrow

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def dtype_for(self, page_size: int) -> np.dtype[Any]:
        """The dtype this column gets in a directory of pages of ``page_size`` tokens."""
        return np.dtype(np.uint16) if self.narrow and page_size <= _NARROW_MAX else self.dtype

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Column[_Scalar]: ...

    @overload
    def __get__(self, obj: Directory, owner: type | None = None) -> NDArray[_Scalar]: ...

    def __get__(self, obj: Directory | None, owner: type | None = None) -> Column[_Scalar] | NDArray[_Scalar]:
        if obj is None:
            return self
        # Reached only before _init_directory stored the column in the instance.
        raise AttributeError(f"directory column {self.name!r} is read before the directory is allocated")


class Directory:
    """The directory columns and their row allocation (the block manager builds on it)."""

    # -- the columns, one row per page (c_*: the value as of the last commit) --------------
    uid = Column(np.uint64, 0, "the page's public identity, never reused: keys its record, tokens "
                               "and block-table entries")
    slot = Column(np.int32, -1, "pool slot holding the page's bytes now; -1 when not resident")
    fill: Column[FillScalar] = Column(np.int32, 0, "tokens the page holds", narrow=True)
    csum = Column(np.uint64, 0, "checksum of the page's current bytes (valid while csum_ok)")
    csum_ok = Column(np.bool_, True, "csum is up to date: false from a write until it is recomputed")
    verified = Column(np.bool_, True, "the resident bytes were checked against csum since the store "
                                      "opened (or written since)")
    rec = Column(np.int8, REC_NONE, "the page's spill record: REC_NONE, REC_CURRENT or REC_STALE "
                                    "(it holds bytes the page has been written past)")
    live = Column(np.bool_, False, "the row holds a page (false when free, and for a zombie until "
                                   "the commit that forgets it)")
    corrupt = Column(np.bool_, False, "the page failed a checksum: unreadable until it is rewritten")
    c_where = Column(np.int32, NOWHERE, "committed placement: a slot, SPILLED, or NOWHERE if no "
                                        "commit recorded the page")
    c_fill: Column[FillScalar] = Column(np.int32, 0, "committed fill", narrow=True)
    c_csum = Column(np.uint64, 0, "committed checksum (of c_fill tokens)")
    flags = Column(np.uint8, 0, "HASHED | HAS_TOKENS (the codec lives in its own column)")
    c_flags = Column(np.uint8, 0, "committed flags")
    hash: Column[np.void] = Column(np.dtype("V16"), b"", "chained content hash of a full page whose "
                                   "token ids are known: the prefix index's key", sparse=True)
    ref = Column(np.int32, 0, "references from live block tables (0: a cache-only page)")
    c_ref = Column(np.int32, 0, "references from committed block tables; a commit copies ref "
                                "only where it moved (rows in PageTable.refs_moved)")
    pstamp = Column(np.int64, 0, "the LRU stamp the page's slot had when it went to the spill "
                                 "store: its last use while not resident")
    rec_bytes = Column(np.int32, 0, "bytes of the page's spill record in LMDB (0: none)")
    chg = Column(np.bool_, False, "the next commit rewrites this page's directory entry; set "
                                  "only through PageTable.note_changed*, which also note the "
                                  "row in PageTable.changed: the commit visits those rows alone")
    codec = Column(np.uint8, 0, "index into storage.codecs.CODECS of the page's spill record")
    parent = Column(np.uint64, 0, "chain class of the page a hashed page follows (0: first page)",
                    sparse=True)
    chain = Column(np.uint64, 0, "chain class of a hashed page: the uid of the first of its equals",
                   sparse=True)
    gen = Column(np.uint32, 0, "write generation, bumped on every write: background work that "
                               "copied a page compares it to see whether the page changed since")

    # -- row allocation ----------------------------------------------------------------------
    next_uid: int  # the uid the next new page gets
    hashing: bool  # whether the sparse columns have storage of their own yet
    free_pids: array[int]  # spare rows holding every column's default; a new page takes the last
    _freed: array[int]  # rows given up since the last refill of free_pids: reset in bulk before reuse
    _cap: int  # rows every column holds
    _layout: tuple[_Layout, ...]  # each column's (name, dtype, default, sparse) at this page size
    _defaults: list[tuple[NDArray[Any], object]]  # (column, default) a new row is reset with

    def _init_directory(self, capacity: int, page_size: int) -> None:
        self.next_uid = 1
        self._cap = 0
        self.hashing = False
        self._layout = _LAYOUTS[page_size <= _NARROW_MAX]
        self._grow(capacity)
        # Spare rows as a machine-int array: a list would hold an int object per row.
        self.free_pids = array("q", range(self._cap - 1, -1, -1))
        self._freed = array("q")

    def _grow(self, capacity: int) -> None:
        old = self._cap
        for name, dtype, default, sparse in self._layout:
            if sparse and not self.hashing:
                column = np.broadcast_to(np.full(1, default, dtype=dtype), (capacity,))
            else:
                column = np.full(capacity, default, dtype=dtype)
                if old:
                    column[:old] = getattr(self, name)
            setattr(self, name, column)
        self._reset_pairs()
        self._cap = capacity
        if old:
            self.free_pids.extend(range(capacity - 1, old - 1, -1))

    def _reset_pairs(self) -> None:
        # (column, default) pairs, so a new row is reset without a lookup per column.
        self._defaults = [(getattr(self, name), default) for name, _, default, sparse in self._layout
                          if self.hashing or not sparse]

    def track_hashes(self) -> None:
        """Give the content-hash columns storage of their own (before the first hashed page)."""
        if self.hashing:
            return
        self.hashing = True
        for name, dtype, default, sparse in self._layout:
            if sparse:
                setattr(self, name, np.full(self._cap, default, dtype=dtype))
        self._reset_pairs()

    def _reserve(self, count: int) -> None:
        """Have ``count`` spare rows, all holding their defaults: freed rows reset in bulk, else more rows.

        Resetting rows as they are freed, many at a time, keeps the column resets
        (one numpy call per column, twenty-odd) off the allocation of a decode
        step's few new pages, where they were a tenth of the step.
        """
        if len(self.free_pids) >= count:
            return
        if self._freed:
            rows = np.frombuffer(self._freed, np.int64)
            for column, default in self._defaults:
                column[rows] = default
            self.free_pids[:0] = self._freed[::-1]  # taken after the rows spare already
            self._freed = array("q")
        while len(self.free_pids) < count:
            # Modest steps: metadata RAM is per page, and a copy per step is amortised anyway.
            self._grow(self._cap + max(64, self._cap // 8))

    def _new_pid(self, uid: int) -> int:
        self._reserve(1)
        pid = self.free_pids.pop()
        self.uid[pid] = uid
        self.live[pid] = True
        return pid

    def _new_pids(self, count: int) -> NDArray[np.int64]:
        """``count`` spare rows made live with fresh uids, in the order ``_new_pid`` would give them."""
        self._reserve(count)
        pids = np.array(self.free_pids[:-count - 1:-1], np.int64)
        del self.free_pids[-count:]
        self.uid[pids] = np.arange(self.next_uid, self.next_uid + count, dtype=np.uint64)
        self.next_uid += count
        self.live[pids] = True
        return pids

    def _recycle(self, pid: int) -> None:
        self.live[pid] = False
        self._freed.append(pid)


# Declaration order: the order columns are allocated and new rows reset in.
COLUMNS: tuple[Column[Any], ...] = tuple(value for value in vars(Directory).values()
                                         if isinstance(value, Column))
# Both layouts built once (keyed by whether fills fit in a uint16), so a directory holds
# a reference to one instead of a copy.
_LAYOUTS: dict[bool, tuple[_Layout, ...]] = {
    narrow: tuple((col.name, col.dtype_for(1 if narrow else _NARROW_MAX + 1), col.default, col.sparse)
                  for col in COLUMNS)
    for narrow in (False, True)}
