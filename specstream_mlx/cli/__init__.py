"""The ``specstream-mlx`` command line (a thin Typer layer over the library)."""

from .app import app, main

__all__ = ["app", "main"]
