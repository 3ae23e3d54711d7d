"""plamo2-tools: split, check and run PLaMo 2 checkpoints."""

__version__ = "0.1.0"
