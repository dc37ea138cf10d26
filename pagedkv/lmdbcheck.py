"""Checking an LMDB file before this process trusts it.

LMDB trusts its file: a truncated one is mapped and faults past its end, and
damaged page headers or database records make it assert (SIGABRT) or fault
(SIGBUS) instead of returning an error. These checks turn such damage into
``StoreCorrupt``: the size against the meta pages, a walk over every tree page
header, and a read-back of every database in a forked child.
"""

from __future__ import annotations

import mmap
import os
import select
import signal
import struct

import lmdb

from .errors import StoreCorrupt

_META_MAGIC = 0xBEEFC0DE


def check_data_file(path: str) -> None:
    """Refuse a data.mdb whose size disagrees with its own meta pages, before LMDB maps it.

    LMDB trusts the file: a truncated one is mapped and then faults (SIGBUS) on
    the first access past its end, and an empty one is silently re-initialised.
    """
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as data:
            head = data.read(4096)
            psize = struct.unpack_from("<I", head, 40)[0] if len(head) >= 48 else 0
            if psize not in (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536):
                raise StoreCorrupt(f"{path}: not an LMDB data file (page size field {psize})")
            data.seek(0)
            metas = data.read(2 * psize)
    except OSError as exc:
        raise StoreCorrupt(f"{path}: cannot be read ({exc.strerror})") from None
    found = []
    for base in (0, psize):
        if len(metas) >= base + 152 and struct.unpack_from("<I", metas, base + 16)[0] == _META_MAGIC:
            last_page, txnid = struct.unpack_from("<QQ", metas, base + 136)
            found.append((txnid, last_page))
    if not found:
        raise StoreCorrupt(f"{path}: no valid LMDB meta page")
    if size < 2 * psize:
        raise StoreCorrupt(f"{path}: file of {size} bytes is shorter than its two meta pages")
    _, last_page = max(found)
    # A torn last page inside the range the meta declares is damage (truncation);
    # a partial page beyond it is what a failed extending write leaves, and whole
    # pages past the end are ones LMDB allocated but never needed to write.
    if size % psize and size < (last_page + 1) * psize:
        raise StoreCorrupt(f"{path}: file is {size} bytes, cut inside page {size // psize}")
    # Pages up to the meta's last page need not all be written yet (LMDB allocates
    # ahead); walk_pages checks that every page the tree reaches lies in the file.


def probe_in_child(path: str, names: tuple[bytes, ...], lock: bool = False, timeout: float = 10.0) -> None:
    """Walk the environment at ``path`` in a forked child before this process trusts it.

    LMDB asserts (SIGABRT) or faults (SIGBUS) on some structurally damaged files
    instead of returning an error; a child that dies that way turns into
    ``StoreCorrupt`` here rather than killing the caller.
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: walk everything the parent's load will touch, then report
        code = 1
        try:
            # Drop every inherited descriptor: one of them carries the writer's flock,
            # which must die with the parent, not linger in this child.
            os.closerange(3, write_end)
            os.closerange(write_end + 1, os.sysconf("SC_OPEN_MAX"))
            walk_pages(os.path.join(path, "data.mdb"))
            env = lmdb.open(path, readonly=True, lock=lock, subdir=True, max_dbs=len(names))
            with env.begin(buffers=True) as txn:
                for name in names:
                    for _key, value in txn.cursor(db=env.open_db(name, txn=txn, create=False)):
                        if len(value):
                            value[len(value) - 1]  # faults here, in the child, if it lies past the end
            env.close()  # frees its reader slot; os._exit would leave it stale
            os.write(write_end, b"1")
            code = 0
        except lmdb.Error as exc:
            if "already open" in str(exc):  # this process holds it: it was probed at that open
                os.write(write_end, b"1")
                code = 0
        except BaseException:
            pass
        finally:
            os._exit(code)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], timeout)
        ok = bool(ready) and os.read(read_end, 1) == b"1"
    finally:
        os.close(read_end)
        if not ok:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _, status = os.waitpid(pid, 0)
    if not ok:
        how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else "an error"
        raise StoreCorrupt(f"{path}: the spill store does not read back cleanly (its reader hit {how})")


_P_BRANCH, _P_LEAF, _F_BIGDATA, _F_SUBDATA = 0x01, 0x02, 0x01, 0x02
_P_INVALID = (1 << 64) - 1
_U16x4 = struct.Struct("<HHHH")


_MDB_INTEGERKEY = 0x08


def _check_db_record(raw: mmap.mmap, at: int, flags: int) -> None:
    """An MDB_db record: its flags must be the expected ones and its depth plausible."""
    db_flags, depth = struct.unpack_from("<HH", raw, at + 4)
    if db_flags != flags or depth > 64:
        raise ValueError(f"database record at {at} has flags {db_flags:#x}, depth {depth}")


def walk_pages(path: str) -> None:
    """Check the header of every branch and leaf page reachable from the newest meta page.

    LMDB trusts these headers: a bad key count, node offset or child page number
    makes it assert or fault, on the read path or later on the write path. This
    walk (over tree pages only, never the overflow pages holding page records)
    raises ValueError instead.
    """
    with open(path, "rb") as data:
        raw = mmap.mmap(data.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        psize = struct.unpack_from("<I", raw, 40)[0]
        metas = [struct.unpack_from("<QQ", raw, base + 136)[::-1] + (base,) for base in (0, psize)
                 if struct.unpack_from("<I", raw, base + 16)[0] == _META_MAGIC]
        _, last_page, base = max(metas)  # (txnid, last page, offset) of the newest meta
        last_page = min(last_page, len(raw) // psize - 1)  # reachable pages must exist
        # The free list is keyed by integer txn ids and no database of ours sets flags:
        # other flags would send LMDB down dupsort paths that assert on this data.
        for offset, expected in ((40, _MDB_INTEGERKEY), (88, 0)):
            _check_db_record(raw, base + offset, expected)
        roots = [struct.unpack_from("<Q", raw, base + offset)[0] for offset in (80, 128)]
        stack = [root for root in roots if root != _P_INVALID]
        seen: set[int] = set()
        while stack:
            page = stack.pop()
            if not 2 <= page <= last_page or page in seen:
                raise ValueError(f"page {page} is out of range or reached twice")
            seen.add(page)
            stack += _page_children(raw, page * psize, psize, last_page)
    finally:
        raw.close()


def _page_children(raw: mmap.mmap, start: int, psize: int, last_page: int) -> list[int]:
    flags, lower, upper = struct.unpack_from("<HHH", raw, start + 10)
    kind = flags  # a tree page on disk is exactly a branch or a leaf: no loose/keep/dup bits
    if kind not in (_P_BRANCH, _P_LEAF) or not 16 <= lower <= upper <= psize or lower % 2:
        raise ValueError(f"page at {start} has a bad header")
    children = []
    for index in range((lower - 16) // 2):
        ptr = struct.unpack_from("<H", raw, start + 16 + 2 * index)[0]
        if not upper <= ptr <= psize - 8:
            raise ValueError(f"node pointer {ptr} of page at {start} is out of range")
        lo, hi, node_flags, ksize = _U16x4.unpack_from(raw, start + ptr)
        body = ptr + 8 + ksize
        if body > psize:
            raise ValueError(f"node key of page at {start} runs past the page")
        if kind == _P_BRANCH:
            children.append(lo | hi << 16 | node_flags << 32)
            continue
        size = lo | hi << 16
        if node_flags & _F_BIGDATA:
            first = struct.unpack_from("<Q", raw, start + body)[0] if body + 8 <= psize else _P_INVALID
            if first + (size + 16 + psize - 1) // psize - 1 > last_page:
                raise ValueError(f"overflow data of page at {start} lies past the last page")
        elif node_flags & _F_SUBDATA:
            if body + 48 > psize or size != 48:
                raise ValueError(f"sub-database record of page at {start} is malformed")
            _check_db_record(raw, start + body, 0)
            root = struct.unpack_from("<Q", raw, start + body + 40)[0]
            if root != _P_INVALID:
                children.append(root)
        elif body + size > psize:
            raise ValueError(f"node data of page at {start} runs past the page")
    return children
