"""One vLLM engine in a child process, run by tests/test_vllm.py: ``python -m tests.kits.vllm_child SPEC OUT``.

SPEC (JSON): model, store (or null: no connector), extra (more connector keys),
multiprocessing (bool), max_num_batched_tokens, batches (lists of requests:
prompt token ids, max_tokens, optional cache_salt; or chat_from [batch, request] plus
extend: that earlier request's prompt and answer, then more tokens), perturb (test only: add noise
to every page loaded from the store, so a test can see the check fail),
async_scheduling (schedule the next step while one runs), hold (print "CHILD READY" once the first batch is committed, then run the second
batch forever: for SIGKILL tests). OUT gets, per batch, each request's output
token ids and num_cached_tokens, plus the connector's log lines.
"""

from __future__ import annotations

import json
import os
import sys


def _perturb_loads() -> None:
    """Make every loaded page wrong (test-only negative control, in-process engines only)."""
    from pagedkv.integrations.vllm import layouts

    caches = layouts.LayerCaches
    scatter, scatter_page = caches.scatter, caches.scatter_page
    caches.scatter = lambda self, ids, pages: scatter(self, ids, pages * 0.5 + 0.25)  # type: ignore
    caches.scatter_page = lambda self, block, page: scatter_page(self, block, page * 0.5 + 0.25)  # type: ignore


def _flush_store() -> None:
    """Until the connector's worker has committed every save so far (in-process engines only)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    get_kv_transfer_group()._worker.flush()


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if not spec.get("multiprocessing", False):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if spec.get("perturb"):
        _perturb_loads()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs = {}
    if spec.get("store"):
        extra = {"path": spec["store"], **spec.get("extra", {})}
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="PagedKVConnector", kv_connector_module_path="pagedkv.integrations.vllm",
            kv_role="kv_both", kv_connector_extra_config=extra)
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype="float32", block_size=32,
              max_model_len=1024, enforce_eager=True, seed=0, gpu_memory_utilization=0.5,
              max_num_batched_tokens=spec.get("max_num_batched_tokens", 128), max_num_seqs=8,
              disable_log_stats=False, **({"async_scheduling": True} if spec.get("async_scheduling") else {}),
              **kwargs)
    results = []
    for index, batch in enumerate(spec["batches"]):
        for request in batch:
            if "chat_from" in request:  # the next turn of a chat: earlier prompt + its answer + more
                earlier, position = request["chat_from"]
                done = results[earlier][position]
                request["prompt"] = done["prompt"] + done["tokens"] + request["extend"]
        prompts = [TokensPrompt(prompt_token_ids=r["prompt"], **({"cache_salt": r["cache_salt"]}
                                                                  if r.get("cache_salt") else {}))
                   for r in batch]
        params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True, detokenize=False)
                  for r in batch]
        if spec.get("hold") and index == 1:
            print("CHILD READY", flush=True)
            while True:  # until the test kills this process
                llm.generate(prompts, params, use_tqdm=False)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([{"prompt": r["prompt"], "tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens}
                        for r, o in zip(batch, outs)])
        if spec.get("hold") and index == 0:
            _flush_store()
    llm.llm_engine.do_log_stats()
    scheduling = llm.llm_engine.vllm_config.scheduler_config.async_scheduling
    json.dump({"batches": results, "async_scheduling": bool(scheduling)}, open(sys.argv[2], "w"))
    print("CHILD DONE", flush=True)


if __name__ == "__main__":
    main()
