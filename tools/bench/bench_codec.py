"""Block size of shard-comm-quant's codecs: quantization error against bytes and time.

Why: a block's scale is its largest magnitude, so a larger block shares one
scale among more values (larger error where magnitudes vary within it) and
spends fewer bytes on scales; a smaller block costs more per value to encode
(one reduction per block). This script measures all three on what the codecs
really carry in ``tools/bench/bench_train.py``'s standing GPT (layers 4,
d_model 256, heads 4, seq 128, vocabulary 1024): its parameters (the weight
all-gather) and its gradients after a few AdamW steps (the reduction), and on
Gaussian values for reference. Run from the repository root::

    .venv/bin/python tools/bench/bench_codec.py [--blocks 32 64 128 256 512 1024 4096] [--json OUT]

[Note: what the columns are]
- bytes: encoded bytes over float32 bytes (codes plus one float32 scale per block).
- error: ``||decode(encode(x)) - x|| / ||x||`` over all values, int8 (and int4
  for gradients), for each kind of data.
- feedback: the same for gradients encoded with error feedback over 20
  steps of the same model: the relative error of the *sum* of what was sent
  against the sum of the true gradients (what training accumulates), which
  error feedback keeps at one step's residual.
- encode / decode: median CPU time (``time.thread_time``, one torch thread,
  steady under load) per million values, int8, encode with error feedback
  as the reduction runs it (8 rows of the whole model's gradient).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from shard_cli.gpt import GPT, GPTConfig, synthetic_tokens
from shard_comm_quant import BlockQuantCodec

STANDING = GPTConfig(vocab_size=1024, d_model=256, n_heads=4, n_layers=4, seq_len=128)


def _round_trip(
    codec: BlockQuantCodec, rows: torch.Tensor, residual: torch.Tensor | None = None
) -> torch.Tensor:
    encoded = torch.empty(rows.shape[0], codec.encoded_nbytes(rows.shape[1]), dtype=torch.uint8)
    codec.encode(rows, encoded, residual)
    decoded = torch.empty(rows.shape)
    codec.decode(encoded, decoded)
    return decoded


def _model_data(steps: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The standing GPT's flat parameters, and its flat gradient at each of ``steps`` steps."""
    torch.manual_seed(0)
    model = GPT(STANDING)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    grads = []
    for step in range(steps):
        tokens = synthetic_tokens(STANDING, 8, seed=0, step=step)
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()  # type: ignore[no-untyped-call]
        grads.append(
            torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        )
        optim.step()
        optim.zero_grad()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    return weights, grads


def _rows(flat: torch.Tensor, rows: int) -> torch.Tensor:
    n = flat.numel() // rows
    return flat[: rows * n].view(rows, n)


def _error(codec: BlockQuantCodec, rows: torch.Tensor) -> float:
    return float((_round_trip(codec, rows) - rows).norm() / rows.norm())


def _feedback_error(codec: BlockQuantCodec, grads: list[torch.Tensor]) -> tuple[float, float]:
    """Relative error of the summed sent gradients, without and with error feedback."""
    rows = [_rows(g, 8) for g in grads]
    truth = torch.stack(rows).double().sum(0)
    plain = torch.stack([_round_trip(codec, r) for r in rows]).double().sum(0)
    residual = torch.zeros_like(rows[0])
    fed = torch.zeros_like(truth)
    for r in rows:
        fed += _round_trip(codec, r, residual).double()
    return float((plain - truth).norm() / truth.norm()), float((fed - truth).norm() / truth.norm())


def _cpu_ms_per_million(fn: Any, numel: int, repeats: int = 9) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return statistics.median(times) * 1e3 * 1e6 / numel


def measure(block: int, weights: torch.Tensor, grads: list[torch.Tensor]) -> dict[str, Any]:
    int8, int4 = BlockQuantCodec(8, block), BlockQuantCodec(4, block)
    gauss = torch.randn(8, 1 << 17, generator=torch.Generator().manual_seed(0))
    w_rows, g_rows = _rows(weights, 2), _rows(grads[-1], 8)
    plain, fed = _feedback_error(int8, grads)
    encoded = torch.empty(8, int8.encoded_nbytes(g_rows.shape[1]), dtype=torch.uint8)
    residual = torch.zeros_like(g_rows)
    decoded = torch.empty_like(g_rows)
    int8.encode(g_rows, encoded, residual)
    return {
        "block": block,
        "bytes": int8.encoded_nbytes(1 << 20) / (4 << 20),
        "bytes_int4": int4.encoded_nbytes(1 << 20) / (4 << 20),
        "error_gauss": _error(int8, gauss),
        "error_weights": _error(int8, w_rows),
        "error_grads": _error(int8, g_rows),
        "error_grads_int4": _error(int4, g_rows),
        "sum_error_plain": plain,
        "sum_error_feedback": fed,
        "encode_ms_per_m": _cpu_ms_per_million(
            lambda: int8.encode(g_rows, encoded, residual), g_rows.numel()
        ),
        "decode_ms_per_m": _cpu_ms_per_million(
            lambda: int8.decode(encoded, decoded), g_rows.numel()
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--blocks", type=int, nargs="+", default=[32, 64, 128, 256, 512, 1024, 4096]
    )
    parser.add_argument("--steps", type=int, default=20, help="training steps for the gradients")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    weights, grads = _model_data(args.steps)
    rows = [measure(block, weights, grads) for block in args.blocks]
    print(
        f"standing GPT: {weights.numel():,} parameters; gradients of {args.steps} AdamW steps; "
        "int8 unless said; error = relative L2"
    )
    print(
        f"{'block':>6} {'bytes':>7} {'int4':>6} {'err gauss':>10} {'err weights':>12} "
        f"{'err grads':>10} {'int4 grads':>11} {'sum err':>8} {'+feedback':>10} "
        f"{'enc ms/M':>9} {'dec ms/M':>9}"
    )
    for r in rows:
        print(
            f"{r['block']:>6} {r['bytes']:>6.4f}x {r['bytes_int4']:>5.4f}x "
            f"{r['error_gauss']:>10.2e} {r['error_weights']:>12.2e} "
            f"{r['error_grads']:>10.2e} {r['error_grads_int4']:>11.2e} "
            f"{r['sum_error_plain']:>8.2e} {r['sum_error_feedback']:>10.2e} "
            f"{r['encode_ms_per_m']:>9.2f} {r['decode_ms_per_m']:>9.2f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
