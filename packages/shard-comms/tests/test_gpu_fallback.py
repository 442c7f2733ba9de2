"""GPU machines never fall back to gloo on the CPU silently (resolve_device_handle, init).

Runs without a GPU: torch's accelerator queries and the registry are faked.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from shard_comms import _device, _process_group
from shard_core import CpuDeviceHandle
from shard_core.errors import DistributedInitError, UnknownPluginNameError

HINT = (
    "no shard plugin serves device type 'cuda': install shard-device-cuda from the shard "
    "repository (pip install ./plugins/shard-device-cuda in a checkout; the shard names on "
    "PyPI belong to unrelated projects)"
)
OPT_OUT = "or set SHARD_DEVICE=cpu (or pass device_type='cpu') to run on the CPU"


class _Registry:
    """A registry serving the CPU and, when given, one CUDA handle; records lookups."""

    def __init__(self, cuda: object | None = None) -> None:
        self.cpu = CpuDeviceHandle()
        self.cuda = cuda
        self.lookups: list[str] = []

    def device_handle(self, device_type: str) -> object:
        self.lookups.append(device_type)
        if device_type == "cpu":
            return self.cpu
        if device_type == "cuda" and self.cuda is not None:
            return self.cuda
        raise UnknownPluginNameError(HINT)


class _Cuda:
    """A CUDA handle; ``available=False`` is a plugin finding the device unusable (a driver
    mismatch, say)."""

    device_type = "cuda"
    backend = "nccl"

    def __init__(self, available: bool) -> None:
        self.available = available

    def is_available(self) -> bool:
        return self.available


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(_process_group.SHARD_DEVICE_ENV, raising=False)
    _device.clear_device_handle_cache()
    yield
    _device.clear_device_handle_cache()


def _machine(
    monkeypatch: pytest.MonkeyPatch,
    registry: _Registry,
    *,
    accelerator: str | None,
    cuda: bool,
) -> None:
    """Fake what torch sees (``torch.accelerator`` and CUDA) and the plugin registry."""
    monkeypatch.setattr(_device, "get_registry", lambda: registry)
    monkeypatch.setattr(_process_group, "get_registry", lambda: registry)
    monkeypatch.setattr(_device, "current_accelerator_type", lambda: accelerator)
    monkeypatch.setattr(_process_group, "current_accelerator_type", lambda: accelerator)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)


def test_visible_gpu_without_plugin_names_the_distribution(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A visible CUDA GPU with no shard plugin for it raises, naming shard-device-cuda."""
    _machine(monkeypatch, _Registry(), accelerator="cuda", cuda=True)
    with pytest.raises(DistributedInitError) as info:
        _process_group.resolve_device_handle()
    assert str(info.value) == (
        f"a 'cuda' accelerator is visible but shard would run on the CPU with gloo: {HINT}; "
        f"{OPT_OUT}"
    )


def test_cuda_seen_only_by_torch_cuda_is_still_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.cuda.is_available() alone (no torch.accelerator answer) is enough to refuse."""
    _machine(monkeypatch, _Registry(), accelerator=None, cuda=True)
    with pytest.raises(DistributedInitError, match=r"^a 'cuda' accelerator is visible"):
        _process_group.resolve_device_handle()


def test_unusable_plugin_handle_is_an_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plugin that serves CUDA but finds it unusable is an error too, naming the handle."""
    _machine(monkeypatch, _Registry(_Cuda(available=False)), accelerator="cuda", cuda=True)
    with pytest.raises(DistributedInitError) as info:
        _process_group.resolve_device_handle()
    assert str(info.value) == (
        "a 'cuda' accelerator is visible but its shard device handle (_Cuda) reports "
        "it unusable, so shard would run on the CPU with gloo; check the driver and that this "
        f"build of torch supports 'cuda', {OPT_OUT}"
    )


def test_init_distributed_refuses_before_creating_a_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """init_distributed raises the error itself and never reaches init_process_group."""
    _machine(monkeypatch, _Registry(), accelerator="cuda", cuda=True)
    monkeypatch.setattr(_process_group.dist, "is_initialized", lambda: False)
    calls: list[object] = []
    monkeypatch.setattr(_process_group.dist, "init_process_group", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(_process_group, "_STATE", None)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(DistributedInitError, match="install shard-device-cuda from the shard"):
        _process_group.init_distributed()
    assert calls == []


@pytest.mark.parametrize("how", ["env", "argument"])
def test_cpu_opt_out_keeps_the_cpu(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """SHARD_DEVICE=cpu or device_type='cpu' runs on the CPU on purpose, GPU or not."""
    registry = _Registry()
    _machine(monkeypatch, registry, accelerator="cuda", cuda=True)
    if how == "env":
        monkeypatch.setenv(_process_group.SHARD_DEVICE_ENV, "cpu")
        handle = _process_group.resolve_device_handle()
    else:
        handle = _process_group.resolve_device_handle("cpu")
    assert handle is registry.cpu
    assert registry.lookups == ["cpu"]


def test_cpu_only_machine_is_unaffected(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without any accelerator the CPU handle is used and nothing is raised."""
    registry = _Registry()
    _machine(monkeypatch, registry, accelerator=None, cuda=False)
    assert _process_group.resolve_device_handle() is registry.cpu


def test_served_gpu_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the plugin installed and the GPU usable, its handle is the one resolved."""
    cuda = _Cuda(available=True)
    registry = _Registry(cuda)
    _machine(monkeypatch, registry, accelerator="cuda", cuda=True)
    assert _process_group.resolve_device_handle() is cuda


def test_this_machine_resolves_without_error() -> None:
    """On the real machine (CPU in CI, with shard-device-cuda installed) resolution succeeds."""
    handle = _process_group.resolve_device_handle()
    assert handle.device_type == ("cuda" if torch.cuda.is_available() else "cpu")
