"""The issue's story through ``shard train``: a flipped bit is caught, never trained on.

Two CPU ranks train the tiny preset for 6 steps, saving every 2 in the
background and keeping the last 2. One bit in the middle of rank 0's file
of the newest checkpoint is flipped, as in the report: ``--resume`` refuses
it, naming the file, the rank, the key and the intact checkpoint to resume
from; ``--resume latest-intact`` resumes from that one and trains steps 5
and 6 to the very losses of the first run (its checkpoint, written in the
background, held the exact state of step 4). Three launches, about 30 s.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

from shard_checkpoint._checksums import decode_manifest

TINY = ["--preset", "tiny", "--batch", "4", "--seq", "32", "--sample-chars", "0"]


def shard(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shard_cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text("utf-8").splitlines()
    return {record["step"]: record["loss"] for record in map(json.loads, lines)}


def _flip_middle_bit(checkpoint: Path) -> str:
    """Flip one bit mid-way through rank 0's file; the culprit as the error will name it."""
    data_file = checkpoint / "__0_0.distcp"
    data = bytearray(data_file.read_bytes())
    middle = len(data) // 2
    data[middle] ^= 0x10
    data_file.write_bytes(bytes(data))
    metadata = pickle.loads((checkpoint / ".metadata").read_bytes())
    [index] = [
        index
        for index, info in metadata.storage_data.items()
        if info.relative_path == "__0_0.distcp"
        and info.offset <= middle < info.offset + info.length
    ]
    manifest = decode_manifest((checkpoint / ".checksums").read_bytes())
    [(start, length, _)] = [
        segment
        for segment in manifest.files["__0_0.distcp"].segments
        if segment[0] <= middle < segment[0] + segment[1]
    ]
    chunk = f", chunk at offsets {tuple(index.offset)}" if index.offset is not None else ""
    return (
        f"__0_0.distcp (written by rank 0) does not match its checksum at bytes "
        f"{start}-{start + length} (the data of {index.fqn!r}{chunk})"
    )


def test_a_flipped_bit_is_refused_and_latest_intact_resumes_exactly(tmp_path: Path) -> None:
    """Async saves, --keep-last 2, a flipped bit: --resume refuses, latest-intact continues."""
    first = shard(
        "train", *TINY, "--steps", "6", "--ckpt-every", "2", "--async-checkpoint",
        "--keep-last", "2", "--run-dir", "run", cwd=tmp_path,
    )  # fmt: skip
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    checkpoints = tmp_path / "run" / "checkpoint"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-4", "step-6"]
    losses = _losses(tmp_path / "run")

    culprit = _flip_middle_bit(checkpoints / "step-6")
    refused = shard("train", "--resume", "--run-dir", "run", cwd=tmp_path)
    assert refused.returncode == 1
    error = (
        f"checkpoint run/checkpoint/step-6 is corrupt: {culprit}; it changed after its save "
        "completed (a disk, copy or transfer error, or a file edited or removed by hand), so "
        "loading it would give wrong values; the newest intact checkpoint beside it is "
        "run/checkpoint/step-4: resume from it with --resume latest-intact"
    )
    for rank in (0, 1):  # every rank read the same checksums, and says the same
        assert f"shard train: rank {rank} stopped" in refused.stderr, refused.stderr[-3000:]
        assert refused.stderr.count(f": {error}\n") == 2, refused.stderr[-3000:]

    resumed = shard(
        "train", "--resume", "latest-intact", "--run-dir", "run", "--steps", "6", cwd=tmp_path
    )
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert (
        "shard train: --resume latest-intact: run/checkpoint/step-6 is corrupt ("
        f"{culprit.replace(' (written by rank 0)', '')}); resuming from run/checkpoint/step-4\n"
    ) in resumed.stderr
    assert "resuming at step 5" in resumed.stdout
    assert _losses(tmp_path / "run") == losses  # steps 1-4 kept, 5 and 6 trained again: equal
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-4", "step-6"]
