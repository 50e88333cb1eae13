"""Builds, caches and calls the compiled kernel of vescale.random (csrc/vescale_rng.c) through ctypes.

The C source is compiled on first use with the system C compiler (``$CC``, else ``cc``) into
``$XDG_CACHE_HOME/vescale`` (else ``~/.cache/vescale``; the temporary directory if that is not
writable), under a name that hashes the source, the
compiler's version, the flags and the CPU's feature flags (the build uses ``-march=native``), so a
stale or foreign build is never loaded. Concurrent builds (several ranks starting at once) each write
their own temporary file and rename it into place. If no compiler is found or the build fails, a
warning says so once and ``load`` returns None: vescale.random then uses its pure-PyTorch path, which
gives the same bits, only slower.
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
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Sequence

import torch

if TYPE_CHECKING:
    from vescale.random.kernel import Block, Draw, Launch

_SOURCE = Path(__file__).with_name("csrc") / "vescale_rng.c"
_ABI_VERSION = 2
# -ffp-contract=off: no fused multiply-add may change a rounding (the PyTorch path has none).
# -fno-trapping-math / -fno-math-errno change no value (no -ffast-math: no reassociation, signed
# zeros kept); they let the compiler turn the branch-free transforms into vector code.
_COMMON_FLAGS = ["-O3", "-ffp-contract=off", "-fno-trapping-math", "-fno-math-errno", "-fPIC", "-shared", "-pthread"]
# -march=native: AVX2 Philox and vector transforms where the CPU has them (the cache key includes the
# CPU's flags); -fopenmp-simd only honours `omp simd` loop hints, no OpenMP runtime is linked.
_FLAG_SETS = [["-march=native", "-fopenmp-simd"], ["-fopenmp-simd"], []]

_DTYPE_CODES = {
    torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3, torch.bool: 4,
    torch.uint8: 5, torch.int8: 6, torch.int16: 7, torch.int32: 8, torch.int64: 9,
}


class _Job(ctypes.Structure):
    """Mirror of ``vrng_job`` in vescale_rng.c (same field order and types)."""

    _fields_ = [
        ("op", ctypes.c_int64), ("dtype", ctypes.c_int64), ("wide", ctypes.c_int64), ("unroll", ctypes.c_int64),
        ("seed", ctypes.c_uint64), ("nlaunch", ctypes.c_int64),
        ("launch_start", ctypes.c_void_p), ("launch_threads", ctypes.c_void_p), ("launch_counter", ctypes.c_void_p),
        ("nrows", ctypes.c_int64), ("ninner", ctypes.c_int64), ("run", ctypes.c_int64),
        ("row_base", ctypes.c_void_p), ("inner_off", ctypes.c_void_p),
        ("a", ctypes.c_double), ("b", ctypes.c_double), ("c", ctypes.c_double),
        ("modulus", ctypes.c_uint64), ("base", ctypes.c_int64),
        ("prob", ctypes.c_void_p), ("out", ctypes.c_void_p), ("num_threads", ctypes.c_int64),
    ]


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "vescale"


def _cpu_fingerprint() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return platform.machine() + platform.processor() + flags


def compiler() -> str:
    """The C compiler the build uses: ``$CC``, else ``cc``."""
    return os.environ.get("CC") or "cc"


def has_compiler() -> bool:
    """Whether this platform has the C compiler (found on ``PATH`` or as a path); without one the
    kernel cannot be built here, and a build that fails anyway is a defect, not the platform."""
    return shutil.which(compiler()) is not None


def _build() -> Path:
    cc = compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise RuntimeError(f"no C compiler ({cc!r}: {error})") from None
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join([source, version.encode(), repr((_COMMON_FLAGS, _FLAG_SETS)).encode(), _cpu_fingerprint().encode()])
    ).hexdigest()[:20]
    target = cache_dir() / f"vescale_rng_{key}.so"
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError:  # an unwritable home: build in the temporary directory instead
        target = Path(tempfile.gettempdir()) / f"vescale-{os.getuid()}" / target.name
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    for extra in _FLAG_SETS:
        temporary = target.with_name(f"{target.stem}.{os.getpid()}.{threading.get_ident()}.tmp.so")
        command = [cc, *_COMMON_FLAGS, *extra, str(_SOURCE), "-o", str(temporary), "-lm"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if result.returncode == 0:
            os.replace(temporary, target)
            return target
        temporary.unlink(missing_ok=True)
        errors.append(f"{' '.join(command)}:\n{result.stderr.strip()}")
    raise RuntimeError("compilation failed:\n" + "\n".join(errors))


class NativeKernel:
    """The loaded library; ``fill`` is kernel.generate's compiled path."""

    def __init__(self, library: ctypes.CDLL):
        self._lib = library
        library.vrng_fill.argtypes = [ctypes.POINTER(_Job)]
        library.vrng_fill.restype = ctypes.c_int64
        library.vrng_philox.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 4 + [ctypes.c_uint32] * 2 + [ctypes.c_void_p]
        library.vrng_philox.restype = None
        library.vrng_scan_index.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
        library.vrng_scan_index.restype = ctypes.c_int64

    def scan_index(self, index: torch.Tensor) -> IndexScan:
        """min, max and step-1-ness of a contiguous 1-D int64 index tensor, in one read-only pass."""
        min_max = (ctypes.c_int64 * 2)()
        step_one = self._lib.vrng_scan_index(index.data_ptr(), index.numel(), min_max)
        return IndexScan(min_max[0], min_max[1], bool(step_one))

    def philox(
        self, c0: torch.Tensor | int, c1: torch.Tensor | int, c2: torch.Tensor | int, c3: torch.Tensor | int, k0: int, k1: int
    ) -> torch.Tensor:
        """Philox4x32-10 of int64 tensors of counter words (values < 2**32): an (n, 4) int64 tensor."""
        words = [torch.as_tensor(c, dtype=torch.int64).reshape(-1).to(torch.int32).contiguous() for c in (c0, c1, c2, c3)]
        out = torch.empty((words[0].numel(), 4), dtype=torch.int32)
        self._lib.vrng_philox(words[0].numel(), *[w.data_ptr() for w in words], k0, k1, out.data_ptr())
        return out.to(torch.int64) & 0xFFFFFFFF

    def fill(
        self, out: torch.Tensor, draw: Draw, seed: int, launches: Sequence[Launch], block: Block, prob: torch.Tensor | None
    ) -> None:
        """Fill ``out`` with ``block`` (a kernel.Block) of the draw. The launch tables are small ctypes arrays
        (a torch.tensor each would cost more than the rest of the call for a small block)."""
        row_base, inner_off, run = block.layout()
        count = len(launches)
        starts = (ctypes.c_int64 * (count + 1))(*[launch.start for launch in launches], block.global_numel)
        threads = (ctypes.c_int64 * count)(*[launch.threads for launch in launches])
        counters = (ctypes.c_uint64 * count)(*[launch.counter for launch in launches])  # < 2**62
        job = _Job(
            draw.op, _DTYPE_CODES[out.dtype], int(draw.wide), draw.unroll, seed,
            count, ctypes.addressof(starts), ctypes.addressof(threads), ctypes.addressof(counters),
            row_base.numel(), inner_off.numel(), run, row_base.data_ptr(), inner_off.data_ptr(),
            draw.a, draw.b, draw.c, draw.modulus, draw.base,
            None if prob is None else prob.data_ptr(), out.data_ptr(), torch.get_num_threads(),
        )
        if self._lib.vrng_fill(ctypes.byref(job)) != 0:
            raise MemoryError("vescale.random: the compiled kernel could not allocate its task list")


class IndexScan(NamedTuple):
    low: int
    high: int
    step_one: bool  # index[i + 1] == index[i] + 1 throughout (and not empty)


def local_layout(
    global_shape: Sequence[int], dim_indices: Sequence[torch.Tensor] | None, scans: Sequence[IndexScan] | None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(row_base, inner_off, run) such that local element (r, p, c) in C order, e = (r * P + p) * run + c,
    is global flat index row_base[r] + inner_off[p] + c.

    Trailing dims the block holds whole, plus one more dim it holds as a step-1 range, fold into one
    contiguous run, so a row- or column-sharded block is a few long runs the kernel walks without
    dividing per element."""
    numel = 1
    for size in global_shape:
        numel *= size
    zero = torch.zeros(1, dtype=torch.int64)
    if dim_indices is None:
        return zero, zero, numel
    strides: list[int] = []
    stride = 1
    for size in reversed(global_shape):
        strides.insert(0, stride)
        stride *= size
    d, run = len(global_shape) - 1, 1
    while d >= 0 and scans[d].step_one and scans[d].low == 0 and dim_indices[d].numel() == global_shape[d]:
        run *= global_shape[d]
        d -= 1
    if d < 0:
        return zero, zero, run
    index = dim_indices[d]
    if scans[d].step_one:
        inner_off = index[:1] * strides[d]
        run *= index.numel()
    else:
        inner_off = index * strides[d]
    if d == 0:
        return zero, inner_off.contiguous(), run
    from vescale.random.kernel import flat_indices

    row_base = flat_indices(global_shape[:d], dim_indices[:d]) * strides[d - 1]
    return row_base.contiguous(), inner_off.contiguous(), run


_lock = threading.Lock()
_kernel: NativeKernel | None = None
_failure: str | None = None


def load(required: bool = False) -> NativeKernel | None:
    """The compiled kernel, built on first use; None (after one warning) if it cannot be built,
    or a RuntimeError naming the reason when ``required``."""
    global _kernel, _failure
    if _kernel is not None:  # every random op asks: no lock once it is loaded
        return _kernel
    with _lock:
        if _kernel is None and _failure is None:
            try:
                library = ctypes.CDLL(str(_build()))
                library.vrng_abi_version.restype = ctypes.c_int64
                if library.vrng_abi_version() != _ABI_VERSION:
                    raise RuntimeError(f"ABI version {library.vrng_abi_version()} != {_ABI_VERSION}")
                _kernel = NativeKernel(library)
            except Exception as error:  # any build or load problem means: use the PyTorch path
                _failure = f"{type(error).__name__}: {error}"
                warnings.warn(
                    f"vescale.random: the compiled random kernel is unavailable ({_failure}); "
                    "using the pure-PyTorch path (same values, slower)",
                    RuntimeWarning,
                    stacklevel=3,
                )
    if _kernel is None and required:
        raise RuntimeError(f"vescale.random: the compiled random kernel is unavailable: {_failure}")
    return _kernel
