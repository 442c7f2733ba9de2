"""One rank of ``shard train``: build, shard, train, checkpoint, measure, report.

Every rank runs :func:`run_worker`, whether the launcher started it on this
machine or ``torchrun`` started it on one of several; rank 0 also writes the
run directory and prints. See ``_launch.py`` for how ranks are started and
stopped, and [Note: batches from the step alone] for why resuming is exact.

[Note: a step]
A step is: the step's learning rate into AdamW (``_schedule.py``), this
rank's batch, forward, ``cross_entropy`` in float32, backward (the runtime
reduce-scatters the gradients), with ``--clip-grad-norm`` the gradients
clipped to a global norm, ``AdamW.step()``, then ``zero_grad`` (gradients
freed). The loss shown is the average over ranks.

[Note: gradient accumulation]
With ``--grad-accum K`` the step draws one batch of ``K * batch`` rows for
``(seed, step, rank)`` and runs it as ``K`` micro-batches of ``batch`` rows,
each loss divided by ``K``: the gradient is the one of the whole batch, so
``--grad-accum K --batch B`` trains as ``--batch K*B`` does (up to the order
of float additions) in a ``K``-th of the activation memory. Gradients are
reduced on the last micro-batch only: before it, ``fully_shard`` models get
``set_requires_gradient_sync(False)`` and wrapper models run under
``no_sync()``, so each rank accumulates its full, unreduced gradients
locally. The step's loss is the mean of its micro-batches' losses.
The clipped norm is the norm of the whole model's gradient: under
``fully_shard`` the gradients are DTensors, whose norm
``torch.nn.utils.get_total_norm`` reduces across shards (and replicas);
the wrapper's own ``clip_grad_norm_`` does the same for flat parameters.
Five consecutive steps (``_measured_steps.py``; from ``--measure-step``, by
default the second of the launch, up to the last) run under the profiler and
the collective counters; the summary reports their communication bytes per
kind, their communication and compute time, and the lowest of their peaks:
gloo frees a collective's buffers from its own thread when the collective is
done, a moment that varies from step to step by up to one unit's buffers,
and the lowest peak is the one that does not include that accident
(``summary.json`` keeps the highest too). What each rank holds is measured
right after the last one's optimizer step (gradients still there).

[Note: restarts]
Under ``--max-restarts N`` (or ``torchrun --max-restarts``) the elastic agent
restarts every rank after one fails, and sets ``TORCHELASTIC_RESTART_COUNT``
to the attempt. A restarted rank resumes as ``--resume`` would, from the
checkpoint in the run's checkpoint directory, if that checkpoint is complete
(an interrupted save leaves the previous one in place) and was written by
this launch (``_train_checkpoint.launch_id``) or the launch itself resumed;
otherwise it starts over from step 1. Every rank decides alone from the same
files (the agent has stopped all ranks before it starts new ones), so the
ranks agree without a collective. The resumed losses equal an uninterrupted
run's bit for bit: a step's batch depends only on ``(seed, step, rank)``
([Note: batches from the step alone]), the global random generator is
reseeded from the same triple before every step (so dropout, were a model
to use it, would not depend on how many steps this process ran), and the
checkpoint holds the parameters and AdamW's state (its step count
included) exactly. ``SHARD_TRAIN_TEST_KILL_AT_STEP``, for tests only,
makes a rank SIGKILL itself at a chosen point of a step of each attempt
(``_kill_switch.py``).

[Note: failure messages name the user's step]
Every step first tells the flight recorder its number
(``shard_comms.set_training_step``), so a collective that fails in step 5
(the step 5 of the progress line, after a resume too) is reported as step
5, and the loss's all-reduce at the end of the step goes through shard's
``all_reduce`` (labelled ``loss``) so that a rank lost in the optimizer step
is named like one lost in forward or backward. A rank lost during a
checkpoint save fails the save's own collectives, which shard does not
record; ``run_worker`` still exchanges the flight records then
(``collective_failure`` with no entry), so the dead rank is named too. Under ``shard train`` the
c10d store lives in the launcher (``_launch.py``), so the survivors of any
rank, rank 0 included, exchange their records; a survivor the launcher
stops first still writes what it knows (shard-comms' ``_terminate.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from shard_cli._activations import ActivationProfile, lm_activation_profile
from shard_cli._blocks import checkpointed_blocks, find_blocks, wrap_blocks
from shard_cli._comm_quant import apply_comm_quant
from shard_cli._corpus import CharCorpus, TokenFile, fingerprint, load_data
from shard_cli._finetune import Finetuning, finetuned_source, parameter_counts
from shard_cli._kill_switch import KillSwitch, kill_point
from shard_cli._measured_steps import MeasuredSteps
from shard_cli._model_source import (
    ModelSource,
    build_for_training,
    load_model_source,
    logits_from,
    materialise_sharded,
)
from shard_cli._options import TrainOptions
from shard_cli._plan import (
    MemoryEstimate,
    PlanConfig,
    estimate_memory,
    plan_model_units,
    unsharded_memory,
)
from shard_cli._presets import get_preset
from shard_cli._progress import Progress
from shard_cli._report import summary_lines
from shard_cli._schedule import lr_at
from shard_cli._strategy import compute_dtype, resolve_policy, shard_layout, shard_model
from shard_cli._summary import RunSummary
from shard_cli._tensorboard import MetricsWriter
from shard_cli._train_checkpoint import TrainCheckpointer, launch_id, load_training, read_info
from shard_cli.gpt import GPT, GPTConfig
from shard_comms import (
    CommCounts,
    all_reduce,
    get_device_handle,
    init_distributed,
    set_training_step,
)
from shard_comms.plumbing import SHARD_STORE_ENV, collective_failure
from shard_core.errors import CollectiveError, ShardError
from shard_runtime import (
    FSDPModule,
    FullyShardedDataParallel,
    set_release_host_memory_after_backward,
)

__all__ = ["predict", "predict_ranks", "run_worker"]


def restart_attempt() -> int:
    """Which attempt of the job this process is: 0, or the restart's number (elastic agent)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def restart_options(options: TrainOptions, attempt: int) -> tuple[TrainOptions, str, bool]:
    """The options a restarted rank runs with, what rank 0 says, and whether nothing is left.

    See [Note: restarts]: resume from the checkpoint when it is this launch's
    (or the launch resumed), else start over. Nothing is left when the
    checkpoint is the run's last step (a rank failed after training, while
    sampling or writing the summary): the trained model is saved, and a
    restart has nothing to redo.
    """
    info = read_info(options.checkpoint_path)
    where = options.checkpoint_path
    if info is not None and (options.resume or (info.launch and info.launch == launch_id())):
        if info.step >= options.steps:
            note = (
                f"shard train: restart {attempt} after a rank failed: the checkpoint at {where} "
                f"is at the last step ({info.step}); training is complete, nothing to redo"
            )
            return options, note, True
        note = (
            f"shard train: restart {attempt} after a rank failed: resuming from the "
            f"checkpoint at step {info.step} ({where})"
        )
        # The user's --resume latest-intact stays; a plain restart refuses a corrupt checkpoint.
        resume = options.resume or True
        return dataclasses.replace(options, resume=resume), note, False
    note = (
        f"shard train: restart {attempt} after a rank failed: no checkpoint of this run "
        f"yet at {where}, starting over from step 1"
    )
    return options, note, False


def _check_restart_store() -> None:
    """Refuse a restart whose ranks would rendezvous through the previous attempt's store.

    Under ``torchrun`` the agent shares its TCPStore with the ranks and keeps
    it across restarts; the new process group would read the dead ranks'
    addresses from it and fail with gloo's or NCCL's connection errors
    (pytorch/pytorch#135712). ``shard train``'s launcher avoids it (its own
    store, one prefix per attempt); a bare ``torchrun --max-restarts`` needs
    the variable named below.
    """
    if os.environ.get(SHARD_STORE_ENV):
        return
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise RuntimeError(
            "restarted by torchrun's elastic agent with its shared TCPStore, which still "
            "holds the previous attempt's addresses, so the ranks cannot connect "
            "(pytorch/pytorch#135712); set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the "
            "environment of torchrun (shard train --max-restarts does)"
        )


def _seed_step(seed: int, step: int, rank: int) -> None:
    """Reseed the global generators from ``(seed, step, rank)``; see [Note: restarts]."""
    # Another salt than the batch's generator (_corpus.py), so the two streams differ.
    torch.manual_seed(((seed * 1_000_003 + step) * 65_537 + rank) * 31 + 7 & (2**63 - 1))


def model_config(options: TrainOptions, vocab_size: int) -> GPTConfig:
    """The model ``options`` describe, over a vocabulary of ``vocab_size`` characters."""
    return get_preset(options.preset).config(
        vocab_size=vocab_size,
        seq_len=options.seq,
        d_model=options.d_model,
        n_heads=options.n_heads,
        n_layers=options.n_layers,
    )


def gpt_source(config: GPTConfig, preset: str) -> ModelSource:
    """The preset's GPT as a model source (its vocabulary is the data's)."""
    return ModelSource(
        description=f"preset {preset}",
        build=lambda: GPT(config),
        vocab_size=config.vocab_size,
        seq=config.seq_len,
        batch=0,
        logits_of=None,
        default_policy="blocks",
    )


def wrap_policy_name(options: TrainOptions, source: ModelSource) -> str:
    """The wrap policy of the run: ``blocks`` means the source's default for a user's model.

    ``blocks`` names shard's GPT blocks, which a user's model does not have;
    its default (the ``transformer`` policy when registered: each repeated
    layer a unit) is what ``shard plan --wrap-policy auto`` picks for it, and
    a model without repeated layers (the policy finds none) is one unit.
    """
    if options.wrap_policy != "blocks" or not (options.model or options.hf_config):
        return options.wrap_policy
    if source.default_policy == "none":
        return "none"
    try:
        with torch.device("meta"):
            plan_model_units(source.build(), resolve_policy(source.default_policy))
    except ShardError:
        return "none"
    return source.default_policy


def predict(
    source: ModelSource, options: TrainOptions, world: int, rank: int = 0, policy: str = ""
) -> tuple[MemoryEstimate, MemoryEstimate]:
    """``shard plan``'s estimate for ``rank`` of this run, and for one unsharded process."""
    estimates, single = predict_ranks(source, options, world, [rank], policy)
    return estimates[0], single


def predict_ranks(
    source: ModelSource,
    options: TrainOptions,
    world: int,
    ranks: Sequence[int],
    policy: str = "",
) -> tuple[list[MemoryEstimate], MemoryEstimate]:
    """``shard plan``'s estimate for each of ``ranks``, and for one unsharded process.

    The activation profile (a fake forward and backward) is traced once per
    dtype for all of them.

    A user's model whose fake forward fails is estimated without activations.
    The model is ``source``'s as built, with its frozen parameters
    (``--lora``/``--freeze``): only the trainable ones count for gradients
    and AdamW state.
    With ``--activation-checkpointing`` the blocks it applies to (``_blocks.py``)
    keep only their inputs until their backward recomputes the rest.
    """
    with torch.device("meta"):
        model = source.build()
        units = plan_model_units(model, resolve_policy(policy or wrap_policy_name(options, source)))
    names = [u.name for u in units]
    checkpointed = checkpointed_blocks(model, source) if options.activation_checkpointing else []
    vocab = source.vocab_size

    def profile(dtype: torch.dtype) -> ActivationProfile | None:
        if vocab is None:
            return None
        try:
            return lm_activation_profile(
                source.build,
                names,
                batch=options.batch,
                seq=options.seq,
                vocab_size=vocab,
                dtype=dtype,
                logits_of=source.logits_of,
            )
        except Exception:  # a user's model the fake forward cannot run
            if source.logits_of is None:  # shard's own GPT: a bug, say it
                raise
            return None

    plan_config = PlanConfig(
        frontend=options.frontend,
        strategy=options.strategy,
        world=world,
        shard_size=shard_layout(options.strategy, world, options.shard_size).shard,
        precision=options.precision,
        cpu_offload=options.cpu_offload,
        # shard_model's use_orig_params: the wrapper's choice when a parameter is frozen.
        orig_params=any(u.frozen for u in units),
    )
    dtype = compute_dtype(options.precision)
    activations = profile(dtype)
    estimates = [
        estimate_memory(
            units, plan_config, activations=activations, rank=rank, checkpointed=checkpointed
        )
        for rank in ranks
    ]
    unsharded = activations if dtype == torch.float32 else profile(torch.float32)
    return estimates, unsharded_memory(units, activations=unsharded, checkpointed=checkpointed)


def model_vocab(source: ModelSource, model: nn.Module, data_vocab: int, data: str | None) -> int:
    """The model's vocabulary (logits per token); an error when the data's does not fit.

    A factory's model says it only through its output, so one token goes
    through it (on the meta device when the model is there: shapes only).
    """
    vocab = source.vocab_size
    if vocab is None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
        with torch.no_grad():
            tokens = torch.zeros(1, 1, dtype=torch.long, device=device)
            vocab = int(logits_from(model(tokens)).shape[-1])
    if vocab < data_vocab and data is not None and Path(data).suffix == ".bin":
        raise ValueError(
            f"{source.description} has a vocabulary of {vocab} tokens but --data {data} holds "
            f"token id {data_vocab - 1}; give the model a vocabulary of at least {data_vocab} "
            "(vocab_size in its config or factory), or check --data-dtype"
        )
    if vocab < data_vocab:
        what = data or "shard's sources"
        raise ValueError(
            f"{source.description} has a vocabulary of {vocab} tokens but the data "
            f"({what}) has {data_vocab}; give the model a vocabulary of "
            f"at least {data_vocab} (vocab_size in its config or factory)"
        )
    return vocab


def preflight(options: TrainOptions) -> None:
    """Before any rank starts: the user's model imports, builds and fits the data, and the
    fine-tuning flags fit the model.

    The model is built on the meta device, so this costs no memory; each rank
    checks again (under ``torchrun`` there is no launcher to do it).

    Raises:
        ValueError: the model or the data cannot be loaded, or the data's
            vocabulary is larger than the model's (the message says which).
    """
    if not (options.model or options.hf_config or Finetuning.of(options).active):
        return
    corpus = load_data(options.data, options.data_dtype)
    source = training_source(options, corpus.vocab_size)
    with torch.device("meta"):
        model = source.build()
    model_vocab(source, model, corpus.vocab_size, options.data)


def training_source(options: TrainOptions, data_vocab: int) -> ModelSource:
    """The model ``options`` train: the preset's GPT over the data's vocabulary, or the user's,
    with the fine-tuning flags applied (``_finetune.py``).

    Raises:
        ValueError: the model cannot be loaded, or a fine-tuning flag does not fit it.
    """
    if options.model or options.hf_config:
        source = load_model_source(model=options.model, hf_config=options.hf_config)
    else:
        source = gpt_source(model_config(options, data_vocab), options.preset)
    return finetuned_source(source, Finetuning.of(options))


class _Run:
    """The state of one rank's run."""

    def __init__(self, options: TrainOptions) -> None:
        self.options = options
        dist_state = init_distributed(timeout=options.timeout_s)
        self.rank = dist_state.rank
        self.world = dist_state.world_size
        self.device = dist_state.device
        self.backend = dist_state.backend
        if self.device.type == "cpu":
            local = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
        self.run_dir = Path(options.run_dir)
        self.corpus: CharCorpus | TokenFile = load_data(options.data, options.data_dtype)
        self.data_fingerprint = fingerprint(self.corpus)
        self.config: GPTConfig | None = None
        if not (options.model or options.hf_config):
            self.config = model_config(options, self.corpus.vocab_size)
        # With --lora/--freeze the source's model comes adapted and frozen (_finetune.py).
        self.source = training_source(options, self.corpus.vocab_size)
        self._check_vocab()
        torch.manual_seed(options.seed)
        # A transformers model starts on the meta device, filled shard by shard after
        # fully_shard (_materialise.py); other models are built as their constructor makes them.
        model = build_for_training(
            self.source,
            sharded_later=options.frontend == "fully_shard",
            device=self.device,
            seed=options.seed,
        )
        self.vocab_size = self._model_vocab(model)
        self.policy = wrap_policy_name(options, self.source)
        # Test hook, see [Note: restarts].
        self.kill = KillSwitch(kill_point(self.rank, self.world, restart_attempt()))
        self.kill.arm_forward(model)
        self._wrap_blocks(model)
        self.trainable, self.parameters = parameter_counts(model)
        layout = shard_layout(options.strategy, self.world, options.shard_size)
        self.model, self.mesh = shard_model(
            model,
            frontend=options.frontend,
            strategy=options.strategy,
            layout=layout,
            precision=options.precision,
            cpu_offload=options.cpu_offload,
            policy=resolve_policy(self.policy),
            device=self.device,
            use_orig_params=self.trainable < self.parameters,
        )
        apply_comm_quant(self.model, options.comm_quant)
        set_release_host_memory_after_backward(options.release_host_memory)
        materialise_sharded(
            self.model,
            self.source,
            device=self.device,
            seed=options.seed,
            cpu_offload=options.cpu_offload,
        )
        # Only what trains: frozen parameters would get no state anyway (no gradient), but
        # an optimizer that never sees them cannot step them by mistake.
        self.optim = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=options.lr
        )
        self.metrics_writer: MetricsWriter | None = None
        self.start = 0
        self.current_step = 0
        self.mesh_for_ckpt: DeviceMesh | None = (
            None if options.strategy == "no-shard" and options.frontend == "wrapper" else self.mesh
        )
        self.checkpointer = TrainCheckpointer(
            options.checkpoint_path,
            asynchronous=options.async_checkpoint,
            keep_last=options.keep_last,
            resumed=bool(options.resume),
        )

    # ------------------------------------------------------------------ setup

    def _wrap_blocks(self, model: nn.Module) -> None:
        """Checkpoint and/or compile each block; see ``_blocks.py``."""
        o = self.options
        if not (o.activation_checkpointing or o.compile):
            return
        flags = " and ".join(
            f
            for f, on in (
                ("--activation-checkpointing", o.activation_checkpointing),
                ("--compile", o.compile),
            )
            if on
        )
        policy = resolve_policy(self.source.default_policy)
        blocks = find_blocks(model, policy, what=self.source.description, flags=flags)
        wrap_blocks(blocks, checkpointing=o.activation_checkpointing, compile=o.compile)

    def _data_vocab(self) -> str | int:
        """What the data's tokens are: its characters, or a token file's vocabulary size."""
        return self.corpus.vocab if isinstance(self.corpus, CharCorpus) else self.corpus.vocab_size

    def _model_vocab(self, model: nn.Module) -> int:
        return model_vocab(self.source, model, self.corpus.vocab_size, self.options.data)

    def _logits(self, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        return logits_from(model(tokens))

    def _check_vocab(self) -> None:
        path = self.run_dir / "model.json"
        if self.options.resume and path.is_file():
            stored = json.loads(path.read_text(encoding="utf-8"))
            if stored.get("source", self.source.description) != self.source.description:
                raise RuntimeError(
                    f"--resume: {self.run_dir} trained {stored['source']}, not "
                    f"{self.source.description}; resume with the same model, or start a new "
                    "run with another --run-dir"
                )
            if stored["vocab"] != self._data_vocab():
                raise RuntimeError(
                    f"--resume: the training data's tokens changed since {self.run_dir} "
                    "was started (its file, or shard's sources, were edited), so the "
                    "checkpoint's embedding does not fit; start a new run with another --run-dir"
                )
            self._check_same_data(stored.get("data"))

    def _check_same_data(self, stored: Any) -> None:
        """The data of the run, if its path is the one the run started with, is unchanged.

        See [Note: batches from the step alone] in ``_corpus.py``: the same
        path with other contents would silently train on other batches. Another
        ``--data`` is the user's choice, and is trained on.
        """
        if not isinstance(stored, dict) or stored.get("path") != self.options.data:
            return
        if stored.get("fingerprint") == self.data_fingerprint:
            return
        what = (
            f"--data {self.options.data}"
            if self.options.data
            else "shard's sources (the installed shard packages were edited or upgraded)"
        )
        raise RuntimeError(
            f"--resume: the training data changed since {self.run_dir} was started: {what} "
            f"holds other text now (fingerprint {self.data_fingerprint}, the run started with "
            f"{stored.get('fingerprint')}), so the steps to come would draw other batches than "
            "an uninterrupted run; put the data back as it was, or start a new run with "
            "another --run-dir"
        )

    def prepare(self) -> None:
        """Resume from the checkpoint, or start the run directory."""
        options = self.options
        if options.resume:
            self.start = load_training(
                options.checkpoint_path,
                model=self.model,
                optim=self.optim,
                frontend=options.frontend,
                mesh=self.mesh_for_ckpt,
                fallback=options.resume == "latest-intact",
            )
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.json").write_text(
                json.dumps(options.to_json(), indent=2) + "\n", encoding="utf-8"
            )
            (self.run_dir / "model.json").write_text(
                json.dumps(
                    {
                        "source": self.source.description,
                        "config": asdict(self.config) if self.config else None,
                        "vocab": self._data_vocab(),
                        "data": {"path": options.data, "fingerprint": self.data_fingerprint},
                        "vocab_size": self.vocab_size,
                        "parameters": self.parameters,
                    },
                    indent=2,
                )
                + "\n",
                encoding="utf-8",
            )
            metrics = self.run_dir / "metrics.jsonl"
            kept = []
            if options.resume and metrics.is_file():
                for line in metrics.read_text(encoding="utf-8").splitlines():
                    if line and json.loads(line)["step"] <= self.start:
                        kept.append(line + "\n")
            metrics.write_text("".join(kept), encoding="utf-8")
            if options.tensorboard:
                self.metrics_writer = MetricsWriter(self.run_dir)
        dist.barrier()

    # ------------------------------------------------------------------ steps

    def _batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All micro-batches of ``step`` on this rank; see [Note: gradient accumulation]."""
        options = self.options
        x, y = self.corpus.batch(
            step=step,
            rank=self.rank,
            batch=options.batch * options.grad_accum,
            seq=options.seq,
            seed=options.seed,
        )
        return x.to(self.device), y.to(self.device)

    def _lr(self, step: int) -> float:
        o = self.options
        return lr_at(
            step,
            lr=o.lr,
            steps=o.steps,
            warmup_steps=o.warmup_steps,
            schedule=o.lr_schedule,
            min_lr=o.min_lr,
        )

    def _gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager[None]:
        """Reduce gradients in the next backward or not; see [Note: gradient accumulation]."""
        if isinstance(self.model, FSDPModule):
            self.model.set_requires_gradient_sync(enabled)
            return contextlib.nullcontext()
        if isinstance(self.model, FullyShardedDataParallel) and not enabled:
            return self.model.no_sync()
        return contextlib.nullcontext()

    def _clip(self, max_norm: float) -> float:
        """Clip the gradients to ``max_norm``; the norm before clipping (collective)."""
        if isinstance(self.model, FullyShardedDataParallel):
            return float(self.model.clip_grad_norm_(max_norm))
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return float(norm)

    def _step(self, step: int) -> tuple[torch.Tensor, float | None]:
        """One optimizer step: its loss and the pre-clip gradient norm; see [Note: a step]."""
        for group in self.optim.param_groups:
            group["lr"] = self._lr(step)
        accum = self.options.grad_accum
        inputs, targets = self._batch(step)
        total = torch.zeros((), device=self.device)
        for index, (x, y) in enumerate(zip(inputs.chunk(accum), targets.chunk(accum), strict=True)):
            last = index == accum - 1
            with self._gradient_sync(last):
                logits = self._logits(self.model, x)
                loss = F.cross_entropy(logits.float().reshape(-1, self.vocab_size), y.reshape(-1))
                self.kill.watch_loss(loss)
                (loss / accum if accum > 1 else loss).backward()  # type: ignore[no-untyped-call]
            total += loss.detach()
        max_norm = self.options.clip_grad_norm
        norm = self._clip(max_norm) if max_norm is not None else None
        self.kill.at("optimizer")
        self.optim.step()
        return (total / accum if accum > 1 else total), norm

    def train(self) -> RunSummary:
        """Run the steps from the checkpoint (or 1) to ``--steps``; rank 0 reports."""
        options = self.options
        first = self._first_step()
        measured = MeasuredSteps.of(first, options.steps, options.measure_step)
        progress = Progress(sys.stdout, first=first, last=options.steps, tty=sys.stdout.isatty())
        if self.rank == 0:
            print(self._banner(first), flush=True)
        tokens_per_step = self.world * options.batch * options.grad_accum * options.seq
        losses: list[float] = []
        handle = get_device_handle(self.device.type)
        handle.reset_peak_memory_stats()
        started = time.perf_counter()
        for step in range(first, options.steps + 1):
            self.current_step = step
            set_training_step(step)  # See [Note: failure messages name the user's step]
            self.kill.begin(step)
            _seed_step(options.seed, step, self.rank)
            began = time.perf_counter()
            loss, norm = self._run_step(step, measured)
            losses.append(loss)
            elapsed = time.perf_counter() - started
            self._check_finite(step, loss)
            if self.rank == 0:
                rate = tokens_per_step * (step - first + 1) / elapsed
                self._report_step(step, loss, norm, rate, elapsed, began, progress)
            self._checkpoint_if_due(step)
        self.checkpointer.finish()  # the last save, when written in the background
        wall = time.perf_counter() - started
        self._close_output(progress)
        rss_peak = int(handle.memory_stats().get("peak_allocated", 0))
        ranks = self._gather_measurements(measured, rss_peak)
        summary = self._summary(
            ranks, losses, wall, measured.first, measured.counts, tokens_per_step
        )
        summary.measured_steps = len(measured.traces)
        return summary

    def _first_step(self) -> int:
        """The step this launch starts at; an error when the checkpoint is at ``--steps``."""
        if self.start + 1 > self.options.steps:
            raise RuntimeError(
                f"--resume: the checkpoint is at step {self.start} and --steps is "
                f"{self.options.steps}; pass a larger --steps to train further"
            )
        return self.start + 1

    def _run_step(self, step: int, measured: MeasuredSteps) -> tuple[float, float | None]:
        """Step ``step`` (under the profiler if it is measured), then free its gradients.

        Returns its loss averaged over the ranks (collective) and the pre-clip
        gradient norm (``None`` without ``--clip-grad-norm``).
        """
        if step in measured:
            loss, norm = measured.profile(
                self.device, self.model, self.optim, lambda: self._step(step)
            )
        else:
            loss, norm = self._step(step)
        self.optim.zero_grad(set_to_none=True)
        all_reduce(loss, label="loss", phase="end of step")
        return float(loss) / self.world, norm

    def _check_finite(self, step: int, loss: float) -> None:
        """Stop at the first loss that is not finite: the step has already applied the
        gradients behind it to the parameters, so training would not recover."""
        if not math.isfinite(loss):
            raise FloatingPointError(
                f"the loss is {loss} at step {step}; lower --lr (now {self.options.lr})"
            )

    def _report_step(
        self,
        step: int,
        loss: float,
        norm: float | None,
        rate: float,
        elapsed: float,
        began: float,
        progress: Progress,
    ) -> None:
        """Rank 0: the step's metrics (``_log``), then the progress display.

        ``elapsed`` is the time since the launch's first step began, ``began``
        the ``perf_counter`` at the start of this step.
        """
        lr = self._lr(step)
        self._log(step, loss, lr, norm, rate, elapsed, time.perf_counter() - began)
        progress.update(step, loss, rate)

    def _checkpoint_if_due(self, step: int) -> None:
        """Save after every ``--ckpt-every``-th step and after the last (collective)."""
        options = self.options
        if step == options.steps or (options.ckpt_every and step % options.ckpt_every == 0):
            self.kill.at("save")  # test hook, see [Note: restarts]
            self.checkpointer.save(
                model=self.model,
                optim=self.optim,
                frontend=options.frontend,
                step=step,
                world_size=self.world,
            )

    def _close_output(self, progress: Progress) -> None:
        """End the progress display (rank 0) and the TensorBoard metrics once the steps are done."""
        if self.rank == 0:
            progress.close()
        if self.metrics_writer is not None:
            self.metrics_writer.close()

    def _gather_measurements(self, measured: MeasuredSteps, rss_peak: int) -> list[Any]:
        """Every rank's ``MeasuredSteps.rank_record``, in rank order (collective)."""
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, measured.rank_record(self.rank, rss_peak))
        return gathered

    # ------------------------------------------------------------------ output

    def _banner(self, first: int) -> str:
        o = self.options
        resumed = f", resuming at step {first}" if o.resume else ""
        where = f"{self.world} ranks ({self.backend}, {self.device.type})"
        return (
            f"shard train: {self.source.description} ({self._parameters_text()}) on "
            f"{where}, {o.frontend}, strategy {o.strategy}, {o.precision}"
            f"{', cpu offload' if o.cpu_offload else ''}{self._training_banner()}{resumed}\n"
            f"run directory: {o.run_dir}  (checkpoint: {o.checkpoint_path})"
        )

    def _parameters_text(self) -> str:
        """How many parameters the model has, and how many of them train when not all do."""
        text = f"{self.parameters / 1e6:.2f} M parameters"
        if self.trainable < self.parameters:
            text += f", {self.trainable / self.parameters:.2%} of them trainable"
        return text

    def _training_banner(self) -> str:
        """The non-default training options, for the banner."""
        o = self.options
        parts = []
        if o.grad_accum > 1:
            parts.append(f"{o.grad_accum} micro-batches per step")
        if o.warmup_steps or o.lr_schedule != "constant":
            parts.append(f"lr {o.lr_schedule}, {o.warmup_steps} warmup steps")
        if o.clip_grad_norm is not None:
            parts.append(f"gradients clipped to norm {o.clip_grad_norm}")
        if o.activation_checkpointing:
            parts.append("activation checkpointing")
        if o.compile:
            parts.append("compiled blocks")
        if o.comm_quant:
            parts.append(f"quantized communication ({', '.join(o.comm_quant)})")
        if o.release_host_memory:
            parts.append("host memory released after every backward")
        return "".join(f", {p}" for p in parts)

    def _short_name(self) -> str:
        o = self.options
        return o.model or (Path(o.hf_config).parent.name if o.hf_config else o.preset)

    def _log(
        self,
        step: int,
        loss: float,
        lr: float,
        grad_norm: float | None,
        rate: float,
        elapsed: float,
        step_s: float,
    ) -> None:
        """One line of ``metrics.jsonl`` (and TensorBoard scalars); ``grad_norm`` if clipping."""
        record: dict[str, float] = {"step": step, "loss": loss, "lr": lr}
        if grad_norm is not None:
            record["grad_norm"] = grad_norm
        record.update(tokens_per_s=rate, elapsed_s=elapsed, step_s=step_s)
        with (self.run_dir / "metrics.jsonl").open("a", encoding="utf-8") as file:
            file.write(json.dumps(record) + "\n")
        if self.metrics_writer is not None:
            self.metrics_writer.write(step, {k: v for k, v in record.items() if k != "step"})

    def _summary(
        self,
        ranks: list[Any],
        losses: list[float],
        wall: float,
        measured: int,
        counts: CommCounts,
        tokens_per_step: int,
    ) -> RunSummary:
        o, world, policy = self.options, self.world, self.policy
        per_rank, single = predict_ranks(self.source, o, world, range(world), policy)
        plan = per_rank[0]
        rank0 = ranks[0]
        return RunSummary(
            options=self.options.to_json(),
            world_size=self.world,
            device=self.device.type,
            backend=self.backend,
            parameters=self.parameters,
            trainable=self.trainable,
            steps_run=len(losses),
            first_loss=losses[0],
            last_loss=losses[-1],
            tokens_per_s=tokens_per_step * len(losses) / wall,
            wall_s=wall,
            measured_step=measured,
            measured_steps=1,
            ranks=[{k: v for k, v in r.items() if k not in ("step_s", "comm_s")} for r in ranks],
            plan={
                "params": plan.params,
                "grads": plan.grads,
                "optim": plan.optim,
                "activations": plan.activations or 0,
                "in_flight": plan.in_flight,
                "peak": plan.peak,
                "ranks": [
                    {"rank": e.rank, "params": e.params, "grads": e.grads, "optim": e.optim}
                    for e in per_rank
                ],
            },
            unsharded={
                "params": single.params,
                "grads": single.grads,
                "optim": single.optim,
                "peak": single.peak,
            },
            comm_per_step=counts.as_dict(),
            time={
                "step_s": rank0["step_s"],
                "comm_s": rank0["comm_s"],
                "compute_s": max(0.0, rank0["step_s"] - rank0["comm_s"]),
            },
        )

    @torch.no_grad()
    def sample(self, length: int, prompt: str = "def ") -> str:
        """``length`` generated characters after ``prompt`` (collective: every rank runs it)."""
        if length <= 0 or not isinstance(self.corpus, CharCorpus):
            return ""
        generator = torch.Generator().manual_seed(self.options.seed)
        try:
            tokens = self.corpus.encode(prompt)
        except ValueError:  # a user's text without these characters: start from its first
            tokens = self.corpus.tokens[:1]
        for _ in range(length):
            context = tokens[-self.options.seq :].unsqueeze(0).to(self.device)
            logits = self._logits(self.model, context)[0, -1, : self.corpus.vocab_size]
            logits = logits.float().cpu()
            probs = torch.softmax(logits / 0.8, dim=-1)
            tokens = torch.cat([tokens, torch.multinomial(probs, 1, generator=generator)])
        return self.corpus.decode(tokens)

    def finish(self, summary: RunSummary) -> None:
        """Rank 0: write summary.json, training.png and sample.txt; print the summary."""
        from shard_cli._plot import training_chart

        text = self.sample(self.options.sample_chars)
        if self.rank != 0:
            return
        (self.run_dir / "summary.json").write_text(
            json.dumps(asdict(summary), indent=2) + "\n", encoding="utf-8"
        )
        records = [
            json.loads(line)
            for line in (self.run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
            if line
        ]
        png = training_chart(
            records,
            [
                (f"rank {r['rank']}", r["params"], r["grads"], r["optim"], r["peak"])
                for r in summary.ranks
            ],
            title=f"shard train: {self._short_name()}, {self.world} ranks",
        )
        (self.run_dir / "training.png").write_bytes(png)
        if text:
            (self.run_dir / "sample.txt").write_text(text + "\n", encoding="utf-8")
        for line in summary_lines(summary, sample=text):
            print(line)
        sys.stdout.flush()


def run_worker(options: TrainOptions) -> int:
    """Run one rank of ``options``; the exit status for the process.

    A collective that fails (another rank died) or an interrupt ends this
    rank with a one-line message instead of a traceback; the launcher (or
    ``torchrun``) stops the others.
    """
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    run: _Run | None = None
    attempt = restart_attempt()
    try:
        if attempt:
            _check_restart_store()
            options, note, finished = restart_options(options, attempt)
            if int(os.environ.get("RANK", "0")) == 0:
                print(note, file=sys.stderr, flush=True)
            if finished:
                return 0
        run = _Run(options)
        run.prepare()
        summary = run.train()
        run.finish(summary)
        dist.barrier()
        return 0
    except KeyboardInterrupt:
        if run is not None and run.rank == 0:
            print(f"\nshard train: interrupted during step {_step_of(run)}", flush=True)
        return 130
    except (RuntimeError, FloatingPointError, ValueError, ShardError) as error:
        exc: BaseException = error
        if run is not None and _lost_a_peer(error):
            exc = collective_failure(None, error)  # See [Note: failure messages name ...]
        rank = run.rank if run is not None else int(os.environ.get("RANK", "0"))
        where = f" during step {_step_of(run)}" if run is not None else ""
        print(
            f"\nshard train: rank {rank} stopped{where}: {_first_sentence(exc)}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    finally:
        if run is not None and run.metrics_writer is not None:
            run.metrics_writer.close()  # the steps logged before a failure stay readable


def _lost_a_peer(error: BaseException) -> bool:
    """Whether ``error`` is a backend's communication error outside shard's collectives.

    A checkpoint save's collectives are ``torch.distributed``'s own, so a
    rank lost during a save fails them with the backend's bare error (gloo
    and NCCL raise ``RuntimeError``s naming themselves).
    """
    if isinstance(error, CollectiveError) or not dist.is_initialized():
        return False
    if dist.get_world_size() < 2:
        return False
    bare = type(error) is RuntimeError or isinstance(error, dist.DistError)
    return bare and any(name in str(error) for name in ("gloo", "NCCL", "Connection"))


def _first_sentence(exc: BaseException) -> str:
    """The start of an error's message (gloo's run on for several sentences)."""
    if isinstance(exc, CollectiveError):  # all of it: its lines say what every rank was doing
        return str(exc)
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    cut = text.find(". ")
    return text[: cut + 1] if cut > 0 else text


def _step_of(run: _Run) -> int:
    return run.current_step or run.start
