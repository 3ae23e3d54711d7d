"""Benchmark: `export gguf` against `cp` of the source and against llama.cpp's own converter, on the same
synthetic checkpoint (issue 31, "Benchmarks"): wall time and peak resident memory of each, measured in the
same run, one after the other, the source read once before (page cache warm for all three).

    python bench/gguf_export.py --preset plamo-2-1b --type f16 --out reports/export/gguf-export-plamo-2-1b.json
    python bench/gguf_export.py --preset plamo-3-8b --type bf16 --out reports/export/gguf-export-plamo-3-8b.json

Every command runs as a subprocess under `/usr/bin/time -v` (peak RSS = its "Maximum resident set size").
The converter is llama-cpp-python 0.3.36's vendored convert_hf_to_gguf.py (bench/llama_cpp.sh keeps the
tree), run with the same Python.  Ours runs with --no-verify (the verification is a separate cost).  The
two GGUF files are compared after (same tensors and keys but ours), so the times are of the same work.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KIND = "plamo2-bench-gguf-export"
SCHEMA_VERSION = 1
VERSION = "0.3.36"
DEFAULT_CACHE = Path.home() / f".cache/plamo2-tools/llama-cpp-python-{VERSION}"
CACHE = Path(os.environ.get("PLAMO2_LLAMA_CPP_CACHE") or DEFAULT_CACHE)
TREE = CACHE / "src" / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"


def timed(argv: list[str], env: dict[str, str] | None = None) -> dict[str, float]:
    """Run under /usr/bin/time -v: wall seconds and peak RSS (MiB) of the command and its children."""
    t0 = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-v", *argv], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{argv[0]} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    return {"seconds": round(wall, 3), "peak_rss_mib": round(int(rss.group(1)) / 1024, 1) if rss else None}


def content(path: Path) -> tuple[dict[str, str], set[str]]:
    """(tensor name -> type and XXH3-128 of its bytes, key names) of a GGUF file, which is then
    deleted: only one output is on disk at a time (an 8B bf16 source and output are 16 GB each)."""
    import gguf
    import xxhash

    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: f"{t.tensor_type.name}:{xxhash.xxh3_128_hexdigest(t.data.tobytes())}" for t in reader.tensors}
    keys = set(reader.fields)
    del reader
    path.unlink()
    return tensors, keys


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="plamo-2-1b")
    p.add_argument("--type", default="f16")
    p.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temporary one)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    if not (TREE / "convert_hf_to_gguf.py").is_file():
        raise SystemExit(f"no llama.cpp tree at {TREE}: run bench/llama_cpp.sh")
    cli = shutil.which("plamo2-tools") or "plamo2-tools"
    work = args.work or Path(tempfile.mkdtemp(prefix="gguf-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    src = work / "src"
    result: dict[str, object] = {
        "kind": KIND,
        "schema_version": SCHEMA_VERSION,
        "preset": args.preset,
        "type": args.type,
        "command": " ".join(["python", *sys.argv]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
    }
    try:
        if not (src / "config.json").is_file():
            result["synth"] = timed([cli, "synth", str(src), "--preset", args.preset])
        weights = sorted(src.glob("*.safetensors"))
        result["source_bytes"] = sum(f.stat().st_size for f in weights)
        subprocess.run(["cat", *map(str, weights)], stdout=subprocess.DEVNULL, check=True)  # warm the page cache
        copy = work / "copy"
        copy.mkdir(exist_ok=True)
        result["cp"] = timed(["cp", *map(str, weights), str(copy)])
        shutil.rmtree(copy)
        ours, theirs = work / "ours.gguf", work / "theirs.gguf"
        result["ours"] = timed(
            [cli, "export", "gguf", str(src), str(ours), "--type", args.type, "--no-verify", "--json", "--force"]
        )
        result["output_bytes"] = ours.stat().st_size
        (work / "ours.gguf.plamo2-export.json").unlink(missing_ok=True)
        mine, my_keys = content(ours)
        result["llama_cpp_convert"] = timed(
            [
                sys.executable,
                str(TREE / "convert_hf_to_gguf.py"),
                str(src),
                "--outfile",
                str(theirs),
                "--outtype",
                args.type,
            ]
        )
        reference, keys = content(theirs)
        # A = -exp(A_log) may differ by an ulp (torch's exp; docs/convert.md): named, not hidden.
        differing = [n for n in reference if mine.get(n) != reference[n]]
        result["same_content"] = {
            "tensors": len(reference),
            "keys_only_ours": sorted(my_keys - keys),
            "tensors_differing": differing,
        }
        for key in ("ours", "llama_cpp_convert"):
            result[f"{key}_vs_cp"] = round(result[key]["seconds"] / result["cp"]["seconds"], 2)  # type: ignore[index]
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
        else:
            for f in ("ours.gguf", "ours.gguf.plamo2-export.json", "theirs.gguf"):
                (work / f).unlink(missing_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
