"""The connector's settings: ``kv_connector_extra_config`` parsed, defaults taken from vLLM.

``path`` is the only required key. The others map to ``pagedkv.open`` options or
tune the connector; an unknown key is an error naming the known ones, so a typo
never silently falls back to a default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from ...errors import PagedKVError
from ...geometry import Geometry

__all__ = ["ConnectorConfig", "OPEN_KEYS", "KNOWN_KEYS", "geometry_of", "LAYOUTS"]

# Keys passed straight to pagedkv.open, with the type each must have.
OPEN_KEYS: dict[str, tuple[type, ...]] = {
    "pool_pages": (int,),
    "spill_limit_bytes": (int,),
    "durability": (str,),
    "spill_codec": (str,),
    "write_behind": (bool,),
    "evict_batch": (int,),
    "map_size": (int,),
    "allow_remote": (bool,),
    "allow_model_change": (bool,),
    "remote": (str,),  # a shared remote tier: redis://, rediss://, unix://, redis+cluster:// (redis extra)
}
# Keys of the connector itself.
OWN_KEYS: dict[str, tuple[type, ...]] = {
    "path": (str,),
    "model": (str,),
    "weights_fingerprint": (str,),
    "pool_bytes": (int,),
    "save_queue_bytes": (int,),
    "kv_layout": (str,),
}
KNOWN_KEYS = frozenset(OPEN_KEYS) | frozenset(OWN_KEYS)
WEIGHTS_MODES = ("sample", "full", "none")
LAYOUTS = ("auto", "cpu", "standard", "kv_first")
_TORCH_TO_STORE = {"torch.float16": "float16", "torch.bfloat16": "bfloat16", "torch.float32": "float32"}


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """Validated ``kv_connector_extra_config`` of a ``PagedKVConnector``."""

    path: str  # the store directory (created on first use)
    open_options: tuple[tuple[str, Any], ...] = ()  # extra pagedkv.open keywords, as given
    model: str | None = None  # a fingerprint to use instead of the derived one
    weights_fingerprint: str = "sample"  # how weight files enter the fingerprint: sample, full, none
    pool_bytes: int = 1 << 30  # pool size when creating the store and pool_pages is not given
    save_queue_bytes: int = 256 << 20  # staged page bytes waiting for the writer before saves drop
    kv_layout: str = "auto"  # how a layer's vLLM cache holds K/V (see layouts.py)

    def __post_init__(self) -> None:
        if not self.path:
            raise PagedKVError("kv_connector_extra_config needs 'path': the pagedkv store directory")
        if self.weights_fingerprint not in WEIGHTS_MODES:
            raise PagedKVError(f"weights_fingerprint must be one of {WEIGHTS_MODES}, "
                               f"got {self.weights_fingerprint!r}")
        if self.kv_layout not in LAYOUTS:
            raise PagedKVError(f"kv_layout must be one of {LAYOUTS}, got {self.kv_layout!r}")
        for name in ("pool_bytes", "save_queue_bytes"):
            if getattr(self, name) < 1:
                raise PagedKVError(f"{name} must be a positive int")

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """Parse ``kv_connector_extra_config``; unknown keys and wrong types are ``PagedKVError``."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - KNOWN_KEYS)
        if unknown:
            raise PagedKVError(f"unknown kv_connector_extra_config key(s) {unknown} for PagedKVConnector; "
                               f"known keys: {sorted(KNOWN_KEYS)}")
        for key, value in extra.items():
            kinds = OPEN_KEYS.get(key) or OWN_KEYS[key]
            if value is None and key != "path":
                continue
            if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
                raise PagedKVError(f"kv_connector_extra_config[{key!r}] must be "
                                   f"{' or '.join(k.__name__ for k in kinds)}, got {value!r}")
        if "path" not in extra:
            raise PagedKVError("kv_connector_extra_config needs 'path': the pagedkv store directory")
        own = {key: extra[key] for key in OWN_KEYS if key in extra and extra[key] is not None}
        own["path"] = os.path.abspath(os.path.expanduser(str(extra["path"])))
        opts = tuple(sorted((key, extra[key]) for key in OPEN_KEYS if extra.get(key) is not None))
        return cls(open_options=opts, **own)

    def open_kwargs(self, geometry: Geometry, creating: bool = True) -> dict[str, Any]:
        """Keywords for ``pagedkv.open`` besides path, geometry and model.

        ``pool_pages`` defaults to ``pool_bytes`` worth of pages when the store is
        created; an existing store keeps its own unless the key is given.
        """
        kwargs = dict(self.open_options)
        if creating:
            kwargs.setdefault("pool_pages", max(16, self.pool_bytes // geometry.page_nbytes))
        return kwargs


def geometry_of(kv_cache_config: Any) -> tuple[Geometry, list[str]]:
    """The store geometry of vLLM's KV cache, and the attention layer names in layer order.

    Only one KV cache group of full attention is supported (the plain decoder
    models pagedkv's pages describe); anything else is a clear error.
    """
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) != 1:
        raise PagedKVError(f"PagedKVConnector needs one KV cache group of full attention; "
                           f"this model has {len(groups)}")
    spec = groups[0].kv_cache_spec
    if type(spec).__name__ != "FullAttentionSpec" or getattr(spec, "sliding_window", None):
        raise PagedKVError(f"PagedKVConnector supports full attention only, not {type(spec).__name__}")
    if getattr(spec, "head_size_v", spec.head_size) != spec.head_size:
        raise PagedKVError("PagedKVConnector needs K and V of one head size")
    dtype = _TORCH_TO_STORE.get(str(spec.dtype))
    if dtype is None:
        raise PagedKVError(f"pagedkv stores float16, bfloat16 or float32 KV, not {spec.dtype} "
                           "(kv_cache_dtype must be 'auto' with such a model dtype)")
    names = sorted(groups[0].layer_names, key=_layer_order)
    geometry = Geometry(layers=len(names), kv_heads=int(spec.num_kv_heads), head_dim=int(spec.head_size),
                        page_size=int(spec.block_size), dtype=dtype)
    return geometry, names


def _layer_order(name: str) -> tuple[int, str]:
    """Sort key of an attention layer name: its layer index (``model.layers.7.self_attn.attn``)."""
    numbers = [int(part) for part in name.split(".") if part.isdigit()]
    return (numbers[0] if numbers else -1, name)
