"""pytest plugin for shard multi-rank tests (filled in by the rank pool)."""
