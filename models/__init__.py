"""Everything model-specific: family adapters, FIM templates, the bundled default model."""

from pathlib import Path

DEFAULT_MODEL_NAME = "completiond-py-mini"


def default_model_dir() -> Path:
    """Directory of the bundled default model (shipped inside this package)."""
    return Path(__file__).resolve().parent / DEFAULT_MODEL_NAME
