"""merak_pipe — see the package README for what it holds."""

__version__ = "0.1.0"

__all__ = ["__version__"]
