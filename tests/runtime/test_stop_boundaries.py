"""Stop strings at every offset: around the runtime's sync boundaries, inside byte-fallback tokens.

The oracle is the definition: a generation with stop string s ends at the first n whose decoded
prefix tokens[:n] contains s (token by token, a full decode each time).  The runtime looks at
tokens every `sync_every` steps and decodes only a tail (`StopStringWatcher`), so each stop
string is tried at every offset of a text made of whole-character tokens and of the byte tokens
of multi-byte characters, with every sync boundary (`checked`) before its hit, and end to end in
`Runtime.generate` with several `sync_every`.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from plamo2_tools.eval.stop_rules import finish_text
from plamo2_tools.runtime.batching.engine import Runtime
from plamo2_tools.runtime.batching.text import StopStringWatcher, TextStream, cut_at_stop, decode_kept_specials
from plamo2_tools.tokenizer import load_native

# Byte-fallback characters (👍, é) next to whole-character pieces, a repeated stop candidate.
TEXT = "Q: 東京👍 ab é漢字\n\nAnswer: 42 👍👍 end"


@pytest.fixture(scope="module")
def tok(checkpoint):  # type: ignore[no-untyped-def]
    return load_native(checkpoint("tiny", seed=11))


def first_prefix(decode, tokens: Sequence[int], stops: Sequence[str], start: int = 0) -> int | None:  # type: ignore[no-untyped-def]
    """The definition: the smallest n > start whose decoded prefix contains a stop string."""
    return next((n for n in range(start + 1, len(tokens) + 1) if any(s in decode(tokens[:n]) for s in stops)), None)


def stops_of(text: str, lengths: Sequence[int] = (1, 2, 3, 5)) -> list[str]:
    found = {text[a : a + n] for n in lengths for a in range(len(text) - n + 1)}
    return sorted(s for s in found if s.strip() and "\ufffd" not in s)


def test_text_has_byte_tokens(tok) -> None:  # type: ignore[no-untyped-def]
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert sum(t.startswith("<0x") for t in tok.convert_ids_to_tokens(ids)) >= 10
    assert decode_kept_specials(tok)(ids) == TEXT


def test_watcher_finds_every_stop_from_every_sync_boundary(tok) -> None:  # type: ignore[no-untyped-def]
    decode = decode_kept_specials(tok)
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    for s in stops_of(TEXT):
        want = first_prefix(decode, ids, [s])
        assert want is not None, s
        for checked in range(want):  # no hit up to `checked`: the runtime's situation at a sync
            w = StopStringWatcher(decode, [s])
            assert w.first_hit(0, ids, checked) == want, f"stop {s!r} after a sync at {checked}"
        w = StopStringWatcher(decode, [s])
        calls = [w(0, ids[:n]) for n in range(1, want + 1)]  # token by token
        assert calls == [False] * (want - 1) + [True], f"stop {s!r} token by token"


def test_stream_never_shows_a_byte_of_the_stop_string(tok) -> None:  # type: ignore[no-untyped-def]
    decode = decode_kept_specials(tok)
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    for s in stops_of(TEXT, (2, 3, 5)):
        before = cut_at_stop(TEXT, [s])[0]
        stream, shown = TextStream(decode, [s]), ""
        for t in ids:
            shown += stream.push(t)
            assert before.startswith(shown), f"stop {s!r}: showed {shown!r}"
            if stream.stopped:  # the token that completed the stop string is the last one
                break
        shown += stream.finish()
        assert shown == before, s


def test_eos_text_is_dropped_and_the_rest_cut(tok) -> None:  # type: ignore[no-untyped-def]
    decode = decode_kept_specials(tok)
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    eos = tok.eos_token_id
    assert finish_text([*ids, eos], [eos], decode, []) == TEXT
    assert finish_text([eos, *ids], [eos], decode, []) == decode([eos, *ids])  # only a final EOS goes
    assert finish_text([*ids, eos], [eos], decode, ["Answer"]) == TEXT[: TEXT.index("Answer")]


class PerRequest:
    """Request i's own watcher (generate takes one stop callback for all requests)."""

    def __init__(self, watchers: list[StopStringWatcher], fast: bool) -> None:
        self.watchers = watchers
        if fast:
            self.first_hit = lambda i, tokens, checked: watchers[i].first_hit(i, tokens, checked)

    def __call__(self, i: int, tokens: list[int]) -> bool:
        return self.watchers[i](i, tokens)


@pytest.mark.parametrize("fast", [True, False], ids=["first_hit", "token_by_token"])
@pytest.mark.parametrize("sync_every", [1, 3, 8])
def test_generate_stops_where_the_definition_says(shards, tok, sync_every: int, fast: bool) -> None:  # type: ignore[no-untyped-def]
    decode = decode_kept_specials(tok)
    with Runtime(shards("tiny", 1, 1, seed=11), backend="torch") as rt:
        prompt = torch.randint(3, 1000, (7,), generator=torch.Generator().manual_seed(1)).tolist()
        free = rt.generate([prompt], 40).tokens[0]
        text = decode(free)
        stops = stops_of(text, (1, 2, 4))[::3][:24]
        ends = [first_prefix(decode, free, [s]) for s in stops]
        watch = PerRequest([StopStringWatcher(decode, [s]) for s in stops], fast)
        got = rt.generate([prompt] * len(stops), 40, stop=watch, sync_every=sync_every).tokens
    assert len(stops) >= 10
    for s, end, tokens in zip(stops, ends, got, strict=True):
        assert tokens == free[:end], f"stop {s!r}: {len(tokens)} tokens, the definition says {end}"


def test_work_per_sync_stays_bounded(shards, tok) -> None:  # type: ignore[no-untyped-def]
    """Each look decodes the new tokens and a fixed window before them, not the whole answer."""
    decode, decoded = decode_kept_specials(tok), [0]

    def counting(ids: Sequence[int]) -> str:
        decoded[0] += len(ids)
        return decode(ids)

    watcher = StopStringWatcher(counting, ["\x00never\x00"])
    with Runtime(shards("tiny", 1, 1, seed=11), backend="torch") as rt:
        out = rt.generate([[5, 6, 7]], 80, stop=watcher, sync_every=2).tokens[0]
    looks = len(out) // 2 + 2
    assert decoded[0] <= len(out) + looks * watcher.window, (decoded[0], len(out), watcher.window)
