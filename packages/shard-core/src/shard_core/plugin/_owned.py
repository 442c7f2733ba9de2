"""The names shard's own plugin distributions register, and where to install them from.

When a lookup finds nothing under a name that one of this repository's
plugins provides (``"size"``, ``"bf16_compress"``, ``"cuda"``), the error
names the distribution to install instead of a generic "install the plugin".
This is the one table of those names; ``integration_tests/test_plugin_entry_points.py``
checks it against what the distributions under ``plugins/`` really register,
so it cannot go stale.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

__all__ = ["SHARD_OWNED_NAMES", "from_repository", "owning_distribution"]

SHARD_OWNED_NAMES: Mapping[str, Mapping[str, str]] = MappingProxyType(
    {
        "shard_comm_codecs": MappingProxyType(
            {"int4": "shard-comm-quant", "int8": "shard-comm-quant"}
        ),
        "shard_comm_hooks": MappingProxyType(
            {"bf16_compress": "shard-comm-lowp", "fp16_compress": "shard-comm-lowp"}
        ),
        "shard_device_handle": MappingProxyType(
            {
                "cuda": "shard-device-cuda",
                "hpu": "shard-device-accel",
                "mps": "shard-device-accel",
                "npu": "shard-device-accel",
                "xpu": "shard-device-accel",
            }
        ),
        "shard_wrap_policies": MappingProxyType(
            {
                "name_pattern": "shard-wrap-example",
                "size": "shard-wrap-size",
                "transformer": "shard-wrap-transformer",
            }
        ),
    }
)
"""By hook name, each name a distribution under ``plugins/`` registers (a device type
for ``shard_device_handle``), mapped to that distribution."""


def owning_distribution(hook_name: str, name: str) -> str | None:
    """The distribution of this repository that provides ``name`` through ``hook_name``, if any."""
    return SHARD_OWNED_NAMES.get(hook_name, {}).get(name)


def from_repository(distribution: str, folder: str = "plugins") -> str:
    """How to install ``distribution``: from this repository, as PyPI's shard names are not ours."""
    return (
        f"from the shard repository (pip install ./{folder}/{distribution} in a checkout; "
        "the shard names on PyPI belong to unrelated projects)"
    )
