"""`plamo2-tools merge`: rebuild the HF checkpoint from shards (the inverse of convert).

Like convert, merge holds OUT's lock while it writes, records what it writes before the first
byte (`.plamo2_written.json`, see outputs.py) and writes `config.json` last, so that an
interrupted merge never looks like a checkpoint and `--force` removes only files of ours.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from ..errors import UserError
from ..model import hf_tensor_shapes
from ..model.checkpoint import INDEX_NAME, hf_file_names, write_hf_weights
from ..outputs import check_free_space, make_output_dir, prepare_output, write_record
from ..safe_files import copy_file
from ..shards.lock import OutputLock, ensure_not_being_written
from .engine import CHUNK_BYTES
from .plan import DEFAULT_MAX_PART_SIZE, output_path_problems
from .sources import ShardSource, source_side_files

LAST = "config.json"  # an HF checkpoint without it is not one: written last, it marks completion


def merge(
    shards: str | Path,
    out: str | Path,
    max_part_size: int = DEFAULT_MAX_PART_SIZE,
    force: bool = False,
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """Write an HF checkpoint (model.safetensors or an index over parts) rebuilt from shards.

    Tensors that were only resharded come back byte-identical; A and the offset norms come back
    within the rounding of their transform; a dtype cast made by convert is not undone.
    """
    out = Path(out)
    source = ShardSource(Path(shards))
    lock: OutputLock | None = None
    try:
        problems = output_path_problems(source.path, out)
        if problems:
            raise UserError("; ".join(problems))
        ensure_not_being_written(out)  # a second writer stops here, before the shards are hashed
        source.verify()  # a damaged shard must not come back as a clean-looking HF checkpoint
        tensors = list(hf_tensor_shapes(source.config))
        groups = _groups(source, tensors, max_part_size)
        sides = source_side_files(source)  # the recorded ones, checked by verify() above
        weights = hf_file_names(len(groups))
        writes = weights + ([INDEX_NAME] if len(groups) > 1 else []) + [p.name for p in sides]
        make_output_dir(out)
        lock = OutputLock(out, "merge")
        prepare_output(out, writes, force)
        weights_bytes = sum(source.tensors[n].row_bytes * source.tensors[n].rows for n in tensors)
        # Headers, the index and the side files too (a few kB each; the side files their size).
        extra = sum(p.stat().st_size for p in sides) + 65536 * (len(groups) + 1)
        check_free_space(out, weights_bytes + extra, "the merge")
        write_record(out, "merge", str(source.path), writes, "writing")

        def chunks(name: str) -> Iterator[tuple[int, np.ndarray]]:
            st = source.tensors[name]
            step = max(1, CHUNK_BYTES // st.row_bytes)
            for a in range(0, st.rows, step):
                yield a, source.read_rows(name, a, min(a + step, st.rows))

        specs = {n: (source.tensors[n].dtype, source.tensors[n].shape) for n in tensors}
        for p in sides:
            if p.name != LAST:
                _copy(p, out)
        names = write_hf_weights(out, groups, specs, chunks, progress)
        for p in sides:
            if p.name == LAST:
                _copy(p, out)
        write_record(out, "merge", str(source.path), writes, "complete")
        return names
    finally:
        if lock is not None:
            lock.release()
        source.close()


def _groups(source: ShardSource, tensors: list[str], max_part_size: int) -> list[list[str]]:
    """Tensors in HF order, cut greedily into files of at most max_part_size bytes."""
    groups: list[list[str]] = [[]]
    size = 0
    for name in tensors:
        nbytes = source.tensors[name].row_bytes * source.tensors[name].rows
        if groups[-1] and size + nbytes > max_part_size:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def _copy(src: Path, out: Path) -> None:
    copy_file(src, out / src.name)  # created fresh: never through a link planted in OUT


def merged_bytes(shards: str | Path) -> int:
    source = ShardSource(Path(shards))
    try:
        return sum(t.row_bytes * t.rows for t in source.tensors.values())
    finally:
        source.close()
