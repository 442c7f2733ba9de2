"""Fine-tuning: LoRA adapters (``--lora``) and frozen parameters (``--freeze``), before sharding.

[Note: fine-tuning before sharding]
Both change the model before it is sharded, so every unit knows from the
start which of its parameters train (``fully_shard`` reduces gradients and
the optimizer keeps state only for those; ``shard plan`` counts the same):

- ``--lora RANK`` injects Hugging Face ``peft``'s LoRA layers into the model
  in place (``peft.inject_adapter_in_model``): each targeted linear layer
  becomes a ``peft`` ``lora.Linear`` that holds the original as
  ``base_layer`` and two adapters, ``lora_A.default`` (``RANK x in``) and
  ``lora_B.default`` (``out x RANK``), and computes
  ``base(x) + B(A(x)) * alpha / RANK``; ``peft`` freezes every other
  parameter. The model keeps its class (no ``PeftModel`` around it), so
  wrap policies, blocks, logits and checkpoints work as before, under the
  parameters' new names (``...q_proj.base_layer.weight``,
  ``...q_proj.lora_A.default.weight``). The default targets are every
  linear layer inside the model's blocks (the units of its default wrap
  policy: a Llama's ``q_proj k_proj v_proj o_proj gate_proj up_proj
  down_proj``, shard's GPT's ``attn.qkv attn.proj mlp.fc mlp.proj``), not
  the embeddings or the output head.
- ``--freeze PATTERN`` sets ``requires_grad=False`` on every parameter one
  of whose qualified names (a tied parameter has several) matches the
  shell-style pattern (``fnmatch.fnmatchcase``: ``*``, ``?``, ``[...]``;
  ``*`` crosses dots). It runs after LoRA, so names are the adapted ones
  and adapters can be frozen too.

A pattern that matches no parameter, a target that names no module, and a
model left with nothing to train are errors naming the flag and the value:
a typo would otherwise train (or freeze) the wrong thing silently.

[Note: adapters on a model built on the meta device]
``shard train --hf-config`` builds the model on the meta device and gives
it values after sharding, module by module, from ``(seed, module name)``
(``_materialise.py``). Adapters are injected while it is still on meta, and
at materialisation:

- a base layer is seeded by the name it has without the adapter
  (:func:`seed_name`: ``...q_proj.base_layer`` is ``...q_proj``), so the
  frozen base is, bit for bit, the model ``shard train --hf-config`` starts
  from without ``--lora``;
- each LoRA layer gets ``peft``'s own initialisation
  (``reset_lora_parameters``: ``A`` Kaiming-uniform, ``B`` zeros) after its
  children had the model's, so at step 1 the adapted model computes what
  its base does.

A model built with its values (a preset, ``--model``) gets its adapters
from ``peft`` directly, from the global generator ``shard train`` seeds.

[Note: what a checkpoint holds when fine-tuning]
The checkpoint holds the whole model, frozen weights included, and AdamW's
state of the trainable parameters only (the optimizer is given nothing
else). Keeping the frozen weights costs their bytes on disk once per save
but makes a checkpoint complete on its own: a resume reads every weight
back instead of trusting that rebuilding the base from the seed gives the
same values, and ``shard ckpt consolidate`` exports the fine-tuned model
whole (adapters beside their bases, under ``peft``'s names).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Sequence
from fnmatch import fnmatchcase

import torch
from torch import nn

from shard_cli._blocks import find_blocks
from shard_cli._materialise import ModuleInit
from shard_cli._model_source import ModelSource
from shard_cli._options import TrainOptions
from shard_cli._strategy import resolve_policy

__all__ = [
    "PEFT_INSTALL",
    "Finetuning",
    "apply_finetuning",
    "check_peft",
    "default_lora_targets",
    "finetuned_source",
    "lora_module_init",
    "parameter_counts",
    "seed_name",
]

PEFT_INSTALL = (
    "pip install peft (or, from a shard checkout, pip install './packages/shard-cli[lora]'; "
    "never shard-cli from the public index, an unrelated project)"
)
"""How to install what ``--lora`` needs."""

_ADAPTER = "default"  # peft's adapter name: the parameters are ``lora_A.default.weight``
_BASE_LAYER = ".base_layer"


@dataclasses.dataclass(frozen=True)
class Finetuning:
    """What ``--lora``, ``--lora-alpha``, ``--lora-targets`` and ``--freeze`` ask for.

    Attributes:
        lora: The adapters' rank; ``None``: no adapters.
        lora_alpha: LoRA's ``alpha``; ``None``: ``2 * lora``.
        lora_targets: Module names (or dotted suffixes, as ``peft`` matches
            them) that get adapters; ``None``: :func:`default_lora_targets`.
        freeze: Shell-style patterns over parameter qualified names.
    """

    lora: int | None = None
    lora_alpha: float | None = None
    lora_targets: tuple[str, ...] | None = None
    freeze: tuple[str, ...] = ()

    @classmethod
    def of(cls, options: TrainOptions) -> Finetuning:
        """The fine-tuning a ``shard train`` run asks for."""
        return cls(
            lora=options.lora,
            lora_alpha=options.lora_alpha,
            lora_targets=options.lora_targets,
            freeze=options.freeze,
        )

    @property
    def active(self) -> bool:
        """Whether the model changes at all."""
        return self.lora is not None or bool(self.freeze)

    @property
    def alpha(self) -> float:
        """LoRA's ``alpha``: the given one, else twice the rank (a scale of 2)."""
        assert self.lora is not None
        return self.lora_alpha if self.lora_alpha is not None else 2.0 * self.lora


def check_peft() -> None:
    """Fail before training when ``--lora`` cannot import ``peft``.

    Raises:
        ValueError: ``peft`` is not installed (the message says how to install it).
    """
    try:
        importlib.import_module("peft")
    except ImportError as exc:
        raise ValueError(f"--lora needs the peft package: {PEFT_INSTALL}") from exc


def seed_name(name: str) -> str:
    """The name a module is seeded by: a LoRA base layer's is the one it had before the adapter.

    See [Note: adapters on a model built on the meta device].
    """
    return name.replace(_BASE_LAYER + ".", ".").removesuffix(_BASE_LAYER)


def lora_module_init(base: ModuleInit) -> ModuleInit:
    """``base`` (the model's initialisation), with ``peft``'s own for each LoRA layer.

    ``materialise`` calls it on each module after its children (post-order),
    so a LoRA layer's adapters, initialised by ``base`` as plain linear
    layers first, end with ``peft``'s values: ``A`` Kaiming-uniform, ``B``
    zeros. See [Note: adapters on a model built on the meta device].
    """
    from peft.tuners.lora import LoraLayer

    def init(root: nn.Module, module: nn.Module) -> None:
        if isinstance(module, LoraLayer):
            for adapter in module.lora_A:
                module.reset_lora_parameters(adapter, init_lora_weights=True)  # type: ignore[no-untyped-call]
            return
        base(root, module)

    return init


def _is_linear(module: nn.Module) -> bool:
    """A layer LoRA adapts by default: ``nn.Linear``, or ``transformers``' ``Conv1D`` (GPT-2)."""
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def default_lora_targets(model: nn.Module, source: ModelSource) -> list[str]:
    """Qualified names of every linear layer in ``model``'s blocks; see [Note: fine-tuning...].

    The blocks are the units of the model's default wrap policy (as for
    ``--activation-checkpointing``), so embeddings and the output head get
    no adapters.

    Raises:
        ValueError: the model has no blocks, or they hold no linear layer
            (the message asks for ``--lora-targets``).
    """
    try:
        blocks = find_blocks(
            model,
            resolve_policy(source.default_policy),
            what=source.description,
            flags="--lora",
        )
    except ValueError:
        blocks = []
    name_of = {id(module): name for name, module in model.named_modules()}
    targets = [
        name_of[id(module)]
        for block in blocks
        for module in block.modules()
        if _is_linear(module) and id(module) in name_of
    ]
    if not targets:
        raise ValueError(
            f"--lora: {source.description} has no blocks (repeated layers) with linear layers "
            "that shard finds to put adapters on; name the modules with --lora-targets "
            "(comma-separated, e.g. q_proj,v_proj)"
        )
    return targets


def _check_targets(model: nn.Module, targets: Sequence[str], what: str) -> None:
    """Each of ``--lora-targets`` names a module, as ``peft`` matches them (name or suffix)."""
    names = [name for name, _ in model.named_modules() if name]
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if _is_linear(m)})
    for target in targets:
        if not any(name == target or name.endswith("." + target) for name in names):
            raise ValueError(
                f"--lora-targets {target!r} names no module of {what}; give module names or "
                f"dotted suffixes of them; its linear layers are named {', '.join(linear)}"
            )


def _leaf_names(names: Sequence[str]) -> str:
    """The distinct last components of ``names``, in first-seen order, for a description."""
    return ", ".join(dict.fromkeys(name.rsplit(".", 1)[-1] for name in names))


def _freeze(model: nn.Module, patterns: Sequence[str], what: str) -> None:
    """Freeze the parameters matching ``patterns``; see [Note: fine-tuning before sharding]."""
    named = list(model.named_parameters(remove_duplicate=False))
    for pattern in patterns:
        matched = [param for name, param in named if fnmatchcase(name, pattern)]
        if not matched:
            examples = ", ".join(name for name, _ in named[:3])
            raise ValueError(
                f"--freeze {pattern!r} matches no parameter of {what}; patterns are shell-style "
                f"(fnmatch: * matches any characters, dots included) over qualified parameter "
                f"names such as {examples}"
            )
        for param in matched:
            param.requires_grad_(False)


def apply_finetuning(
    model: nn.Module, finetuning: Finetuning, *, targets: Sequence[str], what: str
) -> None:
    """Add LoRA adapters on ``targets`` and freeze, in place; see [Note: fine-tuning...].

    Raises:
        ValueError: ``peft`` refuses a target (one it cannot adapt), a
            ``--freeze`` pattern matches nothing, or nothing is left to train.
    """
    if finetuning.lora is not None:
        import peft

        config = peft.LoraConfig(
            r=finetuning.lora,
            # Annotated int, used as alpha / r: a float scale is what it computes.
            lora_alpha=finetuning.alpha,  # type: ignore[arg-type]
            target_modules=list(targets),
            lora_dropout=0.0,
            bias="none",
        )
        try:
            peft.inject_adapter_in_model(config, model, adapter_name=_ADAPTER)
        except ValueError as exc:
            raise ValueError(f"--lora: peft cannot adapt {what}: {exc}") from exc
    _freeze(model, finetuning.freeze, what)
    if not any(p.requires_grad for p in model.parameters()):
        flags = [f"--freeze {p!r}" for p in finetuning.freeze]
        if finetuning.lora is not None:
            flags.insert(0, f"--lora {finetuning.lora}")
        raise ValueError(
            f"{' with '.join(flags)} leaves no parameter of {what} to train; freeze fewer "
            "parameters (the patterns match every trainable one)"
        )


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) elements of ``model``'s parameters, each tensor once."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def finetuned_source(source: ModelSource, finetuning: Finetuning) -> ModelSource:
    """``source`` whose model gets ``finetuning`` each time it is built (``source`` if none).

    The model is built once on the meta device here, to resolve the default
    LoRA targets and to check the flags against it, so a bad one fails
    before any rank starts (and on every rank the same way).

    Raises:
        ValueError: ``peft`` is missing, or a flag does not fit the model (see
            :func:`apply_finetuning`).
    """
    if not finetuning.active:
        return source
    if finetuning.lora is not None:
        check_peft()
    with torch.device("meta"):
        probe = source.build()
    what = source.description
    if finetuning.lora_targets is not None:
        _check_targets(probe, finetuning.lora_targets, what)
        targets: list[str] = list(finetuning.lora_targets)
    elif finetuning.lora is not None:
        targets = default_lora_targets(probe, source)
    else:
        targets = []
    with torch.device("meta"):
        apply_finetuning(probe, finetuning, targets=targets, what=what)
    parts = []
    if finetuning.lora is not None:
        alpha = f"{finetuning.alpha:g}"
        parts.append(f"LoRA rank {finetuning.lora}, alpha {alpha} on {_leaf_names(targets)}")
    if finetuning.freeze:
        parts.append(f"frozen {', '.join(finetuning.freeze)}")

    def build() -> nn.Module:
        model = source.build()
        apply_finetuning(model, finetuning, targets=targets, what=what)
        return model

    init = source.init
    if init is not None and finetuning.lora is not None:
        init = lora_module_init(init)
    return dataclasses.replace(
        source,
        description=f"{what} + {'; '.join(parts)}",
        build=build,
        init=init,
        seed_name=seed_name if finetuning.lora is not None else source.seed_name,
    )
