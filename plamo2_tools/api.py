"""The library API, as `plamo2_tools` exports it (docs/api.md): one thin, documented function per
thing a script does, each over the module that does it.  Nothing heavy is imported here: each
function imports its implementation when called, so `from plamo2_tools import convert, check`
stays free of PyTorch like the commands that only move bytes.

    load(shards)                         -> Runtime (a context manager: `with load(...) as rt:`)
    generate(rt, prompt | prompts, ...)  -> the continuation's text (a list for a list of prompts)
    score(rt, context, continuation)     -> Score: log p(continuation | context), greedy or not
    convert(src, out, tp=, pp=, ...)     -> ConvertResult (convert/engine.py)
    check(shards)                        -> CheckReport (shards/check.py)
    verify(targets, reference, ...)      -> the verify result (deploy/verify.py; `plamo2-tools verify --json`)
    export(src, out, format, ...)        -> the export's result (export/)
    eval(shards, gsm8k_dir=, ...)        -> EvalOutcome (eval/harness.py)

`options` everywhere is the model family's runtime options (`--option KEY=VALUE` of the
commands, e.g. PLaMo 3's ``{"window_convention": "vllm"}``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .convert.engine import ConvertResult
    from .eval.harness import EvalOutcome
    from .runtime.batching.engine import Runtime
    from .shards.check import CheckReport

Prompt = str | Sequence[int]  # text (tokenized with the model's tokenizer, BOS as its config says) or token ids


def load(
    shards: str | Path,
    device: str = "cpu",
    backend: str = "auto",
    options: Mapping[str, str] | None = None,
    **runtime: Any,
) -> Runtime:
    """The shard directory loaded and ready to run: every rank as a thread of this process, or
    this process's own rank when it runs under torchrun.  `runtime` passes further `Runtime`
    arguments (prefill_chunk, cuda_graph, verify_files, memory_budget, ...).  Close it (or use
    `with`) to free the model."""
    from .kernels.devices import check_backend, check_device
    from .runtime.batching.engine import Runtime

    check_device(device)
    check_backend(backend, device)
    return Runtime(shards, device=device, backend=backend, forward_options=dict(options or {}), **runtime)


def generate(
    runtime: Runtime,
    prompt: Prompt | Sequence[Prompt],
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    max_batch: int | str = "auto",
) -> str | list[str]:
    """The text `runtime` continues `prompt` with (greedy at temperature 0), ending at the
    checkpoint's EOS (not shown) or after `max_new_tokens`; several prompts run together
    through continuous batching (`max_batch` at once) and give a list."""
    from .runtime.batching.text import decode_kept_specials, stop_token_ids

    single = isinstance(prompt, str) or (len(prompt) > 0 and isinstance(prompt[0], int))
    prompts: list[Prompt] = [prompt] if single else list(prompt)  # type: ignore[list-item]
    tok = runtime.tokenizer
    ids = [_ids(tok, p, special=True) for p in prompts]
    eos = stop_token_ids(runtime.path, tok)
    gen = runtime.generate(
        ids, max_new_tokens, eos_token_ids=eos, temperature=temperature, top_p=top_p, seed=seed, max_batch=max_batch
    )
    decode = decode_kept_specials(tok)
    texts = [
        decode(t[:-1] if reason == "stop" and t and t[-1] in eos else t)
        for t, reason in zip(gen.tokens, gen.finish_reasons, strict=True)
    ]
    return texts[0] if single else texts


@dataclass(frozen=True)
class Score:
    """log p(continuation | context), summed over its tokens, and whether greedy decoding from the
    context would have produced exactly the continuation (lm-eval's loglikelihood)."""

    logprob: float
    greedy: bool
    tokens: int  # the continuation's tokens


def score(runtime: Runtime, context: Prompt, continuation: Prompt) -> Score:
    """How likely the model finds `continuation` after `context` (a text continuation is
    tokenized without special tokens, the context with BOS as the tokenizer config says)."""
    tok = runtime.tokenizer
    head, tail = _ids(tok, context, special=True), _ids(tok, continuation, special=False)
    if not head or not tail:
        from .errors import UserError

        raise UserError("score: the context and the continuation need at least one token each")
    logprobs, greedy = runtime.score([head + tail], [len(head)])[0]
    return Score(float(logprobs.sum()), bool(greedy.all()), len(tail))


def _ids(tokenizer: Any, prompt: Prompt, special: bool) -> list[int]:
    if isinstance(prompt, str):
        return list(tokenizer(prompt, add_special_tokens=special)["input_ids"])
    return [int(t) for t in prompt]


def convert(src: str | Path, out: str | Path, tp: int = 1, pp: int = 1, **kwargs: Any) -> ConvertResult:
    """An HF checkpoint (or a shard directory of ours: a reshard) as TP x PP shards in `out`;
    resumes an interrupted run.  `kwargs`: pp_layers, dtype, max_part_size, force, copy, workers,
    verify_blobs, sync (see `plamo2-tools convert --help`)."""
    from .convert.engine import convert as run

    return run(src, out, tp, pp, **kwargs)


def check(shards: str | Path) -> CheckReport:
    """Every file of a shard directory against its manifest and the layout its config implies;
    `.ok` says whether all is well, `.checks` lists the problems."""
    from .shards.check import check_shards

    return check_shards(shards)


def export(src: str | Path, out: str | Path, format: str, **kwargs: Any) -> Any:
    """`src` (an HF checkpoint, or our shards) written for another runtime and, unless `verify=False`,
    judged against the reference as `verify` judges a deployment (docs/export.md).  `format`:
    "gguf" (llama.cpp; kwargs: type_name, tensor_types, recipe, force, verify, ... of
    `export.gguf.export_gguf`), "mlx" (mlx-lm; kwargs: bits, group_size, mixed, dtype, force, verify,
    reference, max_part) or "fp8" (compressed-tensors for vLLM; kwargs of `export.fp8.export_fp8`)."""
    from .errors import UserError

    if format == "gguf":
        from .export.gguf import export_gguf

        return export_gguf(Path(src), Path(out), **kwargs)
    if format == "fp8":
        from .export.fp8 import export_fp8

        return export_fp8(src, out, **kwargs)
    if format == "mlx":
        from .dtypes import float_dtype
        from .export.mlx import Recipe, export_mlx_path

        dtype = kwargs.pop("dtype", None)
        recipe = Recipe(
            bits=kwargs.pop("bits", None),
            group_size=kwargs.pop("group_size", 64),
            mixed=kwargs.pop("mixed", False),
            dtype=float_dtype(dtype) if dtype else None,
        )
        return export_mlx_path(src, out, recipe, **kwargs)
    raise UserError(f"export format {format!r}: one of gguf, mlx, fp8")


def verify(
    targets: str | Path | Sequence[str | Path],
    reference: str | Path,
    prompts: Sequence[Sequence[int]] | None = None,
    random: int = 4,
    seed: int = 0,
    max_new_tokens: int = 32,
    options: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """Deployments judged against the float reference forward of the checkpoint they came from, as
    `plamo2-tools verify TARGET...` judges them (the same call, `deploy/verify.py:verify_deployments`):
    shard directories, http(s) URLs of OpenAI-compatible servers, .gguf files, MLX or FP8
    directories.  The result is that command's JSON, `["passed"]` true when every target follows
    the reference (docs/deploy.md).  Without `prompts`, `random` random prompts from `seed`;
    `options` pins the family's runtime options (PLaMo 3: `{"window_convention": "vllm"}`), else
    every convention is tried.  `kwargs`: precision, reference_device, target_precision, gsm8k_like,
    and the targets' own: device, backend, launch, prefill_chunk, verify_files, api_key, timeout,
    model, top_k."""
    from .deploy.verify import verify_deployments

    specs = [targets] if isinstance(targets, (str, Path)) else list(targets)
    return verify_deployments(
        [str(t) for t in specs],
        Path(reference),
        prompts,
        random=random,
        seed=seed,
        max_new_tokens=max_new_tokens,
        pinned=dict(options or {}),
        **kwargs,
    )


def eval(
    shards: str | Path,
    gsm8k_dir: str | Path | None = None,
    limit: int | float | None = None,  # noqa: A001
    options: Mapping[str, str] | None = None,
    launch: bool = False,
    **kwargs: Any,
) -> EvalOutcome | None:
    """GSM8K with lm-eval's own task on local data files (`plamo2-tools eval`); `kwargs` are
    `eval.harness.EvalRequest` fields (num_fewshot, batch_size, output_path, device, backend, ...).
    None on a torchrun rank other than the first."""
    from .eval.gsm8k_task import load_gsm8k_data
    from .eval.harness import EvalRequest, run_eval

    data = load_gsm8k_data(gsm8k_dir, allow_unverified=kwargs.pop("allow_unverified_data", False))
    request = EvalRequest(
        shards=str(shards), data=data.to_dict(), limit=limit, forward_options=dict(options or {}), **kwargs
    )
    return run_eval(request, launch=launch)


__all__ = ["Score", "check", "convert", "eval", "generate", "load", "score", "verify"]
