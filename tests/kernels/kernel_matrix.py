"""Where the kernel tests run (imported by tests; conftest.py only holds fixtures)."""

import os

import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
