"""kvlab as a user installs it: run by tests/test_wheel.py with a fresh venv's python.

    <fresh venv>/bin/python wheel_check.py REPO_ROOT     (from a folder outside the repo)

The venv holds kvlab's wheel (installed with --no-deps) and finds kvlab's dependencies in
the development venv's site-packages through a plain path line in a .pth file: such a
folder's own .pth files are not run, so the editable install's finder there never loads,
and `import kvlab` finds the wheel's copy. This script checks, in order:

1. kvlab, kvlab.kernels and kvlab's distribution metadata come from the fresh venv;
2. every module of the installed package imports (found by walking it, never listed);
   `__main__` modules are not imported (they run the CLI) and a module whose third-party
   dependency is not installed is skipped, naming it;
3. the native CPU kernels compile from the installed sources into $XDG_CACHE_HOME, which
   the test points at an empty folder (in a thread, while step 2 imports);
4. the console scripts load from the installed copy, and `kvlab --help` answers;
5. the embedded model answers a chat request over HTTP (kvlab.serve.ServerThread) with
   its attention on the native kernels ($KVLAB_KERNELS=cpu: an error if they cannot run).

The last line of its output is a JSON object of what it found; a failed check exits
non-zero with the reason.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import io
import json
import os
import pkgutil
import sys
import sysconfig
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

QUESTION = "What is the capital of France?"

PREFIX = Path(sys.prefix).resolve()


def fail(message: str) -> None:
    raise SystemExit(f"wheel_check: {message}")


def check_installed(what: str, path: str | os.PathLike, repo: Path) -> None:
    """`path` lies in the fresh venv, not in the repository."""
    resolved = Path(path).resolve()
    if not resolved.is_relative_to(PREFIX) or resolved.is_relative_to(repo):
        fail(f"{what} is {resolved}, not in the fresh venv {PREFIX}")


def import_all(package) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """Import every module under `package`: (imported, skipped: why, failed: traceback)."""
    imported, skipped, failed = [], {}, {}

    def walk(pkg) -> None:
        for info in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + "."):
            if info.name.rpartition(".")[2] == "__main__":
                skipped[info.name] = "runs the CLI when imported; its entry point is checked"
                continue
            try:
                module = importlib.import_module(info.name)
            except ModuleNotFoundError as error:
                missing = (error.name or "").partition(".")[0]
                if missing and missing != "kvlab":  # an optional third-party dependency
                    skipped[info.name] = f"needs {error.name}, which is not installed"
                else:
                    failed[info.name] = traceback.format_exc()
                continue
            except Exception:
                failed[info.name] = traceback.format_exc()
                continue
            imported.append(info.name)
            if info.ispkg:
                walk(module)

    walk(package)
    return imported, skipped, failed


def check_entry_points(repo: Path) -> dict[str, str]:
    """The console scripts: installed in the venv, each loading from the installed copy;
    `kvlab --help` prints its usage. {name: "module:function"}."""
    dist = importlib.metadata.distribution("kvlab")
    check_installed("kvlab's distribution metadata", dist.locate_file("kvlab"), repo)
    scripts = {}
    for entry in dist.entry_points.select(group="console_scripts"):
        script = Path(sysconfig.get_path("scripts")) / entry.name
        if not script.exists():
            fail(f"the console script {script} is not installed")
        function = entry.load()
        check_installed(f"{entry.name}'s module", sys.modules[function.__module__].__file__, repo)
        scripts[entry.name] = entry.value
        if entry.name == "kvlab":
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
                function(["--help"])
            if "usage: kvlab" not in out.getvalue():
                fail(f"`kvlab --help` printed {out.getvalue()!r}")
    return scripts


def serve_one_request() -> str:
    """The embedded model's answer to QUESTION, served over HTTP on the native kernels."""
    import httpx

    import kvlab
    from kvlab.serve import ServerThread

    os.environ["KVLAB_KERNELS"] = "cpu"  # the native kernels, or an error
    model = kvlab.load_model(device="cpu", progress=False)
    config = kvlab.EngineConfig(
        cache="paged", attention="kernels", max_model_len=256, kv_budget_tokens=1024
    )
    with ServerThread(kvlab.Engine(model, config)) as server:
        name = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        body = {
            "model": name,
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 16,
            "temperature": 0,
        }
        response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)
    if response.status_code != 200:
        fail(f"the chat request answered {response.status_code}: {response.text}")
    return response.json()["choices"][0]["message"]["content"]


def main(repo: Path) -> dict:
    start = time.perf_counter()
    import kvlab.kernels
    from kvlab.kernels import cpu_build

    check_installed("kvlab", kvlab.__file__, repo)
    check_installed("kvlab.kernels", kvlab.kernels.__file__, repo)
    sources = [*cpu_build.SOURCES, *cpu_build.HEADERS]
    for path in sources:
        check_installed("a native kernel source", path, repo)
        if not path.exists():
            fail(f"the native kernel source {path} is not installed")

    with ThreadPoolExecutor(1) as pool:  # the compiler runs while the modules import
        built = pool.submit(cpu_build.cpu_kernels_available)
        imported, skipped, failed = import_all(kvlab)
        built = built.result()
    imports_s = time.perf_counter() - start
    if failed:
        fail("these modules do not import:\n" + "\n".join(failed.values()))
    if not built:
        fail(f"the native CPU kernels did not build: {cpu_build.cpu_kernels_error()}")
    cache = Path(os.environ["XDG_CACHE_HOME"]) / "kvlab" / "kernels"
    libraries = sorted(path.name for path in cache.glob("*.so"))
    if not libraries:
        fail(f"no library was built in the fresh cache {cache}")

    return {
        "prefix": str(PREFIX),
        "kvlab": kvlab.__file__,
        "imported": imported,
        "skipped": skipped,
        "kernel_sources": sorted(str(path) for path in sources),
        "kernel_libraries": libraries,
        "entry_points": check_entry_points(repo),
        "answer": serve_one_request(),
        "seconds": {"imports and kernel build": imports_s, "all": time.perf_counter() - start},
    }


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]).resolve())))
