"""Builds and loads kvlab's native CPU kernels: one library from the C files beside this one.

    cpu_kernels_available()            True once the library is built and loaded (never raises)
    cpu_kernels_error()                why it is not, or None
    cpu_kernels_threads()              whose threads run the kernels: "openmp" or "own"
    cpu_kernels_have(dtype)            whether this build computes in dtype
    native_function(name, argtypes)    an entry point of the library, its ctypes signature set

SOURCES (the thread pool, the decode and the prompt kernels, bf16 prompts on AMX tiles, a
layer's fused bf16 elementwise ops, bf16 linears on AMX tiles, a decode step's layer in
two calls and fp32 linears streamed; cpu_common.h is what they share) compile on first use
with the system's C compiler (`$CC`, else cc/gcc/clang) into `$XDG_CACHE_HOME/kvlab/kernels/`
(default ~/.cache), named by a hash of the sources, flags, compiler version and CPU,
compiled to a temporary file and renamed into place, so concurrent processes are safe.
Without a compiler the kernels are unavailable, and kvlab.kernels.dispatch takes the torch
reference instead.

Threads: where torch runs on OpenMP (Linux), the library is handed the GOMP_parallel of
the runtime torch loaded, and each kernel call runs on torch's own OpenMP threads, which
are still spinning from torch's last op and take it at once (cpu_pool.c). Elsewhere, or
with `KVLAB_CPU_THREADS=own`, the library runs its own pool of pthreads.

This module imports only torch and the standard library.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

HERE = Path(__file__).parent
SOURCES = tuple(
    HERE / name
    for name in (
        "cpu_pool.c", "cpu_decode.c", "cpu_prefill.c", "cpu_amx.c", "cpu_fused.c",
        "cpu_invariant.c", "cpu_linear.c", "cpu_layer.c", "cpu_stream.c",
    )
)  # fmt: skip
HEADERS = (HERE / "cpu_common.h", HERE / "cpu_tiles.h", HERE / "cpu_amx.h")
FLAG_SETS = (  # tried in order: -march=native is fastest but not every compiler has it
    ("-O3", "-march=native", "-shared", "-fPIC", "-pthread"),
    ("-O3", "-shared", "-fPIC", "-pthread"),
)
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # cpu_common.h's codes
NO_MEMORY = 4  # KVLAB_ENOMEM

_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib": the loaded CDLL or None, "error": why not
_functions: dict[str, object] = {}  # entry points whose signatures are set
THREADS_ENV = "KVLAB_CPU_THREADS"  # "own": the library's pthreads even where OpenMP is there
OPENMP_RUNTIMES = ("libgomp", "libomp", "libiomp5")  # each has GOMP_parallel


def cpu_kernels_available() -> bool:
    """True when the native kernels are compiled and loaded (built on first call; never
    raises)."""
    return _library() is not None


def cpu_kernels_error() -> str | None:
    """Why the native kernels are unavailable, or None when they are available."""
    _library()
    return _state.get("error")


def cpu_kernels_threads() -> str | None:
    """ "openmp" when the kernels run on torch's OpenMP threads, "own" on the library's
    pthreads, None when the library is unavailable."""
    _library()
    return _state.get("threads")


def cpu_kernels_have(dtype: torch.dtype) -> bool:
    """Whether this build of the native kernels computes in `dtype` (float16 needs the
    compiler's _Float16); False where the library is unavailable."""
    lib = _library()
    return lib is not None and dtype in DTYPES and bool(lib.kvlab_dtype_supported(DTYPES[dtype]))


def native_function(name: str, argtypes: list, *dtypes: torch.dtype):
    """The library's entry point `name` (returning an int status), with `argtypes` set.

    RuntimeError when the library is unavailable; ValueError when this build lacks one of
    `dtypes` (float16 needs the compiler's _Float16).
    """
    lib = _library()
    if lib is None:
        raise RuntimeError(f"the native CPU kernels are unavailable: {cpu_kernels_error()}")
    for dtype in dtypes:
        if not lib.kvlab_dtype_supported(DTYPES[dtype]):
            raise ValueError(f"this build of the native CPU kernels has no {dtype}")
    with _lock:
        if name not in _functions:
            function = getattr(lib, name)
            function.argtypes, function.restype = argtypes, ctypes.c_int
            _functions[name] = function
        return _functions[name]


def raise_for(status: int, kernel: str, errors: dict[int, str]) -> None:
    """The error a kernel's return code stands for, if any; `errors` names its codes."""
    if status == NO_MEMORY:
        raise MemoryError(f"{kernel}: no memory for its buffers")
    if status != 0:
        raise ValueError(f"{kernel}: {errors.get(status, f'error {status}')}")


def rows_contiguous(cache: torch.Tensor) -> torch.Tensor:
    """The cache as is when its last dim is contiguous (strides are passed), else a copy."""
    return cache if cache.stride(-1) == 1 or cache.shape[-1] == 1 else cache.contiguous()


# --- building and loading -------------------------------------------------------------


def _library() -> ctypes.CDLL | None:
    """The loaded library, built on first use; None (and _state["error"]) when it cannot be."""
    with _lock:
        if "lib" not in _state:
            try:
                _state["lib"], _state["error"] = _load(_build()), None
            except Exception as e:  # no compiler, a failed build, an unwritable cache...
                _state["lib"], _state["error"] = None, f"{type(e).__name__}: {e}"
        return _state["lib"]


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.kvlab_dtype_supported.argtypes = [ctypes.c_int]
    lib.kvlab_dtype_supported.restype = ctypes.c_int
    entry = _openmp_entry() if os.environ.get(THREADS_ENV) != "own" else None
    lib.kvlab_use_openmp.argtypes = [ctypes.c_void_p]
    lib.kvlab_use_openmp.restype = None
    lib.kvlab_use_openmp(entry)
    _state["threads"] = "openmp" if entry else "own"
    return lib


def _openmp_entry() -> int | None:
    """The address of GOMP_parallel in the OpenMP runtime torch loaded, if any (Linux)."""
    if not torch.backends.openmp.is_available():
        return None
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/" in line}  # mapped files
    except OSError:
        return None
    for path in sorted(paths):
        if Path(path).name.startswith(OPENMP_RUNTIMES):
            try:  # the loaded copy: dlopen of a loaded library returns it
                return ctypes.cast(ctypes.CDLL(path).GOMP_parallel, ctypes.c_void_p).value
            except (OSError, AttributeError):
                continue
    return None


def _build() -> Path:
    """The compiled library's path in the cache, compiling it first if it is not there."""
    compiler = _compiler()
    source = b"\0".join(path.read_bytes() for path in SOURCES + HEADERS)
    errors = []
    for flags in FLAG_SETS:
        target = _cache_dir() / f"cpu_kernels-{_key(source, compiler, flags)}.so"
        if target.exists():
            return target
        error = _compile(compiler, flags, target)
        if error is None:
            return target
        errors.append(f"{' '.join([compiler, *flags])}: {error}")
    raise RuntimeError("compiling the native CPU kernels failed:\n" + "\n".join(errors))


def _compile(compiler: str, flags: tuple[str, ...], target: Path) -> str | None:
    """Compile to a temporary file beside `target`, then rename it into place (atomic, so
    racing processes are safe). The compiler's error output, or None on success."""
    fd, tmp = tempfile.mkstemp(prefix=target.stem + "-", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        cmd = [compiler, *flags, "-o", tmp, *map(str, SOURCES)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            return done.stderr.strip()[-2000:] or f"exit status {done.returncode}"
        os.replace(tmp, target)
        return None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        path = shutil.which(name) if name else None
        if path:
            return path
    raise RuntimeError("no C compiler found ($CC, cc, gcc or clang)")


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(root) / "kvlab" / "kernels"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _key(source: bytes, compiler: str, flags: tuple[str, ...]) -> str:
    """A hash of everything the binary depends on: sources, flags, compiler and CPU."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=60
    ).stdout
    parts = [source, " ".join(flags).encode(), version.encode(), _cpu_model().encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    for line in _cpu_model().splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.partition(":")[2].split())
    return set()


def _cpu_model() -> str:
    """The CPU's model name and feature flags (what -march=native compiles for)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
