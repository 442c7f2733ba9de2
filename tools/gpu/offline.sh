#!/usr/bin/env bash
# The GPU check on a machine that has a CUDA torch but no package index.
#
#   here:  bash tools/gpu/offline.sh stage [--dir DIR] [--python-version 3.12]
#   there: bash tools/gpu/offline.sh run [--dir DIR] [check.sh options...]
#
# check.sh installs the dev environment with pip and hatch, which needs an
# index; machines lent for GPU work are often cut off from the network and
# come with their own CUDA build of torch (ours: an H200 image with torch
# 2.11.0+cu130 in /opt/torch/.venv, no hatch, no crc32c). So:
#   stage  builds a wheel of every workspace package (packages/*, plugins/*)
#          and downloads the third-party ones such an image lacks (crc32c,
#          pluggy) for that machine's Python, into DIR (.gpu/whl, git-ignored):
#          carry it (the device tool's `carry: [".gpu"]`).
#   run    finds a Python whose torch sees CUDA ($PYTHON, else python3 on
#          PATH, else /opt/*/.venv/bin/python3), installs DIR's wheels into a
#          throwaway target (no dependencies resolved, nothing else touched),
#          puts them first on PYTHONPATH and runs check.sh in that Python, as
#          `hatch run dev:gpu-check` would in the dev environment.
# The image's torch is used as it is, whatever its version: the table that
# check.sh prints names it.
#
# Exit status: check.sh's; 2 bad usage or nothing staged; 3 no Python here
# whose torch sees CUDA.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT" || exit 2
THIRD_PARTY=("crc32c>=2.4,<3" "pluggy>=1.7,<2")

usage() {
    sed -n '2,5p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

(($#)) || { usage >&2; exit 2; }
verb="$1"
shift
dir=.gpu/whl
pyver=3.12
forward=()
while (($#)); do
    case "$1" in
        --dir) dir="${2:?--dir needs a directory}"; shift ;;
        --python-version) pyver="${2:?--python-version needs X.Y}"; shift ;;
        -h | --help) usage; exit 0 ;;
        *) forward+=("$1") ;;
    esac
    shift
done

stage() {
    local here_py="${PYTHON:-}" p
    if [[ -z $here_py ]]; then
        if [[ -x .venv/bin/python ]]; then here_py=.venv/bin/python; else here_py=python3; fi
    fi
    rm -rf "$dir" && mkdir -p "$dir" || return 2
    for p in packages/*/ plugins/*/; do
        "$here_py" -m pip wheel -q --no-deps -w "$dir" "$p" || return 1
    done
    "$here_py" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dir" \
        "${THIRD_PARTY[@]}" || return 1
    echo "staged $(find "$dir" -name '*.whl' | wc -l) wheels in $dir ($(du -sh "$dir" | cut -f1));"
    echo "carry it, then there: bash tools/gpu/offline.sh run --dir $dir"
}

cuda_python() {  # the first Python whose torch sees a GPU
    local candidate
    for candidate in ${PYTHON:-} python3 /opt/*/.venv/bin/python3; do
        command -v "$candidate" >/dev/null 2>&1 || continue
        if "$candidate" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' \
            >/dev/null 2>&1; then
            command -v "$candidate"
            return 0
        fi
    done
    return 1
}

run() {
    local py site
    if ! compgen -G "$dir/*.whl" >/dev/null; then
        echo "tools/gpu/offline.sh: no wheels in $dir; run \`bash tools/gpu/offline.sh stage" \
            "--dir $dir\` where pip works and carry $dir here" >&2
        return 2
    fi
    if ! py=$(cuda_python); then
        echo "tools/gpu/offline.sh: no Python here imports a torch that sees a GPU (tried" \
            "\$PYTHON, python3, /opt/*/.venv/bin/python3); set PYTHON" >&2
        return 3
    fi
    site="${TMPDIR:-/tmp}/shard-gpu-site"
    rm -rf "$site"
    "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$dir"/*.whl ||
        return 1
    echo "offline: $py ($("$py" -c 'import torch; print(torch.__version__)')), shard from $site"
    # check.sh's in-environment mode runs `python` and `pytest`: this Python's.
    PATH="$(dirname "$py"):$PATH" PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" \
        HATCH_ENV_ACTIVE=dev bash tools/gpu/check.sh "${forward[@]}"
}

case "$verb" in
    stage) stage ;;
    run) run ;;
    -h | --help) usage; exit 0 ;;
    *) echo "tools/gpu/offline.sh: unknown command $verb (stage or run)" >&2; usage >&2; exit 2 ;;
esac
