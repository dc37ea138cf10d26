"""Fixtures of the pagedkv test suite; the helpers live in support.py."""

from __future__ import annotations

from pathlib import Path

import pytest

import pagedkv
from support import GEOM, Stores, get_seed


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """A printed, replayable seed (``PAGEDKV_SEED`` overrides it)."""
    return get_seed(request.node.nodeid)


@pytest.fixture
def stores(tmp_path: Path):
    factory = Stores(tmp_path)
    yield factory
    factory.close_all()


@pytest.fixture
def store(stores: Stores) -> pagedkv.KVStore:
    """A fresh store with the tiny geometry and 8 pool slots."""
    return stores.open()
