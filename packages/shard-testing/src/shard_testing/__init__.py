"""A pytest plugin for fast multi-rank tests: a persistent pool of gloo ranks and parity helpers.

``RankPool`` runs a module-level function on every rank of a pool of gloo
processes that lives for the whole session; ``shard_testing.reference``
trains the single-process reference that parity tests compare against.
The pytest plugin (``shard_testing.plugin``, loaded through the ``pytest11``
entry point) provides the session-scoped ``rank_pool`` fixture.
"""

from shard_testing._errors import RankFailure, RankTimeout
from shard_testing._pool import RankPool
from shard_testing._version import __version__
from shard_testing.reference import (
    Batch,
    ReferenceRun,
    assert_state_dicts_equal,
    global_batch,
    make_batches,
    train_reference,
)

# Show the front door in reprs and tracebacks ("shard_testing.RankFailure").
for _public in (RankFailure, RankPool, RankTimeout):
    _public.__module__ = __name__
del _public

__all__ = [
    "Batch",
    "RankFailure",
    "RankPool",
    "RankTimeout",
    "ReferenceRun",
    "__version__",
    "assert_state_dicts_equal",
    "global_batch",
    "make_batches",
    "train_reference",
]
