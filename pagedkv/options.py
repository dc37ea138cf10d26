"""The store handle's options, and the decorator that makes each operation atomic."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import lmdb

from .errors import StoreFull, StoreIOError
from .geometry import Geometry
from .storage.schema import COUNTER_KEYS, DURABILITY
from .storage.spill import lmdb_error

if TYPE_CHECKING:
    from .store import KVStore

F = TypeVar("F", bound=Callable[..., Any])
# Counters the commit adds to the persistent state record (cumulative over sessions).
PERSISTED_COUNTERS = COUNTER_KEYS


def _op(write: bool) -> Callable[[F], F]:
    """Serialise a public operation on the store lock and check the handle is usable."""

    def wrap(fn: F) -> F:
        def inner(self: KVStore, *args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self._usable(write)
                try:
                    return fn(self, *args, **kwargs)
                except lmdb.Error as exc:
                    error = lmdb_error(exc, fn.__name__)
                    if not self.readonly:
                        self._poisoned = str(error)
                    raise error from None
                except (StoreIOError, StoreFull) as exc:
                    # Reads evict and restore too: any failed I/O leaves memory ahead of
                    # (or behind) disk, so the handle stops; the last commit is intact.
                    if not self.readonly and not getattr(exc, "recoverable", False):
                        self._poisoned = str(exc)
                    raise

        inner.__name__, inner.__doc__, inner.__wrapped__ = fn.__name__, fn.__doc__, fn  # type: ignore
        return inner  # type: ignore[return-value]

    return wrap


@dataclass
class StoreOptions:
    """How a store is opened (see ``pagedkv.open`` for each field's meaning)."""

    geometry: Geometry | None = None
    pool_pages: int | None = None
    durability: str = "durable"
    readonly: bool = False
    evict_batch: int = 64
    map_size: int | None = None
    model: str | None = None
    allow_model_change: bool = False
    spill_limit: int | None = None
    spill_codec: str = "raw"
    write_behind: bool = False
    remote: Any = None  # a pagedkv.RemoteConfig, or None: no remote tier
