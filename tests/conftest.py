"""Shared pytest setup and the fixtures every test folder uses.

* Triton's CPU interpreter, and `gpu` tests skipped without a GPU (the `gpu`, `slow` and `vllm`
  markers are registered in pyproject.toml); one intra-op torch thread per test.
* `cli`: the one way to run `plamo2-tools` in-process; `one_line_error`: the contract of every
  refusal; `interrupt`: Ctrl-C (KeyboardInterrupt) at a chosen call.
* Two session caches, shared read-only (a test that damages a directory takes `private_copy` of it
  first): `checkpoint(preset, ...)`, every synthetic HF checkpoint, and `shards(preset, tp, pp, ...)`,
  every converted layout.  `medium_checkpoint` is the one checkpoint big enough to stop a conversion
  half way.

Helper modules live next to their tests and are imported by name (`from convert_expect import ...`);
the folders whose helpers other folders import are on `pythonpath` (pyproject.toml).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner, Result

if not torch.cuda.is_available():  # must happen before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")


HAVE_MLX = importlib.util.find_spec("mlx") is not None and importlib.util.find_spec("mlx_lm") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skips = {
        "gpu": None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA device"),
        "mlx": None if HAVE_MLX else pytest.mark.skip(reason="needs mlx and mlx-lm (the [mlx] extra)"),
    }
    for item in items:
        for marker, skip in skips.items():
            # The marker itself, not `item.keywords`: those also hold the names of the folders above
            # the test (a checkout in a directory named mlx would skip every test).
            if skip is not None and item.get_closest_marker(marker) is not None:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The models here are tiny: intra-op threads gain nothing, and on a busy 2-core machine
    OpenMP's spinning threads slow the tests down several times.  Restored after each test."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- the command line ---------------------------------------------------------------------------
Cli = Callable[..., Result]


@pytest.fixture(scope="session")
def cli() -> Cli:
    """cli(*ARGS, expect=0, input=None): run `plamo2-tools ARGS` in-process and return Click's result.

    stdout and stderr are kept apart; the terminal is wide (COLUMNS=250, NO_COLOR=1) so Rich does not
    wrap table cells; an uncaught exception (a traceback a user would see) fails the test whatever
    the exit code; `expect` is the exit code the run must end with (None: any); `input` is stdin."""
    from plamo2_tools.cli import app

    runner = CliRunner(env={"COLUMNS": "250", "NO_COLOR": "1"})

    def run(*args: str | int | Path, expect: int | None = 0, input: str | None = None) -> Result:
        result = runner.invoke(app, [str(a) for a in args], input=input)
        crashed = result.exception is not None and not isinstance(result.exception, SystemExit)
        if crashed or (expect is not None and result.exit_code != expect):
            raise AssertionError(
                f"plamo2-tools {' '.join(map(str, args))}: exit {result.exit_code}, expected {expect}"
                f"{' (uncaught exception)' if crashed else ''}\n"
                f"stdout: {result.stdout}\nstderr: {result.stderr}\nexception: {result.exception!r}"
            )
        return result

    return run


OneLineError = Callable[..., str]


@pytest.fixture(scope="session")
def one_line_error() -> OneLineError:
    """The contract of every refusal (issue 14): the expected exit code, exactly one non-empty line
    on stderr starting with `error:` (or `prefix`), no traceback anywhere.  Returns the line.
    Takes a `cli` result or a subprocess.CompletedProcess (text mode)."""

    def check(r: Any, code: int, prefix: str = "error:") -> str:
        exit_code = getattr(r, "exit_code", getattr(r, "returncode", None))
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert exit_code == code, f"exit {exit_code}, expected {code}\nstderr: {r.stderr}\nstdout: {r.stdout}"
        assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{r.stderr}"
        assert lines[0].startswith(prefix), lines[0]
        assert "Traceback" not in r.stderr + r.stdout
        return lines[0]

    return check


Interrupt = Callable[..., Callable[[], None]]


@pytest.fixture
def interrupt(monkeypatch: pytest.MonkeyPatch) -> Interrupt:
    """interrupt(owner, name, on_call=None): `owner.name` raises KeyboardInterrupt, as Ctrl-C would,
    on every call (on_call=None) or only on its on_call-th call (the calls before and after run the
    real one).  Returns a function that puts the real one back (monkeypatch also does, after the test)."""

    def patch(owner: Any, name: str, on_call: int | None = None) -> Callable[[], None]:
        real, calls = getattr(owner, name), [0]

        def interrupted(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if on_call is None or calls[0] == on_call:
                raise KeyboardInterrupt
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, interrupted)
        return lambda: monkeypatch.setattr(owner, name, real)

    return patch


# ---- the session caches -----------------------------------------------------------------------------
Checkpoint = Callable[..., Path]
Shards = Callable[..., Path]
VALUES = ("synth", "watermark")


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """checkpoint(preset, seed=0, dtype=None, files=1, values="synth") -> an HF checkpoint directory,
    written once per session.

    values="synth": exactly what `plamo2-tools synth --preset PRESET --seed SEED` writes (synth's
    healthy random values, config, generation config, tokenizer, synth's record).
    values="watermark": every element encodes its own coordinates, exactly in float32
    (convert_expect.Watermark), so a value read back from a shard says where it came from; config
    and generation config, no tokenizer; `seed` does not apply.
    dtype: a name or a torch.dtype (None: the preset's own); files: weight files (> 1: with an HF
    index).  Never modify one: take `private_copy` of it first."""
    from convert_expect import Watermark

    from plamo2_tools.dtypes import FLOAT_DTYPES, dtype_name
    from plamo2_tools.model.synth import preset_config, synth, write_checkpoint

    cache: dict[tuple[Any, ...], Path] = {}

    def make(
        preset: str, seed: int = 0, dtype: str | torch.dtype | None = None, files: int = 1, values: str = "synth"
    ) -> Path:
        if values not in VALUES:
            raise ValueError(f"values={values!r}: one of {VALUES}")
        name = dtype_name(dtype) if isinstance(dtype, torch.dtype) else dtype or preset_config(preset).torch_dtype
        key = (preset, values, seed if values == "synth" else None, name, files)
        if key not in cache:
            tag = f"s{seed}" if values == "synth" else "wm"
            path = tmp_path_factory.mktemp(f"{preset}-{tag}-{name}-f{files}") / "ckpt"
            if values == "synth":
                synth(path, preset, seed=seed, dtype=name, files=files)
            else:
                cfg = preset_config(preset)
                write_checkpoint(path, cfg, Watermark(cfg), FLOAT_DTYPES[name], files=files, tokenizer=False)
            cache[key] = path
        return cache[key]

    return make


@pytest.fixture(scope="session")
def shards(cli: Cli, checkpoint: Checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Shards:
    """shards(preset, tp, pp, *options, dtype="auto", seed=0, values="synth", source_dtype=None) ->
    the output of `plamo2-tools convert` of checkpoint(preset, seed, source_dtype, values=values) at
    TP x PP with --dtype DTYPE and any further convert options (e.g. "--pp-layers", "1,3,1"),
    converted once per session.  Never modify one: take `private_copy` of it first."""
    cache: dict[tuple[Any, ...], Path] = {}

    def get(
        preset: str,
        tp: int,
        pp: int,
        *options: str | int,
        dtype: str = "auto",
        seed: int = 0,
        values: str = "synth",
        source_dtype: str | torch.dtype | None = None,
    ) -> Path:
        key = (preset, tp, pp, tuple(map(str, options)), dtype, seed, values, str(source_dtype))
        if key not in cache:
            src = checkpoint(preset, seed=seed, dtype=source_dtype, values=values)
            out = tmp_path_factory.mktemp(f"{preset}-tp{tp}-pp{pp}-{dtype}") / "shards"
            cli("convert", src, out, "--tp", tp, "--pp", pp, "--dtype", dtype, *options, "--json")
            cache[key] = out
        return cache[key]

    return get


@pytest.fixture
def private_copy(tmp_path: Path) -> Callable[[Path], Path]:
    """A private copy (in the test's tmp_path) of a cached checkpoint or shard directory, safe to damage."""

    def copy(src: Path) -> Path:
        dst = tmp_path / "copy"
        shutil.copytree(src, dst)
        return dst

    return copy


# Big enough (68 MB, 8 layers, V=32000) that a conversion split into ~50 files of <= 1 MB takes
# about a second on a 2-core CI machine: time to SIGKILL it after its first files are finished.
MEDIUM = dict(
    model_type="plamo2",
    hidden_size=256,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=1,
    hidden_size_per_head=64,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_num_heads=8,
    mamba_step=2,
    intermediate_size=1024,
    vocab_size=32000,
)


@pytest.fixture(scope="session")
def medium_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from plamo2_tools.model.plamo2.config import Plamo2Config
    from plamo2_tools.model.synth import write_checkpoint

    cfg = Plamo2Config.from_dict(MEDIUM)

    def values(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
        return torch.randn(shape, generator=torch.Generator().manual_seed(seed))

    path = tmp_path_factory.mktemp("medium") / "ckpt"
    write_checkpoint(path, cfg, values, torch.float32, tokenizer=False)
    return path
