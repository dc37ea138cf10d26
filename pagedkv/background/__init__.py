"""Background work on an open store: prefetching spilled pages and writing evictions behind the caller."""
