"""The bundled plugins, found through their real entry points by the real registry.

Also checks shard-core's table of the names these plugins own
(``SHARD_OWNED_NAMES``, which unknown-name errors use to say what to install)
against what the distributions under ``plugins/`` really register.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator

import pluggy
import pytest
import torch

import shard_comm_lowp
import shard_comm_quant
import shard_device_accel
import shard_device_accel.plugin
import shard_device_cuda.plugin
from shard_core import CpuDeviceHandle, get_plugin_manager, get_registry, reset_plugin_manager
from shard_core.plugin import PROJECT_NAME, SHARD_OWNED_NAMES, Registry, hookspecs
from shard_core.plugin._registry import _NAMED_HOOKS

from ._workspace import DISTRIBUTIONS, ROOT

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - CI runs 3.11
    tomllib = pytest.importorskip("tomli")

SWITCHES = ("SHARD_DISABLE_PLUGINS", "SHARD_LOAD_PLUGINS", "SHARD_TRACE_PLUGINS")


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[Registry]:
    """The process-wide registry, rebuilt from the installed entry points with no switches set."""
    for switch in SWITCHES:
        monkeypatch.delenv(switch, raising=False)
    reset_plugin_manager()
    yield get_registry()
    reset_plugin_manager()


def test_plugins_are_registered_under_their_entry_point_names(registry: Registry) -> None:
    """The manager holds each plugin module under its entry-point name."""
    pm = get_plugin_manager()
    assert {"accel", "comm-lowp", "comm-quant", "cuda"} <= set(registry.plugin_names())
    assert pm.get_plugin("comm-lowp") is shard_comm_lowp.plugin
    assert pm.get_plugin("comm-quant") is shard_comm_quant.plugin
    assert pm.get_plugin("cuda") is shard_device_cuda.plugin
    assert pm.get_plugin("accel") is shard_device_accel.plugin


def test_compression_hooks_are_found_by_name(registry: Registry) -> None:
    """comm_hook('bf16_compress') and comm_hook('fp16_compress') are the plugin's hook objects."""
    assert registry.comm_hook("bf16_compress") is shard_comm_lowp.bf16_compress
    assert registry.comm_hook("fp16_compress") is shard_comm_lowp.fp16_compress


def test_quantization_codecs_are_found_by_name(registry: Registry) -> None:
    """comm_codec('int8') and comm_codec('int4') build the plugin's block-quantization codecs."""
    int8 = registry.comm_codec("int8", block_size=128)
    assert isinstance(int8, shard_comm_quant.BlockQuantCodec)
    assert (int8.bits, int8.block_size) == (8, 128)
    assert registry.comm_codec("int4").bits == 4


def test_cuda_handle_is_found_for_cuda(registry: Registry) -> None:
    """device_handle('cuda') is the CUDA plugin's handle, available exactly when torch.cuda is."""
    handle = registry.device_handle("cuda")
    assert handle is shard_device_cuda.plugin.CUDA_HANDLE
    assert (handle.device_type, handle.backend) == ("cuda", "nccl")
    assert handle.is_available() is torch.cuda.is_available()


def test_accel_leaves_cpu_to_the_built_in_handle(registry: Registry) -> None:
    """The accel plugin, asked through the manager, answers None for 'cpu'; cpu stays built in."""
    (accel_impl,) = [
        impl
        for impl in get_plugin_manager().hook.shard_device_handle.get_hookimpls()
        if impl.plugin is shard_device_accel.plugin
    ]
    assert accel_impl.function(device_type="cpu") is None
    assert isinstance(registry.device_handle("cpu"), CpuDeviceHandle)


def test_distinfo_names_the_installed_plugin_distributions(registry: Registry) -> None:
    """list_plugin_distinfo() gives each bundled plugin's distribution name and version."""
    listed = {
        plugin: (dist.project_name, dist.version)
        for plugin, dist in get_plugin_manager().list_plugin_distinfo()
    }
    assert listed[shard_comm_lowp.plugin] == ("shard-comm-lowp", shard_comm_lowp.__version__)
    assert listed[shard_comm_quant.plugin] == ("shard-comm-quant", shard_comm_quant.__version__)
    assert listed[shard_device_cuda.plugin] == ("shard-device-cuda", shard_device_cuda.__version__)
    assert listed[shard_device_accel.plugin] == (
        "shard-device-accel",
        shard_device_accel.__version__,
    )


def test_distinfo_matches_pluggys_own_entry_point_loader(registry: Registry) -> None:
    """Our loader records the same (plugin, distribution) pairs pluggy's loader would."""
    reference = pluggy.PluginManager(PROJECT_NAME)
    reference.add_hookspecs(hookspecs)
    reference.load_setuptools_entrypoints(PROJECT_NAME)

    def pairs(pm: pluggy.PluginManager) -> list[tuple[object, str, str]]:
        return sorted(
            (
                (plugin, dist.project_name, dist.version)
                for plugin, dist in pm.list_plugin_distinfo()
            ),
            key=lambda pair: pair[1],
        )

    assert len(registry.plugin_names()) == len(pairs(reference)) + 1  # and builtins
    assert pairs(get_plugin_manager()) == pairs(reference)


def _plugin_modules() -> dict[str, list[object]]:
    """Each distribution under plugins/, by name, with the modules of its ``shard`` entry points."""
    found: dict[str, list[object]] = {}
    for path in DISTRIBUTIONS:
        if not path.startswith("plugins/"):
            continue
        with (ROOT / path / "pyproject.toml").open("rb") as file:
            project = tomllib.load(file)["project"]
        targets = project.get("entry-points", {}).get(PROJECT_NAME, {}).values()
        found[project["name"]] = [importlib.import_module(t.partition(":")[0]) for t in targets]
    return found


def test_owned_names_table_matches_the_plugins_directory() -> None:
    """SHARD_OWNED_NAMES lists exactly the names each plugin under plugins/ registers.

    Every named hook of the registry is called; device types are those the CUDA plugin serves
    ("cuda", even without a GPU) and shard-device-accel's ACCELERATOR_TYPES.
    """
    actual: dict[str, dict[str, str]] = {}
    for distribution, modules in _plugin_modules().items():
        for module in modules:
            for hook in _NAMED_HOOKS:
                implementation = getattr(module, hook, None)
                if implementation is not None:
                    for name in implementation():
                        actual.setdefault(hook, {})[name] = distribution
            if getattr(module, "shard_device_handle", None) is not None:
                served = (
                    shard_device_accel.ACCELERATOR_TYPES
                    if distribution == "shard-device-accel"
                    else [t for t in ("cuda",) if module.shard_device_handle(t) is not None]  # type: ignore[attr-defined]
                )
                assert served, f"{distribution}: serves no device type this test knows"
                for device_type in served:
                    actual.setdefault("shard_device_handle", {})[device_type] = distribution
    assert {hook: dict(names) for hook, names in SHARD_OWNED_NAMES.items()} == actual
