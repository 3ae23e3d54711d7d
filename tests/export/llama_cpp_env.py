"""Where llama.cpp is for the GGUF tests, and llama.cpp's own converter run as the oracle.

`bench/llama_cpp.sh` builds llama-cpp-python 0.3.36 (the `llama_cpp` module) and keeps its
sdist's vendored llama.cpp tree, whose `convert_hf_to_gguf.py` is the converter our export must
equal, under ~/.cache/plamo2-tools/llama-cpp-python-0.3.36/ ($PLAMO2_LLAMA_CPP_CACHE overrides).
Tests that need it carry the `llama_cpp` marker and skip when it is absent.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

VERSION = "0.3.36"
CACHE = Path(
    os.environ.get("PLAMO2_LLAMA_CPP_CACHE") or Path.home() / ".cache" / "plamo2-tools" / f"llama-cpp-python-{VERSION}"
)
TREE = CACHE / "src" / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
TOOLS = CACHE / "tools" / "bin"
HAVE_MODULE = importlib.util.find_spec("llama_cpp") is not None
HAVE_TREE = (TREE / "convert_hf_to_gguf.py").is_file()

needs_converter = pytest.mark.skipif(not HAVE_TREE, reason=f"no llama.cpp tree at {TREE} (bench/llama_cpp.sh)")
needs_llama = pytest.mark.skipif(not HAVE_MODULE, reason="llama-cpp-python is not installed (bench/llama_cpp.sh)")

_DRIVER = """
import logging, sys
sys.path.insert(0, sys.argv[1])
import convert_hf_to_gguf as conv
for spec in sys.argv[2:]:
    model, outtype, outfile = spec.split("::")
    sys.argv = ["convert_hf_to_gguf.py", model, "--outtype", outtype, "--outfile", outfile]
    conv.main()
"""


def convert_with_llama_cpp(jobs: list[tuple[Path, str, Path]]) -> None:
    """Run llama.cpp's convert_hf_to_gguf.py (the vendored tree, its vendored gguf-py) on every
    (checkpoint, outtype, outfile), in one process (its imports take most of the time)."""
    specs = [f"{model}::{outtype}::{out}" for model, outtype, out in jobs]
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(TREE), *specs], capture_output=True, text=True, timeout=1800
    )
    if proc.returncode != 0:
        raise AssertionError(f"llama.cpp's converter failed:\n{proc.stderr[-3000:]}")


def gguf_fields(path: Path) -> dict[str, tuple[list[int], object]]:
    """Every key of a GGUF file: (value types, contents), as the gguf package reads them."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {k: ([int(t) for t in f.types], f.contents()) for k, f in reader.fields.items()}


def gguf_tensors(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {t.name: (t.tensor_type.name, [int(d) for d in t.shape], bytes(t.data)) for t in reader.tensors}
