"""merak_core — composes merak-pipe, merak-graph and merak-tp into the 3D trainer."""

__version__ = "0.1.0"

__all__ = ["__version__"]
