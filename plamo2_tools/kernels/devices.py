"""Up-front checks of `--device` and `--backend`, so that a device or kernel backend that is not
there is one line with the reason before anything is loaded (instead of `pin_memory=True requires
CUDA` or Triton's `0 active drivers` from deep inside the first forward).

The checks import PyTorch only when the answer needs it (issue 33: a refusal in milliseconds, where
`import torch` costs seconds): device strings are parsed by torch's own grammar here, the CPU needs
nothing more, and a CPU-only build of torch or a CUDA_VISIBLE_DEVICES that hides every GPU is known
from torch's `version.py` and the environment alone.  Only a CUDA build asked for a CUDA device
imports torch to ask the driver.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import warnings

from ..errors import EnvironmentLimitError, UserError

BACKENDS = ("auto", "torch", "triton")  # auto: Triton on CUDA devices when it imports, else PyTorch
DEVICES = ("cpu", "cuda", "cuda:N")
# The device types `torch.device` accepts (c10/core/DeviceType.cpp, torch 2.x); other names are not devices.
TORCH_DEVICE_TYPES = frozenset(
    (
        "cpu",
        "cuda",
        "ipu",
        "xpu",
        "mkldnn",
        "opengl",
        "opencl",
        "ideep",
        "hip",
        "ve",
        "fpga",
        "maia",
        "xla",
        "lazy",
        "vulkan",
        "mps",
        "meta",
        "hpu",
        "mtia",
        "privateuseone",
    )
)
_DEVICE = re.compile(r"([a-z]+)(?::(0|[1-9][0-9]*))?")  # torch's grammar: a type, then an optional :index


def parse_device(device: str) -> tuple[str, int | None] | None:
    """(type, index) as `torch.device(device)` reads it, or None where torch would refuse it."""
    m = _DEVICE.fullmatch(device)
    if m is None or m.group(1) not in TORCH_DEVICE_TYPES:
        return None
    return m.group(1), None if m.group(2) is None else int(m.group(2))


def torch_build() -> dict[str, str | None] | None:
    """`torch.version`'s version, cuda and hip, read from the installed file without importing torch
    (the package's `__init__` would load all of it); None when torch is not installed there."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(next(iter(spec.submodule_search_locations)), "version.py")
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return None
    found: dict[str, object] = {}
    for node in tree.body:  # `name = "..."` / `name: Optional[str] = None` constants, never executed
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
            found[target.id] = value.value
    if not isinstance(found.get("__version__"), str):
        return None
    return {k: v if isinstance(v := found.get(k), str) else None for k in ("__version__", "cuda", "hip")}


def check_device(device: str, option: str = "--device") -> None:
    """cpu, cuda or cuda:N; exit 2 for a name that is not a device we run on, 3 for one that this
    machine does not have (with why not).  Imports torch only for a CUDA device that may be there."""
    parsed = parse_device(device)
    if parsed is None:
        raise UserError(f"{option} {device!r} is not a device (use cpu, cuda or cuda:N)")
    kind, index = parsed
    if kind == "cpu":
        return
    if kind != "cuda":
        raise UserError(f"{option} {device}: the runtime runs on cpu or cuda, not {kind}")
    reason = cuda_unavailable_reason()
    if reason:
        raise EnvironmentLimitError(f"{option} {device}: no CUDA device is usable ({reason})")
    import torch

    count = torch.cuda.device_count()
    if index is not None and index >= count:
        raise EnvironmentLimitError(f"{option} {device}: this machine has {count} CUDA device(s), cuda:0..{count - 1}")


def cuda_unavailable_reason() -> str | None:
    """None when CUDA works; otherwise the likeliest reason, in words (without importing torch when
    its build or the environment already answers)."""
    build = torch_build()
    if build is not None and build["cuda"] is None and build["hip"] is None:
        return f"this PyTorch {build['__version__']} is a CPU-only build; install a CUDA build of torch"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU"
    import torch

    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return f"this PyTorch {torch.__version__} is a CPU-only build; install a CUDA build of torch"
    with warnings.catch_warnings():  # torch warns on stderr about a missing driver: we say it in our line
        warnings.simplefilter("ignore")
        if torch.cuda.is_available():
            return None
    return "no NVIDIA driver or GPU found"


def check_backend(backend: str, device: str) -> None:
    """auto, torch or triton; triton needs Triton installed and a CUDA device (or its CPU
    interpreter, TRITON_INTERPRET=1, which the tests use)."""
    if backend not in BACKENDS:
        raise UserError(f"--backend {backend!r} is not a kernel backend (choose {', '.join(BACKENDS)})")
    if backend != "triton":
        return
    parsed = parse_device(device)
    if (parsed is None or parsed[0] != "cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        raise UserError(
            f"--backend triton runs on CUDA devices, not --device {device} (use --backend torch or auto on the CPU; "
            "TRITON_INTERPRET=1 runs Triton's slow CPU interpreter)"
        )
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise EnvironmentLimitError(f"--backend triton: Triton is not installed or does not import ({e})") from None
