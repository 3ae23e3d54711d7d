"""Options more than one command takes, defined once (help texts built from the real choices)."""

from __future__ import annotations

from typing import Annotated

import typer

from ..kernels.devices import BACKENDS, DEVICES

Json = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout (for scripts), nothing else.")]
Device = Annotated[str, typer.Option(help=f"Where the runtime runs: {', '.join(DEVICES)}.")]
Backend = Annotated[
    str, typer.Option(help=f"Kernel backend: {', '.join(BACKENDS)} (auto: Triton on CUDA, PyTorch elsewhere).")
]
NoVerify = Annotated[
    bool,
    typer.Option(
        "--no-verify",
        help="Skip the digests of the shard files at load (headers, keys, shapes and dtypes are still "
        "checked); for directories `check` has just passed.",
    ),
]
Force = Annotated[
    bool, typer.Option(help="Replace what an earlier plamo2-tools run wrote in OUT (never anyone else's files).")
]
TrustRemoteCode = Annotated[
    bool,
    typer.Option(help="Run the checkpoint's own tokenizer code instead of the native PLaMo tokenizer."),
]
CudaGraph = Annotated[
    bool, typer.Option("--cuda-graph/--no-cuda-graph", help="CUDA: replay decode steps from CUDA graphs.")
]
MaxPartSize = Annotated[str, typer.Option(help="Largest file written, e.g. 5GiB, 500MB.")]
Launch = Annotated[
    bool,
    typer.Option(
        help="Run the ranks as real torchrun processes (gloo on CPU, NCCL on GPU), not as threads of this process."
    ),
]
# The families' own choices for their forward (model.family.RuntimeOption), one option for all of
# them: `--help` of a command that has it lists the registered families' declarations
# (errors.OneLineErrors fills them in, so that only a help screen pays for the model registry).
FORWARD_OPTION_HELP = "A choice of the model family's forward, KEY=VALUE (repeatable)."
ForwardOption = Annotated[
    list[str] | None, typer.Option("--option", metavar="KEY=VALUE", help=FORWARD_OPTION_HELP, show_default=False)
]
PRESET_HELP = "A preset of any family, real shapes or tiny ones"


def _option_help() -> str:
    from ..model.registry import runtime_options_help

    return f"{FORWARD_OPTION_HELP} {runtime_options_help()}."


def _preset_help() -> str:
    from ..model.registry import all_presets

    return f"{PRESET_HELP}: {', '.join(all_presets())}."


# Help filled in from the model registry on a help screen only (errors._forward_option_help).
REGISTRY_HELP = {"--option": _option_help, "--preset": _preset_help}
