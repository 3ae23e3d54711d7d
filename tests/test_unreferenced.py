"""No definition in the package that nothing reads (issue 29 item 7): a new one fails here, named
with its file and line.  The finder is `tests/unreferenced.py` (ast, names matched by spelling);
below it is shown finding planted dead definitions and leaving live ones alone.  Removed when this
test came: jsonio.LINE_BYTES, model.synth.SPECIAL_TOKENS,
parallel.Mapping.rank_info, safetensors_io.pread_exact, shards.formats.bytes_digest,
tokenizer.encoder.PlamoEncoder.encode_batch, tokenizer.vocab.TYPES (and, found by reading,
model.family.Variant.differences, whose name a live method shares)."""

from __future__ import annotations

from pathlib import Path

from unreferenced import unreferenced

# Read by someone else's code, by name; each with the reason.
TOKENIZER = "plamo2_tools.tokenizer.hf.PlamoTokenizerNative."
HOOKS = (
    "_convert_token_to_id",
    "_convert_id_to_token",
    "build_inputs_with_special_tokens",
    "save_vocabulary",
    "vocab_files_names",
    "model_input_names",
)
ALLOWED = {
    *(TOKENIZER + hook for hook in HOOKS),  # transformers' PreTrainedTokenizer calls these
    "plamo2_tools.eval.plamo2_lm.PlamoLM.tokenizer_name",  # lm-eval's TemplateLM reads it (chat templates)
    "plamo2_tools.tokenizer.hf.PlamoTokenizerNative.token_to_score",  # PFN's Plamo2Tokenizer has it: same interface
    "plamo2_tools.model.mlx.Difference.from_position",  # set positionally, read by vars() into the export record
    # the warm-up of every prefill specialization; tests/serve/test_warm_shapes.py proves its claim, the
    # server does not call it until its start-up cost is measured on a GPU (docs/serve.md, "Compiles after warm-up")
    "plamo2_tools.serve.protocol.ModelCard.owned_by",  # a field of OpenAI's /v1/models, serialised by pydantic
    "plamo2_tools.serve.server._GracefulServer.capture_signals",  # overrides uvicorn.Server's
    "plamo2_tools.runtime.batching.scheduler.ChunkStop",  # the Protocol that documents `first_hit` (read by getattr)
    "plamo2_tools.runtime.batching.generation.LoopStats.prefill_chunks",  # summed by LoopStats.add over vars()
}


def test_nothing_in_the_package_is_unreferenced() -> None:
    dead = unreferenced(allowed=ALLOWED)
    assert not dead, "definitions nothing reads (remove them, or say in ALLOWED who reads them):\n" + "\n".join(
        f"{d.where} {d.qualname}" for d in dead
    )


def test_every_allowed_name_still_exists() -> None:
    """An entry whose definition is gone is itself dead: the list stays small."""
    defined = {d.qualname for d in unreferenced()}
    assert defined >= ALLOWED, ALLOWED - defined


PACKAGE = '''
"""Mentions dead_in_prose only in its docstring."""
LIMIT = 1
UNUSED_LIMIT = 2


def used() -> int:
    return LIMIT


def dead() -> None:
    pass


def dead_in_prose() -> None:
    pass


def by_name() -> None:
    pass


class Record:
    read: int
    written: int

    def method(self) -> int:
        return self.read
'''

READER = """
from planted import Record, used
REGISTRY = {"x": "planted:by_name"}
print(used(), Record(read=1, written=2).read, Record(1, 2).method())
"""


def test_the_finder_finds_planted_dead_definitions(tmp_path: Path) -> None:
    (tmp_path / "planted.py").write_text(PACKAGE)
    (tmp_path / "reader.py").write_text(READER)
    files = [tmp_path / "planted.py", tmp_path / "reader.py"]
    found = {d.qualname for d in unreferenced(files[:1], files)}
    assert found == {"planted.UNUSED_LIMIT", "planted.dead", "planted.dead_in_prose", "planted.Record.written"}
    assert not unreferenced(files[:1], files, allowed=found)
