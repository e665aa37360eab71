"""What the scripts in benchmarks/ share: their options, the machine line and the output.

Each script is `main(argv=None) -> dict`: it reads `script_parser(__doc__)`'s options
(`--quick`: a tiny workload, so the test suite runs it in seconds; `--model PATH`: a local
checkpoint instead of the embedded model; `--out PATH`: also write the JSON there), takes
its measurements from kvlab.experiments, prints them as JSON (`report`) and returns them.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from kvlab.model.loading import LoadedModel, load_model


def script_parser(doc: str | None) -> argparse.ArgumentParser:
    """An ArgumentParser with the options every benchmark script takes."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a tiny workload (seconds)")
    parser.add_argument("--model", help="a local model directory (default: the embedded model)")
    parser.add_argument("--out", type=Path, help="also write the JSON to this file")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's; 1 "
                        "keeps timings steady on a machine shared with other work)")  # fmt: skip
    return parser


def sized(args: argparse.Namespace, sizes: dict[str, tuple[int, int]]) -> None:
    """Fill each option of `sizes` (name: (full, quick)) the command line left unset with
    its full size, or its --quick one."""
    for name, (full, quick) in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)


def load(args: argparse.Namespace) -> LoadedModel:
    """The model `--model` names (default: the embedded SmolLM2-135M-Instruct), after
    setting torch's threads to `--threads`."""
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    return load_model(args.model, progress=False)


def machine(model: LoadedModel) -> str:
    """Where a result was measured: "x86_64, 2 threads, cpu" (architecture, torch threads,
    the model's device)."""
    return f"{platform.machine()}, {torch.get_num_threads()} threads, {model.device}"


def report(result: dict, out: Path | None = None) -> dict:
    """Print `result` as JSON (and write it to `out`); return it."""
    text = json.dumps(result, indent=2)
    print(text)
    if out is not None:
        Path(out).write_text(text + "\n")
    return result
