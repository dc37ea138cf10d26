"""The demo workload behind `pagedkv demo`, its synthetic KV generator and the seed workload loader."""
