"""compress: offline compression toolkit for language models."""

__version__ = "0.1.0"
