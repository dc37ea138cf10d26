"""Logging: the ``pagedkv`` logger and its children say what happened, and are silent by default.

Each event is provoked for real (a crash leaving stray records, a format-1 store, a full
pool, a flipped bit, a failing background write, a held lock) and its record is looked
for with caplog: logger name under ``pagedkv``, level, and the facts in the message.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import lmdb
import numpy as np
import pytest

import pagedkv
from pagedkv import PageCorrupt, faults
from pagedkv.storage.pool import HEADER_NBYTES

from tests.kits.model import Model
from tests.kits.store import GEOM, ROOT



PS = GEOM.page_size


def records(caplog: pytest.LogCaptureFixture, level: int, *words: str) -> list[logging.LogRecord]:
    """Records of pagedkv's loggers at ``level`` whose message holds every one of ``words``."""
    return [r for r in caplog.records if (r.name == "pagedkv" or r.name.startswith("pagedkv."))
            and r.levelno == level and all(w in r.getMessage() for w in words)]


def filled(store: pagedkv.KVStore, model: Model, seq, n: int) -> None:
    store.create(seq)
    model.create(seq)
    store.append(seq, *model.next_kv(seq, n))


def test_the_package_logger_is_silent_by_default(tmp_path: Path) -> None:
    """No handler configured: a warning reaches no stderr (a NullHandler stops logging's last resort)."""
    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("pagedkv").handlers)
    code = ("import logging, pagedkv\n"
            "logging.getLogger('pagedkv.pages.evict').warning('a pagedkv warning')\n"
            "logging.getLogger('elsewhere').warning('another library')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "a pagedkv warning" not in out.stderr
    assert "another library" in out.stderr  # logging's last resort is on for the others


def test_stray_records_at_open_are_logged(stores, seed, caplog) -> None:
    store = stores.open(pool_pages=4, evict_batch=1)
    model = Model(seed)
    filled(store, model, "a", 2)
    store.commit()
    filled(store, model, "b", 8 * PS)  # uncommitted, and spilled: records no commit names
    store._abandon()
    caplog.set_level(logging.INFO, logger="pagedkv")
    store = stores.open(geom=None, pool_pages=None)
    found = records(caplog, logging.INFO, "stray")
    assert found, [r.getMessage() for r in caplog.records]
    assert any(f"{n} stray" in found[0].getMessage() for n in range(4, 9))
    store.commit()
    assert store.check() == []


def test_a_format_1_upgrade_is_logged(tmp_path: Path, caplog) -> None:
    work = tmp_path / "sample.kv"
    shutil.copytree(ROOT / "data" / "sample.kv", work)
    caplog.set_level(logging.INFO, logger="pagedkv")
    with pagedkv.open(work) as store:
        assert store.superblock["format"] >= 2
    found = records(caplog, logging.INFO, "format 1", "upgraded")
    assert found, [r.getMessage() for r in caplog.records]
    caplog.clear()
    pagedkv.open(work).close()
    assert not records(caplog, logging.INFO, "upgraded")  # once


def test_evictions_are_logged_per_batch_at_debug(stores, seed, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="pagedkv")
    store = stores.open(pool_pages=4, evict_batch=1)
    model = Model(seed)
    filled(store, model, "a", 6 * PS)
    batches = [r for r in caplog.records if r.name == "pagedkv.pages.evict" and r.levelno == logging.DEBUG
               and "evicted" in r.getMessage()]
    assert len(batches) == store.stats()["evict_batches"] > 0


def test_cache_drops_are_logged(stores, caplog) -> None:
    store = stores.open(pool_pages=8)
    store.create("a", tokens=list(range(2 * PS)))
    k = np.zeros((GEOM.layers, 2 * PS, GEOM.kv_heads, GEOM.head_dim), GEOM.np_dtype)
    store.append("a", k, k, tokens=list(range(2 * PS)))
    store.drop("a")
    store.commit()
    caplog.set_level(logging.INFO, logger="pagedkv")
    assert store.clear_cache()["pages"] == 2
    assert records(caplog, logging.INFO, "clear_cache", "dropped 2 cache-only pages")


def _committed_slot(stores, seed) -> tuple[Path, Model, int, int]:
    store = stores.open(pool_pages=8)
    model = Model(seed)
    filled(store, model, "a", 2 * PS)
    store.commit()
    pid = int(store._seqs.find("a").table[0])
    slot, uid = int(store._mgr.slot[pid]), int(store._mgr.uid[pid])
    store.close()
    return Path(store.path), model, slot, uid


def test_a_pool_checksum_failure_is_a_warning(stores, seed, caplog) -> None:
    path, model, slot, uid = _committed_slot(stores, seed)
    with open(path / "pool.bin", "r+b") as fh:  # one bit of the page's first token
        at = HEADER_NBYTES + slot * GEOM.page_nbytes
        fh.seek(at)
        byte = fh.read(1)[0]
        fh.seek(at)
        fh.write(bytes([byte ^ 1]))
    caplog.set_level(logging.INFO, logger="pagedkv")
    store = stores.open(geom=None, pool_pages=None)
    with pytest.raises(PageCorrupt):
        store.read("a")
    with pytest.raises(PageCorrupt):
        store.read("a")  # known corrupt now: said once
    found = records(caplog, logging.WARNING, f"page {uid}", "checksum")
    assert len(found) == 1, [r.getMessage() for r in caplog.records]


def corrupt_record(path: Path, uid: int) -> None:
    """Flip a payload byte of page ``uid``'s spill record (through LMDB, so the file stays sound)."""
    env = lmdb.open(str(path / "spill"), max_dbs=8, subdir=True)
    try:
        pages = env.open_db(b"pages", create=False)
        with env.begin(write=True) as txn:
            key = uid.to_bytes(8, "big")
            value = bytearray(txn.get(key, db=pages))
            value[-3] ^= 0x10
            txn.put(key, bytes(value), db=pages)
    finally:
        env.close()


def _spilled_uid(stores, seed) -> tuple[Path, int]:
    store = stores.open(pool_pages=4, evict_batch=1)
    model = Model(seed)
    filled(store, model, "a", 6 * PS)
    store.commit()
    mgr = store._mgr
    pid = int(store._seqs.find("a").table[0])
    assert mgr.slot[pid] < 0
    uid = int(mgr.uid[pid])
    store.close()
    return Path(store.path), uid


def test_a_spill_record_checksum_failure_is_a_warning(stores, seed, caplog) -> None:
    path, uid = _spilled_uid(stores, seed)
    corrupt_record(path, uid)
    caplog.set_level(logging.INFO, logger="pagedkv")
    store = stores.open(geom=None, pool_pages=None, evict_batch=1)
    with pytest.raises(PageCorrupt):
        store.read("a", 0, PS)
    with pytest.raises(PageCorrupt):
        store.read("a", 0, PS)
    found = records(caplog, logging.WARNING, f"page {uid}")
    assert len(found) == 1, [r.getMessage() for r in caplog.records]


def test_a_failed_prefetch_is_logged(stores, seed, caplog) -> None:
    path, uid = _spilled_uid(stores, seed)
    corrupt_record(path, uid)
    caplog.set_level(logging.INFO, logger="pagedkv")
    store = stores.open(geom=None, pool_pages=None, evict_batch=1)
    handle = store.prefetch(["a"])
    assert handle.wait(60)
    assert isinstance(handle.error, PageCorrupt)
    found = [r for r in caplog.records if r.name == "pagedkv.background.prefetch" and r.levelno >= logging.WARNING]
    assert found and f"page {uid}" in found[0].getMessage(), [r.getMessage() for r in caplog.records]


def test_a_failed_write_behind_batch_is_an_error(stores, seed, caplog) -> None:
    caplog.set_level(logging.INFO, logger="pagedkv")
    failed = threading.Event()

    def fail_in_the_thread(op: str) -> None:
        if op == "put" and threading.current_thread().name == "pagedkv-write-behind":
            failed.set()
            raise OSError(5, "injected write-behind failure")

    store = stores.open(pool_pages=16, write_behind=True)
    model = Model(seed)
    faults.set_injector(fail_in_the_thread)
    try:
        seq = 0
        while not failed.is_set() and seq < 64:  # fill the pool until the thread spills (and fails)
            filled(store, model, seq, PS)
            seq += 1
        assert failed.wait(60), "the write-behind thread never ran"
    except pagedkv.PagedKVError:
        pass  # a foreground op landed the failed batch first: it fails like the thread did
    finally:
        store._abandon()  # joins the thread: every record it makes is made by now
        faults.set_injector(None)
    found = [r for r in caplog.records if r.name == "pagedkv.background.writebehind" and r.levelno == logging.ERROR]
    assert len(found) == 1, [r.getMessage() for r in caplog.records]
    assert "injected write-behind failure" in found[0].getMessage()


def test_a_lock_wait_is_logged(tmp_path: Path, caplog) -> None:
    path = tmp_path / "store"
    first = pagedkv.open(path, GEOM, 8)
    caplog.set_level(logging.INFO, logger="pagedkv")
    try:
        with pytest.raises(pagedkv.StoreLocked):
            pagedkv.open(path, lock_timeout=0.05)
    finally:
        first.close()
    assert records(caplog, logging.INFO, "waiting", f"pid {os.getpid()}")
