"""Prefix reuse: chained content hashes of full pages and the index that finds them.

A full page whose token ids are known gets ``hash = xxh3_128(parent hash | salt |
token ids)``, where the parent is the previous page of its sequence and the salt
binds the store and the model fingerprint. The hash is deterministic across
processes, machines and Python versions, so the index rebuilt on reopen finds
the same pages. A hit is confirmed by comparing token ids and the chain class of
the page it follows, so a hash collision can never serve another prompt's KV.
"""

from __future__ import annotations

from itertools import accumulate, chain
from typing import Any, Callable, Mapping

import numpy as np
import xxhash

from ..errors import PagedKVError
from .rowindex import RowIndex
from .directory import HAS_TOKENS, HASHED
from .tokens import TOKEN_DTYPE

ROOT = bytes(16)  # parent hash of a sequence's first page
# (token ids, locally matched page rows, most pages) -> those rows and the cache pages placed after them
Extend = Callable[[np.ndarray, list[int], int], list[int]]


def make_salt(store_salt: bytes, model: str | None) -> bytes:
    """The per-store, per-model salt mixed into every page hash."""
    return xxhash.xxh3_128_digest(store_salt + b"\x00model\x00" + (model or "").encode("utf-8"))


def chain_hash(parent: bytes, salt: bytes, token_ids: np.ndarray) -> bytes:
    """128-bit hash of a full page from its parent's hash and its token ids."""
    # One call over the joined bytes: a page's 64 bytes of ids cost less than the streaming
    # hasher's setup (xxh3 streams, so the digest is the same).
    return xxhash.xxh3_128_digest(parent + salt + np.ascontiguousarray(token_ids, TOKEN_DTYPE).tobytes())


def as_token_ids(tokens: Any, count: int | None = None) -> np.ndarray:
    """Validate token ids (a 1-D sequence of ints in [0, 2**32)) and return them as uint32."""
    try:
        arr = np.asarray(tokens)
    except Exception:
        raise PagedKVError("tokens must be a 1-D sequence of ints") from None
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise PagedKVError(f"tokens must be a 1-D sequence of ints, got {arr.dtype} {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 1 << 32):
        raise PagedKVError("token ids must be in [0, 2**32)")
    if count is not None and len(arr) != count:
        raise PagedKVError(f"{len(arr)} token ids given for {count} tokens")
    return arr.astype(TOKEN_DTYPE)


def step_token_ids(tokens: Mapping[Any, Any], counts: Mapping[Any, int],
                   all_one: bool = False) -> tuple[list[int], np.ndarray]:
    """Validate the token ids of many sequences at once (``as_token_ids``'s rules).

    ``tokens`` maps sequences to their new tokens' ids, ``counts`` says how many
    each must have (``all_one``: every count is 1). Returns how many each has and all of them concatenated in
    ``tokens``' order (uint32; ``split_ids`` cuts them per sequence). One numpy
    pass checks them all: a decode step gives one id for each of hundreds of
    sequences.
    """
    values = list(tokens.values())
    try:
        lengths = list(map(len, values))
        if lengths and lengths.count(1) == len(lengths) and set(map(type, values)) == {list}:
            # A decode step's lists of one id each: numpy reads a flat list of ints 2.5x
            # as fast as it works out the shape of a list of lists.
            flat = np.array([value[0] for value in values])
        elif lengths and lengths.count(lengths[0]) == len(lengths):  # one C pass
            grid = np.array(values) if lengths[0] else np.empty((len(values), 0), np.int64)
            flat = grid.reshape(-1) if grid.ndim == 2 else grid  # deeper: refused just below
        else:
            flat = np.array(list(chain.from_iterable(values)))
    except (TypeError, ValueError):
        raise PagedKVError("tokens must be a 1-D sequence of ints for each sequence") from None
    if flat.ndim != 1:
        raise PagedKVError("tokens must be 1-D sequences of ints (nested sequences given)")
    if flat.size and flat.dtype.kind not in "iu":
        raise PagedKVError(f"tokens must be 1-D sequences of ints, got {flat.dtype} values")
    if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= 1 << 32):
        raise PagedKVError("token ids must be in [0, 2**32)")
    if lengths.count(1) == len(lengths) and all_one:  # a decode step: one id for one token each
        return lengths, flat.astype(TOKEN_DTYPE)
    wanted = [int(counts[key]) for key in tokens]
    if lengths != wanted:
        got, want = next((got, want) for got, want in zip(lengths, wanted) if got != want)
        raise PagedKVError(f"{got} token ids given for {want} tokens")
    flat = flat.astype(TOKEN_DTYPE)
    return lengths, flat


def split_ids(keys: list[Any], lengths: list[int], flat: np.ndarray) -> dict[Any, np.ndarray]:
    """``step_token_ids``' ids per sequence: views of ``flat`` cut at ``lengths``."""
    ends = list(accumulate(lengths))
    return {key: flat[end - size:end] for key, end, size in zip(keys, ends, lengths)}


class PrefixIndex:
    """hash -> page row for every live full page that can be shared.

    The rows sit in a ``RowIndex`` keyed by the directory's own ``hash`` column,
    so an indexed page costs a few bytes of table rather than a dict entry.
    """

    def __init__(self, salt: bytes, page_size: int) -> None:
        self.salt = salt
        self.page_size = page_size
        self.index = RowIndex()

    def match(self, token_ids: np.ndarray, max_pages: int, mgr: Any) -> list[int]:
        """Page rows of the longest cached run of full pages that starts ``token_ids``.

        Several pages may hold one position of a prompt (it was prefilled twice);
        each has a chain class, the uid of the first page sealed with that
        content after that prefix. A hit must hold the same token ids *and* follow
        a class matched at the position before (its recorded parent class), so
        even a collision of the chained hash never serves a page computed after
        another prefix, and a page computed after a duplicate is found as well.
        Among equal pages a resident one is preferred; a page known to fail its
        checksum is never matched, so the prefix is computed (and saved) anew.
        """
        found: list[int] = []
        parent, classes = ROOT, {0}
        size = self.page_size
        for index in range(max_pages):
            chunk = token_ids[index * size:(index + 1) * size]
            digest = chain_hash(parent, self.salt, chunk)
            pick, reached = -1, set()
            for pid in self.index.get(digest, mgr.hash):
                if int(mgr.parent[pid]) not in classes or mgr.corrupt[pid]:
                    continue  # another prefix, or a page that failed its checksum: never share it
                chain = int(mgr.chain[pid])
                if chain not in reached:  # pages of one class hold the same ids: compare once
                    stored = mgr.page_tokens_of(pid)
                    if stored is None or not np.array_equal(stored, chunk):
                        continue  # a collision (or lost token ids): never share
                    reached.add(chain)
                if pick < 0 or (mgr.slot[pick] < 0 <= mgr.slot[pid]):
                    pick = pid
            if pick < 0:
                break
            found.append(pick)
            parent, classes = digest, reached
        return found

    def class_of(self, digest: bytes, parent_class: int, token_ids: np.ndarray, mgr: Any) -> int:
        """The chain class of an indexed page holding ``token_ids`` after ``parent_class``, or 0."""
        for pid in self.index.get(digest, mgr.hash):
            if int(mgr.parent[pid]) == parent_class:
                stored = mgr.page_tokens_of(pid)
                if stored is not None and np.array_equal(stored, token_ids):
                    return int(mgr.chain[pid])
        return 0

    def insert(self, digest: bytes, pid: int, parent_class: int, token_ids: np.ndarray, mgr: Any) -> int:
        """Index a page just hashed (``mgr.hash[pid]`` is ``digest``) and return ``class_of`` for it:
        one probe of the table for both."""
        for other in self.index.insert(digest, pid, mgr.hash):
            if int(mgr.parent[other]) == parent_class:
                stored = mgr.page_tokens_of(other)
                if stored is not None and np.array_equal(stored, token_ids):
                    return int(mgr.chain[other])
        return 0

    def equal_page(self, pid: int, mgr: Any) -> int:
        """Another indexed page of ``pid``'s chain class (same prefix, same ids), or -1.

        A page known to fail its checksum serves nothing, so it is never the other.
        """
        chain = int(mgr.chain[pid])
        for other in self.index.get(bytes(mgr.hash[pid]), mgr.hash):
            if other != pid and int(mgr.chain[other]) == chain and not mgr.corrupt[other]:
                return other
        return -1

    def add(self, digest: bytes, pid: int, hashes: np.ndarray) -> bool:
        """Index ``pid`` (``hashes[pid]`` is ``digest``) unless it is indexed already."""
        return self.index.add(digest, pid, hashes)

    def add_many(self, pids: np.ndarray, hashes: np.ndarray) -> None:
        """``add`` for every page of ``pids`` in order (a reopen rebuilding the index)."""
        self.index.add_many(pids, hashes)

    def discard(self, digest: bytes, pid: int) -> None:
        """Forget ``digest`` if it points at ``pid``."""
        self.index.discard(digest, pid)

    def holds(self, digest: bytes, pid: int) -> bool:
        """Whether ``pid`` is indexed under ``digest``."""
        return self.index.holds(digest, pid)

    def pages(self) -> np.ndarray:
        """Every indexed page row."""
        return self.index.rows()


def share_prefix(mgr: Any, seq: Any, token_ids: np.ndarray, extend: Extend | None = None) -> None:
    """Start an empty ``seq`` with the longest cached run of full pages of ``token_ids``.

    At most ``len(token_ids) - 1`` tokens are reused, so the engine always has a
    token left to compute. The pages are shared (refcount up, no copy).
    ``extend`` (the remote tier's) may add verified cache pages after the local match.
    """
    page_size = mgr.geom.page_size
    pids = match_prefix(mgr, token_ids, max(len(token_ids) - 1, 0) // page_size, extend)
    for pid in pids:
        seq.push(pid)
    mgr.incref(np.asarray(pids, np.int64))
    seq.length = len(pids) * page_size
    mgr.stats.add("prefix_queries")
    mgr.stats.add("prefix_query_tokens", len(token_ids))
    mgr.stats.add("prefix_hit_tokens", seq.length)
    mgr.stats.add("prefix_hit_pages", len(pids))


def match_prefix(mgr: Any, token_ids: np.ndarray, max_pages: int, extend: Extend | None = None) -> list[int]:
    """The local match of ``token_ids`` (``PrefixIndex.match``), then what ``extend`` adds after it."""
    pids = mgr.prefix.match(token_ids, max_pages, mgr)
    return extend(token_ids, pids, max_pages) if extend is not None and len(pids) < max_pages else pids


def write_tokens(mgr: Any, pid: int, offset: int, token_ids: np.ndarray | None) -> None:
    """Record the ids of tokens ``[offset, offset + len)`` of a page (None: ids unknown)."""
    known = offset == 0 or mgr.flags[pid] & HAS_TOKENS
    previous = mgr.page_tokens_of(pid) if offset and known else None
    if token_ids is None or not known or (offset and (previous is None or len(previous) < offset)):
        mgr.forget_ids(pid)
        return
    if offset and pid in mgr.page_tokens:
        mgr.page_tokens.write(pid, offset, token_ids)
    else:  # the first ids of a page, or those of a committed partial page, loaded just above
        mgr.page_tokens.set(pid, token_ids if previous is None else np.concatenate([previous[:offset], token_ids]))
    mgr.know_ids(pid)


def seal(mgr: Any, pid: int, parent: int) -> None:
    """Give a page that just filled its chained hash, if its ids and its parent's hash are known.

    ``parent`` is the previous page of the sequence, or -1 for the first page.
    A page equal to one indexed already (same parent class, same ids: the same
    prompt prefilled again) joins that page's chain class, so the pages computed
    after either are found from both; otherwise it starts a class of its own.
    """
    flags: int = mgr.flags.item(pid)
    if flags & HASHED or not flags & HAS_TOKENS or mgr.fill.item(pid) != mgr.geom.page_size:
        return
    if parent >= 0 and not mgr.flags.item(parent) & HASHED:
        return
    token_ids = mgr.page_tokens_of(pid)
    if token_ids is None:
        return
    mgr.track_hashes()
    # Scalars through item(): a numpy scalar and its conversion cost several times as much.
    digest = chain_hash(mgr.hash.item(parent) if parent >= 0 else ROOT, mgr.prefix.salt, token_ids)
    mgr.hash_page(pid, digest, mgr.chain.item(parent) if parent >= 0 else 0, token_ids)
    if mgr.on_seal is not None:
        mgr.on_seal(pid, parent)
