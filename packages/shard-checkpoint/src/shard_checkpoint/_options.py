"""What kind of state dict the functional API returns and loads.

Same fields and defaults as ``torch.distributed.checkpoint.state_dict``'s
``StateDictOptions``, so a script switches by changing its import line.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StateDictOptions"]


@dataclass(frozen=True)
class StateDictOptions:
    """Options of :func:`get_model_state_dict` and its three siblings.

    Attributes:
        full_state_dict: ``False``: values of sharded parameters (and of their
            optimizer state) are the local ``DTensor`` shards, no
            communication. ``True``: plain full tensors, gathered one
            parameter at a time; loading accepts full tensors and keeps only
            this rank's rows.
        cpu_offload: move values to the CPU. With ``full_state_dict`` only
            rank 0 keeps the full values and every other rank gets ``{}``.
        broadcast_from_rank0: loading only, with ``full_state_dict``: the full
            state dict exists on rank 0 alone (other ranks pass ``{}``); it is
            broadcast one tensor at a time and every rank keeps its rows, so
            no rank holds more than one full tensor beyond its shards.
        strict: loading only: a key the model (or optimizer) has that the
            state dict lacks, or the reverse, is an error naming the first
            such key. ``False``: load what matches and report the rest.
        flatten_optimizer_state_dict: optimizer state dicts are flat,
            ``{"state.<fqn>.<name>": value, "param_groups.<fqn>.<option>": value}``,
            instead of ``{"state": {fqn: {...}}, "param_groups": [...]}``.
            Loading accepts either form whatever this says.
    """

    full_state_dict: bool = False
    cpu_offload: bool = False
    broadcast_from_rank0: bool = False
    strict: bool = True
    flatten_optimizer_state_dict: bool = False

    def __post_init__(self) -> None:
        if self.broadcast_from_rank0 and not self.full_state_dict:
            raise ValueError(
                "StateDictOptions: broadcast_from_rank0=True loads a full state dict held by "
                "rank 0; set full_state_dict=True as well"
            )
