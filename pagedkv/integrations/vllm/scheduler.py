"""The scheduler side: how much of a prompt pagedkv holds, and the per-step plan for the worker.

It never touches page bytes and never holds the store's writer. At start it
takes a snapshot of the store's chained page hashes (``PrefixView``: a short
read-only open, or the worker's own handle when both sides share a process);
from then on it keeps the view current itself: pages it asks the worker to save
are added when planned (the worker applies saves before the next step's loads),
and hashes the worker reports as missing or unsaved are dropped. A page the view
wrongly believes present costs one load error and a recompute, never wrong KV.

With a remote tier (``"remote"``), the pages after the local match are asked of
it too: one pipelined EXISTS round trip per request (the tier's fetch timeouts;
a failure is a miss, counted). The worker's store fetches and verifies them when
it loads them; one gone or refused by then is a load error and a recompute.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import ModelMismatch, PagedKVError
from ...geometry import Geometry
from ...prefixview import ROOT, PrefixView
from ...remote.tier import Probe
from .config import ConnectorConfig
from .identity import namespace_tokens, request_namespace
from .meta import PageJob, PagedKVStats, StepPlan, WorkerReport
from .shared import log, live_worker_store

__all__ = ["SchedulerSide"]

_FAILED_CAP = 1 << 16  # remote hashes remembered as failed; past it they are offered again


@dataclass
class _Request:
    """What the scheduler side tracks of one request."""

    request: Any  # vLLM's Request (same process)
    namespace: list[int] | None  # token ids of its namespace page, if any
    root: bytes  # hash its first real page chains from (ROOT, or the namespace page's)
    digests: list[bytes] = field(default_factory=list)  # chained hashes of its full pages so far
    local_tokens: int = 0  # vLLM's own prefix hit at the last lookup
    held_pages: int = 0  # leading full prompt pages the store holds, at the last lookup
    saved: int = 0  # leading pages held by the store or planned to be saved
    remote_digests: list[bytes] | None = None  # remote hashes of the store's pages of the prompt
    probed: tuple[int, int] | None = None  # (local pages, usable pages) of the last remote probe
    remote_pages_cached: int = 0  # that probe's answer
    remote_pages: int = 0  # prompt pages after the local match the remote tier holds, per that probe


class SchedulerSide:
    """Lookups, load and save planning, and the incremental view of the store.

    Params:
        config: the connector's settings.
        fingerprint: this engine's model fingerprint (compared with the store's).
        page_size: vLLM's block size (the store's page size).
        load, save: whether to serve prompts from the store, and to save into it.
        geometry: the store geometry; with it and a ``"remote"`` setting, the remote tier is asked too.
    """

    def __init__(self, config: ConnectorConfig, fingerprint: str, page_size: int, load: bool = True,
                 save: bool = True, geometry: Geometry | None = None) -> None:
        self.config, self.page_size, self.fingerprint = config, page_size, fingerprint
        self.load, self.save = load, save  # kv_role: kv_consumer only loads, kv_producer only saves
        self.stats = PagedKVStats()
        self._requests: dict[str, _Request] = {}
        self._plan = StepPlan()
        self.view: PrefixView | None = None
        self.probe: Probe | None = None
        self._remote_failed: set[bytes] = set()  # remote hashes whose load failed: not offered again
        self.disabled: str | None = None
        try:
            store = live_worker_store(config.path)
            view = PrefixView.of_store(store) if store is not None else PrefixView.open(config.path)
        except PagedKVError as exc:
            self._disable(f"cannot read the store at {config.path}: {exc}")
            return
        if view.model != fingerprint:
            self._disable(str(ModelMismatch(f"{config.path} holds KV of model {view.model!r}, this engine "
                                            f"runs {fingerprint!r}")))
            return
        if view.page_size != page_size:
            self._disable(f"{config.path} has pages of {view.page_size} tokens, vLLM blocks of {page_size}")
            return
        self.view = view
        log.info("pagedkv: %s holds %d cached pages for this model", config.path, len(view))
        remote = dict(config.open_options).get("remote")
        if remote is not None and geometry is not None and load:
            try:
                self.probe = Probe(remote, fingerprint, geometry)
            except PagedKVError as exc:  # the worker's open refuses it too, and says so
                log.warning("pagedkv: remote tier not asked, local hits only: %s", exc)

    def _disable(self, reason: str) -> None:
        self.disabled = reason
        self.stats.add("store_errors")
        log.error("pagedkv: connector disabled, every token is computed: %s", reason)

    # -- lookups ---------------------------------------------------------------
    def _state(self, request: Any) -> _Request | None:
        state = self._requests.get(request.request_id)
        if state is None and self.view is not None and request.prompt_token_ids is not None \
                and getattr(request, "prompt_embeds", None) is None:
            namespace = request_namespace(request)
            ns_ids = None if namespace is None else namespace_tokens(namespace, self.page_size)
            root = ROOT if ns_ids is None else self.view.chain(ns_ids)[0]
            state = _Request(request, None if ns_ids is None else ns_ids.tolist(), root)
            self._requests[request.request_id] = state
        return state

    def _digests(self, state: _Request, pages: int) -> list[bytes]:
        """The chained hashes of the request's first ``pages`` full pages (extended as tokens arrive)."""
        have = len(state.digests)
        if pages > have and self.view is not None:
            size = self.page_size
            tokens = state.request.all_token_ids[have * size:pages * size]
            parent = state.digests[-1] if have else state.root
            state.digests.extend(self.view.chain(np.asarray(tokens, np.int64), parent, have))
        return state.digests[:pages]

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Prompt tokens beyond ``num_computed_tokens`` that the store holds in full pages.

        At least one prompt token is always left to compute.
        """
        started = time.perf_counter()
        state = self._state(request)
        if state is None or self.view is None:
            return 0
        size = self.page_size
        prompt_pages = request.num_prompt_tokens // size
        digests = self._digests(state, prompt_pages)
        ns_ok = state.namespace is None or state.root in self.view
        state.held_pages = self.view.leading(digests) if ns_ok else 0
        state.local_tokens = num_computed_tokens
        limit = (request.num_prompt_tokens - 1) // size
        state.remote_pages = 0
        if self.probe is not None and self.load and state.held_pages < limit:
            state.remote_pages = self._remote_pages(state, ns_ok, limit)
            state.held_pages += state.remote_pages
        usable = min(state.held_pages, limit) * size if self.load else 0
        self.stats.add("lookup_us", (time.perf_counter() - started) * 1e6)
        return max(0, usable - num_computed_tokens)

    def _remote_pages(self, state: _Request, ns_ok: bool, limit: int) -> int:
        """Prompt pages after the local match (of ``limit`` usable) that the remote tier holds.

        Remote hashes chain from the store's first page (the namespace page, if
        any), as the worker's store asks for them; one probe per request unless
        the local match moved.
        """
        assert self.probe is not None
        shift = 0 if state.namespace is None else 1
        local = shift + state.held_pages if ns_ok else 0  # store pages matched locally
        if state.probed == (local, limit):
            return state.remote_pages_cached
        started = time.perf_counter()
        if state.remote_digests is None or len(state.remote_digests) < shift + limit:
            ids = list(state.namespace or []) + list(state.request.all_token_ids[:limit * self.page_size])
            state.remote_digests = self.probe.chain(np.asarray(ids, np.int64), shift + limit)
        wanted = state.remote_digests[local:shift + limit]
        failed = [index for index, digest in enumerate(wanted) if digest in self._remote_failed]
        held = self.probe.held(wanted[:failed[0]] if failed else wanted)
        self.stats.add("remote_probe_us", (time.perf_counter() - started) * 1e6)
        if held is None:
            self.stats.add("remote_probe_errors")
            pages = 0
        else:
            pages = max(0, local + held - shift - state.held_pages)
        state.probed, state.remote_pages_cached = (local, limit), pages
        return pages

    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plan the load of the external tokens into the blocks vLLM allocated."""
        state = self._requests.get(request.request_id)
        if state is None:
            return
        self.stats.add("lookups")
        self.stats.add("lookup_tokens", request.num_prompt_tokens)
        state.saved = max(state.saved, state.held_pages)
        if num_external_tokens <= 0:
            return
        self.stats.add("hit_tokens", num_external_tokens)
        size = self.page_size
        first = state.local_tokens // size
        last = (state.local_tokens + num_external_tokens) // size
        block_ids = list(blocks.get_block_ids()[0][first:last])
        if state.remote_pages and self.view is not None:
            # The worker's store fetches them for this load: local from now on (a failed fetch is
            # reported back and forgotten again, as any failed load).
            self.stats.add("remote_hit_tokens", min(num_external_tokens, state.remote_pages * size))
            self.view.add(state.digests[first:last])
            if state.namespace is not None:
                self.view.add([state.root])
        self._plan.loads.append(PageJob(request.request_id, first, last, block_ids,
                                        list(request.all_token_ids[:last * size + 1]), state.namespace,
                                        state.digests[first:last]))

    # -- saves -----------------------------------------------------------------
    def _save_job(self, state: _Request, target: int, block_ids: list[int], finished: bool) -> PageJob | None:
        if target <= state.saved or self.view is None or not self.save:
            return None
        target = min(target, len(block_ids))
        if target <= state.saved:
            return None
        digests = self._digests(state, target)[state.saved:target]
        job = PageJob(state.request.request_id, state.saved, target, list(block_ids[state.saved:target]),
                      list(state.request.all_token_ids[:target * self.page_size]), state.namespace,
                      digests, finished)
        self.view.add(digests)
        if state.namespace is not None:
            self.view.add([state.root])
        state.saved = target
        return job

    def build_plan(self, scheduler_output: Any) -> StepPlan:
        """This step's plan: the loads planned at allocation, and every block full after this step."""
        plan, self._plan = self._plan, StepPlan()
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        if self.view is None or block_state is None:
            return plan
        size = self.page_size
        for req_id, count in scheduler_output.num_scheduled_tokens.items():
            state = self._requests.get(req_id)
            if state is None:
                continue
            request = state.request
            # Only tokens whose ids are known (not a draft or an output still in flight).
            target = min(request.num_computed_tokens + count, len(request.all_token_ids)) // size
            if target <= state.saved:
                continue
            groups = block_state.get_block_ids(req_id)
            job = self._save_job(state, target, list(groups[0]) if groups else [], False)
            if job is not None:
                plan.saves.append(job)
        return plan

    def finished(self, request: Any, block_ids: list[int]) -> bool:
        """Forget a finished request; True if its blocks must wait for a last save (delayed free)."""
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return False
        target = min(request.num_computed_tokens, len(request.all_token_ids)) // self.page_size
        job = self._save_job(state, target, list(block_ids), True)
        if job is None:
            return False
        self._plan.saves.append(job)
        return True

    def worker_output(self, connector_output: Any) -> None:
        """Drop from the view what the worker reported missing or unsaved; re-plan failed loads' saves."""
        report = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(report, WorkerReport) or self.view is None:
            return
        self.view.discard(report.forget)
        for req_id, page in report.failed_loads.items():
            state = self._requests.get(req_id)
            if state is not None:  # vLLM recomputes those pages: save them once they are
                state.saved = min(state.saved, page)
                if state.remote_digests is not None:
                    # Gone or refused by the worker's store: offering it again would only fail again.
                    index = page + (0 if state.namespace is None else 1)
                    if index < len(state.remote_digests):
                        if len(self._remote_failed) >= _FAILED_CAP:
                            self._remote_failed.clear()
                        self._remote_failed.add(state.remote_digests[index])
                    state.probed = None

    def take_stats(self) -> PagedKVStats | None:
        """The scheduler side's counters since the last call, or None if nothing was counted."""
        if self.stats.is_empty():
            return None
        stats, self.stats = self.stats, PagedKVStats()
        return stats
