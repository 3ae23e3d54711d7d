"""`serve`: the OpenAI-compatible HTTP server (docs/serve.md).  FastAPI, uvicorn and the runtime
are imported only when the command runs, so `plamo2-tools --help` loads none of them."""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from typing import Annotated, Any

import typer

from ..errors import EnvironmentLimitError, UserError
from ..serve import API_KEY_ENV  # the package's __init__ imports nothing heavy
from .options import Backend, CudaGraph, Device, ForwardOption, Launch, NoVerify, TrustRemoteCode
from .validators import parse_max_batch, runtime_args

DEFAULT_HOST = "127.0.0.1"


def serve(
    shards: Annotated[Path, typer.Argument(help="A shard directory (any TP x PP layout).")],
    host: Annotated[str, typer.Option(help="Address to listen on; 0.0.0.0 for every interface.")] = DEFAULT_HOST,
    port: Annotated[int, typer.Option(help="TCP port (0: any free one, printed at start).")] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar=API_KEY_ENV,
            show_envvar=True,
            help="Require `Authorization: Bearer KEY` on every route but /health and /metrics.",
        ),
    ] = None,
    served_model_name: Annotated[
        list[str] | None,
        typer.Option(help="The model name clients send (repeat for aliases; default: SHARDS as given)."),
    ] = None,
    max_batch: Annotated[str, typer.Option(help='Sequences decoding at once, or "auto" (as memory allows).')] = "auto",
    max_context: Annotated[
        int | None, typer.Option(help="Tokens per sequence, prompt + completion (default 4096, at most the model's).")
    ] = None,
    max_queue: Annotated[
        int, typer.Option(help="Sequences admitted beyond --max-batch before new requests get 429.")
    ] = 256,
    max_body_bytes: Annotated[int, typer.Option(help="Larger request bodies get 413.")] = 16 * 2**20,
    shutdown_timeout: Annotated[
        float, typer.Option(help="On SIGTERM/SIGINT: seconds running requests may finish before they are cancelled.")
    ] = 30.0,
    sync_every: Annotated[int, typer.Option(help="Decode steps between two looks at the tokens.")] = 8,
    chat_template: Annotated[
        Path | None,
        typer.Option(help="A Jinja chat template file (Hugging Face's dialect) for chat; replaces the checkpoint's."),
    ] = None,
    launch: Launch = False,
    device: Device = "cpu",
    backend: Backend = "auto",
    trust_remote_code: TrustRemoteCode = False,
    option: ForwardOption = None,
    no_verify: NoVerify = False,
    cuda_graph: CudaGraph = True,
) -> None:
    """Serve the shards over HTTP with OpenAI's API: /v1/completions, /v1/chat/completions (when the
    checkpoint has a chat template), /v1/models, /health, /tokenize, /detokenize, /metrics.

    Every request goes into the runtime's continuous-batching loop.  Listens on 127.0.0.1 unless
    --host says otherwise; SIGTERM or SIGINT finishes running requests (up to --shutdown-timeout)
    and exits 0.  Under `torchrun` (or with --launch) rank 0 serves and the other ranks follow."""
    from ..shards.manifest import load_manifest

    run = runtime_args(shards, device, backend, option, no_verify, trust_remote_code, cuda_graph)
    names = list(served_model_name or []) or [str(shards)]
    args = {
        "model_id": names[0],
        "host": host,
        "port": port,
        "loop": {"max_batch": parse_max_batch(max_batch), "max_context": max_context, "sync_every": sync_every},
        "server": {"served_model_names": names[1:], "max_queue": max_queue, "max_body_bytes": max_body_bytes},
        "shutdown_timeout": shutdown_timeout,
        "log_level": "info" if logging.getLogger().isEnabledFor(logging.INFO) else "warning",
        "chat_template": read_chat_template(chat_template) if chat_template is not None else None,
    }
    check_service_args(args, api_key)
    load_manifest(shards)  # a shard directory, finished: one line now if not
    from ..serve.service import switch_interval  # the runtime (torch): after the refusals (issue 33)

    switch_interval()  # the GIL knob's value, checked before the model loads
    if launch:
        serve_on_torchrun(run, args, api_key)
        return
    from ..runtime.batching.engine import Runtime
    from ..serve.service import serve_job

    sock = bind(host, port) if _is_rank0() else None
    with Runtime(**run, mode="auto") as rt:
        serve_job(rt, **args, api_key=api_key, sock=sock)


def check_service_args(args: dict[str, Any], api_key: str | None) -> None:
    """The server's numbers, each refused with one line before anything loads."""
    loop, server = args["loop"], args["server"]
    for name, value, low in (
        ("--max-queue", server["max_queue"], 0),
        ("--max-body-bytes", server["max_body_bytes"], 1),
        ("--sync-every", loop["sync_every"], 1),
    ):
        if value < low:
            raise UserError(f"{name} {value}: must be >= {low}")
    if loop["max_context"] is not None and loop["max_context"] < 2:
        raise UserError(f"--max-context {loop['max_context']}: must be >= 2")
    if not 0 <= args["port"] <= 65535:
        raise UserError(f"--port {args['port']}: must be in 0..65535")
    if args["shutdown_timeout"] < 0:
        raise UserError(f"--shutdown-timeout {args['shutdown_timeout']:g}: must be >= 0")
    if api_key is not None and not api_key.strip():
        raise UserError(f"--api-key (or {API_KEY_ENV}) is empty")


def serve_on_torchrun(run: dict[str, Any], args: dict[str, Any], api_key: str | None) -> None:
    """`serve --launch`: fresh torchrun ranks, rank 0 serving (runtime/process/jobs.py:run_service)."""
    from ..runtime.process.jobs import run_service
    from ..serve.service import serve_job

    check_port(args["host"], args["port"])  # rank 0 binds it once loaded; a taken port is one line now, not later
    rc = run_service(serve_job, run, args, {API_KEY_ENV: api_key} if api_key else None)
    if rc != 0:
        raise EnvironmentLimitError(f"the torchrun ranks of serve exited with code {rc} (their output is above)")


CHAT_TEMPLATE_BYTES = 1 << 20  # HF's templates are a few KiB; a bigger file is not one


def read_chat_template(path: Path) -> str:
    """`--chat-template FILE`: its text, compiled once here (Jinja's sandbox, as the server renders it),
    so a missing, oversized, non-UTF-8 or broken template is one line before the model loads."""
    from ..safe_files import read_regular

    data = read_regular(path, CHAT_TEMPLATE_BYTES)  # one line for a missing, special or oversized file
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"--chat-template {path}: not UTF-8 text") from None
    if not text.strip():
        raise UserError(f"--chat-template {path}: the file is empty")
    from jinja2 import TemplateError

    from ..serve.chat_template import compile_template

    try:
        compile_template(text)
    except TemplateError as e:
        raise UserError(f"--chat-template {path}: not a Jinja template ({e})") from None
    return text


def _is_rank0() -> bool:
    import os

    return os.environ.get("RANK", "0") == "0"


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, made before the model loads, so that a taken port or a bad address is
    one line at once."""
    from ..serve.server import bind_socket

    try:
        return bind_socket(host, port)
    except OSError as e:
        raise EnvironmentLimitError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None


def check_port(host: str, port: int) -> None:
    bind(host, port).close()
