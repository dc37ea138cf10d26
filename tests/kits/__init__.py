"""Shared machinery of the pagedkv tests, one concept a module.

content      deterministic K/V (one splitmix64 family) and seeds
model        the reference model of what a store holds; build_committed
store        the tiny geometry, the Stores factory, the engine side of a step
child        one child-process harness: fork, talk over pipes, collect, kill
files        a store's files from outside: names, byte edits, pool header, raw LMDB
lmdbfile     data.mdb's on-disk layout, for damage aimed at LMDB's structure
faults       the I/O fault injector, store states, tallies, /proc counters, soak sizes
prefix       prefix caching: geometry, prompts, prefill, exact checks, index audit
cli          one CLI runner: exit codes, escaped output, JSON
workload     the random workload the crash loops run
crash        the SIGKILL loop and its writer child
crashpoints  SIGKILL at every named crash point
powerloss    simulated power loss
verdict      which commit a crashed store holds; a loop's figures
vllm         vLLM engines in child processes (vllm_child is one engine)
redisserver  real Redis servers for the remote-tier tests (a pytest plugin of their fixtures)
remotehost   one host of the remote-tier tests, run as its own process

Import them as ``tests.kits.<name>`` (pytest puts the repository root on ``sys.path``).
"""
