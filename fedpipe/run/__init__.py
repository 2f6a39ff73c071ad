"""One run: its config, its layout in the store, its phases, its evaluation and report."""

from fedpipe.run.run import Run

__all__ = ["Run"]
