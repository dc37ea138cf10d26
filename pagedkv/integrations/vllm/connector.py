"""``PagedKVConnector``: vLLM's ``KVConnectorBase_V1`` over a pagedkv store.

vLLM makes one instance per role: the scheduler's (``scheduler.py``: lookups and
the per-step plan) and each worker's (``worker.py``: the store's writer, loads
before the forward pass, saves after it). This class only routes vLLM's calls to
the side that runs in this instance.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)

from ...errors import PagedKVError
from .config import ConnectorConfig, geometry_of
from .identity import model_fingerprint
from .layouts import default_layout
from .meta import PagedKVStats, StepPlan
from .scheduler import SchedulerSide
from .worker import WorkerSide

__all__ = ["PagedKVConnector"]


class PagedKVConnector(KVConnectorBase_V1):
    """pagedkv as vLLM's persistent KV tier: prompts' full blocks are restored instead of prefilled.

    Load it out of tree with ``KVTransferConfig(kv_connector="PagedKVConnector",
    kv_connector_module_path="pagedkv.integrations.vllm", kv_role="kv_both",
    kv_connector_extra_config={"path": ...})``; see ``config.py`` for the other keys.
    ``kv_role`` "kv_both" loads and saves, "kv_consumer" only loads, "kv_producer"
    only saves. A store that cannot be opened or read, or that holds another
    model's KV, disables the connector (logged, counted): vLLM then computes every token.
    """

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self.config = ConnectorConfig.from_extra(getattr(transfer, "kv_connector_extra_config", None))
        parallel = vllm_config.parallel_config
        if getattr(parallel, "world_size", 1) * getattr(parallel, "data_parallel_size", 1) > 1:
            raise PagedKVError("PagedKVConnector supports one worker (tensor, pipeline and data "
                               "parallel size 1): a store has one writer")
        # A miss is only a recompute for a cache, never a failed request.
        transfer.kv_load_failure_policy = "recompute"
        geometry, layer_names = geometry_of(kv_cache_config)
        fingerprint = self.config.model or model_fingerprint(vllm_config, self.config.weights_fingerprint)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(self.config, fingerprint, geometry.page_size,
                                            load=bool(transfer.is_kv_consumer), save=bool(transfer.is_kv_producer),
                                            geometry=geometry)
        else:
            self._worker = WorkerSide(self.config, geometry, layer_names, fingerprint,
                                      int(kv_cache_config.num_blocks))

    @property
    def requires_kv_delivery(self) -> bool:
        """False: a save that does not happen is only a later cache miss."""
        return False

    # -- scheduler side ----------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Prompt tokens beyond vLLM's own hit that pagedkv holds (full pages, one token left)."""
        assert self._scheduler is not None
        return self._scheduler.matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plan the load of the matched tokens into the blocks just allocated."""
        assert self._scheduler is not None
        self._scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """This step's loads and saves, for the worker."""
        assert self._scheduler is not None
        return self._scheduler.build_plan(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        """Take in what the worker reported missing or unsaved."""
        assert self._scheduler is not None
        self._scheduler.worker_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Save the request's last full blocks if any are unsaved (their free waits for it)."""
        assert self._scheduler is not None
        return self._scheduler.finished(request, block_ids), None

    # -- worker side -------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Bind vLLM's per-layer KV caches."""
        assert self._worker is not None
        if not kv_caches:
            return
        layout = self.config.kv_layout
        if layout == "auto":
            layout = default_layout(next(iter(kv_caches.values())).device)
        try:
            self._worker.register(kv_caches, layout)
        except PagedKVError as exc:
            self._worker._disable(f"vLLM's KV caches do not fit the store: {exc}")

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Fill this step's loaded blocks (synchronously, before the forward pass)."""
        assert self._worker is not None
        plan = self._get_connector_metadata()
        if isinstance(plan, StepPlan):
            self._worker.load(plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: ``start_load_kv`` loaded every layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Nothing per layer: blocks are saved whole after the forward pass."""

    def wait_for_save(self) -> None:
        """Copy this step's saved blocks out of vLLM's caches; the writer thread stores them."""
        assert self._worker is not None
        if self.has_connector_metadata():
            plan = self._get_connector_metadata()
            if isinstance(plan, StepPlan):
                self._worker.save(plan)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Finished requests whose last blocks are copied out (their blocks may be freed)."""
        assert self._worker is not None
        return self._worker.finished_sending(finished_req_ids), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks that could not be loaded this step: vLLM recomputes them."""
        assert self._worker is not None
        return self._worker.load_errors()

    def build_connector_worker_meta(self) -> Any:
        """Page hashes the scheduler's view must forget."""
        return self._worker.report() if self._worker is not None else None

    def shutdown(self) -> None:
        """Land queued saves, commit and close the store."""
        if self._worker is not None:
            self._worker.shutdown()

    # -- stats ---------------------------------------------------------------------
    def get_kv_connector_stats(self) -> PagedKVStats | None:
        """This side's counters since the last call (vLLM sums both sides and logs them)."""
        side = self._scheduler or self._worker
        return side.take_stats() if side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PagedKVStats | None:
        """Counters rebuilt from their serialised form (vLLM's stats logger)."""
        return PagedKVStats(data=dict(data or {}))

