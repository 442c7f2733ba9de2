"""Is the development environment's torch a CUDA build that sees a GPU? (step 1 of check.sh)

``tools/gpu/check.sh`` runs this inside the dev environment right after
hatch has created (or synced) it: it is the step that installs the
environment, and this script says whether what got installed can run the
GPU tests. It prints torch's version, its CUDA version and every visible
GPU, and exits 3 with the reason and the fix when

- torch is a CPU-only build (``torch.version.cuda`` is ``None``): pip chose a
  CPU wheel, usually because its configuration (``pip config list``: an
  index, ``find-links`` or a constraints file) points at one, or because
  ``.venv`` was created earlier on a CPU machine;
- torch is a CUDA build but sees no device (driver, container or
  ``CUDA_VISIBLE_DEVICES``).

Usage: ``python tools/gpu/probe.py`` (no options).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Print what torch sees; 0 when it is a CUDA build with at least one GPU, else 3."""
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None).parse_args(
        argv
    )
    import torch

    print(f"torch {torch.__version__} at {torch.__file__}")
    if torch.version.cuda is None:
        print(
            f"probe: torch {torch.__version__} in {sys.prefix} is a CPU-only build, so the GPU "
            "tests would all be skipped. pip picked a CPU wheel: its configuration "
            "(`python -m pip config list`: an index, find-links or a constraints file) points at "
            "one, or this environment was created on a CPU machine. Fix the pip configuration, "
            f"remove {sys.prefix} and run tools/gpu/check.sh again: on a CUDA machine a plain "
            "`pip install torch==<version>` from PyPI is the CUDA build.",
            file=sys.stderr,
        )
        return 3
    print(f"CUDA {torch.version.cuda}")
    if not torch.cuda.is_available():
        print(
            f"probe: torch {torch.__version__} is a CUDA {torch.version.cuda} build but sees no "
            "GPU: check the driver (`nvidia-smi`), that the container was started with GPUs, "
            "and CUDA_VISIBLE_DEVICES.",
            file=sys.stderr,
        )
        return 3
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        print(
            f"cuda:{index} {props.name}, compute capability {props.major}.{props.minor}, "
            f"{props.total_memory / 2**30:.1f} GiB"
        )
    if not torch.cuda.is_bf16_supported():
        print("probe: warning: this GPU has no native bf16; the bf16 benchmark will be slow")
    return 0


if __name__ == "__main__":
    sys.exit(main())
