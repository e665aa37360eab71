"""The wheel and the sdist, built from this tree, hold every source and work once installed.

Only editable installs ran before, and a wheel without five subpackages and the kernels'
headers went unnoticed (issue 38). Here the tree (git's view of it: files tracked, or new
and not ignored) is copied to a temporary folder and built there, as a user builds it:

* `pip wheel .`, the wheel from the tree, holds exactly the tree's files under kvlab/ and
  kernels/ (the latter as kvlab/kernels/): every package, module, data file and kernel
  source, and nothing outside kvlab/ (no top-level `kernels`). Nothing is listed here: a
  new subpackage or data file is checked the day it lands.
* `python -m build`, the sdist and then a wheel built from it, ships the same sources, and
  its wheel has the same file list.
* That wheel, installed with --no-deps into a fresh venv, runs tests/wheel_check.py from a
  folder outside the repository: every module imports, the native CPU kernels compile from
  the installed sources into an empty cache, and the embedded model serves a request.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECK = Path(__file__).with_name("wheel_check.py")
INSTALLS_AS = {"kvlab": "kvlab", "kernels": "kvlab/kernels"}  # pyproject's package-dir
QUESTION_ANSWER = "The capital of France is Paris."  # wheel_check.py's request, greedy


@dataclass
class Built:
    tree: list[str]  # the tree's files, relative to the repository root
    wheel: Path  # `pip wheel .`
    sdist: Path  # `python -m build`
    sdist_wheel: Path  # `python -m build`: the wheel built from the sdist


def tree_files() -> list[str]:
    """The tree's files as git sees them: tracked (and not deleted), or new and not ignored."""
    cmd = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    listed = run(cmd, cwd=ROOT).stdout.split("\0")
    return sorted({name for name in listed if name and (ROOT / name).is_file()})


def in_wheel(path: str) -> str | None:
    """Where a file of the tree installs in the wheel; None for one outside the package."""
    top, _, rest = path.partition("/")
    return f"{INSTALLS_AS[top]}/{rest}" if top in INSTALLS_AS and rest else None


def wheel_names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        return sorted(name for name in archive.namelist() if not name.endswith("/"))


def packages(files) -> list[str]:
    """The packages among `files` (paths in the wheel): folders with an __init__.py."""
    inits = [name for name in files if name.endswith("/__init__.py")]
    return sorted({name.rpartition("/")[0].replace("/", ".") for name in inits})


def modules(files) -> set[str]:
    """The importable modules under kvlab among `files` (paths in the wheel)."""
    names = {name.removesuffix(".py").replace("/", ".") for name in files if name.endswith(".py")}
    return {name.removesuffix(".__init__") for name in names} - {"kvlab"}


def run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run([str(part) for part in cmd], capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        pytest.fail(
            f"`{' '.join(map(str, cmd))}` exited with {done.returncode}:\n"
            f"{done.stdout[-4000:]}\n{done.stderr[-6000:]}",
            pytrace=False,
        )
    return done


def model_cache() -> Path:
    """Where kvlab keeps the embedded model (kvlab.model.loading.cache_dir's rule), so the
    installed copy loads it from there while its kernels build in an empty cache."""
    if os.environ.get("KVLAB_CACHE_DIR"):
        return Path(os.environ["KVLAB_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvlab"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Built:
    """Both builds, each in a copy of the tree of its own, side by side."""
    tmp = tmp_path_factory.mktemp("wheel")
    tree = tree_files()
    for copy in ("tree", "sdist"):
        for name in tree:
            (tmp / copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tmp / copy / name)
    py = sys.executable  # .venv's: its setuptools and build, no download
    builds = [  # each run in its copy's folder, on "."
        [py, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", tmp / "out-tree"],
        [py, "-m", "build", "--no-isolation", "--outdir", tmp / "out-sdist"],
    ]
    procs = [
        subprocess.Popen(
            [*map(str, cmd), "."],
            cwd=tmp / copy,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for cmd, copy in zip(builds, ("tree", "sdist"))
    ]
    for cmd, proc in zip(builds, procs):
        out = proc.communicate(timeout=600)[0]
        if proc.returncode != 0:
            pytest.fail(f"`{' '.join(map(str, cmd))}` failed:\n{out[-6000:]}", pytrace=False)
    (wheel,) = (tmp / "out-tree").glob("*.whl")
    (sdist,) = (tmp / "out-sdist").glob("*.tar.gz")
    (sdist_wheel,) = (tmp / "out-sdist").glob("*.whl")
    return Built(tree, wheel, sdist, sdist_wheel)


def test_wheel_holds_every_file_of_the_tree(built):
    names = wheel_names(built.wheel)
    outside = [n for n in names if not n.startswith("kvlab/") and ".dist-info/" not in n]
    assert not outside, f"the wheel installs files outside kvlab/: {outside}"
    files = {n for n in names if n.startswith("kvlab/")}
    expected = {in_wheel(name) for name in built.tree} - {None}

    missing_packages = sorted(set(packages(expected)) - set(packages(files)))
    assert not missing_packages, (
        f"packages of the tree missing from the wheel: {missing_packages} "
        "(setup.py's find_packages should find every folder with an __init__.py)"
    )
    missing = sorted(expected - files)
    assert not missing, (
        f"files of the tree missing from the wheel: {missing} (a module needs an __init__.py "
        "in its folder; any other file a pattern in pyproject's [tool.setuptools.package-data])"
    )
    extra = sorted(files - expected)
    assert not extra, f"files in the wheel that the tree does not have: {extra}"


def test_sdist_ships_the_sources_and_builds_the_same_wheel(built):
    with tarfile.open(built.sdist) as sdist:  # each name under kvlab-<version>/
        names = {m.name.partition("/")[2] for m in sdist.getmembers() if m.isfile()}
    sources = {name for name in built.tree if in_wheel(name)}
    missing = sorted(sources - names)
    assert not missing, f"files of kvlab/ and kernels/ missing from the sdist: {missing}"
    assert {"pyproject.toml", "setup.py", "README.md", "LICENSE"} <= names
    assert wheel_names(built.sdist_wheel) == wheel_names(built.wheel)


@pytest.mark.slow
def test_installed_wheel_imports_builds_its_kernels_and_serves(built, tmp_path):
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    install = ["install", "--no-deps", "--no-index", "--quiet", built.sdist_wheel]
    run([sys.executable, "-m", "pip", "--python", python, *install])
    # kvlab's dependencies: .venv's site-packages, as plain path lines (so its .pth files,
    # the editable install's finder among them, do not run), after the venv's own.
    site = run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
    deps = dict.fromkeys(sysconfig.get_path(kind) for kind in ("purelib", "platlib"))
    (Path(site.stdout.strip()) / "zz_kvlab_dependencies.pth").write_text("\n".join(deps) + "\n")

    work = tmp_path / "work"  # outside the repository: the source tree is not importable
    work.mkdir()
    shutil.copy(CHECK, work)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(XDG_CACHE_HOME=str(tmp_path / "cache"), KVLAB_CACHE_DIR=str(model_cache()))
    done = run([python, work / CHECK.name, ROOT], cwd=work, env=env, timeout=600)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    print("skipped:", found["skipped"], "seconds:", found["seconds"])  # shown by pytest -s

    assert Path(found["kvlab"]).is_relative_to(venv.resolve())
    walked = set(found["imported"]) | set(found["skipped"])
    assert walked == modules(wheel_names(built.sdist_wheel)), "the walk missed modules"
    assert found["kernel_libraries"], "no kernel library was built in the fresh cache"
    assert "kvlab" in found["entry_points"]
    assert found["answer"] == QUESTION_ANSWER
