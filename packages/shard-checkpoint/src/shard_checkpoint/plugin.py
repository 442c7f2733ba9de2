"""Registry hooks of shard-checkpoint (the wrapper reaches its state-dict methods through them)."""
