"""Where a model comes from, for ``shard plan`` and ``shard train`` alike.

One of: a preset (shard's GPT), ``--model module:factory`` (a callable
returning an ``nn.Module`` whose forward maps token ids ``(batch, seq)`` to
logits ``(batch, seq, vocab)``, or to an output with ``.logits``), or
``--hf-config`` (a local ``config.json`` or a ``transformers`` config class
name, built with ``AutoModelForCausalLM.from_config``; nothing is downloaded).
Both commands resolve the model here, so a model ``shard plan`` accepts is
one ``shard train`` trains. A source that knows how to initialise its
modules (``init``: a ``transformers`` model's own ``_init_weights``) is
trained from the meta device: :func:`build_for_training` builds it without
parameter storage and :func:`materialise_sharded` fills the shards (see
``_materialise.py``).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shard_cli._materialise import ModuleInit, hf_module_init, materialise, parameters_on_meta
from shard_cli._presets import get_preset
from shard_cli.gpt import GPT
from shard_core import get_registry

__all__ = [
    "HF_INSTALL",
    "ModelSource",
    "build_for_training",
    "load_model_source",
    "logits_from",
    "materialise_sharded",
]

HF_INSTALL = (
    "pip install transformers (or, from a shard checkout, pip install './packages/shard-cli[hf]'; "
    "never shard-cli from the public index, an unrelated project)"
)
"""How to install what ``--hf-config`` needs."""


@dataclass(frozen=True)
class ModelSource:
    """A model to plan or train, built on demand (on the meta device for a plan).

    Attributes:
        description: What the model is, for the report.
        build: Makes the model (call it under ``torch.device("meta")``).
        vocab_size: Its vocabulary when it is a language model (activations
            are then estimated), else ``None``.
        seq: The default sequence length for the activation estimate.
        batch: The default batch for the activation estimate.
        logits_of: How to get logits from ``(model, tokens)``; ``None``: ``model(tokens)``.
        default_policy: The wrap policy when ``--wrap-policy auto``.
        init: How to initialise one module's parameters in place,
            ``init(root, module)``, after the model was built on the meta
            device; ``None``: the model is built with its values on the CPU
            (its constructor initialises it).
        seed_name: The name a module's initialisation is seeded by, from its
            qualified name; ``None``: the name itself (see ``_materialise.py``;
            LoRA's base layers keep their names from before the adapter,
            ``_finetune.py``).
    """

    description: str
    build: Callable[[], nn.Module]
    vocab_size: int | None
    seq: int
    batch: int
    logits_of: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None
    default_policy: str
    init: ModuleInit | None = None
    seed_name: Callable[[str], str] | None = None


def _registered_or_none(name: str) -> str:
    return name if name in get_registry().wrap_policies() else "none"


def _hf_logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=tokens).logits
    assert isinstance(logits, torch.Tensor)
    return logits


def parse_key_values(
    items: Sequence[str], *, flag: str = "--hf-arg", example: str = "n_layer=4"
) -> dict[str, Any]:
    """``KEY=VALUE`` strings as keyword arguments; a VALUE that is JSON is read as JSON.

    ``n_layer=4`` gives ``4``, ``bias=false`` ``False``, ``pattern=layers\\.\\d+``
    the string.
    """
    kwargs: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} {item!r}: write KEY=VALUE, e.g. {example}")
        try:
            kwargs[key] = json.loads(raw)
        except json.JSONDecodeError:
            kwargs[key] = raw
    return kwargs


def load_model_source(
    *,
    preset: str | None = None,
    model: str | None = None,
    hf_config: str | None = None,
    hf_args: Sequence[str] = (),
    overrides: dict[str, int | None] | None = None,
) -> ModelSource:
    """The model one of ``preset``, ``model`` (``module:factory``) or ``hf_config`` names.

    Raises:
        ValueError: none or several are given, or one cannot be resolved (the
            message says which and how to fix it).
    """
    given = [
        n for n, v in (("--preset", preset), ("--model", model), ("--hf-config", hf_config)) if v
    ]
    if len(given) > 1:
        raise ValueError(f"give one model, got {' and '.join(given)}")
    if model:
        return _factory_source(model)
    if hf_config:
        return _hf_source(hf_config, parse_key_values(hf_args))
    spec = get_preset(preset or "small")
    vocab = spec.vocab_size
    if vocab is None:
        from shard_cli._corpus import load_corpus

        vocab = load_corpus().vocab_size
    sizes = overrides or {}
    config = spec.config(
        vocab_size=vocab,
        seq_len=sizes.get("seq"),
        d_model=sizes.get("d_model"),
        n_heads=sizes.get("n_heads"),
        n_layers=sizes.get("n_layers"),
    )
    return ModelSource(
        description=f"preset {spec.name}: {spec.description}",
        build=lambda: GPT(config),
        vocab_size=config.vocab_size,
        seq=config.seq_len,
        batch=spec.batch,
        logits_of=None,
        default_policy="blocks",
    )


def _import_user_module(module_ref: str) -> Any:
    """Import the module ``--model`` names: a dotted name, or the path of a ``.py`` file.

    A dotted name is found with the working directory on ``sys.path``, as
    ``python -m`` would: the ``shard`` console script's ``sys.path`` starts at
    its own ``bin/``, so ``--model mymodel:build`` would otherwise fail from
    the very directory that holds ``mymodel.py``. A file path is loaded as a
    module named after the file, and its directory goes on ``sys.path`` so
    that it can import its neighbours.
    """
    if module_ref.endswith(".py"):
        path = Path(module_ref).resolve()
        if not path.is_file():
            raise ImportError(f"no file {path}")
        name = path.stem
        if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(path):
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"{path} is not a Python module")
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    cwd = str(Path.cwd())
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    return importlib.import_module(module_ref)


def _factory_source(path: str) -> ModelSource:
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"--model {path!r}: write module:factory, e.g. mypkg.models:build or models.py:build"
        )
    try:
        factory = getattr(_import_user_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--model {path!r}: cannot import it: {exc}") from exc
    if not callable(factory):
        raise ValueError(f"--model {path!r}: {attr} is not callable; name a function or class")

    def build() -> nn.Module:
        built = factory()
        if not isinstance(built, nn.Module):
            raise ValueError(f"--model {path!r} returned {type(built).__name__}, not an nn.Module")
        return built

    return ModelSource(
        description=f"{path}()",
        build=build,
        vocab_size=None,
        seq=0,
        batch=0,
        logits_of=lambda model, tokens: logits_from(model(tokens)),
        default_policy=_registered_or_none("transformer"),
    )


def _hf_source(config_ref: str, kwargs: dict[str, Any]) -> ModelSource:
    try:
        import transformers
    except ImportError as exc:
        raise ValueError(f"--hf-config needs the transformers package: {HF_INSTALL}") from exc
    path = Path(config_ref)
    if path.exists():
        file = path / "config.json" if path.is_dir() else path
        config = transformers.AutoConfig.from_pretrained(str(file), **kwargs)
        what = f"transformers config {file}"
    else:
        cls = getattr(transformers, config_ref, None)
        if not isinstance(cls, type) or not issubclass(cls, transformers.PretrainedConfig):
            raise ValueError(
                f"--hf-config {config_ref!r} is neither a local config.json (file or directory) "
                "nor a transformers config class (GPT2Config, LlamaConfig...); names of hub "
                "models would need a download, which shard never does"
            )
        config = cls(**kwargs)
        what = f"transformers.{config_ref}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"
    vocab = getattr(config, "vocab_size", None)
    positions = getattr(config, "n_positions", None) or getattr(
        config, "max_position_embeddings", None
    )
    seq = min(positions, 2048) if isinstance(positions, int) else 1024

    def build() -> nn.Module:
        model = transformers.AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
        assert isinstance(model, nn.Module)
        return model

    return ModelSource(
        description=what,
        build=build,
        vocab_size=vocab if isinstance(vocab, int) else None,
        seq=seq,
        batch=1,
        logits_of=_hf_logits,
        default_policy=_registered_or_none("transformer"),
        init=hf_module_init,
    )


def build_for_training(
    source: ModelSource, *, sharded_later: bool, device: torch.device, seed: int
) -> nn.Module:
    """``source``'s model for ``shard train``: parameters on meta when they can be filled later.

    A source with ``init`` is built with its parameters on the meta device
    (no storage). When ``sharded_later`` (``fully_shard`` takes meta
    parameters and :func:`materialise_sharded` fills the shards), it is
    returned so; otherwise (the wrapper flattens real tensors) it is
    initialised whole on ``device`` first, to the same values. A source
    without ``init`` is built as its constructor makes it.
    """
    if source.init is None:
        return source.build()
    with parameters_on_meta():
        model = source.build()
    if not sharded_later:
        materialise(model, device=device, seed=seed, init=source.init, seed_name=source.seed_name)
    return model


def materialise_sharded(
    model: nn.Module,
    source: ModelSource,
    *,
    device: torch.device,
    seed: int,
    cpu_offload: bool = False,
) -> None:
    """Give a model :func:`build_for_training` left on meta its values, after ``fully_shard``.

    Does nothing when no parameter is on the meta device. With
    ``cpu_offload`` the shards live on the CPU (the runtime copies them to
    ``device`` for compute); buffers go to ``device`` either way.
    """
    if source.init is None or not any(p.is_meta for p in model.parameters()):
        return
    materialise(
        model,
        device=device,
        param_device=torch.device("cpu") if cpu_offload else None,
        seed=seed,
        init=source.init,
        seed_name=source.seed_name,
    )


def logits_from(output: Any) -> torch.Tensor:
    """The logits of a model's output: the tensor itself, or its ``.logits`` (Hugging Face).

    Raises:
        ValueError: the output is neither (the message names its type).
    """
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise ValueError(
        f"the model returned {type(output).__name__}, not logits; its forward must map token "
        "ids (batch, seq) to logits (batch, seq, vocab) or to an output with .logits"
    )
