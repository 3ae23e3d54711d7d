"""`python -m plamo2_tools.cli` (and `torchrun -m plamo2_tools.cli`, one process per rank)."""

from . import app

app()
