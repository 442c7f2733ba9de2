#!/usr/bin/env bash
# The GPU path in one command: install, run every `gpu`-marked test, benchmark
# shard against PyTorch FSDP2/FSDP1 in bf16 on one GPU, print one table.
#
#   bash tools/gpu/check.sh [--dry-run] [--out DIR] [--budget SECONDS]
#
# On a CUDA machine, from a bare checkout, unattended, in under 10 minutes:
#   1. python -m pip install -q "hatch>=1.16,<2"        (as README's commands do)
#   2. the dev environment (.venv), created or synced by `hatch run`, and
#      tools/gpu/probe.py in it: is torch a CUDA build that sees a GPU?
#   3. pytest -m gpu over packages, plugins and integration_tests
#   4. tools/bench/bench_train.py at world size 1, --device cuda --precision bf16:
#      the plain model, shard fully_shard and wrapper, PyTorch FSDP2 and FSDP1
#   5. tools/gpu/report.py: the table (step time, tokens/s, peak CUDA memory,
#      overhead against the plain model)
# Each step runs under `timeout`, capped by what is left of --budget (570 s).
# Results land in --out (runs/gpu-check): gpu-tests.xml, bench.json, check.log.
#
# torch: the dev environment pins `torch==2.13.0` and nothing more. Nothing here
# names an index or a wheel, so pip resolves it as configured; on a CUDA
# machine with pip's defaults that is PyPI's torch 2.13.0, the CUDA build.
# Where pip is configured for CPU wheels (as on our CPU machines) step 2 stops
# with the reason instead of running the GPU tests against a CPU torch.
# A machine with its own CUDA torch and no package index: tools/gpu/offline.sh.
#
# --dry-run prints every command in order and checks what needs no GPU (the
# scripts and test roots exist, bench_train.py accepts the options, pytest
# collects gpu tests), then exits 0 if all of that holds. Without it, on a
# machine with no CUDA GPU, the check stops at once, before installing.
#
# Exit status: 0 all good; 1 a step failed or ran out of time (a gpu test that
# skipped counts: on a CUDA machine it checked nothing); 2 bad usage; 3 no CUDA
# GPU here.
set -uo pipefail

usage() {
    sed -n '2,5p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

caller="$PWD"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT" || exit 2

dry_run=0
out=runs/gpu-check
budget=570
while (($#)); do
    case "$1" in
        --dry-run) dry_run=1 ;;
        --out) out="${2:?--out needs a directory}"; shift ;;
        --out=*) out="${1#--out=}" ;;
        --budget) budget="${2:?--budget needs seconds}"; shift ;;
        --budget=*) budget="${1#--budget=}" ;;
        -h | --help) usage; exit 0 ;;
        *) echo "tools/gpu/check.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    esac
    shift
done
if [[ $out != runs/gpu-check && $out != /* ]]; then
    out="$caller/$out"  # a relative --out is where the command was started
fi
if ! [[ $budget =~ ^[0-9]+$ ]] || ((budget < 60)); then
    echo "tools/gpu/check.sh: --budget must be a whole number of seconds, at least 60" >&2
    exit 2
fi

py="${PYTHON:-}"
if [[ -z $py ]]; then
    if command -v python >/dev/null 2>&1; then py=python; else py=python3; fi
fi
# Under `hatch run dev:gpu-check` the dev environment is already there and
# active: run in it directly. Otherwise every step goes through hatch, as
# README's commands do.
if [[ ${HATCH_ENV_ACTIVE:-} == dev ]]; then
    in_env=1
    run=""
else
    in_env=0
    run="$py -m hatch run dev:"
fi

TEST_ROOTS=(packages plugins integration_tests)
BENCH=tools/bench/bench_train.py
PROBE=tools/gpu/probe.py
REPORT=tools/gpu/report.py
# Small sizes: the whole benchmark is ten short runs in fresh processes.
BENCH_ARGS=(
    --world-size 1 --device cuda --precision bf16
    --impls "single,shard_fsdp,torch_fsdp,shard_fsdp1,torch_fsdp1"
    --layers 4 --d-model 512 --heads 8 --seq 256 --batch 8
    --steps 20 --warmup 5 --repeat 2
)
TESTS_XML="$out/gpu-tests.xml"
BENCH_JSON="$out/bench.json"
# As they appear in the commands, which run through `bash -c`.
tests_xml_q=$(printf %q "$TESTS_XML")
bench_json_q=$(printf %q "$BENCH_JSON")

names=()
caps=()
cmds=()
add_step() { names+=("$1"); caps+=("$2"); cmds+=("$3"); }
if ((in_env)); then
    add_step "dev environment: torch sees CUDA" 60 "${run}python $PROBE"
else
    add_step "install hatch" 180 "$py -m pip install -q \"hatch>=1.16,<2\""
    add_step "dev environment (.venv): install, torch sees CUDA" 420 "${run}python $PROBE"
fi
add_step "gpu tests" 300 "${run}pytest -m gpu --junitxml $tests_xml_q ${TEST_ROOTS[*]}"
add_step "benchmark" 240 "${run}python $BENCH ${BENCH_ARGS[*]} --json $bench_json_q"
add_step "report" 30 "${run}python $REPORT --tests $tests_xml_q --bench $bench_json_q"
# The steps before the tests prepare the environment: when one fails, the rest cannot run.
setup_steps=$((${#names[@]} - 3))

print_plan() {
    echo "0. nvidia-smi -L  (a CUDA GPU must answer; otherwise stop here, before installing)"
    local i
    for i in "${!names[@]}"; do
        echo "$((i + 1)). timeout ${caps[i]} ${cmds[i]}"
    done
}

# ---------------------------------------------------------------- --dry-run

dry_fail=0
check() {  # check DESCRIPTION COMMAND...: run COMMAND quietly, report ok or FAILED with its output
    local what="$1" output
    shift
    if output=$("$@" 2>&1); then
        echo "ok      $what"
    else
        echo "FAILED  $what"
        printf '%s\n' "$output" | tail -n 15 | sed 's/^/        /'
        dry_fail=1
    fi
}

gpu_tests_by_root() {  # pytest collects at least one gpu test; prints the count per root
    # Only the modules that name the mark: importing every test module to find them
    # takes 15-20 s on two cores, these few take 2-3 s. The run itself collects every root.
    local listing root count total=0 files
    mapfile -t files < <(grep -rlE --include='test_*.py' 'mark\.gpu\b' "${TEST_ROOTS[@]}")
    if ((${#files[@]} == 0)); then
        echo "no test module under ${TEST_ROOTS[*]} names pytest.mark.gpu"
        return 1
    fi
    listing=$("$1" -m pytest --collect-only -q -m gpu -p no:cacheprovider "${files[@]}") || {
        printf '%s\n' "$listing"
        return 1
    }
    for root in "${TEST_ROOTS[@]}"; do
        count=$(grep -c "^$root/.*::" <<<"$listing")
        total=$((total + count))
        echo "$root: $count"
    done
    ((total > 0))
}

if ((dry_run)); then
    echo "tools/gpu/check.sh --dry-run: what a run executes, in order (budget ${budget}s):"
    print_plan | sed 's/^/  /'
    echo
    echo "checks without a GPU:"
    for path in "$BENCH" "$PROBE" "$REPORT"; do
        check "$path exists" test -f "$path"
    done
    for root in "${TEST_ROOTS[@]}"; do
        check "test root $root/ exists" test -d "$root"
    done
    # The dev environment's python, if it is there; a dry run installs nothing.
    if ((in_env)); then env_py=python; else env_py=.venv/bin/python; fi
    if ((in_env)) || [[ -x $env_py ]]; then
        check "$BENCH accepts: ${BENCH_ARGS[*]} --json $BENCH_JSON" \
            "$env_py" "$BENCH" "${BENCH_ARGS[@]}" --json "$BENCH_JSON" --parse-only
        check "$PROBE and $REPORT parse --help" \
            bash -c "'$env_py' $PROBE --help && '$env_py' $REPORT --help"
        if counts=$(gpu_tests_by_root "$env_py" 2>&1); then
            echo "ok      pytest -m gpu collects gpu tests: $(tail -n 3 <<<"$counts" | paste -sd ' ')"
        else
            echo "FAILED  pytest -m gpu collects gpu tests"
            tail -n 15 <<<"$counts" | sed 's/^/        /'
            dry_fail=1
        fi
    else
        echo "skipped the option and collection checks: no .venv yet (step 2 creates it;"
        echo "        \`$py -m hatch run dev:true\` makes one here without a GPU)"
    fi
    if ((dry_fail)); then
        echo "dry run: a check FAILED"
        exit 1
    fi
    echo "dry run: all checks passed; nothing was installed or run"
    exit 0
fi

# ---------------------------------------------------------------- the run

no_cuda() {  # why there is no usable CUDA GPU here, or nothing (status 1) when there is one
    local listing
    case "${CUDA_VISIBLE_DEVICES-unset}" in
        "" | -1)
            echo "CUDA_VISIBLE_DEVICES='${CUDA_VISIBLE_DEVICES}' hides every GPU"
            return 0
            ;;
    esac
    if ! command -v nvidia-smi >/dev/null 2>&1; then
        echo "nvidia-smi is not installed (no NVIDIA driver)"
        return 0
    fi
    if ! listing=$(nvidia-smi -L 2>&1); then
        echo "nvidia-smi -L failed: $(head -n 1 <<<"$listing")"
        return 0
    fi
    if ! grep -q '^GPU ' <<<"$listing"; then
        echo "nvidia-smi -L lists no GPU"
        return 0
    fi
    return 1
}

if reason=$(no_cuda); then
    echo "tools/gpu/check.sh: needs a CUDA GPU and found none: $reason" >&2
    echo "Nothing was installed or run. \`bash tools/gpu/check.sh --dry-run\` lists and checks" >&2
    echo "the commands without a GPU." >&2
    exit 3
fi

mkdir -p "$out" || exit 1
log="$out/check.log"
rm -f "$TESTS_XML" "$BENCH_JSON"
: >"$log"
{
    echo "tools/gpu/check.sh $(date -u +%Y-%m-%dT%H:%M:%SZ) in $ROOT, budget ${budget}s"
    nvidia-smi -L
} | tee -a "$log"

start=$SECONDS
report_cap=${caps[-1]}
statuses=()
failed=0
setup_broke=0
for i in "${!names[@]}"; do
    name="${names[i]}"
    last=$((i == ${#names[@]} - 1))
    if ((setup_broke)); then
        statuses+=("not run (the environment is not ready)")
        continue
    fi
    # Every step but the report shares the budget less the report's own time.
    left=$((budget - report_cap - (SECONDS - start)))
    cap=${caps[i]}
    if ((!last)); then
        if ((left < 20)); then
            statuses+=("not run (out of time: --budget ${budget}s)")
            failed=1
            continue
        fi
        if ((left < cap)); then cap=$left; fi
    fi
    echo
    echo "==> [$((i + 1))/${#names[@]}] $name: timeout $cap ${cmds[i]}" | tee -a "$log"
    step_start=$SECONDS
    timeout -k 10 "$cap" bash -c "${cmds[i]}" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    took=$((SECONDS - step_start))
    if ((rc == 0)); then
        statuses+=("ok (${took}s)")
        continue
    fi
    if ((rc == 124 || rc == 137)); then
        statuses+=("FAILED: timed out after ${cap}s")
    else
        statuses+=("FAILED: exit status $rc (${took}s)")
    fi
    failed=1
    if ((i < setup_steps)); then setup_broke=1; fi
done

{
    echo
    echo "==> summary ($((SECONDS - start))s; log: $log)"
    for i in "${!names[@]}"; do
        printf '  %d. %-50s %s\n' "$((i + 1))" "${names[i]}" "${statuses[i]}"
    done
    if ((failed)); then echo "GPU check FAILED"; else echo "GPU check passed"; fi
} | tee -a "$log"
exit "$failed"
