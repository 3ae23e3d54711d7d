"""`plamo2-tools merge`: rebuild the HF checkpoint from shards (the inverse of convert)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from ..errors import OutputExistsError, UserError
from ..safetensors_io import PartialFile, plan_file, tensor_bytes
from .engine import CHUNK_BYTES, _check_disk, make_output_dir
from .plan import DEFAULT_MAX_PART_SIZE, output_path_problems
from .sources import ShardSource, side_files


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
    try:
        problems = output_path_problems(source.path, out)
        if problems:
            raise UserError("; ".join(problems))
        source.verify()  # a damaged shard must not come back as a clean-looking HF checkpoint
        make_output_dir(out)
        if any(out.iterdir()):
            if not force:
                raise OutputExistsError(f"{out}: exists and is not empty (use --force to replace it)")
            shutil.rmtree(out)
            out.mkdir()
        tensors = list(source.config.hf_tensor_shapes())
        groups: list[list[str]] = [[]]
        size = 0
        for name in tensors:
            nbytes = source.tensors[name].row_bytes * source.tensors[name].rows
            if groups[-1] and size + nbytes > max_part_size:
                groups.append([])
                size = 0
            groups[-1].append(name)
            size += nbytes
        _check_disk(out, sum(source.tensors[n].row_bytes * source.tensors[n].rows for n in tensors))
        names = (
            ["model.safetensors"]
            if len(groups) == 1
            else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
        )
        weight_map: dict[str, str] = {}
        total = 0
        for fname, group in zip(names, groups, strict=True):
            layout = plan_file([(n, source.tensors[n].dtype, source.tensors[n].shape) for n in group], {"format": "pt"})
            part = PartialFile(out / fname, layout)
            try:
                for name in group:
                    st = source.tensors[name]
                    step = max(1, CHUNK_BYTES // st.row_bytes)
                    for a in range(0, st.rows, step):
                        b = min(a + step, st.rows)
                        data = tensor_bytes(source.read_rows(name, a, b))
                        part.write_at(layout.offsets[name] + a * st.row_bytes, data)
                        if progress:
                            progress(len(data))
                    weight_map[name] = fname
                    total += layout.nbytes[name]
                part.commit()
            except BaseException:
                part.abort()
                raise
        if len(names) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        for p in side_files(source.path):
            shutil.copyfile(p, out / p.name)
        return names
    finally:
        source.close()


def merged_bytes(shards: str | Path) -> int:
    source = ShardSource(Path(shards))
    try:
        return sum(t.row_bytes * t.rows for t in source.tensors.values())
    finally:
        source.close()
