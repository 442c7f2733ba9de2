"""``tools/gpu/check.sh``, the GPU path in one command, as far as a machine without a GPU can go.

CI has no GPU, so the check itself never runs here: these tests hold its
dry run (every command it would run, and the checks that need no GPU), its
refusal to start without CUDA, and the report it ends with, built from a
real world-size-1 bf16 run of ``bench_train.py`` on the CPU.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "tools" / "gpu" / "check.sh"
TEST_ROOTS = "packages plugins integration_tests"


def _bash(
    script: Path, *args: str, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
        cwd=ROOT,
    )


def _check(*args: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return _bash(CHECK, *args, env=env, timeout=timeout)


def _bare_env() -> dict[str, str]:
    """This environment as a fresh shell has it: not inside a hatch environment."""
    env = dict(os.environ)
    env.pop("HATCH_ENV_ACTIVE", None)
    return env


def _plan(stdout: str) -> list[str]:
    """The numbered commands of a dry run, in order, without their number."""
    plan = stdout.split("checks without a GPU:", 1)[0]
    return [
        line.strip().split(". ", 1)[1]
        for line in plan.splitlines()
        if line.startswith("  ") and line.strip()[:1].isdigit()
    ]


def test_dry_run_lists_the_readme_install_then_every_gpu_command() -> None:
    """From a bare shell the plan installs hatch, then runs each step through the dev env."""
    result = _check("--dry-run", env=_bare_env() | {"PYTHON": "python"}, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    plan = _plan(result.stdout)
    assert plan[0].startswith("nvidia-smi -L")
    assert plan[1].endswith('python -m pip install -q "hatch>=1.16,<2"'), plan
    steps = plan[2:]
    assert all("-m hatch run dev:" in step for step in steps), steps
    probe, tests, bench, report = steps
    assert "tools/gpu/probe.py" in probe
    assert "pytest -m gpu" in tests
    assert tests.endswith(TEST_ROOTS), tests
    assert "tools/bench/bench_train.py" in bench
    for flag in ("--world-size 1", "--device cuda", "--precision bf16", "--json"):
        assert flag in bench, bench
    impls = bench.split("--impls ", 1)[1].split()[0].split(",")
    assert set(impls) == {"single", "shard_fsdp", "torch_fsdp", "shard_fsdp1", "torch_fsdp1"}
    assert "tools/gpu/report.py" in report
    assert all(step.startswith("timeout ") for step in plan[1:]), plan
    assert "nothing was installed or run" in result.stdout


def test_dry_run_checks_the_options_and_the_gpu_tests_without_a_gpu() -> None:
    """Inside the dev env (hatch run dev:gpu-check): bench's options parse, gpu tests collect."""
    env = _bare_env() | {
        "HATCH_ENV_ACTIVE": "dev",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    result = _check("--dry-run", env=env, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    plan = _plan(result.stdout)
    assert not any("hatch" in step for step in plan), plan
    gpu_tests = f"pytest -m gpu --junitxml runs/gpu-check/gpu-tests.xml {TEST_ROOTS}"
    assert f"timeout 300 {gpu_tests}" in plan, plan
    lines = result.stdout.splitlines()
    assert any(
        line.startswith("ok      tools/bench/bench_train.py accepts: --world-size 1 --device cuda")
        for line in lines
    ), result.stdout
    (collected,) = [line for line in lines if "pytest -m gpu collects gpu tests" in line]
    assert collected.startswith("ok"), result.stdout
    words = collected.split("gpu tests: ", 1)[1].split()
    per_root = {words[i].rstrip(":"): int(words[i + 1]) for i in range(0, len(words), 2)}
    assert set(per_root) == set(TEST_ROOTS.split())
    # Each gpu test lives with the package it tests: shard-runtime's and shard-comms' in
    # packages/, the CUDA device plugin's in plugins/.
    assert per_root["packages"] >= 3
    assert per_root["plugins"] >= 1


def test_a_budget_under_a_minute_is_a_usage_error() -> None:
    """--budget below 60 s cannot fit the steps: exit 2 before anything else."""
    result = _check("--dry-run", "--budget", "10", env=_bare_env(), timeout=60)
    assert result.returncode == 2
    assert "--budget must be" in result.stderr


def test_run_without_cuda_stops_at_once_and_says_why(tmp_path: Path) -> None:
    """With a driver that does not answer, the run exits 3 naming it, before installing anything."""
    fake = tmp_path / "bin"
    fake.mkdir()
    smi = fake / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver"\n'
        "exit 9\n"
    )
    smi.chmod(0o755)
    env = _bare_env() | {"PATH": f"{fake}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    out = tmp_path / "out"
    result = _check("--out", str(out), env=env, timeout=30)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "needs a CUDA GPU and found none: nvidia-smi -L failed" in result.stderr
    assert "couldn't communicate with the NVIDIA driver" in result.stderr
    assert "Nothing was installed or run" in result.stderr
    assert not out.exists()
    assert result.stdout == ""


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_run_on_a_machine_with_no_driver_says_so(tmp_path: Path) -> None:
    """CI's case: no nvidia-smi at all; exit 3 naming the missing driver."""
    env = _bare_env()
    env.pop("CUDA_VISIBLE_DEVICES", None)
    result = _check("--out", str(tmp_path / "out"), env=env, timeout=30)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "needs a CUDA GPU and found none: nvidia-smi is not installed" in result.stderr


def test_run_with_every_gpu_hidden_says_so(tmp_path: Path) -> None:
    """CUDA_VISIBLE_DEVICES='' hides every GPU: exit 3 naming the variable."""
    env = _bare_env() | {"CUDA_VISIBLE_DEVICES": ""}
    result = _check("--out", str(tmp_path / "out"), env=env, timeout=30)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "CUDA_VISIBLE_DEVICES='' hides every GPU" in result.stderr


JUNIT_PASSED = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="0" failures="0" skipped="0" tests="2">
<testcase classname="integration_tests.test_gpu_comms" name="test_a" time="0.1"/>
<testcase classname="integration_tests.test_gpu_comms" name="test_b" time="0.1"/>
</testsuite></testsuites>
"""

JUNIT_SKIPPED = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="0" failures="0" skipped="1" tests="2">
<testcase classname="integration_tests.test_gpu_comms" name="test_a" time="0.1"/>
<testcase classname="integration_tests.test_gpu_comms" name="test_b" time="0.0">
<skipped type="pytest.skip" message="needs CUDA">needs CUDA</skipped></testcase>
</testsuite></testsuites>
"""


def test_report_table_from_a_world_size_one_bf16_bench_run(tmp_path: Path) -> None:
    """bench_train at world size 1 in bf16 (on the CPU here) feeds the check's one table."""
    bench_json = tmp_path / "bench.json"
    options = {
        "--world-size": "1",
        "--device": "cpu",
        "--precision": "bf16",
        "--impls": "single,shard_fsdp,shard_fsdp1",
        "--layers": "2",
        "--d-model": "32",
        "--heads": "2",
        "--seq": "16",
        "--batch": "2",
        "--steps": "2",
        "--warmup": "1",
        "--json": str(bench_json),
    }
    bench = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench" / "bench_train.py")]
        + [word for option in options.items() for word in option],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        cwd=ROOT,
    )
    assert bench.returncode == 0, bench.stdout[-3000:] + bench.stderr[-3000:]
    data = json.loads(bench_json.read_text(encoding="utf-8"))
    assert data["config"]["precision"] == "bf16"
    assert data["analysis"]["loss_rtol"] == 2e-2
    assert data["results"]["shard_fsdp"]["peak_cuda_bytes_per_rank"] == [0]

    passed = tmp_path / "passed.xml"
    passed.write_text(JUNIT_PASSED)
    report = ROOT / "tools" / "gpu" / "report.py"
    ok = subprocess.run(
        [sys.executable, str(report), "--tests", str(passed), "--bench", str(bench_json)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    lines = ok.stdout.splitlines()
    assert lines[0].startswith("gpu tests: 2 passed, 0 failed, 0 errors, 0 skipped")
    (header,) = [line for line in lines if line.startswith("implementation")]
    for column in ("step ms", "tokens/s", "peak CUDA MiB", "step time vs plain"):
        assert column in header
    rows = {line[:18].strip(): line for line in lines[lines.index(header) + 1 :] if line}
    assert "1.000x (+0.0%)" in rows["plain model"]
    assert {"plain model", "shard fully_shard", "shard wrapper"} <= set(rows)
    # In bf16 the plain model's losses are reported, not judged ([Note: device and precision]).
    assert data["analysis"]["loss_reference"] == "shard_fsdp"
    assert not data["analysis"]["losses"]["single"]["judged"]
    assert data["analysis"]["losses"]["shard_fsdp1"]["judged"]
    assert any(line.startswith("losses vs shard_fsdp") and line.endswith("match") for line in lines)

    skipped = tmp_path / "skipped.xml"
    skipped.write_text(JUNIT_SKIPPED)
    bad = subprocess.run(
        [sys.executable, str(report), "--tests", str(skipped), "--bench", str(tmp_path / "no")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode == 1
    assert "skipped: integration_tests.test_gpu_comms::test_b: needs CUDA" in bad.stdout
    assert "benchmark: no result" in bad.stdout


def _collection_skip(module: Path) -> str:
    """JUnit XML of one passing gpu test and ``module`` skipped while pytest imported it."""
    return f"""<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="0" failures="0" skipped="1" tests="2">
<testcase classname="" name="tests.{module.stem}" time="0.000">
<skipped message="collection skipped">('{module}', 45, "Skipped: no torchao")</skipped>
</testcase>
<testcase classname="integration_tests.test_gpu_comms" name="test_a" time="0.1"/>
</testsuite></testsuites>
"""


@pytest.mark.parametrize("has_gpu_tests", [False, True])
def test_report_counts_a_module_skipped_at_import_only_when_it_holds_gpu_tests(
    tmp_path: Path, has_gpu_tests: bool
) -> None:
    """pytest reports a module skipped at import (an optional library missing) before ``-m gpu``
    deselects its tests: on the first GPU run test_torchao.py failed the check so."""
    module = tmp_path / "test_optional.py"
    mark = "pytestmark = pytest.mark.gpu\n" if has_gpu_tests else ""
    module.write_text(f"import pytest\n{mark}torchao = pytest.importorskip('torchao')\n")
    junit = tmp_path / "tests.xml"
    junit.write_text(_collection_skip(module))
    report_py = str(ROOT / "tools" / "gpu" / "report.py")
    report = subprocess.run(
        [sys.executable, report_py, "--tests", str(junit), "--bench", str(tmp_path / "no")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    first = report.stdout.splitlines()[0]
    if has_gpu_tests:
        assert first.startswith("gpu tests: 1 passed, 0 failed, 0 errors, 1 skipped")
        assert "collection skipped" in report.stdout
    else:
        assert first.startswith("gpu tests: 1 passed, 0 failed, 0 errors, 0 skipped")
        assert "collection skipped" not in report.stdout


def test_offline_run_says_what_is_missing_before_installing(tmp_path: Path) -> None:
    """offline.sh run: no staged wheels is a usage error naming `stage`; wheels but no Python
    whose torch sees a GPU stops with exit 3 before installing anything."""
    offline = ROOT / "tools" / "gpu" / "offline.sh"
    empty = tmp_path / "empty"
    empty.mkdir()
    env = _bare_env() | {"PYTHON": sys.executable, "TMPDIR": str(tmp_path)}
    result = _bash(offline, "run", "--dir", str(empty), env=env, timeout=60)
    assert result.returncode == 2
    assert f"no wheels in {empty}; run `bash tools/gpu/offline.sh stage" in result.stderr
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine may have a GPU: the rest checks the refusal without one")
    staged = tmp_path / "staged"
    staged.mkdir()
    (staged / "shard_core-0.1.0-py3-none-any.whl").write_bytes(b"")
    no_gpu = {**env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}/usr/bin:/bin"}
    result = _bash(offline, "run", "--dir", str(staged), env=no_gpu, timeout=120)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "no Python here imports a torch that sees a GPU" in result.stderr
    assert not (tmp_path / "shard-gpu-site").exists()
