"""Which token ids end a generation when a checkpoint's files disagree (issue 34, class 6).

The rule (docs/eval.md §3, "stop ids"; docs/serve.md; vLLM's): the tokenizer's `eos_token_id`, then `eos_token_id`
of generation_config.json; config.json's only when there is no generation_config.json.  Here the three files name
three different ids, so a reader that takes one from the wrong file, or from both, or in another order, gives
another tuple, and through the real commands another answer: `generate` (CLI, in-process), the online loop the
server and batch files run, lm-eval's `PlamoLM` (the eval code path reads `stop_token_ids` too).

The oracle is the rule written as data (which file's id, in which order), and for the end-to-end answer a free
run of the same greedy generation with no EOS at all, cut by hand at the first id the rule names.  Seen red on
bench/mutants.py's `eos-*` mutants (config.json read as well, generation_config.json skipped, the tokenizer's id
dropped, the order reversed).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from plamo2_tools.runtime.batching.engine import Runtime
from plamo2_tools.runtime.batching.text import stop_token_ids
from plamo2_tools.tokenizer import load_tokenizer

TOKENIZER_EOS = 3  # tokenizer_config.json's eos_token set to <|plamo:pad|> (id 3) below
PROMPT = "The cat sat on"


def edit_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def disagreeing(src: Path, dst: Path, config_eos: object, generation_eos: object | None) -> Path:
    """A copy of an HF checkpoint whose tokenizer, config.json and generation_config.json name different EOS ids
    (generation_eos None: no generation_config.json at all)."""
    shutil.copytree(src, dst)
    edit_json(dst / "tokenizer_config.json", eos_token="<|plamo:pad|>")
    edit_json(dst / "config.json", eos_token_id=config_eos)
    if generation_eos is None:
        (dst / "generation_config.json").unlink()
    else:
        edit_json(dst / "generation_config.json", eos_token_id=generation_eos)
    return dst


@pytest.mark.parametrize(
    ("config_eos", "generation_eos", "want"),
    [
        (40, [50, 60], (TOKENIZER_EOS, 50, 60)),  # generation_config's, never config.json's
        (40, 50, (TOKENIZER_EOS, 50)),  # an int as well as a list
        (40, None, (TOKENIZER_EOS, 40)),  # no generation_config.json: config.json's
        ([40, 41], None, (TOKENIZER_EOS, 40, 41)),
        (40, [TOKENIZER_EOS, 50, 50], (TOKENIZER_EOS, 50)),  # deduplicated, the tokenizer's first
        (40, [60, 2], (TOKENIZER_EOS, 60, 2)),  # in the files' order, not sorted
        (40, [], (TOKENIZER_EOS,)),  # a generation config that names none: still not config.json's
    ],
)
def test_the_rule_when_the_files_disagree(checkpoint, tmp_path: Path, config_eos, generation_eos, want) -> None:
    path = disagreeing(checkpoint("tiny"), tmp_path / "ckpt", config_eos, generation_eos)
    tok = load_tokenizer(path)
    assert tok.eos_token_id == TOKENIZER_EOS  # the tokenizer's own id is the one planted
    assert stop_token_ids(path, tok) == want


def test_without_generation_config_eos_key_config_json_is_not_consulted(checkpoint, tmp_path: Path) -> None:
    path = disagreeing(checkpoint("tiny"), tmp_path / "ckpt", 40, [50])
    edit_json(path / "generation_config.json", eos_token_id=None)  # the file is there, the key is not
    assert stop_token_ids(path, load_tokenizer(path)) == (TOKENIZER_EOS,)


@pytest.fixture(scope="module")
def free_run(shards) -> tuple[list[int], list[int]]:
    """(prompt ids, 40 greedy tokens with no EOS at all) of tiny seed 5."""
    path = shards("tiny", 1, 1, seed=5)
    with Runtime(path, backend="torch", mode="local") as rt:
        ids = list(rt.tokenizer(PROMPT)["input_ids"])
        return ids, list(rt.generate([ids], 40, eos_token_ids=()).tokens[0])


def firsts(tokens: list[int]) -> list[int]:
    """Positions where a token appears for the first time (so that it stops there and nowhere earlier)."""
    return [i for i in range(len(tokens)) if tokens[i] not in tokens[:i]]


def test_every_command_stops_where_the_rule_says(cli, checkpoint, free_run, tmp_path: Path) -> None:
    """config.json names a token the free run writes early (k), generation_config.json one it writes later (j):
    generation stops after j, not k, in `generate`, the online loop (server, batch files) and lm-eval."""
    ids, tokens = free_run
    candidates = [i for i in firsts(tokens) if i >= 2 and tokens[i] > TOKENIZER_EOS]
    assert len(candidates) >= 2, tokens
    k, j = candidates[0], candidates[1]
    src = disagreeing(checkpoint("tiny", seed=5), tmp_path / "ckpt", tokens[k], [tokens[j]])
    shards = tmp_path / "shards"
    cli("convert", src, shards, "--tp", 1, "--pp", 1, "--json")  # side files go in with the shards' digests

    want = tokens[: j + 1]  # the EOS that stopped it is kept in the token list
    out = json.loads(cli("generate", shards, "--prompt", PROMPT, "--max-new-tokens", 40, "--json").stdout)
    assert out["tokens"] == want, (k, j, out["tokens"])

    from online_script import request_of  # the loop's request type, whatever its name

    from plamo2_tools.runtime.batching.online import OnlineLoop

    with Runtime(shards, backend="torch", mode="local") as rt:
        assert list(rt.tokenizer(PROMPT)["input_ids"]) == ids
        with OnlineLoop(rt, max_batch=2, max_context=128) as loop:
            assert loop.eos == (TOKENIZER_EOS, tokens[j])
            handle = loop.submit(request_of({"id": "r", "prompt": ids, "max_tokens": 40, "temperature": 0.0}))
            final = handle.result(120)
            assert handle.tokens == want and final.finish_reason == "stop" and final.stop_reason == tokens[j]

        from plamo2_tools.eval.plamo2_lm import PlamoLM

        assert PlamoLM(pretrained=str(shards), runtime=rt).stop_ids == (TOKENIZER_EOS, tokens[j])
