"""The one table ``tools/gpu/check.sh`` ends with: GPU tests, then the world-size-1 benchmark.

Reads what the check's two measuring steps wrote: pytest's JUnit XML for the
``gpu``-marked tests and ``tools/bench/bench_train.py``'s JSON. Prints the
test counts (and every skipped GPU test, which checked nothing), then one row
per implementation: median step time, tokens/s, peak CUDA memory (allocated,
``torch.cuda.max_memory_allocated``) and both as ratios to the plain model
(``single``, no wrapper, no process group), which at world size 1 is the
overhead of the sharding machinery itself; then shard against PyTorch, pair
by pair. Standard library only, so it runs with any Python >= 3.10.

Usage::

    python tools/gpu/report.py --tests runs/gpu-check/gpu-tests.xml \\
        --bench runs/gpu-check/bench.json

Exit status 0 when every GPU test passed (none failed, errored or was
skipped) and the benchmark's losses matched; 1 otherwise, or when a file is
missing (its step did not finish).
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

PLAIN = "single"
# (shard's implementation, PyTorch's counterpart), as in bench_train.PAIRS.
PAIRS = (("shard_fsdp", "torch_fsdp"), ("shard_fsdp1", "torch_fsdp1"))
LABELS = {
    "single": "plain model",
    "ddp": "DDP",
    "shard_fsdp": "shard fully_shard",
    "torch_fsdp": "PyTorch FSDP2",
    "shard_fsdp1": "shard wrapper",
    "torch_fsdp1": "PyTorch FSDP1",
}


def tests_summary(path: Path) -> tuple[list[str], bool]:
    """Lines describing the JUnit XML at ``path``, and whether every test passed."""
    if not path.is_file():
        return [f"gpu tests: no result ({path} missing: the test step did not finish)"], False
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {key: 0 for key in ("tests", "failures", "errors", "skipped")}
    for suite in suites:
        for key in counts:
            counts[key] += int(suite.get(key, "0"))
    skipped: list[str] = []
    not_gpu = 0
    for case in root.iter("testcase"):
        skip = case.find("skipped")
        if skip is None:
            continue
        if _skipped_module_has_no_gpu_tests(skip):
            not_gpu += 1
            continue
        reason = skip.get("message", "").strip()
        skipped.append(f"  skipped: {case.get('classname')}::{case.get('name')}: {reason}")
    counts["tests"] -= not_gpu
    counts["skipped"] -= not_gpu
    bad = counts["failures"] + counts["errors"]
    passed = counts["tests"] - bad - counts["skipped"]
    lines = [
        f"gpu tests: {passed} passed, {counts['failures']} failed, {counts['errors']} errors, "
        f"{counts['skipped']} skipped ({path})"
    ]
    if skipped:
        lines.append("a gpu test skipped on a CUDA machine checked nothing:")
        lines += skipped
    return lines, counts["tests"] > 0 and bad == 0 and not skipped


def _skipped_module_has_no_gpu_tests(skip: ET.Element) -> bool:
    """A module skipped while pytest imported it (an optional library missing, say) and
    holding no ``gpu`` mark: pytest reports the skip before ``-m gpu`` deselects its tests.

    Its text is ``('path', line, 'Skipped: reason')``; a module that cannot be read
    counts as holding gpu tests, so nothing is hidden.
    """
    if skip.get("message") != "collection skipped":
        return False
    text = (skip.text or "").strip()
    if not text.startswith("('"):
        return False
    path = Path(text[2:].split("'", 1)[0])
    try:
        return "mark.gpu" not in path.read_text()
    except OSError:
        return False


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def _ratio(value: float, reference: float) -> str:
    if not reference:
        return "-"
    q = value / reference
    return f"{q:.3f}x ({(q - 1) * 100:+.1f}%)"


def bench_table(path: Path) -> tuple[list[str], bool]:
    """Lines of the benchmark table from ``bench_train.py --json`` at ``path``, and its verdict."""
    if not path.is_file():
        return [f"benchmark: no result ({path} missing: the benchmark step did not finish)"], False
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    cfg = data["config"]
    model = cfg["model"]
    results: dict[str, Any] = data["results"]
    analysis = data["analysis"]
    repeats = max(len(r["median_step_s_per_repeat"]) for r in results.values())
    lines = [
        f"bench_train.py: world size {cfg['world_size']}, {cfg.get('device', 'cpu')}, "
        f"{cfg.get('precision', 'fp32')} compute, torch {data['env']['torch']}; GPT "
        f"{model['n_layers']} layers x d_model {model['d_model']}, seq {model['seq_len']}, "
        f"batch {cfg['batch']}/rank; median of {cfg['steps']} steps after {cfg['warmup']}, "
        f"best of {repeats} repeat(s)",
        "",
        f"{'implementation':<18} {'step ms':>8} {'tokens/s':>10} {'peak CUDA MiB':>14} "
        f"{'step time vs plain':>19} {'peak CUDA vs plain':>19}",
    ]
    plain = results.get(PLAIN)
    for name, r in results.items():
        peak = max(r.get("peak_cuda_bytes_per_rank") or [0])
        step_vs = mem_vs = "-"
        if plain is not None:
            step_vs = _ratio(r["median_step_s"], plain["median_step_s"])
            mem_vs = _ratio(peak, max(plain.get("peak_cuda_bytes_per_rank") or [0]))
        label = LABELS.get(name, name)
        lines.append(
            f"{label:<18} {r['median_step_s'] * 1e3:>8.2f} {r['tokens_per_s']:>10.0f} "
            f"{_mib(peak) if peak else '-':>14} {step_vs:>19} {mem_vs:>19}"
        )
    lines.append("")
    for shard, torch_name in PAIRS:
        if shard in results and torch_name in results:
            s, t = results[shard], results[torch_name]
            s_peak = max(s.get("peak_cuda_bytes_per_rank") or [0])
            t_peak = max(t.get("peak_cuda_bytes_per_rank") or [0])
            memory = f", peak CUDA {s_peak / t_peak:.3f}x" if t_peak else ""
            lines.append(
                f"{LABELS[shard]} vs {LABELS[torch_name]}: step time "
                f"{s['median_step_s'] / t['median_step_s']:.3f}x{memory}"
            )
    if cfg["world_size"] == 1 and "torch_fsdp1" in results:
        lines.append("(PyTorch FSDP1 switches to NO_SHARD at world size 1; the others still shard)")
    match = bool(analysis["losses_match"])
    worst = max(
        v["max_rel_diff_any_step"] for v in analysis["losses"].values() if v.get("judged", True)
    )
    lines.append(
        f"losses vs {analysis['loss_reference']}: largest relative difference {worst:.2e} "
        f"(rtol {analysis['loss_rtol']:g}): {'match' if match else 'DIFFER'}"
    )
    return lines, match


def main(argv: list[str] | None = None) -> int:
    """Print the report; 0 when everything in it is good."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--tests", type=Path, required=True, help="pytest --junitxml output")
    parser.add_argument("--bench", type=Path, required=True, help="bench_train.py --json output")
    args = parser.parse_args(argv)
    test_lines, tests_ok = tests_summary(args.tests)
    bench_lines, bench_ok = bench_table(args.bench)
    print("\n".join([*test_lines, "", *bench_lines]))
    return 0 if tests_ok and bench_ok else 1


if __name__ == "__main__":
    sys.exit(main())
