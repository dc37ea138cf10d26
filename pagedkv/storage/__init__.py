"""The storage layer: the page pool file, the LMDB spill store, record formats and checksums, codecs, the LMDB file check, file hygiene and the writer's lock. It imports nothing above it."""
