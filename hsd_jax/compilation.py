"""JAX's persistent compilation cache, on by default, so a second process loads the first's
compiled prefill and decode programs instead of compiling them again.

`enable()` (called by `load_target` and before every compile in `api.compiled`) points JAX's
cache at `<user cache>/xla` (`$HSD_JAX_CACHE`, default `~/.cache/hsd_jax`, beside the tuned trees
and the CPU kernel) unless the caller chose a folder already (`JAX_COMPILATION_CACHE_DIR` or
`jax.config.update("jax_compilation_cache_dir", ...)`: theirs is kept), and caches programs that
took at least MIN_COMPILE_SECONDS to compile unless the caller set that threshold.
`HSD_JAX_COMPILATION_CACHE=0` turns it off (JAX's own settings still apply).
"""
from __future__ import annotations

import os

import jax

ENV = "HSD_JAX_COMPILATION_CACHE"
MIN_COMPILE_SECONDS = 0.2   # JAX's default (1 s) would leave SmolLM2's prefill programs out
_JAX_DEFAULT_MIN_SECONDS = 1.0


def disabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off")


def cache_path() -> str:
    from hsd_jax.tuning import cache_dir

    return os.path.join(os.path.dirname(cache_dir()), "xla")


def enable() -> str | None:
    """Turn the persistent cache on (idempotent); returns the folder JAX caches in, or None."""
    current = jax.config.jax_compilation_cache_dir
    if current or disabled():
        return current or None
    path = cache_path()
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    if ("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ
            and jax.config.jax_persistent_cache_min_compile_time_secs == _JAX_DEFAULT_MIN_SECONDS):
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return path


def use_cpu_backend() -> None:
    """Run this process on the CPU backend when none has started yet and JAX_PLATFORMS is unset: for
    `hsd compile` (its programs are built for another platform, none runs here) and on a machine
    with libtpu installed but no TPU (`kernel_build.libtpu_without_tpu`), where JAX would start
    libtpu, log its failure to find a TPU as an error, and fall back to the CPU anyway. Asks
    `jax._src.xla_bridge.backends_are_initialized` (private, present in the jax releases
    pyproject.toml allows); without it nothing changes."""
    from jax._src import xla_bridge

    started = getattr(xla_bridge, "backends_are_initialized", lambda: True)
    if "JAX_PLATFORMS" not in os.environ and not started():
        jax.config.update("jax_platforms", "cpu")
