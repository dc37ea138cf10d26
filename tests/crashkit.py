"""Crash-safety kit of pagedkv (RELIABILITY.md T2, T3, T4), shared by tests/test_crash.py and
tools/crashtest.py.

* Content is a function ``f(seed, cid, token)`` (``token_bits``): the verifier regenerates the
  expected bytes and stores none. ``cid`` is a content id, unique per sequence incarnation; a
  fork inherits its source's segments and appends under its own cid.
* ``Model`` (``{seq id: SeqState}``) is the expected store: per sequence a length and
  ``(start, cid)`` segments. It is small enough to travel in every commit message.
* ``Workload`` drives a store at random (create, append spanning pages, engine steps writing
  K/V into ``store.pool`` via ``slot_mapping``, aborted steps, fork, drop, checked reads,
  commit) and reports each commit through ``intent`` (before) and ``ack`` (after it returned).
* ``sigkill_loop`` (T2), ``crashpoint_run`` (T3) and ``power_loss_loop`` (T4) are the loops;
  each returns a ``LoopResult`` of figures and violations.
"""

from __future__ import annotations

import fcntl
import os
import random
import re
import select
import shutil
import signal
import struct
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import lmdb
import msgpack
import numpy as np

import pagedkv
from pagedkv import faults
from pagedkv.errors import PageCorrupt, PagedKVError
from pagedkv.storage.files import filesystem_type
from pagedkv.pages.manager import BlockManager
from pagedkv.storage.pool import PagePool

# 256-byte pages (2 layers x K/V x 4 tokens x 1 head x 8 dims x fp16): cheap kill cycles.
GEOM_SMALL = pagedkv.Geometry(layers=2, kv_heads=1, head_dim=8, page_size=4, dtype="float16")
# Power loss: 4 KiB pages (one slot per 4 KiB block, eight 512 B sectors per slot) and 1 KiB
# pages (four slots share a block, so one slot's msync and another's unflushed bytes meet).
GEOM_POWER = pagedkv.Geometry(layers=4, kv_heads=2, head_dim=32, page_size=4, dtype="float16")
GEOM_POWER_SHARED = pagedkv.Geometry(layers=2, kv_heads=2, head_dim=16, page_size=4, dtype="float16")

POINTS = (
    "append.after_write", "close.after_commit", "commit.after_commit", "commit.after_flush",
    "commit.before_flush", "create.after_pool", "create.after_superblock", "drop.after_free",
    "evict.after_commit", "evict.before_commit", "lmdb.before_commit", "open.after_lock",
    "restore.after_copy", "step.after_begin", "step.after_end",
)
CREATE_POINTS = ("create.after_pool", "create.after_superblock")
BLOCK, SECTOR = 4096, 512
_MASK64 = (1 << 64) - 1


def resolve_seed(label: str = "") -> int:
    """``PAGEDKV_SEED`` if set, else a fresh seed; printed either way so a run can be replayed."""
    env = os.environ.get("PAGEDKV_SEED", "").strip()
    seed = int(env, 0) if env else random.SystemRandom().randrange(1 << 32)
    print(f"PAGEDKV_SEED={seed}" + (f" ({label})" if label else ""), flush=True)
    return seed


def library_crashpoints() -> set[str]:
    """Every ``faults.crashpoint("name")`` call in the pagedkv sources."""
    root = Path(pagedkv.__file__).parent
    found: set[str] = set()
    for source in root.rglob("*.py"):
        found |= set(re.findall(r"crashpoint\(\s*[\"']([^\"']+)[\"']\s*\)", source.read_text()))
    return found


# -- content -------------------------------------------------------------------------------

_C_TOKEN = np.uint64(0xC2B2AE3D27D4EB4F)
_C_ELEM = np.uint64(0x165667B19E3779F9)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def token_bits(geom: pagedkv.Geometry, seed: int, cid: int, start: int, stop: int) -> np.ndarray:
    """``f(seed, cid, token)`` for tokens ``[start, stop)``: uint16 bit patterns shaped
    ``(tokens, layers, 2, kv_heads, head_dim)`` (index 0 of axis 2 is K, 1 is V).

    Bit 14 is cleared so every value is a finite float16; comparisons are of bits anyway.
    """
    per_token = geom.layers * 2 * geom.kv_heads * geom.head_dim
    base = np.uint64((seed * 0x9E3779B97F4A7C15 ^ cid * 0xD6E8FEB86659FD93 ^ 0x5EED) & _MASK64)
    with np.errstate(over="ignore"):
        x = (base + np.arange(start, stop, dtype=np.uint64)[:, None] * _C_TOKEN
             + np.arange(per_token, dtype=np.uint64)[None, :] * _C_ELEM)
        x ^= x >> np.uint64(30)
        x *= _M1
        x ^= x >> np.uint64(27)
        x *= _M2
        x ^= x >> np.uint64(31)
    bits = (x >> np.uint64(40)).astype(np.uint16) & np.uint16(0xBFFF)
    return bits.reshape(stop - start, geom.layers, 2, geom.kv_heads, geom.head_dim)


def as_kv(bits: np.ndarray, geom: pagedkv.Geometry) -> tuple[np.ndarray, np.ndarray]:
    """K and V ``(layers, tokens, kv_heads, head_dim)`` in the store dtype from ``token_bits``."""
    k = np.ascontiguousarray(bits[:, :, 0].transpose(1, 0, 2, 3)).view(geom.np_dtype)
    v = np.ascontiguousarray(bits[:, :, 1].transpose(1, 0, 2, 3)).view(geom.np_dtype)
    return k, v


# -- the model ---------------------------------------------------------------------------


class SeqState:
    """Expected sequence: ``length`` tokens; token t has the cid of the last segment starting <= t."""

    __slots__ = ("length", "segs", "cid")

    def __init__(self, length: int, segs: list[tuple[int, int]], cid: int) -> None:
        self.length, self.segs, self.cid = length, segs, cid

    def copy(self) -> SeqState:
        return SeqState(self.length, list(self.segs), self.cid)

    def grow(self, count: int) -> None:
        if not self.segs or self.segs[-1][1] != self.cid:
            self.segs.append((self.length, self.cid))
        self.length += count


Model = dict  # seq id (int) -> SeqState


def copy_model(model: Model) -> Model:
    return {sid: st.copy() for sid, st in model.items()}


def model_to_wire(model: Model) -> list[Any]:
    return [[sid, st.length, [x for seg in st.segs for x in seg], st.cid] for sid, st in model.items()]


def model_from_wire(wire: list[Any]) -> Model:
    return {sid: SeqState(length, list(zip(flat[::2], flat[1::2])), cid) for sid, length, flat, cid in wire}


def shape_of(model: Model) -> dict[int, int]:
    return {sid: st.length for sid, st in model.items()}


def expected_bits(geom: pagedkv.Geometry, seed: int, st: SeqState, start: int, stop: int) -> np.ndarray:
    """The bits of tokens ``[start, stop)`` of a sequence, ``(tokens, layers, 2, heads, dim)``."""
    parts = []
    for i, (seg_start, cid) in enumerate(st.segs):
        seg_stop = st.segs[i + 1][0] if i + 1 < len(st.segs) else st.length
        a, b = max(start, seg_start), min(stop, seg_stop)
        if a < b:
            parts.append(token_bits(geom, seed, cid, a, b))
    if not parts:
        return np.empty((0, geom.layers, 2, geom.kv_heads, geom.head_dim), np.uint16)
    return np.concatenate(parts)


def read_matches(geom: pagedkv.Geometry, seed: int, st: SeqState, start: int, stop: int,
                 k: np.ndarray, v: np.ndarray) -> int:
    """How many tokens of a ``read`` result differ from the expected bytes."""
    want = expected_bits(geom, seed, st, start, stop)
    got_k = k.view(np.uint16).transpose(1, 0, 2, 3)
    got_v = v.view(np.uint16).transpose(1, 0, 2, 3)
    if got_k.shape != want[:, :, 0].shape:
        return max(stop - start, 1)
    if stop == start:
        return 0
    bad = (got_k != want[:, :, 0]).reshape(stop - start, -1).any(1)
    bad |= (got_v != want[:, :, 1]).reshape(stop - start, -1).any(1)
    return int(bad.sum())


# -- the workload --------------------------------------------------------------------------


class WrongData(AssertionError):
    """The live store returned bytes that differ from what was written."""


class _EngineFailure(Exception):
    """Raised inside a step to make the store roll the step back."""


@dataclass
class Params:
    """Workload shape: small bounds keep the pool under constant eviction and restore."""

    max_seqs: int = 6  # sequences alive at once
    max_len: int = 24  # tokens per sequence (6 pages of 4)
    max_append: int = 9  # tokens per append (spans up to 3 pages)
    weights: dict[str, float] = field(default_factory=lambda: {
        "create": 8, "append": 24, "step": 18, "step_abort": 3, "fork": 7, "drop": 7,
        "read": 14, "commit": 15,
    })


# Power loss: sequences accumulate (few drops), so every crash has committed pages at risk.
POWER_PARAMS = Params(max_seqs=6, max_len=28, weights={
    "create": 6, "append": 30, "step": 20, "step_abort": 2, "fork": 5, "drop": 3, "read": 12,
    "commit": 14})


class Workload:
    """Random operations on an open store, checked against ``model`` as they run.

    ``intent(n, model)`` is called before commit ``n`` starts and ``ack(n)`` after it returned;
    ``next_id()`` hands out sequence ids and content ids (never reused).
    """

    def __init__(self, store: pagedkv.KVStore, model: Model, commit_no: int, seed: int,
                 rng: random.Random, next_id: Callable[[], int], params: Params,
                 intent: Callable[[int, Model], None], ack: Callable[[int], None]) -> None:
        self.store, self.model, self.commit_no = store, model, commit_no
        self.geom = store.geometry
        self.seed, self.rng, self.next_id, self.params = seed, rng, next_id, params
        self.intent, self.ack = intent, ack
        self._ops = list(params.weights)
        self._cum = np.cumsum([params.weights[name] for name in self._ops]).tolist()
        self.counts: Counter[str] = Counter()

    def run(self, count: int) -> None:
        for _ in range(count):
            self.one()

    def one(self, name: str | None = None) -> None:
        name = name or self.rng.choices(self._ops, cum_weights=self._cum)[0]
        self.counts[name] += 1
        getattr(self, "op_" + name)()

    # -- operations
    def op_create(self) -> None:
        if len(self.model) >= self.params.max_seqs:
            return self.op_drop()
        sid = self.next_id()
        self.store.create(sid)
        self.model[sid] = SeqState(0, [], self.next_id())

    def _pick(self, room: bool = False) -> int | None:
        sids = [s for s, st in self.model.items() if not room or st.length < self.params.max_len]
        return self.rng.choice(sids) if sids else None

    def op_append(self) -> None:
        sid = self._pick(room=True)
        if sid is None:
            return self.op_create() if len(self.model) < self.params.max_seqs else self.op_drop()
        st = self.model[sid]
        count = self.rng.randint(1, min(self.params.max_append, self.params.max_len - st.length))
        k, v = as_kv(token_bits(self.geom, self.seed, st.cid, st.length, st.length + count), self.geom)
        self.store.append(sid, k, v)
        st.grow(count)

    def op_step(self, abort: bool = False) -> None:
        sids = [s for s in self.model]
        if not sids:
            return self.op_create()
        chosen = self.rng.sample(sids, self.rng.randint(1, min(3, len(sids))))
        mapping = {sid: self.rng.randint(0, min(5, self.params.max_len - self.model[sid].length))
                   for sid in chosen}
        if not self.store.can_step(mapping):
            mapping = {chosen[0]: mapping[chosen[0]]}
            if not self.store.can_step(mapping):
                self.counts["step_skipped"] += 1
                return
        geom, page_size = self.geom, self.geom.page_size
        new_bits = [token_bits(geom, self.seed, self.model[sid].cid, self.model[sid].length,
                               self.model[sid].length + count) for sid, count in mapping.items()]
        bits = np.concatenate(new_bits)
        try:
            with self.store.step(mapping) as step:
                pool = self.store.pool.view(np.uint16)
                for row, sid in enumerate(mapping):  # what an attention kernel sees: old tokens
                    st = self.model[sid]
                    if step.seq_lens[row] != st.length + mapping[sid]:
                        raise WrongData(f"step seq_lens[{row}]={step.seq_lens[row]}, expected "
                                        f"{st.length + mapping[sid]}")
                    if st.length:
                        pos = np.arange(st.length)
                        slots = step.block_tables[row, pos // page_size]
                        seen = pool[slots, :, :, pos % page_size]
                        if not np.array_equal(seen, expected_bits(geom, self.seed, st, 0, st.length)):
                            raise WrongData(f"step: pool bytes of sequence {sid} differ from the model")
                mapping_slots = step.slot_mapping // page_size
                offsets = step.slot_mapping % page_size
                if len(mapping_slots) != len(bits):
                    raise WrongData(f"slot_mapping has {len(mapping_slots)} entries for {len(bits)} tokens")
                upto = self.rng.randint(0, len(bits)) if abort else len(bits)
                pool[mapping_slots[:upto], :, 0, offsets[:upto]] = bits[:upto, :, 0]
                pool[mapping_slots[:upto], :, 1, offsets[:upto]] = bits[:upto, :, 1]
                del pool
                if abort:
                    raise _EngineFailure
        except _EngineFailure:
            for sid in mapping:
                if self.store.length(sid) != self.model[sid].length:
                    raise WrongData(f"aborted step left {sid} at {self.store.length(sid)} tokens") from None
            return
        for sid, count in mapping.items():
            if count:
                self.model[sid].grow(count)

    def op_step_abort(self) -> None:
        self.op_step(abort=True)

    def op_fork(self) -> None:
        src = self._pick()
        if src is None or len(self.model) >= self.params.max_seqs:
            return self.op_drop() if src is not None else self.op_create()
        dst = self.next_id()
        self.store.fork(src, dst)
        st = self.model[src]
        self.model[dst] = SeqState(st.length, list(st.segs), self.next_id())

    def op_drop(self) -> None:
        sid = self._pick()
        if sid is None:
            return
        self.store.drop(sid)
        del self.model[sid]

    def op_read(self) -> None:
        sid = self._pick()
        if sid is None:
            return
        st = self.model[sid]
        if self.store.length(sid) != st.length:
            raise WrongData(f"length of {sid} is {self.store.length(sid)}, expected {st.length}")
        start = self.rng.randint(0, st.length)
        stop = self.rng.randint(start, st.length)
        k, v = self.store.read(sid, start, stop)
        bad = read_matches(self.geom, self.seed, st, start, stop, k, v)
        if bad:
            raise WrongData(f"read({sid}, {start}, {stop}) returned {bad} wrong tokens")

    def op_commit(self) -> None:
        number = self.commit_no + 1
        self.intent(number, self.model)
        self.store.commit()
        self.commit_no = number
        self.ack(number)

    def close(self) -> None:
        """``close()`` commits: it is announced and acknowledged like a commit."""
        number = self.commit_no + 1
        self.intent(number, self.model)
        self.store.close()
        self.commit_no = number
        self.ack(number)


# -- verification --------------------------------------------------------------------------


@dataclass
class Verdict:
    outcome: str  # acked | acked+1 | lost-acked | mismatch | reopen-failed
    number: int  # the commit the store was matched (or compared) against
    model: Model
    problems: list[str]
    lost_pages: int = 0
    wrong_tokens: int = 0


def verify_contents(store: pagedkv.KVStore, model: Model, seed: int) -> tuple[list[str], int, int]:
    """Compare every sequence of ``store`` with ``model``: (problems, lost pages, wrong tokens).

    A page that raises ``PageCorrupt`` is a lost committed page; bytes returned that differ
    from the model are wrong data.
    """
    geom, page_size = store.geometry, store.geometry.page_size
    problems: list[str] = []
    lost = wrong = 0
    try:
        problems += [f"check(): {p}" for p in store.check()]
    except PagedKVError as exc:
        problems.append(f"check() raised {exc!r}")
    have = set(store.sequences())
    if have != set(model):
        problems.append(f"sequences differ: missing {sorted(set(model) - have)}, "
                        f"unexpected {sorted(have - set(model))}")
    for sid in sorted(have & set(model)):
        st = model[sid]
        length = store.length(sid)
        if length != st.length:
            problems.append(f"sequence {sid}: {length} tokens, expected {st.length}")
            continue
        try:
            k, v = store.read(sid)
            bad = read_matches(geom, seed, st, 0, length, k, v)
        except PageCorrupt:
            bad = 0
            for first in range(0, length, page_size):  # count page by page
                last = min(length, first + page_size)
                try:
                    k, v = store.read(sid, first, last)
                    bad += read_matches(geom, seed, st, first, last, k, v)
                except PageCorrupt as exc:
                    lost += 1
                    problems.append(f"sequence {sid} page {first // page_size}: lost ({exc})")
        if bad:
            wrong += bad
            problems.append(f"sequence {sid}: {bad} tokens returned with wrong bytes")
    return problems, lost, wrong


def judge(path: Path, mode: str, seed: int, history: dict[int, Model], acked: int) -> Verdict:
    """Reopen ``path`` and decide which commit it holds: acked, or acked+1 (a commit that
    completed without its ack); any other state, a reopen failure, a lost page or a wrong
    byte is a violation. Closes the store (a commit) when it opened.
    """
    problems: list[str] = []
    try:
        store = pagedkv.open(path, durability=mode)
    except pagedkv.StoreLocked as exc:
        # The writer was SIGKILLed and reaped, yet its lock is seen: a reopen failure. Find
        # out whether it is the kernel releasing the dead holder's flock late (diagnosis only).
        free_after_ms = _lock_free_after_ms(path / "LOCK")
        problems.append(f"reopen failed: {exc!r} although that writer is dead and reaped; "
                        f"the lock was free {free_after_ms:.1f} ms later" if free_after_ms is not None
                        else f"reopen failed: {exc!r}; the lock was still held 1 s later")
        try:
            store = pagedkv.open(path, durability=mode)
        except Exception as again:  # noqa: BLE001
            return Verdict("reopen-failed", acked, history[acked], problems + [f"and again: {again!r}"])
    except Exception as exc:  # noqa: BLE001 - any failure to reopen is the finding
        return Verdict("reopen-failed", acked, history[acked], [f"reopen failed: {exc!r}"])
    try:
        shape = {sid: store.length(sid) for sid in store.sequences()}
        number, outcome = acked, "mismatch"
        for candidate, label in ((acked + 1, "acked+1"), (acked, "acked")):
            if candidate in history and shape_of(history[candidate]) == shape:
                number, outcome = candidate, label
                break
        else:
            older = [n for n in sorted(history, reverse=True) if n < acked and shape_of(history[n]) == shape]
            if older:
                number, outcome = older[0], "lost-acked"
                problems.append(f"lost acked commit: the store holds commit {older[0]}, {acked} was acked")
            else:
                problems.append(f"the store holds no known commit (acked {acked}): {shape}")
        found, lost, wrong = verify_contents(store, history[number], seed)
        problems += found
    except Exception as exc:  # noqa: BLE001
        problems.append(f"verification raised {exc!r}")
        number, outcome, lost, wrong = acked, "mismatch", 0, 0
        store._abandon()
    else:
        try:
            store.close()
        except Exception as exc:  # noqa: BLE001
            problems.append(f"close after verification raised {exc!r}")
    return Verdict(outcome, number, history[number], problems, lost, wrong)


def _lock_free_after_ms(lock_path: Path, limit_s: float = 1.0) -> float | None:
    """Milliseconds until an exclusive flock on ``lock_path`` succeeds (None: not within limit)."""
    started = time.monotonic()
    fd = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        while time.monotonic() - started < limit_s:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                time.sleep(0.0002)
                continue
            fcntl.flock(fd, fcntl.LOCK_UN)
            return (time.monotonic() - started) * 1e3
        return None
    finally:
        os.close(fd)


# -- results -------------------------------------------------------------------------------


@dataclass
class LoopResult:
    name: str
    seed: int
    cycles: int = 0
    figures: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    violation_cycles: int = 0
    elapsed_s: float = 0.0
    artifacts: list[str] = field(default_factory=list)
    artifact_root: Path | None = None  # where failing stores are copied (PAGEDKV_ARTIFACTS wins)

    def fail(self, cycle: int, problems: list[str], keep: int = 30) -> None:
        self.violation_cycles += 1
        for problem in problems:
            if len(self.violations) < keep:
                self.violations.append(f"cycle {cycle}: {problem}")

    def summary(self) -> str:
        figures = ", ".join(f"{key}={value}" for key, value in sorted(self.figures.items()))
        lines = [f"[{self.name}] seed={self.seed} cycles={self.cycles} "
                 f"violating_cycles={self.violation_cycles} time={self.elapsed_s:.1f}s", f"  {figures}"]
        lines += [f"  VIOLATION {v}" for v in self.violations]
        lines += [f"  artifact: {a}" for a in self.artifacts]
        return "\n".join(lines)


def save_artifact(result: LoopResult, path: Path, label: str, limit: int = 5) -> None:
    """Copy a failing store directory under ``PAGEDKV_ARTIFACTS`` (default: beside it)."""
    if len(result.artifacts) >= limit or not path.exists():
        return
    root = Path(os.environ.get("PAGEDKV_ARTIFACTS") or result.artifact_root or path.parent / "artifacts")
    dest = root / f"{result.name}-{label}"
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(path, dest, ignore_dangling_symlinks=True)
    result.artifacts.append(str(dest))


def scratch_root(power_loss: bool) -> Path | None:
    """Where a loop keeps its stores: ``PAGEDKV_CRASH_DIR`` if set; else, for the simulated
    power loss (T4) only, /dev/shm when it is a writable tmpfs; else None (the caller's dir).

    T4 models durability itself (flush recorder, on-disk LMDB), so it needs no real disk and
    on tmpfs a cycle costs CPU only. The SIGKILL loops (T2, T3) stay on the caller's (real)
    filesystem, where the kernel's handling of a killed writer's files is what users get.
    """
    forced = os.environ.get("PAGEDKV_CRASH_DIR")
    if forced:
        return Path(forced)
    shm = Path("/dev/shm")
    if power_loss and shm.is_dir() and filesystem_type(str(shm)) == "tmpfs" and os.access(shm, os.W_OK):
        return shm
    return None


def fresh_store(path: Path, geom: pagedkv.Geometry, pool_pages: int) -> None:
    shutil.rmtree(path, ignore_errors=True)
    pagedkv.open(path, geom, pool_pages).close()


# -- child processes (T2, T3) ---------------------------------------------------------------

_FRAME = struct.Struct("<I")


def send(fd: int, message: Any) -> None:
    data = msgpack.packb(message)
    view = memoryview(_FRAME.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


class Frames:
    """Splits the byte stream of a pipe into messages; a torn last frame is never returned."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        self.buf += data
        out = []
        while len(self.buf) >= 4:
            (size,) = _FRAME.unpack_from(self.buf)
            if len(self.buf) < 4 + size:
                break
            out.append(msgpack.unpackb(bytes(self.buf[4:4 + size]), strict_map_key=False))
            del self.buf[:4 + size]
        return out


def _report_failure(wfd: int) -> int:
    """Send the current exception's traceback to the parent (if the pipe still works); the exit code."""
    try:
        send(wfd, ["E", traceback.format_exc()])
    except BaseException:  # noqa: BLE001
        pass
    return 3


def _reuse_pending_slots() -> None:
    """Mutation (P2 broken): a slot freed since the last commit is reused before that commit."""
    original = BlockManager.take_slots

    def take_slots(self: BlockManager, count: int) -> list[int]:
        pending = np.flatnonzero((self.slot_pid < 0) & (self.slot_cpid >= 0)).tolist()
        self.free_slots.extend(s for s in pending if s not in self.free_slots)
        return original(self, count)

    BlockManager.take_slots = take_slots  # type: ignore[method-assign]


def _slow_helper_processes(delay_ms: float) -> None:
    """Widen a race window: a helper process the library forks (any process but this one)
    waits ``delay_ms`` before it opens the LMDB environment.

    Whatever such a helper still holds from its parent at that point (the writer's LOCK
    descriptor, say) then outlives a SIGKILL of the parent deterministically, not by chance.
    """
    writer_pid, real_open = os.getpid(), lmdb.open

    def slow_open(*args: Any, **kwargs: Any) -> Any:
        if os.getpid() != writer_pid:
            time.sleep(delay_ms / 1e3)
        return real_open(*args, **kwargs)

    lmdb.open = slow_open


def child_main(wfd: int, path: Path, mode: str, seed: int, model: Model, commit_no: int,
               id_base: int, params: Params, sessions: int, ops_per_session: int,
               crash: tuple[str, int] | None = None, mutation: str | None = None,
               map_size: int | None = None, helper_delay_ms: float = 0.0) -> None:
    """The body of a forked child; never returns. Frames sent on ``wfd``:
    ``["R"]`` store open, ``["I", n, model]`` before commit n, ``["A", n, evictions, restores]``
    after it returned, ``["H", hits]`` at a normal end, ``["E", traceback]`` on an error.
    ``helper_delay_ms`` makes a helper process the library forks linger that long.
    """
    code = 0
    try:
        if helper_delay_ms:
            _slow_helper_processes(helper_delay_ms)
        if crash is not None:
            os.environ["PAGEDKV_CRASHPOINT"] = f"{crash[0]}:{crash[1]}"
            faults._load_crashpoint()
        faults._hits.clear()
        if mutation == "reuse-pending":
            _reuse_pending_slots()
        ids = iter(range(id_base, id_base + (1 << 30)))
        rng = random.Random(f"{seed}-{id_base}")
        stats = [0, 0]

        def intent(number: int, current: Model) -> None:
            send(wfd, ["I", number, model_to_wire(current)])

        def ack(number: int) -> None:
            send(wfd, ["A", number, *stats])

        for _ in range(sessions):
            store = pagedkv.open(path, durability=mode, map_size=map_size)
            send(wfd, ["R"])
            work = Workload(store, model, commit_no, seed, rng, ids.__next__, params, intent, ack)
            for _ in range(ops_per_session):
                work.one()
                counts = store._stats.counts
                stats[:] = counts["evictions"], counts["restores"]
            work.close()
            commit_no = work.commit_no
        send(wfd, ["H", faults.hits()])
    except BaseException:  # noqa: BLE001 - report everything, exit without unwinding
        code = _report_failure(wfd)
    finally:
        os._exit(code)


@dataclass
class ChildRun:
    status: int
    frames: list[Any]
    elapsed_ms: float
    killed_by_us: bool

    @property
    def sigkilled(self) -> bool:
        return os.WIFSIGNALED(self.status) and os.WTERMSIG(self.status) == signal.SIGKILL

    @property
    def exit_code(self) -> int | None:
        return os.WEXITSTATUS(self.status) if os.WIFEXITED(self.status) else None

    def acked(self, default: int) -> int:
        return max([f[1] for f in self.frames if f[0] == "A"], default=default)

    def errors(self) -> list[str]:
        return [f[1] for f in self.frames if f[0] == "E"]


def run_child(body: Callable[[int], None], kill_after_ms: float | None = None,
              kill_after_frames: int | None = None, extra_ms: float = 0.0,
              safety_s: float = 60.0) -> ChildRun:
    """Fork ``body(write_fd)`` and collect its frames until it exits or we SIGKILL it: at
    ``kill_after_ms`` after the fork, or ``extra_ms`` after the ``kill_after_frames``-th
    frame. The only waiting is on the pipe (poll) and the kill delay itself.
    """
    rfd, wfd = os.pipe()
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller
        try:
            os.close(rfd)
            body(wfd)
        finally:
            os._exit(4)
    os.close(wfd)
    frames, reader = [], Frames()
    deadline = started + (kill_after_ms / 1e3 if kill_after_ms is not None else safety_s)
    killed = done = False
    poller = select.poll()
    poller.register(rfd, select.POLLIN)
    try:
        while not done:
            now = time.monotonic()
            if not killed and now >= deadline:
                os.kill(pid, signal.SIGKILL)
                killed = True
            timeout = None if killed else max(0, int((deadline - now) * 1000 + 0.999))
            if not poller.poll(timeout):
                continue
            data = os.read(rfd, 1 << 16)
            done = not data
            for frame in reader.feed(data):
                frames.append(frame)
                if (kill_after_frames is not None and not killed and len(frames) == kill_after_frames):
                    deadline = min(deadline, time.monotonic() + extra_ms / 1e3)
    finally:
        os.close(rfd)
        if not done:  # interrupted (e.g. a test timeout): never leave a child running
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    return ChildRun(status, frames, (time.monotonic() - started) * 1e3, killed)


# -- T2: black-box SIGKILL loop ---------------------------------------------------------------


def sigkill_loop(path: Path, mode: str, cycles: int, seed: int, *, geom: pagedkv.Geometry = GEOM_SMALL,
                 pool_pages: int = 12, kill_min_ms: float = 1.0, kill_max_ms: float = 50.0,
                 time_share: float = 0.4,
                 params: Params | None = None,
                 mutation: str | None = None, helper_delay_ms: float = 0.0, name: str | None = None,
                 stop_after_lost: bool = False,
                 artifact_root: Path | None = None,
                 progress: Callable[[LoopResult], None] | None = None) -> LoopResult:
    """T2: fork a child that opens the store and runs the random workload, acking every
    returned commit; SIGKILL it at a random moment; reopen and judge. The next child continues
    from the reopened store. The parent never holds the store open across ``fork``.
    A share ``time_share`` of the kills land U(``kill_min_ms``, ``kill_max_ms``) ms after the fork, the
    others a little after a random frame (a random point of the commit stream).
    """
    assert faults._crash_name is None, "PAGEDKV_CRASHPOINT is set in the test process"
    params = params or Params()
    result = LoopResult(name or f"T2-{mode}", seed, artifact_root=artifact_root)
    rng = random.Random(seed)
    started = time.monotonic()
    fresh_store(path, geom, pool_pages)
    model: Model = {}
    commit_no = 0
    for cycle in range(cycles):
        id_base = (cycle + 1) << 20
        # Half the children open with a tiny LMDB map, so map growth happens under the kills.
        map_size = 1 << 15 if rng.random() < 0.5 else None

        def body(wfd: int) -> None:
            child_main(wfd, path, mode, seed, model, commit_no, id_base, params, sessions=1,
                       ops_per_session=20000, mutation=mutation, map_size=map_size,
                       helper_delay_ms=helper_delay_ms)

        if rng.random() < time_share:  # a random moment after the fork
            result.figures["kill_by_time"] += 1
            run = run_child(body, kill_after_ms=rng.uniform(kill_min_ms, kill_max_ms))
        else:  # a random point in the commit stream, a little later
            result.figures["kill_by_frames"] += 1
            run = run_child(body, kill_after_frames=rng.randint(1, 14), extra_ms=rng.uniform(0.0, 3.0),
                            safety_s=30.0)
        result.cycles += 1
        history = {commit_no: model}
        for frame in run.frames:
            if frame[0] == "I":
                history[frame[1]] = model_from_wire(frame[2])
        acked = run.acked(commit_no)
        acks = [f for f in run.frames if f[0] == "A"]
        result.figures["acked_commits"] += acked - commit_no
        if acks:
            result.figures["evictions"] += acks[-1][2]
            result.figures["restores"] += acks[-1][3]
        if not any(f[0] == "R" for f in run.frames):
            result.figures["killed_before_open"] += 1
        problems = [f"child error:\n{text}" for text in run.errors()]
        if run.sigkilled:
            result.figures["sigkilled"] += 1
        elif not problems:
            problems.append(f"child ended without SIGKILL (status {run.status})")
        verdict = judge(path, mode, seed, history, acked)
        result.figures["state_" + verdict.outcome] += 1
        result.figures["reopen_locked"] += any("StoreLocked" in p for p in verdict.problems)
        result.figures["lost_pages"] += verdict.lost_pages
        result.figures["wrong_tokens"] += verdict.wrong_tokens
        problems += verdict.problems
        if problems:
            result.fail(cycle, problems)
            save_artifact(result, path, f"cycle{cycle}")
            fresh_store(path, geom, pool_pages)
            model, commit_no = {}, 0
        else:
            model, commit_no = verdict.model, verdict.number
        if progress is not None:
            progress(result)
        if stop_after_lost and result.figures["lost_pages"]:
            break
    result.elapsed_s = time.monotonic() - started
    return result


# -- T3: white-box crash points --------------------------------------------------------------


def build_base(path: Path, seed: int, geom: pagedkv.Geometry, pool_pages: int, params: Params) -> Model:
    """A committed store with some spilled pages, to copy before every crash-point run."""
    fresh_store(path, geom, pool_pages)
    store = pagedkv.open(path)
    ids = iter(range(1 << 20, 1 << 21))
    model: Model = {}
    work = Workload(store, model, 0, seed, random.Random(f"base-{seed}"), ids.__next__, params,
                    lambda n, m: None, lambda n: None)
    work.run(40)
    store.close()
    return model


def crashpoint_run(workdir: Path, mode: str, seed: int, points: tuple[str, ...] = POINTS,
                   hits: range = range(1, 6), *, geom: pagedkv.Geometry = GEOM_SMALL,
                   pool_pages: int = 8, sessions: int = 6, ops_per_session: int = 24,
                   params: Params | None = None, artifact_root: Path | None = None) -> LoopResult:
    """T3: for every point and k in ``hits``, a child runs a deterministic workload (several
    open/work/close sessions) and dies by SIGKILL at the k-th hit; the store is judged.
    ``figures['fired:<point>']`` counts the runs in which the point fired.
    """
    params = params or Params()
    result = LoopResult(f"T3-{mode}", seed, artifact_root=artifact_root)
    started = time.monotonic()
    base = workdir / "base"
    base_model = build_base(base, seed, geom, pool_pages, params)
    for point in points:
        result.figures[f"fired:{point}"] += 0
        for k in hits:
            label = f"{point}:{k}"
            if point in CREATE_POINTS:
                problems, fired = _create_point(workdir / f"create-{point}-{k}", mode, seed, point, k,
                                                geom, pool_pages, params, result)
            else:
                problems, fired = _regular_point(workdir / f"run-{point}-{k}", base, base_model, mode,
                                                 seed, point, k, sessions, ops_per_session, params,
                                                 result)
            result.cycles += 1
            result.figures[f"fired:{point}"] += fired
            if problems:
                result.fail(result.cycles, [f"[{label}] {p}" for p in problems])
    result.elapsed_s = time.monotonic() - started
    return result


def _classify(run: ChildRun, point: str, k: int) -> tuple[list[str], bool]:
    """Did the point fire (SIGKILL), or did the child end normally having passed it < k times?"""
    problems = [f"child error:\n{text}" for text in run.errors()]
    if run.killed_by_us:
        problems.append("the child hung (killed by the safety timeout)")
    if run.sigkilled and not run.killed_by_us:
        return problems, True
    hit_frames = [f[1] for f in run.frames if f[0] == "H"]
    if run.exit_code == 0 and hit_frames:
        passed = hit_frames[-1].get(point, 0)
        if passed >= k:
            problems.append(f"the point was passed {passed} times but did not kill at hit {k}")
    elif not problems:
        problems.append(f"child ended with status {run.status}")
    return problems, False


def _regular_point(path: Path, base: Path, base_model: Model, mode: str, seed: int, point: str,
                   k: int, sessions: int, ops_per_session: int, params: Params,
                   result: LoopResult) -> tuple[list[str], bool]:
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(base, path)

    def body(wfd: int) -> None:
        child_main(wfd, path, mode, seed, base_model, 0, 2 << 20, params, sessions,
                   ops_per_session, crash=(point, k))

    run = run_child(body, safety_s=60.0)
    problems, fired = _classify(run, point, k)
    history = {0: base_model}
    for frame in run.frames:
        if frame[0] == "I":
            history[frame[1]] = model_from_wire(frame[2])
    verdict = judge(path, mode, seed, history, run.acked(0))
    result.figures["state_" + verdict.outcome] += 1
    result.figures["reopen_locked"] += any("StoreLocked" in p for p in verdict.problems)
    problems += verdict.problems
    if problems:
        save_artifact(result, path, f"{point}-{k}")
    shutil.rmtree(path, ignore_errors=True)
    return problems, fired


def _create_point(workdir: Path, mode: str, seed: int, point: str, k: int, geom: pagedkv.Geometry,
                  pool_pages: int, params: Params, result: LoopResult) -> tuple[list[str], bool]:
    """A child creates stores s1..s5 in turn (one session each); the k-th creation dies.

    Stores before it must be complete with their acked state; at the k-th path there must
    be no store, or a complete one, never a half-created one: opening it either creates a
    fresh store or finds the finished one.
    """
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    paths = [workdir / f"s{i}" for i in range(1, 6)]

    run = run_child(lambda wfd: _create_child(wfd, paths, mode, seed, point, k, geom, pool_pages,
                                              params), safety_s=60.0)
    problems, fired = _classify(run, point, k)
    per_store: dict[int, dict[int, Model]] = {}
    acked: dict[int, int] = {}
    for frame in run.frames:
        if frame[0] == "I":
            per_store.setdefault(frame[3], {0: {}})[frame[1]] = model_from_wire(frame[2])
        elif frame[0] == "A":
            acked[frame[4]] = frame[1]
    attempted = max([f[1] for f in run.frames if f[0] == "S"], default=-1)
    for index, store_path in enumerate(paths):
        if index < attempted or (index == attempted and not fired):
            verdict = judge(store_path, mode, seed, per_store.get(index, {0: {}}), acked.get(index, 0))
            result.figures["state_" + verdict.outcome] += 1
            problems += [f"store s{index + 1}: {p}" for p in verdict.problems]
            continue
        problems += _check_half_created(store_path, mode, geom, pool_pages)
    litter = [p.name for p in workdir.iterdir() if p.name.startswith(".") and ".creating-" in p.name]
    result.figures["create_litter_dirs"] += len(litter)
    if problems:
        save_artifact(result, workdir, f"{point}-{k}")
    shutil.rmtree(workdir, ignore_errors=True)
    return problems, fired


def _create_child(wfd: int, paths: list[Path], mode: str, seed: int, point: str, k: int,
                  geom: pagedkv.Geometry, pool_pages: int, params: Params) -> None:
    code = 0
    try:
        os.environ["PAGEDKV_CRASHPOINT"] = f"{point}:{k}"
        faults._load_crashpoint()
        faults._hits.clear()
        for index, store_path in enumerate(paths):
            send(wfd, ["S", index])
            store = pagedkv.open(store_path, geom, pool_pages, durability=mode)
            ids = iter(range((index + 3) << 20, (index + 4) << 20))

            def intent(number: int, current: Model, index: int = index) -> None:
                send(wfd, ["I", number, model_to_wire(current), index])

            def ack(number: int, index: int = index) -> None:
                send(wfd, ["A", number, 0, 0, index])

            work = Workload(store, {}, 0, seed, random.Random(f"{seed}-create-{index}"), ids.__next__,
                            params, intent, ack)
            work.run(12)
            work.close()
        send(wfd, ["H", faults.hits()])
    except BaseException:  # noqa: BLE001 - report everything, exit without unwinding
        code = _report_failure(wfd)
    finally:
        os._exit(code)


def _check_half_created(path: Path, mode: str, geom: pagedkv.Geometry, pool_pages: int) -> list[str]:
    """After a crash during creation: no store (and opening creates a fresh, empty, working
    one) or a complete store. Never a directory that exists but does not open."""
    problems = []
    existed = path.exists() and any(path.iterdir())
    if not existed:
        try:
            pagedkv.open(path)
            problems.append(f"{path.name}: opening a missing store without geometry did not fail")
        except PagedKVError:
            pass
        if path.exists() and any(path.iterdir()):
            problems.append(f"{path.name}: a failed open left files behind: {sorted(os.listdir(path))}")
    try:
        store = pagedkv.open(path, geom, pool_pages, durability=mode)
    except Exception as exc:  # noqa: BLE001
        return problems + [f"{path.name}: {'existing' if existed else 'fresh'} store does not open: {exc!r}"]
    try:
        if not existed and store.sequences():
            problems.append(f"{path.name}: a freshly created store holds {store.sequences()}")
        problems += [f"{path.name}: check(): {p}" for p in store.check()]
        store.create("probe")
        bits = token_bits(geom, 1, 1, 0, 5)
        store.append("probe", *as_kv(bits, geom))
        store.close()
        store = pagedkv.open(path, durability=mode)
        k, v = store.read("probe")
        if read_matches(geom, 1, SeqState(5, [(0, 1)], 1), 0, 5, k, v):
            problems.append(f"{path.name}: the probe sequence reads back wrong")
    except Exception as exc:  # noqa: BLE001
        problems.append(f"{path.name}: using the store after the crash raised {exc!r}")
    finally:
        store._abandon()
    return problems


# -- T4: simulated power loss -----------------------------------------------------------------


class SimulatedCrash(BaseException):
    """Raised from an I/O seam or the flush recorder: the process 'loses power' right there."""


class PowerLossRig:
    """A durable image of ``pool.bin`` kept by the flush recorder, crash triggers, and the
    builder of the crashed file (each unflushed 4 KiB block kept, reverted or torn at 512 B).
    """

    def __init__(self, pool_path: Path, rng: random.Random) -> None:
        self.pool_path = pool_path
        self.rng = rng
        self.durable = bytearray(pool_path.read_bytes())
        self.flushes = 0
        self.arm_io: int | None = None  # raise at this many I/O seam calls from now on
        self.arm_flush: int | None = None  # raise after this many recorded flushes

    def record(self, pool: PagePool, start: int, end: int) -> None:
        self.durable[start:end] = pool._mm[start:end]
        self.flushes += 1
        if self.arm_flush is not None:
            self.arm_flush -= 1
            if self.arm_flush <= 0:
                self.arm_flush = None
                raise SimulatedCrash("after a flush")

    def inject(self, op: str) -> None:
        if self.arm_io is not None:
            self.arm_io -= 1
            if self.arm_io <= 0:
                self.arm_io = None
                raise SimulatedCrash(f"before I/O op {op}")

    def crash_image(self, figures: Counter[str]) -> None:
        """Rewrite ``pool.bin`` as it could be after the power loss; that becomes durable."""
        current = bytearray(self.pool_path.read_bytes())
        old = self.durable
        for start in range(0, len(current), BLOCK):
            end = start + BLOCK
            if current[start:end] == old[start:end]:
                continue
            figures["blocks_unflushed"] += 1
            choice = self.rng.random()
            if choice < 1 / 3:
                figures["blocks_kept"] += 1
            elif choice < 2 / 3:
                figures["blocks_reverted"] += 1
                current[start:end] = old[start:end]
            else:
                figures["blocks_torn"] += 1
                for sector in range(start, min(end, len(current)), SECTOR):
                    if self.rng.random() < 0.5:
                        current[sector:sector + SECTOR] = old[sector:sector + SECTOR]
        with open(self.pool_path, "r+b") as handle:
            handle.write(current)
        self.durable = current


def power_loss_loop(path: Path, cycles: int, seed: int, *, geom: pagedkv.Geometry = GEOM_POWER,
                    pool_pages: int = 24, params: Params | None = None, name: str = "T4-durable",
                    warmup: tuple[int, int] = (10, 30), ops_after_commit: tuple[int, int] = (0, 6),
                    artifact_root: Path | None = None,
                    progress: Callable[[LoopResult], None] | None = None) -> LoopResult:
    """T4, in-process, durable mode. Each cycle: run the workload; after its first commit arm a
    crash (between operations, before the j-th I/O seam call, or right after the j-th msync);
    ``_abandon()``; build the crashed ``pool.bin`` from the durable image; reopen and verify
    against the last returned commit (that reopened store runs the next cycle).

    LMDB needs no snapshot: in durable mode every write transaction (commit and eviction
    alike) is synced before it returns and a crashed one is aborted unwritten (writemap is
    off), so the environment on disk *is* the latest completed transaction.
    ``figures['flagged_cycles']`` counts crashes after which any violation was found.
    """
    params = params or POWER_PARAMS
    result = LoopResult(name, seed, artifact_root=artifact_root)
    rng = random.Random(seed)
    started = time.monotonic()
    pool_path = path / "pool.bin"
    fresh_store(path, geom, pool_pages)
    committed: Model = {}
    commit_no = 0
    ids = iter(range(1, 1 << 62))
    rig = PowerLossRig(pool_path, rng)
    faults.set_flush_recorder(rig.record)
    try:
        store = pagedkv.open(path, durability="durable")
        for cycle in range(cycles):
            result.cycles += 1
            problems, committed, commit_no = _power_cycle(store, rig, committed, commit_no, seed, rng,
                                                          ids, params, warmup, ops_after_commit, result)
            rig.crash_image(result.figures)
            rig = PowerLossRig(pool_path, rng)
            faults.set_flush_recorder(rig.record)
            try:
                store = pagedkv.open(path, durability="durable")
            except Exception as exc:  # noqa: BLE001 - any failure to reopen is the finding
                problems.append(f"reopen failed: {exc!r}")
                result.figures["reopen_failures"] += 1
                store = None
            else:
                found, lost, wrong = verify_contents(store, committed, seed)
                problems += found
                result.figures["lost_pages"] += lost
                result.figures["wrong_tokens"] += wrong
            if problems:
                result.fail(cycle, problems)
                result.figures["flagged_cycles"] += 1
                if store is not None:
                    store._abandon()
                save_artifact(result, path, f"cycle{cycle}")
                fresh_store(path, geom, pool_pages)
                committed, commit_no = {}, 0
                rig = PowerLossRig(pool_path, rng)
                faults.set_flush_recorder(rig.record)
                store = pagedkv.open(path, durability="durable")
            if progress is not None:
                progress(result)
        store._abandon()
    finally:
        faults.set_injector(None)
        faults.set_flush_recorder(None)
    result.elapsed_s = time.monotonic() - started
    return result


def _power_cycle(store: pagedkv.KVStore, rig: PowerLossRig, committed: Model, commit_no: int,
                 seed: int, rng: random.Random, ids: Any, params: Params,
                 warmup_ops: tuple[int, int], ops_after_commit: tuple[int, int],
                 result: LoopResult) -> tuple[list[str], Model, int]:
    """Run the workload until the armed crash; return (problems, last returned commit)."""
    warm_commit = commit_no
    state: dict[str, Any] = {"committed": committed, "pending": None, "number": commit_no}

    def intent(number: int, current: Model) -> None:
        state["pending"] = copy_model(current)

    def ack(number: int) -> None:
        state["committed"], state["number"] = state["pending"], number
        result.figures["commits"] += 1

    work = Workload(store, copy_model(committed), commit_no, seed, rng, ids.__next__, params,
                    intent, ack)
    kind = rng.choice(("between", "io", "flush", "between", "io", "flush", "close"))
    result.figures["armed_" + kind] += 1
    armed_at = None
    warmup = rng.randint(*warmup_ops)  # the crash is armed at the first commit after these ops
    more_ops = rng.randint(*ops_after_commit)
    problems: list[str] = []
    faults.set_injector(rig.inject)
    try:
        for op_index in range(400):
            if op_index == warmup:
                warm_commit = work.commit_no
            if armed_at is None and op_index > warmup and work.commit_no > warm_commit:
                armed_at = op_index
                if kind == "io":
                    rig.arm_io = rng.randint(1, 6)
                elif kind == "flush":
                    rig.arm_flush = rng.randint(1, 3)
            grace = 8 if kind in ("io", "flush") else 0  # ops for an armed seam to fire in
            if armed_at is not None and op_index >= armed_at + more_ops + grace:
                if kind == "close":  # close() = commit + full sync: power is lost after it
                    work.close()
                break
            work.one()
        result.figures["crash_after_close" if kind == "close" else "crash_between_ops"] += 1
    except SimulatedCrash:
        result.figures["crash_inside_op"] += 1
    except pagedkv.StoreClosed as exc:
        if "write-behind" not in str(exc):  # the crash fired in the background evictor
            problems.append(f"workload raised {exc!r}")
        result.figures["crash_inside_op"] += 1
    except Exception as exc:  # noqa: BLE001 - a failure of the live process is a finding too
        problems.append(f"workload raised {exc!r}")
    finally:
        faults.set_injector(None)
        faults.set_flush_recorder(None)
    store._abandon()
    result.figures["flushes"] += rig.flushes
    return problems, state["committed"], state["number"]


def noflush_mutation() -> Callable[[], None]:
    """Mutation: ``PagePool.flush_slots`` does nothing (write-ahead order broken). Returns undo."""
    original = PagePool.flush_slots
    PagePool.flush_slots = lambda self, slots: None  # type: ignore[method-assign]

    def undo() -> None:
        PagePool.flush_slots = original  # type: ignore[method-assign]

    return undo
