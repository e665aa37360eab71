"""The GPU check for kvlab's kernels: one command, under 5 minutes on one H200.

    python benchmarks/gpu_check.py            # on a CUDA machine: writes
                                              #   benchmarks/results/gpu_check.json
    python benchmarks/gpu_check.py --quick    # CPU smoke run (Triton interpreter, tiny
                                              #   shapes); writes to a temp dir

It needs only torch, triton and transformers, and this checkout's kvlab (installed or
not: the kernels are then loaded from ../kernels by path). The engine part also imports
kvlab's other dependencies (pandas, tqdm: in most images); without them that part records
its error and the others still run. The measuring is kvlab.checks.kernel_check's and
kvlab.checks.gpu_check's.

1. Correctness at full size: every kernel against its torch reference (max abs error per
   codec and dtype; KV writes bit for bit).
2. Bandwidth: the measured device copy bandwidth (read + write of a big tensor), a small
   tuning sweep of the decode kernel at 4k context x 32 sequences, then the decode
   kernel's achieved bandwidth (bytes it must read / time) across context lengths
   512..16k and batch sizes 1..64, as a fraction of the copy bandwidth.
3. The engine's decode throughput (paged cache; torch attention and kernel attention) vs
   HF `generate`, same prompts, greedy, same token counts. The embedded model when it is
   cached on the machine, else a model of its shape with random weights (throughput does
   not depend on the weights).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels on CPU


def load_kernels():
    """kvlab.kernels: installed, or (a bare checkout) loaded from ROOT/kernels under that name.

    The checkout's `kvlab` is its parent: `import kvlab` loads nothing else (its names are
    imported on first use), so this needs only torch and triton.
    """
    sys.path.insert(0, str(ROOT))
    try:
        return importlib.import_module("kvlab.kernels")
    except ModuleNotFoundError as error:
        if error.name != "kvlab.kernels":  # torch or triton missing: nothing to fall back on
            raise
    folder = ROOT / "kernels"  # not under kvlab/: pyproject installs it as kvlab.kernels
    spec = importlib.util.spec_from_file_location(
        "kvlab.kernels", folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    package = importlib.util.module_from_spec(spec)
    sys.modules["kvlab.kernels"] = package
    spec.loader.exec_module(package)
    return package


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: tiny shapes")
    parser.add_argument("--out", type=Path, help="JSON path (default: see above)")
    parser.add_argument("--model", help="a local checkpoint dir (default: the embedded model)")
    parser.add_argument("--budget-s", type=float, default=270.0, help="stop the sweep after this")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.quick:
        parser.error("no CUDA device here: use --quick for the CPU smoke run")
    load_kernels()
    from kvlab.checks.gpu_check import gpu_report

    report = gpu_report(args.quick, args.model, args.budget_s)
    out = args.out or (
        Path(tempfile.gettempdir()) / "gpu_check_quick.json"
        if args.quick
        else ROOT / "benchmarks" / "results" / "gpu_check.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(json.dumps(report["headline"], indent=1, default=str))
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
