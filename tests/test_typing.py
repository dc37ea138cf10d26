"""Typing of the public API: ``stats()`` as ``pagedkv.StoreStats``, the exports, and mypy --strict.

The mypy test type-checks a user's script against pagedkv's annotations (pagedkv's own
modules are followed silently: the script's errors are what count); it is skipped
where mypy is not installed (``pip install mypy``).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import pytest

import pagedkv
import pagedkv.errors
from pagedkv.storage.codecs import CODECS
from pagedkv.stats import COUNTERS

from tests.kits.model import busy_store


def test_stats_values_have_their_declared_types(stores, seed) -> None:
    hints = typing.get_type_hints(pagedkv.StoreStats)
    st = busy_store(stores, seed, fork=True).stats()
    assert set(st) == set(hints), (f"undeclared: {sorted(set(st) - set(hints))}, "
                                   f"missing: {sorted(set(hints) - set(st))}")
    wrong = {key: (type(value).__name__, hints[key].__name__) for key, value in st.items()
             if type(value) is not hints[key]}
    assert not wrong, wrong  # exactly int or float: no numpy scalars, no ints as floats
    assert st["evictions"] > 0 and st["restores"] > 0 and st["restore_ms_p50"] > 0.0
    assert st["prefix_hit_rate"] > 0.0


def test_stats_declares_every_counter_and_codec() -> None:
    """A new counter or codec must be declared too (the TypedDict is written out by hand)."""
    hints = typing.get_type_hints(pagedkv.StoreStats)
    for name in COUNTERS:
        assert hints.get(name) is int, name
    for codec in CODECS:
        assert hints[f"codec_{codec}_pages"] is int and hints[f"codec_{codec}_bytes"] is int
        assert hints[f"codec_{codec}_ratio"] is float


def test_every_error_class_and_the_public_types_are_exported() -> None:
    errors = [cls for _, cls in inspect.getmembers(pagedkv.errors, inspect.isclass)
              if issubclass(cls, pagedkv.errors.PagedKVError)]
    assert len(errors) >= 15
    for cls in errors:
        assert cls.__name__ in pagedkv.__all__, cls.__name__
        assert getattr(pagedkv, cls.__name__) is cls
    for name in ("Prefetch", "StoreStats", "CacheDrop", "KVStore", "Step", "Geometry", "open"):
        assert name in pagedkv.__all__, name
        assert hasattr(pagedkv, name), name
    from pagedkv.background.prefetch import Prefetch
    from pagedkv.stats import CacheDrop, StoreStats

    assert (pagedkv.Prefetch, pagedkv.CacheDrop, pagedkv.StoreStats) == (Prefetch, CacheDrop, StoreStats)
    assert len(set(pagedkv.__all__)) == len(pagedkv.__all__)
    for name in pagedkv.__all__:
        assert hasattr(pagedkv, name), name


USER_SCRIPT = '''
    from __future__ import annotations

    from typing import assert_type

    import numpy as np

    import pagedkv


    def serve(path: str) -> float:
        geom = pagedkv.Geometry(layers=2, kv_heads=2, head_dim=4, page_size=4, dtype="float32")
        try:
            store = pagedkv.open(path, geom, 8, lock_timeout=5.0)
        except pagedkv.StoreLocked as exc:
            print(f"busy: {exc}")
            return 0.0
        except (pagedkv.StoreCorrupt, pagedkv.FormatVersionError, pagedkv.GeometryMismatch):
            raise
        with store:
            store.create("a")
            with store.step({"a": 3}) as step:
                slots: np.ndarray = step.slot_mapping
                assert_type(step, pagedkv.Step)
                print(slots.shape, step.block_tables.shape)
            store.truncate("a", 1)
            by_int: dict[int, int] = {7: 2}
            store.create(7)
            if store.can_step(by_int):
                with store.step(by_int, tokens={7: [1, 2]}):
                    pass
            stats = store.stats()
            assert_type(stats, pagedkv.StoreStats)
            assert_type(stats["evictions"], int)
            assert_type(stats["spill_bytes"], int)
            assert_type(stats["restore_ms_p99"], float)
            assert_type(stats["prefix_hit_rate"], float)
            total: int = stats["pages"] + stats["cached_pages"]
            dropped = store.clear_cache(max_bytes=1 << 20)
            assert_type(dropped, pagedkv.CacheDrop)
            assert_type(dropped["bytes"], int)
            handle = store.prefetch(["a"])
            assert_type(handle, pagedkv.Prefetch)
            handle.wait(1.0)
            try:
                store.read("missing")
            except pagedkv.SequenceNotFound:
                pass
            except pagedkv.PagedKVError as exc:
                print(type(exc).__name__)
            print(total)
            return stats["restore_ms_p50"] + stats["codec_raw_ratio"]
'''


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_mypy_strict_accepts_a_user_script(tmp_path: Path) -> None:
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (pip install mypy)")
    script = tmp_path / "user.py"
    script.write_text(textwrap.dedent(USER_SCRIPT))
    root = Path(pagedkv.__file__).resolve().parent.parent
    env = dict(os.environ, MYPYPATH=str(root))
    out = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent",
                          "--cache-dir", str(tmp_path / "cache"), "--python-version", "3.11", str(script)],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=540)
    assert out.returncode == 0, out.stdout + out.stderr
