"""shard-comm-quant's codec on a GPU: encode/decode throughput against the wire time it saves.

Why: on gloo the codec's CPU cost hides behind slow links, but on a GPU with
NVLink or InfiniBand the wire is fast, so the quantization kernels must be
faster still or the plugin costs time. This script times ``encode`` (with
error feedback, as the gradient reduction runs it, and without, as the weight
all-gather does) and ``decode`` on one device with CUDA events, then says, for
an all-gather of ``--world-size`` ranks, the link bandwidth below which the
codec saves time: the bytes it keeps off the wire divided by the time it costs.
Run from the repository root on a CUDA machine::

    python tools/bench/bench_codec_gpu.py [--device cuda] [--values 67108864] [--json OUT]

[Note: the break-even link]
An all-gather of N values over W ranks moves (W-1)/W * N values into each
rank. Each rank encodes its own N/W values and decodes all N. The codec saves
(W-1)/W * N * (b_in - b_enc) bytes per rank, where b_in is the unencoded
width (4 for float32, 2 for bfloat16) and b_enc the encoded bytes per value;
it costs t_enc(N/W) + t_dec(N) of device time when nothing overlaps it. The
codec pays off on links slower than saved / cost bytes per second.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from shard_comm_quant import BlockQuantCodec


def _time(device: torch.device, fn: Callable[[], None], repeat: int) -> float:
    """Median seconds of ``fn`` on ``device`` after two warm-ups."""
    for _ in range(2):
        fn()
    samples = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - begin)
    return statistics.median(samples)


def measure(
    device: torch.device, numel: int, world_size: int, bits: int, dtype: torch.dtype, repeat: int
) -> dict[str, Any]:
    """One codec and input dtype: times, throughputs and the break-even link (see the Note)."""
    codec = BlockQuantCodec(bits)
    rows = 1
    shard = numel // world_size
    values = torch.randn(rows, shard, device=device).to(dtype)
    residual = torch.zeros(rows, shard, dtype=torch.float32, device=device)
    encoded = torch.empty(rows, codec.encoded_nbytes(shard), dtype=torch.uint8, device=device)
    row_nbytes = codec.encoded_nbytes(shard)
    gathered = torch.empty(world_size, row_nbytes, dtype=torch.uint8, device=device)
    out = torch.empty(world_size, shard, dtype=dtype, device=device)
    codec.encode(values, encoded)
    gathered.copy_(encoded.expand(world_size, -1))
    t_enc = _time(device, lambda: codec.encode(values, encoded), repeat)
    t_enc_fb = _time(device, lambda: codec.encode(values, encoded, residual), repeat)
    t_dec = _time(device, lambda: codec.decode(gathered, out), repeat)
    width = torch.empty((), dtype=dtype).element_size()
    enc_per_value = codec.encoded_nbytes(shard) / shard
    moved = (world_size - 1) / world_size * numel
    saved = moved * (width - enc_per_value)
    cost = t_enc + t_dec
    return {
        "bits": bits,
        "dtype": str(dtype).removeprefix("torch."),
        "values": numel,
        "world_size": world_size,
        "encode_ms": t_enc * 1e3,
        "encode_feedback_ms": t_enc_fb * 1e3,
        "decode_ms": t_dec * 1e3,
        "encode_gbps": shard * width / t_enc / 1e9,
        "decode_gbps": numel * width / t_dec / 1e9,
        "bytes_saved_per_rank": saved,
        "break_even_link_gbps": saved / cost / 1e9,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--values", type=int, default=64 * 2**20, help="values all-gathered")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_codec_gpu: no CUDA device here", file=sys.stderr)
        return 3
    results = [
        measure(device, args.values, args.world_size, bits, dtype, args.repeat)
        for bits in (8, 4)
        for dtype in (torch.float32, torch.bfloat16)
    ]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}: {args.values} values all-gathered over {args.world_size} ranks")
    print(
        f"{'codec':>5} {'dtype':>8} {'enc ms':>8} {'enc+fb ms':>9} {'dec ms':>8} "
        f"{'enc GB/s':>9} {'dec GB/s':>9} {'pays off below':>15}"
    )
    for r in results:
        print(
            f"{'int' + str(r['bits']):>5} {r['dtype']:>8} {r['encode_ms']:8.3f} "
            f"{r['encode_feedback_ms']:9.3f} {r['decode_ms']:8.3f} {r['encode_gbps']:9.1f} "
            f"{r['decode_gbps']:9.1f} {r['break_even_link_gbps']:11.1f} GB/s"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
