"""Checking an LMDB file before this process trusts it.

LMDB trusts its file: a truncated one is mapped and faults past its end, and
damaged page headers or database records make it assert (SIGABRT) or fault
(SIGBUS) instead of returning an error, on the read path or later, inside the
first write transaction. These checks turn such damage into ``StoreCorrupt``:
the size against the meta pages; a walk over the structure of the newest
snapshot (every tree page, every overflow header and the free list) that
refuses what LMDB's write path would trip over, in a forked child before LMDB
maps the file for this process; and a read-back of every database in that
child. Beside a live writer the child first pins a snapshot with a read
transaction and walks that one, so the writer's page reuse never looks like damage.

The walk is ``lmdbwalk.walk_pages``; the on-disk layout it and this module read
(LMDB 0.9's, data format 1) is described in ``lmdbformat``.
"""

from __future__ import annotations

import os
import select
import signal
import struct

import lmdb

from ..errors import StoreCorrupt
from .lmdbformat import (
    META_BYTES, META_LAST_PAGE_AT, META_MAGIC, META_MAGIC_AT, META_PSIZE_AT, META_TXNID_AT, PAGE_SIZES)
from .lmdbwalk import walk_pages


def check_data_file(path: str) -> None:
    """Refuse a data.mdb whose size disagrees with its own meta pages, before LMDB maps it.

    LMDB trusts the file: a truncated one is mapped and then faults (SIGBUS) on
    the first access past its end, and an empty one is silently re-initialised.
    """
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as data:
            head = data.read(4096)
            psize = struct.unpack_from("<I", head, META_PSIZE_AT)[0] if len(head) >= 48 else 0
            if psize not in PAGE_SIZES:
                raise StoreCorrupt(f"{path}: not an LMDB data file (page size field {psize})")
            data.seek(0)
            metas = data.read(2 * psize)
    except OSError as exc:
        raise StoreCorrupt(f"{path}: cannot be read ({exc.strerror})") from None
    found = []
    for base in (0, psize):
        if len(metas) >= base + META_BYTES and struct.unpack_from("<I", metas, base + META_MAGIC_AT)[0] == META_MAGIC:
            last_page, txnid = struct.unpack_from("<QQ", metas, base + META_LAST_PAGE_AT)
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

    The child first checks the structure of ``data.mdb`` with ``walk_pages``
    (which the writer's first commit relies on), then reads every database back.
    With ``lock`` (a reader beside a live writer) it registers as a reader and pins
    a snapshot before walking it, so that the writer cannot reuse its pages meanwhile.
    LMDB asserts (SIGABRT) or faults (SIGBUS) on some structurally damaged files
    instead of returning an error; a child that dies that way, or finds damage,
    turns into ``StoreCorrupt`` here rather than killing the caller.
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
            data_path = os.path.join(path, "data.mdb")
            try:
                if lock:
                    # Beside a live writer, pin a snapshot first: while this reader holds
                    # it, the writer reuses none of its pages, so the walk sees it whole.
                    env, txn, meta = _pinned_snapshot(path, data_path, len(names))
                    walk_pages(data_path, meta)
                else:
                    walk_pages(data_path)
                    env = lmdb.open(path, readonly=True, lock=False, subdir=True, max_dbs=len(names))
                    txn = env.begin(buffers=True)
            except ValueError as exc:
                # One write below PIPE_BUF arrives whole: the parent reads it at once.
                os.write(write_end, b"0" + str(exc).encode("utf-8", "replace")[:1000])
                raise
            with txn:
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
    reply = b""
    try:
        ready, _, _ = select.select([read_end], [], [], timeout)
        if ready:
            reply = os.read(read_end, 1024)
        ok = reply == b"1"
    finally:
        os.close(read_end)
        if not ok:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _, status = os.waitpid(pid, 0)
    if reply[:1] == b"0":
        raise StoreCorrupt(f"{path}: data.mdb is damaged ({reply[1:].decode('utf-8', 'replace')})")
    if not ok:
        how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else "an error"
        raise StoreCorrupt(f"{path}: the spill store does not read back cleanly (its reader hit {how})")


def _pinned_snapshot(path: str, data_path: str,
                     max_dbs: int) -> tuple[lmdb.Environment, lmdb.Transaction, bytes]:
    """A read transaction and the meta page of the snapshot it holds, read at once.

    The reader keeps the snapshot's tree pages from reuse but not its meta page,
    which the writer's next commit but one overwrites: it is copied here, read
    twice alike so that a copy torn by that write is not taken. ValueError when a
    fast writer won every try.
    """
    env = lmdb.open(path, readonly=True, lock=True, subdir=True, max_dbs=max_dbs)
    with open(data_path, "rb") as data:
        psize = struct.unpack_from("<I", data.read(48), META_PSIZE_AT)[0]  # LMDB has just accepted it
        for _ in range(5):
            txn = env.begin(buffers=True)
            for base in (0, psize):
                first = os.pread(data.fileno(), META_BYTES, base)
                if len(first) == META_BYTES and struct.unpack_from("<Q", first, META_TXNID_AT)[0] == txn.id() \
                        and os.pread(data.fileno(), META_BYTES, base) == first:
                    return env, txn, first
            txn.abort()
    env.close()
    raise ValueError("no copy of a pinned snapshot's meta page could be taken (a writer kept moving)")
