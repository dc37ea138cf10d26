"""Shared pieces of the benchmark suite: the run context, rows, targets and A/B interleaving.

Machines here are shared and noisy, so a figure is only meaningful next to its
reference measured in the same process at the same moment: ``interleave`` runs
A B A B ... and a row's ratio is the median of the per-pair ratios.
"""

from __future__ import annotations

import os
import random
import shutil
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import lmdb
import numpy as np

from ..geometry import Geometry

GIB = float(1 << 30)
ROW_KEYS = ("scenario", "name", "pagedkv", "reference", "unit", "ratio", "target", "meets",
            "params", "notes", "metrics")


@dataclass
class Ctx:
    """What every scenario gets: where to put files, how big to go, randomness, progress."""

    workdir: str
    quick: bool
    seed: int
    progress: Callable[[str], None] | None = None
    _count: int = field(default=0, repr=False)

    def rng(self, salt: str) -> random.Random:
        """A reproducible stream per purpose, so adding a scenario does not shift another's."""
        return random.Random(f"{self.seed}:{salt}")

    def np_rng(self, salt: str) -> np.random.Generator:
        """A numpy generator seeded like ``rng``."""
        return np.random.default_rng(self.rng(salt).getrandbits(64))

    def path(self, name: str) -> str:
        """A fresh path inside the work directory (never reused within a run)."""
        self._count += 1
        return os.path.join(self.workdir, f"{self._count:03d}-{name}")

    def say(self, message: str) -> None:
        """Report progress (to stderr in the CLI); silent when no callback is set."""
        if self.progress is not None:
            self.progress(message)


@dataclass(frozen=True)
class Target:
    """A target: ``op`` applied to the ratio (or to the pagedkv figure itself), or none."""

    text: str
    op: str | None = None  # ">=" or "<="
    value: float | None = None
    on: str = "ratio"  # "ratio" or "pagedkv"

    def meets(self, figure: float | None, ratio: float | None) -> bool | None:
        """Whether the row meets the target; None when there is nothing to check."""
        value = ratio if self.on == "ratio" else figure
        if self.op is None or self.value is None or value is None:
            return None
        return value >= self.value if self.op == ">=" else value <= self.value


INFO = Target("info (no target)")


def make_row(scenario: str, name: str, pagedkv: float | None, reference: float | None, unit: str,
             ratio: float | None, target: Target, params: dict[str, Any], notes: str = "",
             metrics: dict[str, Any] | None = None) -> dict[str, Any]:
    """One result row with the stable keys of ``ROW_KEYS`` (JSON-ready: floats, str, None, bool)."""
    return {
        "scenario": scenario, "name": name, "pagedkv": _num(pagedkv), "reference": _num(reference),
        "unit": unit, "ratio": _num(ratio), "target": target.text,
        "meets": target.meets(pagedkv, ratio), "params": params, "notes": notes,
        "metrics": {key: _num(value) if isinstance(value, float) else value
                    for key, value in (metrics or {}).items()},
    }


def _num(value: float | None) -> float | None:
    return None if value is None else float(value)


@dataclass
class Pairs:
    """Interleaved measurements: ``a[i]``, ``b[i]`` (and ``extra[name][i]``) were taken back to back."""

    a: list[float]
    b: list[float]
    extra: dict[str, list[float]] = field(default_factory=dict)

    @property
    def a_median(self) -> float:
        return statistics.median(self.a)

    @property
    def b_median(self) -> float:
        return statistics.median(self.b)

    @property
    def ratio(self) -> float:
        """Median of the per-pair ratios a/b: robust to a slow moment hitting one pair."""
        return self.ratio_to(self.b)

    def ratio_to(self, other: list[float]) -> float:
        """Median of the per-round ratios of ``a`` to another series of the same rounds."""
        return statistics.median(x / y for x, y in zip(self.a, other) if y)

    def ratio_to_b(self, series: list[float]) -> float:
        """Median of the per-round ratios of another series of the same rounds to ``b``."""
        return statistics.median(x / y for x, y in zip(series, self.b) if y)


def interleave(a: Callable[[], float], b: Callable[[], float], pairs: int,
               extra: dict[str, Callable[[], float]] | None = None) -> Pairs:
    """Run ``a`` then ``b`` (then each ``extra``), ``pairs`` times; each returns its figure."""
    out = Pairs([], [], {name: [] for name in extra or {}})
    for _ in range(pairs):
        out.a.append(a())
        out.b.append(b())
        for name, fn in (extra or {}).items():
            out.extra[name].append(fn())
    return out


def timed(fn: Callable[[], Any]) -> float:
    """Seconds one call of ``fn`` takes."""
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def close_all(stores: Iterable[Any], *paths: str) -> None:
    """Close every store of a scenario, then ``remove`` its paths."""
    for store in stores:
        store.close()
    remove(*paths)


def remove(*paths: str) -> None:
    """Delete files and directories between scenarios, freeing disk and page cache (a full B1 writes 8 GiB)."""
    for path in paths:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.exists(path):
            os.unlink(path)


def geom_params(geom: Geometry) -> dict[str, Any]:
    """A geometry as row params, with its page size in bytes."""
    return {**geom.to_dict(), "page_nbytes": geom.page_nbytes}


def open_lmdb(path: str, sync: bool, map_size: int = 1 << 32) -> lmdb.Environment:
    """A bare LMDB environment with the options pagedkv's spill store uses."""
    os.makedirs(path, exist_ok=True)
    return lmdb.open(path, map_size=map_size, subdir=True, sync=sync, metasync=sync,
                     writemap=False, readahead=False, max_dbs=2)


def kv_block(geom: Geometry, tokens: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Random K and V of ``tokens`` tokens, each ``(layers, tokens, kv_heads, head_dim)``."""
    shape = (geom.layers, tokens, geom.kv_heads, geom.head_dim)
    raw = rng.integers(0, 1 << 14, size=(2, *shape), dtype=np.uint16)  # finite float16 bits
    data = raw.view(np.float16).astype(geom.np_dtype)
    return data[0], data[1]


def as_pages(geom: Geometry, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """K/V of whole pages laid out as pagedkv pages: ``(pages, layers, 2, page_size, heads, dim)``."""
    tokens = k.shape[1]
    pages = -(-tokens // geom.page_size)
    out = np.zeros((pages, *geom.page_shape), geom.np_dtype)
    for index in range(pages):
        lo, hi = index * geom.page_size, min(tokens, (index + 1) * geom.page_size)
        out[index, :, 0, : hi - lo] = k[:, lo:hi]
        out[index, :, 1, : hi - lo] = v[:, lo:hi]
    return out
