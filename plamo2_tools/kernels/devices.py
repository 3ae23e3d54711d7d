"""Up-front checks of `--device` and `--backend`, so that a device or kernel backend that is not
there is one line with the reason before anything is loaded (instead of `pin_memory=True requires
CUDA` or Triton's `0 active drivers` from deep inside the first forward)."""

from __future__ import annotations

import os
import warnings

from ..errors import EnvironmentLimitError, UserError

BACKENDS = ("auto", "torch", "triton")  # auto: Triton on CUDA devices when it imports, else PyTorch
DEVICES = ("cpu", "cuda", "cuda:N")


def check_device(device: str, option: str = "--device") -> None:
    """cpu, cuda or cuda:N; exit 2 for a name that is not a device we run on, 3 for one that this
    machine does not have (with why not)."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise UserError(f"{option} {device!r} is not a device (use cpu, cuda or cuda:N)") from None
    if dev.type == "cpu":
        return
    if dev.type != "cuda":
        raise UserError(f"{option} {device}: the runtime runs on cpu or cuda, not {dev.type}")
    reason = cuda_unavailable_reason()
    if reason:
        raise EnvironmentLimitError(f"{option} {device}: no CUDA device is usable ({reason})")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise EnvironmentLimitError(f"{option} {device}: this machine has {count} CUDA device(s), cuda:0..{count - 1}")


def cuda_unavailable_reason() -> str | None:
    """None when CUDA works; otherwise the likeliest reason, in words."""
    import torch

    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return f"this PyTorch {torch.__version__} is a CPU-only build; install a CUDA build of torch"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    with warnings.catch_warnings():  # torch warns on stderr about a missing driver: we say it in our line
        warnings.simplefilter("ignore")
        if torch.cuda.is_available():
            return None
    if visible is not None and visible.strip() in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU"
    return "no NVIDIA driver or GPU found"


def check_backend(backend: str, device: str) -> None:
    """auto, torch or triton; triton needs Triton installed and a CUDA device (or its CPU
    interpreter, TRITON_INTERPRET=1, which the tests use)."""
    if backend not in BACKENDS:
        raise UserError(f"--backend {backend!r} is not a kernel backend (choose {', '.join(BACKENDS)})")
    if backend != "triton":
        return
    import torch

    if torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise UserError(
            f"--backend triton runs on CUDA devices, not --device {device} (use --backend torch or auto on the CPU; "
            "TRITON_INTERPRET=1 runs Triton's slow CPU interpreter)"
        )
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise EnvironmentLimitError(f"--backend triton: Triton is not installed or does not import ({e})") from None
