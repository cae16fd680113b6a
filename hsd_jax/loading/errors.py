"""The error every loader raises for bad model files, so callers can report one clear line."""


class ModelLoadError(ValueError):
    """A model file or directory is missing, malformed or unsupported."""
