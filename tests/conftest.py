"""Fixtures of the pagedkv test suite; the machinery they are made of lives in tests/kits/."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

import pagedkv
from tests.kits.content import get_seed
from tests.kits.files import tmpfs_dir
from tests.kits.prefix import PrefixStores
from tests.kits.store import Stores


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """A printed, replayable seed (``PAGEDKV_SEED`` overrides it)."""
    return get_seed(request.node.nodeid)


def _closing(factory: Stores) -> Iterator[Stores]:
    yield factory
    factory.close_all()


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[Stores]:
    """A factory of stores under ``tmp_path`` (tiny geometry, 8 slots); closes them all at the end."""
    yield from _closing(Stores(tmp_path))


@pytest.fixture
def store(stores: Stores) -> pagedkv.KVStore:
    """A fresh store with the tiny geometry and 8 pool slots."""
    return stores.open()


@pytest.fixture
def pstores(tmp_path: Path) -> Iterator[Stores]:
    """A factory of prefix-caching stores (8 tokens a page, 16 slots); closes them all at the end."""
    yield from _closing(PrefixStores(tmp_path))


@pytest.fixture
def fast_tmp(tmp_path: Path) -> Iterator[Path]:
    """A scratch directory on tmpfs when there is one (fsync is free there), else ``tmp_path``.

    For loops that create hundreds of stores: the fault semantics under test do not depend
    on the filesystem, only their cost does.
    """
    path = tmpfs_dir()
    if path is None:
        yield tmp_path
        return
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
