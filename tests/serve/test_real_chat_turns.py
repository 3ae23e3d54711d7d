"""PLaMo instruction models on a real `plamo2-tools serve`: a chat answer ends on the model's
end-of-turn marker (`<|plamo:tag|>`, one token of PLaMo 3's vocabulary), and `</s>` is ordinary text
for every PLaMo tokenizer, never a stop.

A random model cannot be asked to write either, so the vocabulary is made to: the tiny model's own
greedy continuation of the conversation is computed first, then the tokenizer rows of two of the ids it
writes are renamed, one to `</s>` and a later one to `<|plamo:tag|>` (weights untouched: the model
writes the same ids, whose text is now those strings).  Seen failing before the chat stop was added:
the answer ran on past the marker to max_tokens (finish_reason "length").  Seeded sampling, whose
tokens depend on (prompt, temperature, seed) alone, so the in-process runtime says what the server writes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from real_serve import CliServer, Oracle

from plamo2_tools.tokenizer import load_tokenizer
from plamo2_tools.tokenizer.synthetic import FIRST_PIECE_ID

TEMPLATE = (
    "{% for m in messages %}<|plamo:op|>{{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|plamo:op|>assistant\n{% endif %}"
)
USER = "Hello there, how are you?"
RENDERED = f"<|plamo:op|>user\n{USER}\n<|plamo:op|>assistant\n"
STEPS = 10
SEED = 11


def renamed_checkpoint(src: Path, out: Path, names: dict[int, str]) -> Path:
    """A copy of `src` with a chat template, and tokenizer rows renamed (`names`: id -> piece)."""
    shutil.copytree(src, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    rows = [json.loads(line) for line in (out / "tokenizer.jsonl").read_text(encoding="utf-8").splitlines()]
    for token_id, piece in names.items():
        rows[token_id] = [piece, 0.0, "NORMAL"]
    (out / "tokenizer.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return out


@pytest.mark.parametrize("preset", ["tiny3", "tiny"])
def test_chat_ends_on_the_turn_marker_and_slash_s_is_text(preset: str, cli, checkpoint, shards, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    src = checkpoint(preset, seed=2)
    before = load_tokenizer(src)
    ids = list(before(RENDERED, add_special_tokens=False)["input_ids"])
    oracle = Oracle(shards(preset, 1, 1, seed=2))
    try:
        gen = oracle.tokens(ids, STEPS, temperature=1.0, seed=SEED)  # sampled: a random model's greedy repeats
    finally:
        oracle.close()
    fresh = [k for k in range(1, STEPS) if gen[k] >= FIRST_PIECE_ID and gen[k] not in ids and gen[k] not in gen[:k]]
    assert len(fresh) >= 2, gen  # two ids of plain pieces to rename
    slash, tag = fresh[0], fresh[1]
    ckpt = renamed_checkpoint(src, tmp_path / "ckpt", {gen[slash]: "</s>", gen[tag]: "<|plamo:tag|>"})
    after = load_tokenizer(ckpt)
    assert list(after(RENDERED, add_special_tokens=False)["input_ids"]) == ids  # the prompt reads the same
    assert list(after("<|plamo:tag|>", add_special_tokens=False)["input_ids"]) == [gen[tag]]
    cli("convert", ckpt, tmp_path / "shards", "--tp", 1, "--pp", 1, "--json")
    s = CliServer(tmp_path / "shards", "--max-batch", "2", "--max-context", "128")
    try:
        client = s.client()
        r = client.chat.completions.create(
            model=s.model, messages=[{"role": "user", "content": USER}], max_tokens=STEPS, temperature=1.0, seed=SEED
        )
        choice = r.choices[0]
        want = after.decode(
            gen[:tag],
            skip_special_tokens=False,
            spaces_between_special_tokens=False,
            clean_up_tokenization_spaces=False,
        )
        assert "</s>" in want
        assert (choice.message.content, choice.finish_reason) == (want, "stop")
        assert choice.model_extra["stop_reason"] == "<|plamo:tag|>"
        # A completion is not a chat turn: only EOS ends it, and `</s>` never does.
        c = client.completions.create(model=s.model, prompt=ids, max_tokens=STEPS, temperature=1.0, seed=SEED)
        assert "</s>" in c.choices[0].text and "<|plamo:tag|>" in c.choices[0].text
        assert c.choices[0].finish_reason == "length" and c.usage.completion_tokens == STEPS
    finally:
        assert s.stop() == 0, s.output
