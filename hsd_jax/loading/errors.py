"""The error every loader raises for bad model files, so callers can report one clear line, and
`reading`, the one place per file format where a damaged file's parser failure becomes it."""
from __future__ import annotations

import contextlib


class ModelLoadError(ValueError):
    """A model file or directory is missing, malformed or unsupported."""


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0].split(" See full TensorStore details")[0] if text else type(e).__name__


def one_line(e: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message and of its direct cause (Orbax wraps TensorStore's
    specific one, "byte range ... not valid", in a generic one with a spec dozens of lines long), clipped."""
    text = _first_line(e) + (f" ({_first_line(e.__cause__)})" if e.__cause__ is not None else "")
    return text if len(text) <= limit else text[: limit - 3] + "..."


@contextlib.contextmanager
def reading(path: str, what: str, error=ModelLoadError):
    """Parse an untrusted file inside this block: whatever its parser raises on damage (struct,
    numpy, safetensors, Orbax and TensorStore errors, a bare `Exception` included) leaves as one
    `error` naming the file and what was being read; an `error` raised inside (a check of the
    format's own, already naming the file) passes as it is."""
    try:
        yield
    except error:
        raise
    except Exception as e:
        raise error(f"{path}: {what}: {one_line(e)}") from None


def read_npy(path: str, error=ModelLoadError):
    """A numpy array from an untrusted .npy file: never unpickled, damage reported as `error`."""
    import numpy as np

    with reading(path, "not a valid .npy array", error):
        arr = np.load(path, allow_pickle=False)
    if not isinstance(arr, np.ndarray):
        raise error(f"{path}: not a .npy array")
    return arr
