"""Building the CPU kernels' shared library (`hsd_jax.cpu_kernels`) without importing JAX, so the
CLI starts a first run's build before JAX loads (`hsd_jax.__main__`): the compiler then overlaps
the imports and the model load.

Built with the system C++ compiler against the installed jaxlib's FFI headers for this CPU
(`-march=native`), once per machine: cached in the user cache folder under a key of the sources,
jaxlib's version, the flags and the CPU; the sources compile as one translation unit (the FFI header
parsed once), under a file lock, so processes that ask at the same time build it once.
"""
from __future__ import annotations

import concurrent.futures
import fcntl
import functools
import glob
import hashlib
import os
import pathlib
import pkgutil
import platform
import shutil
import subprocess
import tempfile

HERE = os.path.join(os.path.dirname(__file__), "cpu_kernels")
SOURCES = tuple(os.path.join(HERE, f) for f in ("stacked_matmul.cc", "tree_attention.cc"))
HEADERS = (os.path.join(HERE, "parallel.h"),)
FLAGS = ("-O3", "-march=native", "-std=c++17", "-fPIC")   # each source's compile; linked with -shared
ENV = "HSD_CPU_KERNELS"                                    # "0": XLA's dots, no build
ACCELERATOR_PLUGINS = ("jax_cuda", "jax_rocm", "jax_plugins", "libtpu")   # installed: JAX may not run on the CPU


def disabled() -> bool:
    return os.environ.get(ENV, "1") == "0"


def cache_dir() -> str:
    from hsd_jax.tuning import cache_dir as tuned_dir

    return os.path.join(os.path.dirname(tuned_dir()), "cpu_kernels")


def _jaxlib():
    import jaxlib

    return jaxlib


def include_dir() -> str:
    """jaxlib's bundled headers (where `jax.ffi.include_dir()` points), found without importing JAX."""
    return os.path.join(os.path.dirname(os.path.abspath(_jaxlib().__file__)), "include")


@functools.cache
def _cpuinfo() -> tuple[str, ...] | None:
    """/proc/cpuinfo's lines, read once; None where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            return tuple(f)
    except OSError:
        return None


def _cpu_id() -> str:
    """The CPU's model and instruction-set flags (`-march=native` builds for exactly these)."""
    lines = _cpuinfo()
    if lines is None:
        return platform.processor()
    return "".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags", "Features", "CPU part"))}))


def _vendor() -> str:
    """The CPU's vendor string (`vendor_id` in /proc/cpuinfo: GenuineIntel, AuthenticAMD), '' unknown."""
    return next((ln.split(":", 1)[1].strip() for ln in _cpuinfo() or () if ln.startswith("vendor_id")), "")


def prefetch_locality(vendor: str) -> int:
    """The kernels' software-prefetch cache level for a CPU vendor (stacked_matmul.cc): 2 (prefetcht1) on
    Intel, where prefetchnta made the 2-8-row matmuls 1.8-2.4x slower than one row; 0 (prefetchnta),
    measured on AMD Zen 5, elsewhere."""
    return 2 if vendor == "GenuineIntel" else 0


def prefetch_min_rows(vendor: str) -> int:
    """The fewest rows whose matmul tiles prefetch (stacked_matmul.cc): 1 on Intel, where a decode step's
    one-row matmuls took 0.70x (bf16) and 0.93x (f32) the time with it; 2 elsewhere (one row on AMD Zen 5:
    no gain)."""
    return 1 if vendor == "GenuineIntel" else 2


def bf16_row1_ahead(vendor: str) -> int:
    """How far ahead (tile rows) one-row bf16 matmul tiles prefetch into every cache level (stacked_matmul.cc):
    0 on Intel (its one row prefetches as 2+ rows do, `prefetch_min_rows`); 256 elsewhere, where a bf16
    decode step took 0.96-0.98x the time with it (AMD Zen 5)."""
    return 0 if vendor == "GenuineIntel" else 256


def f32_l2_min_rows(vendor: str) -> int:
    """The fewest rows whose f32 matmul tiles prefetch into L2 (prefetcht1) rather than at `prefetch_locality`
    (stacked_matmul.cc; 0: never): 5 off Intel, where with prefetchnta the FMAs of 5+ rows outlasted the
    lines it fetched (AMD Zen 4, the MLP's matmuls: 5 / 8 / 11 rows 0.87-0.90 / 0.72-0.97 / 0.60-0.85x the
    time with it, 2-4 rows the same); Intel prefetches into L2 at every row count already."""
    return 0 if vendor == "GenuineIntel" else 5


def pairs_ahead(vendor: str) -> tuple[int, int]:
    """(pair rows ahead, fewest rows) of the pairs layout's prefetch into L2 (the head screen, stacked_matmul.cc):
    (64, 4) off Intel (AMD Zen 4: the screen at 8 rows 0.60-0.71x the time with it); none on Intel, where
    the screen at 2-16 rows took 0.65-0.93x the time without it (a Xeon with AVX-512 BF16)."""
    return (0, 2) if vendor == "GenuineIntel" else (64, 4)


def defines() -> tuple[str, ...]:
    """The preprocessor settings this machine's build gets (part of the library's key)."""
    vendor = _vendor()
    ahead, rows = pairs_ahead(vendor)
    return (f"-DHSD_PREFETCH_LOCALITY={prefetch_locality(vendor)}", f"-DHSD_PREFETCH_MIN_ROWS={prefetch_min_rows(vendor)}",
            f"-DHSD_BF16_ROW1_AHEAD={bf16_row1_ahead(vendor)}", f"-DHSD_F32_L2_MIN_ROWS={f32_l2_min_rows(vendor)}",
            f"-DHSD_PAIRS_AHEAD={ahead}", f"-DHSD_PAIRS_MIN_ROWS={rows}")


def _flags() -> tuple[str, ...]:
    """Every compile flag of this machine's build: `FLAGS` and its `defines()`."""
    return FLAGS + defines()


def library_path() -> str:
    """Where the built library for these sources, jaxlib, compiler flags and CPU lives (a shared home
    folder never hands a machine a binary built for another CPU)."""
    source = b"".join(pathlib.Path(path).read_bytes() for path in SOURCES + HEADERS)
    key = hashlib.sha256(source + repr((_jaxlib().__version__, _flags(), "-shared", platform.machine(),
                                        _cpu_id())).encode()).hexdigest()[:16]
    return os.path.join(cache_dir(), f"hsd_kernels-{key}.so")


def build(out: str) -> None:
    """Build the library `out`, once however many processes ask at the same time: each takes a file
    lock first, and one that finds `out` built while it waited uses that (pytest workers and their
    subprocesses all start by asking)."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise RuntimeError("no C++ compiler found (g++ / c++ / $CXX)")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)    # released when the file closes, or when this process dies
        if not os.path.exists(out):
            _compile(compiler, out)


def _compile(compiler: str, out: str) -> None:
    """Compile every source as one translation unit straight into the shared library `out`: the XLA
    FFI header, about half of each source's compile, is then parsed once (a first process on 2 cores:
    the compiler is its critical path)."""
    with tempfile.TemporaryDirectory(dir=os.path.dirname(out)) as tmp:
        unity = os.path.join(tmp, "kernels.cc")
        with open(unity, "w") as f:
            f.writelines(f'#include "{src}"\n' for src in SOURCES)
        part = os.path.join(tmp, "kernel.so")
        proc = subprocess.Popen([compiler, *_flags(), f"-I{include_dir()}", "-shared", unity, "-o", part],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        error = _finish(proc)
        if error:
            raise RuntimeError(f"{compiler} failed: {error[-800:]}")
        os.replace(part, out)       # atomic: a reader never sees half a file


def _finish(proc: subprocess.Popen) -> str:
    """Wait for a compiler process: '' when it succeeded, else its error output."""
    try:
        _, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return "timed out after 300 s"
    return "" if proc.returncode == 0 else err.strip() or f"exit status {proc.returncode}"


@functools.cache
def pending() -> concurrent.futures.Future | None:
    """The library's build, started in a background thread when it is not in the cache yet (once
    per process); None when it is there already."""
    path = library_path()
    if os.path.exists(path):
        return None
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hsd-kernel-build")
    future = pool.submit(build, path)
    pool.shutdown(wait=False)
    return future


def start() -> None:
    """Start the build in the background when the cache lacks it (a failure is reported where the
    library is first used, `cpu_kernels.enabled`, never here)."""
    try:
        pending()
    except Exception:  # noqa: BLE001 - e.g. an unreadable source: reported on use
        pass


def wait() -> None:
    """Let a build `start` began finish, whether or not anything used it (before a process ends
    without its teardown, which would leave the compilers' temporary folder behind)."""
    if pending.cache_info().currsize:
        future = pending()
        if future is not None:
            concurrent.futures.wait([future])


def multi_process() -> bool:
    """Whether the environment asks for a multi-process run (`hsd_jax.distributed`), judged without
    importing JAX: such a run uses no CPU kernel (`cpu_kernels.wanted`), so none of its processes builds."""
    return bool(os.environ.get("HSD_COORDINATOR")) or os.environ.get("HSD_DISTRIBUTED", "").lower() == "auto"


def tpu_present() -> bool:
    """Whether this machine shows a TPU to libtpu: its chips' device files (/dev/accel*, or VFIO groups
    on newer TPU VMs)."""
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def cpu_likely() -> bool:
    """Whether JAX will run on the CPU, judged without importing it or starting its backend:
    JAX_PLATFORMS names the CPU first, or (unset) no accelerator plugin is installed but libtpu on a
    machine without a TPU (installed for `hsd compile`, JAX then falls back to the CPU)."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    plugins = _accelerator_plugins()
    return not plugins or libtpu_without_tpu()


@functools.cache
def _accelerator_plugins() -> tuple[str, ...]:
    """The installed accelerator plugins, scanned once a process (~10 ms a scan of sys.path here)."""
    return tuple(m.name for m in pkgutil.iter_modules() if m.name.startswith(ACCELERATOR_PLUGINS))


def libtpu_without_tpu() -> bool:
    """JAX_PLATFORMS unset, libtpu the only accelerator plugin installed (`hsd compile`'s, or the
    test extra's) and no TPU device on this machine: JAX would try libtpu first, then the CPU."""
    if os.environ.get("JAX_PLATFORMS", "").strip():
        return False
    plugins = _accelerator_plugins()
    return bool(plugins) and all(name.startswith("libtpu") for name in plugins) and not tpu_present()
