"""`hsd` and `python -m hsd_jax`: start the CPU kernels' build (a first run on this machine: the
compiler then overlaps JAX's imports), then run the CLI."""
import sys


def main() -> int:
    from hsd_jax import kernel_build

    if not kernel_build.disabled() and kernel_build.cpu_likely() and not kernel_build.multi_process():
        kernel_build.start()
    from hsd_jax.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
