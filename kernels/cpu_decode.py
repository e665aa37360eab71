"""Paged decode attention on the CPU: a native kernel that reads K/V in place from the pool.

The torch path (kvlab.model.attention.pooled_attention) copies every sequence's K/V into a
padded (B, S, kv_heads, head_dim) tensor each decode step, then runs
scaled_dot_product_attention over it. Decode is memory-bound, so that copy roughly triples
the memory traffic. `cpu_decode.c` instead reads each K and V row once, where it lies:

* **Slots.** Position j of sequence b lives in slot `slots[b, j]` of the layer's
  (num_slots, kv_heads, head_dim) storage; positions >= lens[b] are never read (their
  slots may hold anything, NaN included).
* **One task per chunk of a sequence.** A task covers up to 256 positions of one sequence
  for all its heads: a slot's K for every kv head is one contiguous record (likewise V), so
  the records are read front to back, each value once, and used for all the query heads
  that share its kv head (GQA). Longer sequences are split into such chunks, whose partial
  softmax results are merged by log-sum-exp; the chunks depend only on the lengths, so the
  output is bit-identical for any thread count.
* **Two passes, fp32.** Scores q . k_j * scale go to a (heads, chunk) fp32 buffer; each row
  gets softmax with max subtraction (a polynomial exp, ~1 ulp); the V pass accumulates
  p_j v_j in fp32 and divides by the sum. The output is rounded to q's dtype once.
* **Vectorised C, pthreads.** 16-float GNU vectors; the score pass sums 16 dot products'
  lanes together with a shuffle tree; bf16/fp16 are widened as they are loaded; records a
  few positions ahead are prefetched into L2 (scattered blocks defeat the hardware
  prefetcher). The tasks are taken from a shared counter by the calling thread and
  `torch.get_num_threads() - 1` helper pthreads, which the library starts once and which
  sleep between calls (not OpenMP: torch ships its own runtime). Calls from several Python
  threads run one at a time; a forked child starts its own helpers.

The C file is compiled on first use with the system's C compiler (`$CC`, else cc/gcc/clang)
into `$XDG_CACHE_HOME/kvlab/kernels/` (default ~/.cache), named by a hash of the source,
flags, compiler version and CPU, compiled to a temporary file and renamed into place, so
concurrent processes are safe. Without a compiler `cpu_decode_available()` is False.

Shapes: q (B, heads, head_dim) float32/bfloat16 (float16 where the compiler has _Float16);
k_cache, v_cache (num_slots, kv_heads, head_dim), same dtypes, last dim contiguous (a layer
view `storage[layer]` works); slots (B, S) int64, row stride free; lens (B,) int64, each in
[1, S]. Output (B, heads, head_dim) in q's dtype. No autograd.

This module imports only torch and the standard library.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_decode.c")
FLAG_SETS = (  # tried in order: -march=native is fastest but not every compiler has it
    ("-O3", "-march=native", "-shared", "-fPIC", "-pthread"),
    ("-O3", "-shared", "-fPIC", "-pthread"),
)
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
ERRORS = {  # kvlab_paged_decode's return codes
    1: "invalid arguments",
    2: "every lens[b] must be in [1, S], S = slots.shape[1]",
    3: "slots[b, j] for j < lens[b] must be in [0, num_slots)",
}
NO_MEMORY = 4

_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib": the loaded CDLL or None, "error": why not


def cpu_decode_available() -> bool:
    """True when the native kernel is compiled and loaded (built on first call; never raises)."""
    return _library() is not None


def cpu_decode_error() -> str | None:
    """Why the native kernel is unavailable, or None when it is available."""
    _library()
    return _state.get("error")


def cpu_paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """softmax(q k^T * scale) v per sequence over its first lens[b] slots, GQA; see above."""
    _check(q, k_cache, v_cache, slots, lens, scale)
    lib = _library_for(q.dtype, k_cache.dtype)
    q = q.detach().contiguous()  # (B, heads, head_dim)
    k_cache, v_cache = _rows_contiguous(k_cache), _rows_contiguous(v_cache)
    slots = slots if slots.stride(1) == 1 else slots.contiguous()  # (B, S), any row stride
    lens = lens.contiguous()  # (B,)
    out = torch.empty_like(q)  # (B, heads, head_dim)
    if q.shape[0] > 0:
        status = lib.kvlab_paged_decode(*_arguments(q, k_cache, v_cache, out, slots, lens, scale))
        _raise_for(status)
    return out


# --- arguments ------------------------------------------------------------------------


def _check(q, k_cache, v_cache, slots, lens, scale) -> None:
    """ValueError unless the shapes, dtypes and devices fit the kernel."""
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "slots": slots, "lens": lens}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor")
    if q.dim() != 3 or k_cache.dim() != 3 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "q must be (B, heads, head_dim) and k_cache, v_cache the same "
            f"(num_slots, kv_heads, head_dim); got {tuple(q.shape)}, "
            f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    if k_cache.shape[2] != head_dim or kv_heads == 0 or heads % kv_heads:
        raise ValueError(
            f"q {tuple(q.shape)} and the cache {tuple(k_cache.shape)} need the same head_dim "
            "and heads divisible by kv_heads"
        )
    if q.dtype not in DTYPES or k_cache.dtype not in DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            "q and the caches must be float32, bfloat16 or float16 (k and v alike); "
            f"got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if slots.dtype != torch.int64 or lens.dtype != torch.int64:
        raise ValueError(f"slots and lens must be int64; got {slots.dtype}, {lens.dtype}")
    if slots.dim() != 2 or slots.shape[0] != batch or tuple(lens.shape) != (batch,):
        raise ValueError(
            f"slots must be (B, S) and lens (B,) with B = {batch}; "
            f"got {tuple(slots.shape)}, {tuple(lens.shape)}"
        )
    if batch and slots.shape[1] == 0:
        raise ValueError("slots must have at least one column")
    if not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number; got {scale!r}")


def _library_for(*dtypes: torch.dtype) -> ctypes.CDLL:
    """The loaded kernel, if it is available and handles these dtypes."""
    lib = _library()
    if lib is None:
        raise RuntimeError(f"the CPU decode kernel is unavailable: {cpu_decode_error()}")
    for dtype in dtypes:
        if not lib.kvlab_dtype_supported(DTYPES[dtype]):
            raise ValueError(f"this build of the CPU decode kernel has no {dtype}")
    return lib


def _raise_for(status: int) -> None:
    """The error kvlab_paged_decode's return code stands for, if any."""
    if status == NO_MEMORY:
        raise MemoryError("cpu_paged_decode_attention: no memory for the score buffers")
    if status != 0:
        raise ValueError(f"cpu_paged_decode_attention: {ERRORS.get(status, f'error {status}')}")


def _rows_contiguous(cache: torch.Tensor) -> torch.Tensor:
    """The cache as is when its last dim is contiguous (strides are passed), else a copy."""
    return cache if cache.stride(2) == 1 or cache.shape[2] == 1 else cache.contiguous()


def _arguments(q, k_cache, v_cache, out, slots, lens, scale) -> tuple:
    """kvlab_paged_decode's arguments, in order."""
    batch, heads, head_dim = q.shape
    return (
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        out.data_ptr(),
        DTYPES[q.dtype],
        DTYPES[k_cache.dtype],
        slots.data_ptr(),
        slots.stride(0),
        lens.data_ptr(),
        slots.shape[1],
        k_cache.shape[0],
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        batch,
        heads,
        k_cache.shape[1],
        head_dim,
        float(scale),
        torch.get_num_threads(),
    )


# --- building and loading -------------------------------------------------------------

_SIGNATURE = (
    [ctypes.c_void_p] * 4  # q, k, v, out
    + [ctypes.c_int] * 2  # dtype_q, dtype_kv
    + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]  # slots, slots_stride, lens
    + [ctypes.c_int64] * 6  # max_len, num_slots, k and v slot/head strides
    + [ctypes.c_int] * 4  # B, heads, kv_heads, head_dim
    + [ctypes.c_float, ctypes.c_int]  # scale, num_threads
)


def _library() -> ctypes.CDLL | None:
    """The loaded kernel, built on first use; None (and _state["error"]) when it cannot be."""
    with _lock:
        if "lib" not in _state:
            try:
                _state["lib"], _state["error"] = _load(_build()), None
            except Exception as e:  # no compiler, a failed build, an unwritable cache...
                _state["lib"], _state["error"] = None, f"{type(e).__name__}: {e}"
        return _state["lib"]


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.kvlab_paged_decode.argtypes = _SIGNATURE
    lib.kvlab_paged_decode.restype = ctypes.c_int
    lib.kvlab_dtype_supported.argtypes = [ctypes.c_int]
    lib.kvlab_dtype_supported.restype = ctypes.c_int
    return lib


def _build() -> Path:
    """The compiled library's path in the cache, compiling it first if it is not there."""
    compiler = _compiler()
    source = SOURCE.read_bytes()
    errors = []
    for flags in FLAG_SETS:
        target = _cache_dir() / f"cpu_decode-{_key(source, compiler, flags)}.so"
        if target.exists():
            return target
        error = _compile(compiler, flags, target)
        if error is None:
            return target
        errors.append(f"{' '.join([compiler, *flags])}: {error}")
    raise RuntimeError("compiling cpu_decode.c failed:\n" + "\n".join(errors))


def _compile(compiler: str, flags: tuple[str, ...], target: Path) -> str | None:
    """Compile to a temporary file beside `target`, then rename it into place (atomic, so
    racing processes are safe). The compiler's error output, or None on success."""
    fd, tmp = tempfile.mkstemp(prefix=target.stem + "-", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        cmd = [compiler, *flags, "-o", tmp, str(SOURCE)]
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
    """A hash of everything the binary depends on: source, flags, compiler and CPU."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=60
    ).stdout
    parts = [source, " ".join(flags).encode(), version.encode(), _cpu_model().encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _cpu_model() -> str:
    """The CPU's model name and feature flags (what -march=native compiles for)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
