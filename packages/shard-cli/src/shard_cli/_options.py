"""What a ``shard train`` run is: every choice, resolved, in one frozen dataclass.

The launcher and every rank resolve the same command line into the same
:class:`TrainOptions` (under ``torchrun`` on several machines each rank does it
on its own), and rank 0 writes it to the run directory as ``config.json``, so
``--resume`` restarts from exactly what the interrupted run did.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from shard_cli._comm_quant import parse_comm_quant
from shard_cli._presets import get_preset
from shard_cli._schedule import LR_SCHEDULES, LrSchedule

__all__ = [
    "FRONTENDS",
    "PRECISIONS",
    "STRATEGIES",
    "Frontend",
    "Precision",
    "Strategy",
    "TrainOptions",
    "check_finetuning_flags",
    "load_run_config",
    "normalise_names",
    "resolve_options",
]

Frontend = Literal["fully_shard", "wrapper"]
Strategy = Literal["full", "grad-op", "no-shard", "hybrid"]
Precision = Literal["fp32", "bf16"]

FRONTENDS: tuple[str, ...] = get_args(Frontend)
STRATEGIES: tuple[str, ...] = get_args(Strategy)
PRECISIONS: tuple[str, ...] = get_args(Precision)

# Options a resumed run may change; every other one must match the checkpoint's run.
RESUMABLE_CHANGES = frozenset(
    {
        "steps",
        "ckpt_every",
        "resume",
        "async_checkpoint",
        "keep_last",
        "sample_chars",
        "measure_step",
        "timeout_s",
        "max_restarts",
        # Checkpoints are keyed by parameter name and reshard on load (shard-checkpoint).
        "frontend",
        "strategy",
        "shard_size",
        "cpu_offload",
        "wrap_policy",
        # How activations are kept and blocks run, and where metrics go: same numbers.
        "activation_checkpointing",
        "compile",
        "tensorboard",
        "release_host_memory",
        # What crosses the wire; the checkpoint keeps full precision either way.
        "comm_quant",
    }
)


@dataclass(frozen=True)
class TrainOptions:
    """One ``shard train`` run.

    Attributes:
        preset: Model size and default settings (see ``shard train --help``).
        d_model: Width override; ``None`` keeps the preset's.
        n_heads: Attention heads override; ``None`` keeps the preset's.
        n_layers: Block count override; ``None`` keeps the preset's.
        seq: Sequence length (also the model's context).
        batch: Sequences per rank per micro-batch (per step: ``batch * grad_accum``).
        steps: Optimizer steps of the whole run (a resumed run continues to it).
        lr: AdamW learning rate (constant).
        seed: Seeds the model's initialization and every batch.
        nproc: Local ranks the launcher starts (ignored under ``torchrun``).
        frontend: ``fully_shard`` (per-parameter) or ``wrapper`` (flat parameters).
        strategy: ``full`` (FULL_SHARD), ``grad-op`` (SHARD_GRAD_OP),
            ``no-shard`` (NO_SHARD) or ``hybrid`` (HYBRID_SHARD).
        shard_size: Ranks per shard group for ``hybrid``; ``None``: the ranks
            of one machine (``LOCAL_WORLD_SIZE``).
        precision: ``fp32``, or ``bf16`` compute with fp32 gradient reduction.
        cpu_offload: Keep shards, gradients and optimizer state on the CPU.
        wrap_policy: ``blocks`` (each transformer block a unit), ``none`` (the
            root only), or a wrap policy registered by a plugin.
        run_dir: Where ``config.json``, ``metrics.jsonl``, ``summary.json``,
            ``training.png`` and ``sample.txt`` go.
        ckpt_dir: The checkpoint directory; ``None``: ``<run_dir>/checkpoint``.
        ckpt_every: Save every this many steps (and at the end); 0: only at the end.
        resume: Continue from the newest checkpoint in ``ckpt_dir`` (``True``);
            ``"latest-intact"``: from the newest that verifies when the newest
            is corrupt (see ``_train_checkpoint.py``).
        async_checkpoint: Write checkpoints in the background: training waits
            only while the state is copied to CPU memory.
        keep_last: Keep this many step checkpoints, removing older ones once a
            new one is complete and verified; ``None``: keep them all.
        sample_chars: Characters of text generated at the end (0: none).
        measure_step: The first of the five steps profiled for peak memory
            and communication time; ``None``: the second step of this launch.
        timeout_s: Collective timeout: a rank that stops answering ends the
            job after this long.
        max_restarts: How many times the launcher's elastic agent restarts
            every rank after one fails; each restart resumes from the run's
            last complete checkpoint (see ``_train.py``, [Note: restarts]).
            Ignored under ``torchrun``, which takes its own ``--max-restarts``.
        model: ``module:factory`` of the user's model instead of the preset's
            GPT (see ``_model_source.py``); its import path is recorded, so a
            resume checks it.
        hf_config: A local ``config.json`` of a ``transformers`` causal LM
            instead of the preset's GPT.
        data: A UTF-8 text file (one character per token) or a ``.bin`` of
            token ids; ``None``: shard's own sources.
        data_dtype: Element type of a ``.bin`` file: ``uint16`` or ``uint32``.
        warmup_steps: Steps of linear learning-rate warmup (0: none); see
            ``_schedule.py``.
        lr_schedule: ``constant`` (``lr`` after the warmup) or ``cosine``
            (from ``lr`` down to ``min_lr`` at the last step).
        min_lr: The learning rate the cosine ends at (``cosine`` only).
        clip_grad_norm: Clip the gradients to this global norm (across every
            shard) before each optimizer step; ``None``: no clipping.
        grad_accum: Micro-batches per optimizer step, each of ``batch``
            sequences per rank; gradients are reduced on the last one only.
        activation_checkpointing: Recompute each block's activations in
            backward instead of keeping them (same losses, less memory).
        compile: ``torch.compile`` each block's forward.
        tensorboard: Also write the metrics as TensorBoard events to
            ``<run_dir>/tensorboard`` (needs the tensorboard package).
        lora: Rank of the LoRA adapters added to the model (``peft``) before
            it is sharded; the base weights are frozen and only the adapters
            train. ``None``: no adapters. See ``_finetune.py``.
        lora_alpha: LoRA's ``alpha`` (the adapters' output is scaled by
            ``alpha / rank``); ``None``: ``2 * lora``.
        lora_targets: Names (or dotted suffixes of names) of the modules
            that get adapters; ``None``: every linear layer of the model's
            blocks (``_finetune.default_lora_targets``).
        freeze: Shell-style patterns (``fnmatch``) over parameter qualified
            names; matching parameters get ``requires_grad=False`` before
            sharding (after the LoRA adapters are added).
        comm_quant: What is quantized on the wire, as ``("weights=int8",
            "grads=int8")`` (see ``_comm_quant.py``); ``()``: nothing.
        release_host_memory: Give the heap memory each step freed back to
            the OS at the end of every backward
            (``shard_runtime.set_release_host_memory_after_backward``).
    """

    preset: str = "small"
    d_model: int | None = None
    n_heads: int | None = None
    n_layers: int | None = None
    seq: int = 64
    batch: int = 16
    steps: int = 400
    lr: float = 3e-3
    seed: int = 0
    nproc: int = 2
    frontend: Frontend = "fully_shard"
    strategy: Strategy = "full"
    shard_size: int | None = None
    precision: Precision = "fp32"
    cpu_offload: bool = False
    wrap_policy: str = "blocks"
    run_dir: str = "runs/shard-train"
    ckpt_dir: str | None = None
    ckpt_every: int = 50
    resume: bool | Literal["latest-intact"] = False
    async_checkpoint: bool = False
    keep_last: int | None = None
    sample_chars: int = 200
    measure_step: int | None = None
    timeout_s: float = 300.0
    max_restarts: int = 0
    model: str | None = None
    hf_config: str | None = None
    data: str | None = None
    data_dtype: str = "uint16"
    warmup_steps: int = 0
    lr_schedule: LrSchedule = "constant"
    min_lr: float = 0.0
    clip_grad_norm: float | None = None
    grad_accum: int = 1
    activation_checkpointing: bool = False
    compile: bool = False
    tensorboard: bool = False
    lora: int | None = None
    lora_alpha: float | None = None
    lora_targets: tuple[str, ...] | None = None
    freeze: tuple[str, ...] = ()
    comm_quant: tuple[str, ...] = ()
    release_host_memory: bool = False

    def __post_init__(self) -> None:
        # JSON (config.json), a config file and argparse give lists or a comma-separated
        # string; the options hold tuples, so that equal runs compare equal.
        for name in ("lora_targets", "freeze"):
            object.__setattr__(self, name, normalise_names(name, getattr(self, name)))
        object.__setattr__(self, "comm_quant", parse_comm_quant(self.comm_quant))
        get_preset(self.preset)
        if self.model and self.hf_config:
            raise ValueError("give one model, got --model and --hf-config")
        if self.model or self.hf_config:
            sizes = {"d_model": self.d_model, "heads": self.n_heads, "layers": self.n_layers}
            set_ = [f"--{name.replace('_', '-')}" for name, value in sizes.items() if value]
            if set_:
                raise ValueError(
                    f"{' and '.join(set_)} size the preset's GPT, not --model or --hf-config; "
                    "size your own model in its factory or config"
                )
        if self.data_dtype not in ("uint16", "uint32"):
            raise ValueError(f"--data-dtype must be uint16 or uint32, got {self.data_dtype!r}")
        choices = (
            ("frontend", self.frontend, FRONTENDS),
            ("strategy", self.strategy, STRATEGIES),
            ("precision", self.precision, PRECISIONS),
            ("lr-schedule", self.lr_schedule, LR_SCHEDULES),
        )
        for name, value, allowed in choices:
            if value not in allowed:
                raise ValueError(f"--{name} must be one of {', '.join(allowed)}, got {value!r}")
        positive = {
            "seq": self.seq,
            "batch": self.batch,
            "steps": self.steps,
            "nproc": self.nproc,
            "grad-accum": self.grad_accum,
        }
        for name, number in positive.items():
            if number < 1:
                raise ValueError(f"--{name} must be at least 1, got {number}")
        if self.ckpt_every < 0:
            raise ValueError(
                f"--ckpt-every must be 0 (only at the end) or more, got {self.ckpt_every}"
            )
        if self.resume not in (False, True, "latest-intact"):
            raise ValueError(f"--resume takes latest or latest-intact, got {self.resume!r}")
        if self.keep_last is not None and self.keep_last < 1:
            raise ValueError(
                f"--keep-last must be at least 1 (the newest checkpoint), got {self.keep_last}; "
                "leave it out to keep every checkpoint"
            )
        if self.max_restarts < 0:
            raise ValueError(
                f"--max-restarts must be 0 (a failed rank ends the run) or more, "
                f"got {self.max_restarts}"
            )
        if self.shard_size is not None and self.shard_size < 1:
            raise ValueError(f"--shard-size must be at least 1, got {self.shard_size}")
        self._check_optimization()
        check_finetuning_flags(
            lora=self.lora,
            lora_alpha=self.lora_alpha,
            lora_targets=self.lora_targets,
            freeze=self.freeze,
        )

    def _check_optimization(self) -> None:
        """The learning-rate schedule and clipping flags are in range and consistent."""
        if not self.lr > 0:
            raise ValueError(f"--lr must be more than 0, got {self.lr}")
        if not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(
                f"--warmup-steps must be between 0 and --steps ({self.steps}), "
                f"got {self.warmup_steps}"
            )
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"--min-lr must be between 0 and --lr ({self.lr}), got {self.min_lr}")
        if self.min_lr and self.lr_schedule != "cosine":
            raise ValueError(
                f"--min-lr {self.min_lr} needs --lr-schedule cosine (a constant schedule "
                "stays at --lr); drop --min-lr or pass --lr-schedule cosine"
            )
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ValueError(
                f"--clip-grad-norm must be more than 0, got {self.clip_grad_norm}; "
                "leave it out to train without clipping"
            )

    @property
    def checkpoint_path(self) -> Path:
        """Where the checkpoint is written and read."""
        return Path(self.ckpt_dir) if self.ckpt_dir else Path(self.run_dir) / "checkpoint"

    def to_json(self) -> dict[str, Any]:
        """The options as a JSON object (``config.json``): tuples as the lists JSON reads back."""
        return {
            key: list(value) if isinstance(value, tuple) else value
            for key, value in dataclasses.asdict(self).items()
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainOptions:
        """Options from ``config.json``; unknown keys are an error naming them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(
                f"config.json has options this shard-cli does not know: {', '.join(unknown)}; "
                "resume with the shard-cli version that wrote it"
            )
        return cls(**data)


def check_finetuning_flags(
    *,
    lora: int | None,
    lora_alpha: float | None,
    lora_targets: tuple[str, ...] | None,
    freeze: tuple[str, ...],
) -> None:
    """``--lora``, ``--lora-alpha``, ``--lora-targets`` and ``--freeze`` are consistent.

    For ``shard train`` and ``shard plan`` alike; whether patterns and
    targets match anything is checked against the model (``_finetune.py``),
    before any rank starts.

    Raises:
        ValueError: a flag is out of range, or configures adapters without ``--lora``.
    """
    if lora is not None and lora < 1:
        raise ValueError(f"--lora must be at least 1 (the adapters' rank), got {lora}")
    if lora is None:
        given = [
            flag
            for flag, value in (("--lora-alpha", lora_alpha), ("--lora-targets", lora_targets))
            if value is not None
        ]
        if given:
            raise ValueError(
                f"{' and '.join(given)} configure LoRA adapters, which need --lora RANK; "
                "add --lora 8, say, or drop them"
            )
    if lora_alpha is not None and not lora_alpha > 0:
        raise ValueError(f"--lora-alpha must be more than 0, got {lora_alpha}")
    if lora_targets is not None and (not lora_targets or not all(lora_targets)):
        raise ValueError(
            "--lora-targets must name modules, separated by commas (q_proj,v_proj), got "
            f"{','.join(lora_targets)!r}"
        )
    if not all(pattern.strip() for pattern in freeze):
        raise ValueError("--freeze needs a pattern over parameter names, got an empty one")


def normalise_names(name: str, value: Any) -> Any:
    """``lora_targets`` and ``freeze`` as tuples of strings; other values unchanged.

    ``--lora-targets`` is one comma-separated string on the command line and
    in a config file; ``--freeze`` is repeated (a list) or, in a config file,
    a list or one string; ``config.json`` stores both as lists.
    """
    if name not in ("lora_targets", "freeze") or value is None:
        return value
    if isinstance(value, str):
        items = value.split(",") if name == "lora_targets" else [value]
        return tuple(item.strip() for item in items)
    if isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
        return tuple(value)
    raise ValueError(f"--{name.replace('_', '-')} takes names, got {value!r}")


def _shown(value: Any) -> str:
    """An option's value in an error message: names joined by commas, ``None`` as none."""
    if isinstance(value, tuple):
        return ",".join(value) or "none"
    return "none" if value is None else str(value)


def load_run_config(run_dir: str | Path) -> TrainOptions:
    """The options stored in ``<run_dir>/config.json``.

    Raises:
        FileNotFoundError: the run directory has no ``config.json`` (the
            message says how to start a run there).
    """
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"--resume: {path} does not exist; start the run first (shard train --run-dir "
            f"{run_dir}), or pass the --run-dir of an interrupted run"
        )
    data = json.loads(path.read_text(encoding="utf-8"))
    return TrainOptions.from_json(data)


def resolve_options(given: dict[str, Any]) -> TrainOptions:
    """The run that the flags ``given`` on the command line describe.

    ``given`` holds only the flags the user wrote. A new run takes the rest
    from the preset (``steps``, ``batch``, ``seq``, ``lr``) and the defaults;
    with ``resume`` set, the run continues the one stored in
    ``<run_dir>/config.json`` and only ``steps``, ``ckpt_every``,
    ``sample_chars``, ``measure_step``, ``timeout_s``, ``max_restarts``,
    how the model is sharded (``frontend``, ``strategy``, ``shard_size``, ``cpu_offload``,
    ``wrap_policy``) and how it runs (``activation_checkpointing``, ``compile``,
    ``tensorboard``, ``release_host_memory``) may change; ``steps`` not under a cosine schedule.

    Raises:
        ValueError: a flag is out of range, or a resume changes an option the
            checkpoint depends on (the message names it and the stored value).
        FileNotFoundError: ``resume`` without a ``config.json`` to resume.
    """
    given = {name: normalise_names(name, value) for name, value in given.items()}
    if given.get("resume") == "latest":  # --resume latest (or in a config file): --resume
        given["resume"] = True
    if given.get("resume"):
        stored = load_run_config(given.get("run_dir", TrainOptions.run_dir))
        changes: dict[str, Any] = {"resume": given["resume"]}
        for name, value in given.items():
            if name in RESUMABLE_CHANGES:
                changes[name] = value
            elif name not in ("run_dir", "ckpt_dir") and value != getattr(stored, name):
                flag = "--" + name.replace("_", "-")
                was = _shown(getattr(stored, name))
                raise ValueError(
                    f"--resume: {flag} {_shown(value)} differs from the interrupted run's "
                    f"{was} (config.json); a resumed run keeps the model, data, precision"
                    f" and world size of its checkpoint: drop {flag}"
                )
        if stored.lr_schedule == "cosine" and given.get("steps", stored.steps) != stored.steps:
            raise ValueError(
                f"--resume: --steps {given['steps']} differs from the interrupted run's "
                f"{stored.steps}, over which its cosine learning rate decays; a resumed cosine "
                f"run keeps its --steps: drop --steps"
            )
        for name in ("run_dir", "ckpt_dir"):
            if name in given:
                changes[name] = given[name]
        return dataclasses.replace(stored, **changes)
    preset = get_preset(given.get("preset", TrainOptions.preset))
    defaults: dict[str, Any] = {
        "steps": preset.steps,
        "batch": preset.batch,
        "seq": preset.seq_len,
        "lr": preset.lr,
    }
    return TrainOptions(**{**defaults, **given})
