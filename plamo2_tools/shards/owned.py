"""Which files in a shard directory convert wrote, by its own record (the rule of
`plamo2_tools.outputs` for the shard format): the manifest of a finished conversion (`files`,
`copied_files`) and the journal of an unfinished one, whose first line lists every file that run
writes (`writes`) and whose later lines name the finished ones."""

from __future__ import annotations

from pathlib import Path

from ..errors import CheckpointError, Plamo2Error
from ..jsonio import MANIFEST_BYTES, read_json
from ..outputs import ensure_complete
from ..safe_files import plain_name
from .journal import Journal
from .lock import ensure_not_being_written
from .manifest import MANIFEST_NAME


def convert_outputs(out: Path) -> set[str]:
    """Every file an earlier convert into `out` says it wrote (or was about to write)."""
    names: set[str] = set()
    path = out / MANIFEST_NAME
    try:
        manifest = read_json(path, MANIFEST_BYTES) if path.exists() else None
    except Plamo2Error:  # not a manifest we could have written: it names nothing of ours
        manifest = None
    if isinstance(manifest, dict):
        for field in ("files", "copied_files", "side_files"):
            listed = manifest.get(field) or []
            if not isinstance(listed, (dict, list)):
                raise CheckpointError(f"{path}: `{field}` is neither an object nor a list: refused")
            names.update(plain_name(n, f"{path}: {field}") for n in listed)
    state = Journal(out).state()
    if state is not None:
        names.update(state.writes)
        names.update(state.finished)
    return names


def unfinished_conversion(directory: Path) -> str | None:
    """A one-line description of an interrupted conversion in `directory` (journal, no manifest)."""
    state = Journal(directory).state()
    if (directory / MANIFEST_NAME).exists() or state is None:
        return None
    planned = [n for n in state.writes if n.endswith(".safetensors")]
    done = set(state.finished)
    count = f"{len(done)} of {len(planned)}" if planned else f"{len(done)}"
    return (
        f"{directory}: an unfinished conversion ({count} shard files finished, no {MANIFEST_NAME} yet): "
        "run the same convert again to resume it"
    )


def ensure_readable_checkpoint(directory: str | Path) -> None:
    """What every reader of an HF checkpoint directory checks first: no writer of ours is at work
    there (exit 3), and none stopped half way (exit 2: an unfinished merge, synth or conversion)."""
    directory = Path(directory)
    ensure_not_being_written(directory)
    ensure_complete(directory)
    unfinished = unfinished_conversion(directory)
    if unfinished:
        raise CheckpointError(unfinished)
