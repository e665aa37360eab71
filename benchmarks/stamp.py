"""Add the provenance block every file in benchmarks/results/ carries.

    python benchmarks/stamp.py benchmarks/results/notebook_times.avx2.json \
        --benchmark "each notebook's wall time" --command "make notebook-times" --rounds 1

The block names the benchmark, this machine's class (avx512, avx2 or the architecture)
and CPU (model name and the flags that decide kvlab's kernels, from /proc/cpuinfo), the
date, the command and the rounds; `--notes` adds anything else. It goes first in the file,
before what the benchmark wrote. The file's name should be `<benchmark>.<machine
class>.json` (`--class-of-machine` prints this machine's class); tests/test_docs.py
checks both, and docs/gen_pages.py builds the site's results page from them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
from pathlib import Path

FLAGS = ("avx512f", "avx512_bf16", "amx_bf16", "amx_int8", "avx2", "fma", "f16c")


def cpuinfo() -> tuple[str, set[str]]:
    """This machine's CPU model name and flags ("" and none where /proc/cpuinfo is absent)."""
    model, flags = "", set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return model, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not model:
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return model, flags


def machine_class() -> str:
    """avx512 (AVX-512 foundation), avx2 (AVX2 without it) or the architecture's name."""
    _, flags = cpuinfo()
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if "avx2" in flags else platform.machine() or "unknown"


def provenance(benchmark: str, command: str, rounds: int | str, notes: str = "") -> dict:
    model, flags = cpuinfo()
    have = [f for f in FLAGS if f in flags]
    lack = [f for f in FLAGS if f not in flags]
    block = {
        "benchmark": benchmark,
        "machine_class": machine_class(),
        "machine": f"{model or platform.processor() or 'CPU not known'}, "
        f"{os.cpu_count()} cores, {platform.machine()}",
        "cpu_flags": ", ".join(have) + (f"; no {', no '.join(lack)}" if lack else ""),
        "date": datetime.date.today().isoformat(),
        "command": command,
        "rounds": rounds,
    }
    if notes:
        block["notes"] = notes
    return block


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", type=Path, nargs="?")
    parser.add_argument("--benchmark", help="what was measured, in a line")
    parser.add_argument("--command", help="the command that made the file")
    parser.add_argument("--rounds", default="1", help="rounds (or how repeats were taken)")
    parser.add_argument("--notes", default="")
    parser.add_argument("--class-of-machine", action="store_true", help="print it and stop")
    args = parser.parse_args()
    if args.class_of_machine:
        print(machine_class())
        return
    if not (args.file and args.benchmark and args.command):
        parser.error("FILE, --benchmark and --command are needed")
    data = json.loads(args.file.read_text(encoding="utf-8"))
    data.pop("provenance", None)
    rounds = int(args.rounds) if args.rounds.isdigit() else args.rounds
    stamped = {"provenance": provenance(args.benchmark, args.command, rounds, args.notes), **data}
    args.file.write_text(json.dumps(stamped, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
