"""draftline: a data-versioned, reproducible pipeline for training DFlash drafters."""

__version__ = "0.1.0"
