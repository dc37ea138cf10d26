"""The benchmark suite behind `pagedkv bench`: each workload against an in-process reference."""
