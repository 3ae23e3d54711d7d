"""generate_until of the plamo2 lm-eval model: greedy, stop strings, EOS ids, token limits,
truncation, ordering and batch-size invariance (vLLM's semantics, see plamo2_tools.eval.stop_rules)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from eval_helpers import SpyRuntime
from lm_eval.api.instance import Instance

from plamo2_tools.errors import UserError
from plamo2_tools.eval.stop_rules import StopStringWatcher, gen_settings
from plamo2_tools.runtime.batching.engine import Runtime

PROMPT = "Question: Lena has 5 boxes of crayons. How many?\nAnswer:"


def gen(context: str, idx: int = 0, **gen_kwargs) -> Instance:
    return Instance("generate_until", {}, (context, gen_kwargs), idx)


def free_run(make_lm, spy: SpyRuntime, n: int, prompt: str = PROMPT) -> tuple[str, list[int]]:
    """Text and tokens of an n-token greedy continuation that no stop string cuts."""
    text = make_lm(runtime=spy).generate_until([gen(prompt, until=[], max_gen_toks=n)])[0]
    return text, spy.calls[-1][3][0]


def test_greedy_matches_an_argmax_loop(make_lm, spy, runtime) -> None:
    text, tokens = free_run(make_lm, spy, 6)
    ids = make_lm().tok_encode(PROMPT)
    assert spy.calls[-1][2]["temperature"] == 0.0
    want = []
    for _ in range(6):
        want.append(int(runtime.prompt_logits([ids + want])[0][-1].argmax()))
    assert tokens == want
    assert text == make_lm().tokenizer.decode(want)


def test_stop_strings_cut_at_the_earliest_and_are_excluded(make_lm, spy) -> None:
    text, _ = free_run(make_lm, spy, 24)
    assert len(text) > 20
    late, early = text[12:16], text[5:9]  # a stop string may also span two tokens
    spy.calls.clear()
    lm = make_lm(runtime=spy)
    out = lm.generate_until(
        [gen(PROMPT, 0, until=[late, early], max_gen_toks=24), gen(PROMPT, 1, until=late, max_gen_toks=24)]
    )
    first = min(text.find(late), text.find(early))
    assert out == [text[:first], text[: text.find(late)]]
    assert all(len(tokens) < 24 for call in spy.calls for tokens in call[3])  # generation really stopped


def test_eos_id_from_generation_config_stops_and_is_not_shown(
    make_lm, shard_dirs, cli, checkpoint, tmp_path: Path
) -> None:
    base = Runtime(shard_dirs["tp1pp1"], mode="local")
    tokens = base.generate([make_lm().tok_encode(PROMPT)], 24).tokens[0]
    k = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])  # first occurrence at k >= 2
    eos = tokens[k]
    # The EOS goes into the HF checkpoint's generation_config.json before converting: an edited
    # side file in a shard directory is refused (it is under the manifest's digests).
    src, shards = tmp_path / "ckpt", tmp_path / "shards"
    shutil.copytree(checkpoint("tiny", seed=5), src)
    config = json.loads((src / "generation_config.json").read_text())
    (src / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [2, eos]}))
    cli("convert", src, shards, "--tp", 1, "--pp", 1, "--json")
    spy = SpyRuntime(Runtime(shards, mode="local"))
    lm = make_lm(runtime=spy)
    assert lm.stop_ids == (2, eos)  # the tokenizer's EOS first, then generation_config's
    out = lm.generate_until([gen(PROMPT, until=["Question:"], max_gen_toks=24)])
    assert spy.calls[0][3][0] == tokens[: k + 1]
    assert out == [lm.tokenizer.decode(tokens[:k])]


def test_eos_text_joins_the_stop_strings() -> None:
    task_kwargs = {"until": ["Question:", "</s>", "<|im_end|>"], "do_sample": False, "temperature": 0.0}
    settings = gen_settings(task_kwargs, "<|plamo:eos|>", 256)
    assert settings.until == ("Question:", "</s>", "<|im_end|>", "<|plamo:eos|>")
    assert (settings.max_gen_toks, settings.temperature) == (256, 0.0)
    assert task_kwargs["until"] == ["Question:", "</s>", "<|im_end|>"]  # the task's dict is left alone


def test_token_limits(make_lm, spy) -> None:
    lm = make_lm(runtime=spy)
    lm.generate_until(
        [
            gen(PROMPT, 0, until=["@@"]),  # gsm8k sends no max_gen_toks: the default 256 applies
            gen(PROMPT, 1, until=["@@"], max_gen_toks=7),
            gen(PROMPT, 2, until=["@@"], max_new_tokens=5),  # HF's alias
        ]
    )
    limits = sorted((call[1], len(call[3][0])) for call in spy.calls)
    assert limits == [(5, 5), (7, 7), (256, 256)]
    spy.calls.clear()
    make_lm(runtime=spy, max_gen_toks=9).generate_until([gen(PROMPT, until=["@@"])])
    assert (spy.calls[0][1], len(spy.calls[0][3][0])) == (9, 9)


def test_prompt_is_left_truncated_to_leave_room_for_the_answer(make_lm, spy) -> None:
    lm = make_lm(runtime=spy, max_length=48, max_gen_toks=16)
    long_prompt = "Question: " + "many words here " * 10 + "\nAnswer:"
    ids = lm.tok_encode(long_prompt)
    lm.generate_until([gen(long_prompt, until=[])])
    assert len(ids) > 32 and spy.calls[0][0][0] == ids[-32:]
    assert spy.calls[0][1] == 16


def test_batches_restore_input_order_and_match_batch_size_one(make_lm) -> None:
    """Ragged prompts in two gen_kwargs groups: sorted and batched by 4 they give exactly the
    texts of one-at-a-time generation, in input order (no padding leaks into the Mamba state)."""
    short = {"until": [], "max_gen_toks": 12}
    stopping = {"until": ["w9"], "max_gen_toks": 20}
    requests = [
        gen(f"Question: {'x' * n} {n}?\nAnswer:", i, **(short if i % 2 else stopping))
        for i, n in enumerate((3, 61, 17, 120, 0, 33, 88, 9))
    ]
    one = make_lm(batch_size=1).generate_until(requests)
    four = make_lm(batch_size=4).generate_until(requests)
    assert four == one
    assert len(set(one)) > 4


def test_sampling_settings_and_unsupported_kwargs() -> None:
    settings = gen_settings({"until": [], "do_sample": True, "temperature": 0.7, "top_p": 0.9}, None, 256)
    assert (settings.temperature, settings.top_p) == (0.7, 0.9)
    assert gen_settings({"until": [], "temperature": 0.7}, None, 256).temperature == 0.7  # do_sample absent
    assert gen_settings({"until": [], "do_sample": False, "temperature": 0.7}, None, 256).temperature == 0.0
    with pytest.raises(UserError, match="top_k"):
        gen_settings({"until": [], "top_k": 5}, None, 256)


def test_stop_watcher_fires_first_where_a_full_decode_would(make_lm) -> None:
    """The watcher decodes only a tail; it must fire at the same step as a full-text check, also
    for multi-byte characters (byte tokens) and special tokens."""
    lm = make_lm()
    pieces = ["Question:", " 12", "日本", "<|plamo:eos|>", "abc", "\n\n", "é", "Ques", "tion", "本"]
    stops = ["Question:", "日本", "<|plamo:eos|>", "\n\n"]
    rng = random.Random(0)
    for trial in range(40):
        tokens = lm.tok_encode("".join(rng.choice(pieces) for _ in range(12)), add_special_tokens=False)
        watcher = StopStringWatcher(lm.decode, stops)
        fires = next((n for n in range(1, len(tokens) + 1) if watcher(trial, tokens[:n])), None)
        full = next((n for n in range(1, len(tokens) + 1) if any(s in lm.decode(tokens[:n]) for s in stops)), None)
        assert fires == full
