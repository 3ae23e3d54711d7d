"""runtime/batching/text.py:TextStream, the one text stream of generate, the server and batch files:
stop strings cut exactly, nothing taken back, whole characters only, against a full-decode oracle
(tokens: a byte-level tokenizer with multi-token merges and characters split over byte tokens)."""

from __future__ import annotations

import random

import pytest

from plamo2_tools.runtime.batching.text import TextStream

# A byte-level tokenizer: 0-2 specials, 3-258 the bytes, then merges (one of them a 2-byte character).
BYTE0 = 3
SPECIALS = ["<eos>", "<bos>", "<|plamo:op|>"]
PIECES = (
    [s.encode() for s in SPECIALS]
    + [bytes([b]) for b in range(256)]
    + [m.encode() for m in ("hello", " world", "the", "é")]
)
MERGES = sorted(
    ((p.decode(), i) for i, p in enumerate(PIECES) if i < BYTE0 or i >= BYTE0 + 256), key=lambda x: -len(x[0])
)


def encode(text: str) -> list[int]:
    out, i = [], 0
    while i < len(text):
        hit = next(((s, t) for s, t in MERGES if text.startswith(s, i)), None)
        if hit:
            out.append(hit[1])
            i += len(hit[0])
        else:
            out += [BYTE0 + b for b in text[i].encode()]
            i += 1
    return out


def decode(ids: list[int]) -> str:
    return b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")


def ids(text: str) -> list[int]:
    return encode(text)


def feed(tokens: list[int], stops: list[str]) -> tuple[list[str], int | None, str | None]:
    """Deltas released per token (finish last), index of the stopping token, the stop string."""
    s = TextStream(decode, stops)
    out = []
    for k, t in enumerate(tokens):
        out.append(s.push(t))
        if s.stopped is not None:
            return out, k, s.stopped
    out.append(s.finish())
    return out, None, None


def oracle(tokens: list[int], stops: list[str]) -> tuple[str, int | None]:
    """Independent: the first token after which the decoded text holds a stop string; the text is
    that prefix cut at the earliest occurrence.  Else the whole text."""
    for k in range(len(tokens)):
        text = decode(tokens[: k + 1])
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return text[: min(hits)], k
    return decode(tokens), None


def test_no_stop_releases_everything() -> None:
    deltas, k, _ = feed(ids("hello world, the end"), [])
    assert "".join(deltas) == "hello world, the end" and k is None


def test_stop_spanning_tokens_is_cut_exactly_and_never_sent() -> None:
    tokens = ids("hello world")  # "hello", " world"
    deltas, k, stop = feed(tokens, ["lo wo"])
    assert "".join(deltas) == "hel" and k == 1 and stop == "lo wo"
    assert deltas[0] == "hel"  # "lo" might start the stop string: held back, not sent


def test_held_text_is_released_once_it_cannot_be_a_stop() -> None:
    deltas, k, _ = feed(ids("abxab"), ["abc"])
    assert deltas == ["", "", "abx", "", "", "ab"] and k is None


def test_earliest_stop_wins_and_stop_on_first_token() -> None:
    assert feed(ids("xyz"), ["z", "y"])[0:2] == (["x", ""], 1)
    assert feed(ids("hello"), ["hello"])[0:3] == ([""], 0, "hello")


def test_split_character_waits_for_its_last_byte() -> None:
    tokens = [BYTE0 + b for b in "aé".encode()]  # a, 0xC3, 0xA9
    deltas, _, _ = feed(tokens, [])
    assert deltas == ["a", "", "é", ""]


def test_incomplete_character_at_the_end_is_flushed_as_replacement() -> None:
    deltas, _, _ = feed([BYTE0 + ord("a"), BYTE0 + 0xC3], [])
    assert "".join(deltas) == "a\ufffd"


def test_push_after_stop_is_an_error() -> None:
    s = TextStream(decode, ["a"])
    s.push(ids("a")[0])
    with pytest.raises(RuntimeError):
        s.push(ids("b")[0])


@pytest.mark.parametrize("seed", range(40))
def test_random_sequences_match_the_full_decode_oracle(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = ids("ab") + ids("hello") + [BYTE0 + b for b in "é".encode()] + ids("é") + ids(" world")
    tokens = [rng.choice(alphabet) for _ in range(rng.randrange(1, 30))]
    full = decode(tokens)
    stops = [full[i : i + rng.randrange(1, 5)] for i in (rng.randrange(len(full)) for _ in range(rng.randrange(3)))]
    stops = [s for s in stops if s and "\ufffd" not in s] + rng.sample(["ab", "ba", "lo", "zz"], 2)
    deltas, k, _ = feed(tokens, stops)
    want, want_k = oracle(tokens, stops)
    assert ("".join(deltas), k) == (want, want_k)
    assert not any(s in d for d in deltas for s in stops)


def test_a_tokenizer_that_drops_the_leading_space_of_a_text_gives_the_full_decode() -> None:
    """SentencePiece-style decoders render a piece's leading space everywhere but at the start of
    the text: the windowed decode must still give decode(all tokens), with and without context."""
    pieces = ["\u2581a", "\u2581b", "c", "\u2581d"]

    def sp_decode(tokens: list[int]) -> str:
        return "".join(pieces[t] for t in tokens).replace("\u2581", " ").removeprefix(" ")

    tokens = [0, 2, 1, 3, 2, 1]
    s = TextStream(sp_decode)
    assert "".join([*(s.push(t) for t in tokens), s.finish()]) == sp_decode(tokens) == "ac b dc b"
    s = TextStream(sp_decode, context=[3])  # after a prompt the first piece keeps its space
    assert "".join([*(s.push(t) for t in tokens), s.finish()]) == " " + sp_decode(tokens)


@pytest.mark.parametrize("seed", range(20))
def test_extend_in_chunks_gives_what_pushes_give(seed: int) -> None:
    """The server hands the stream a drain's tokens at once (`extend`): same text, same stop."""
    rng = random.Random(seed)
    alphabet = ids("ab") + ids("hello") + [BYTE0 + b for b in "é".encode()] + ids(" world")
    tokens = [rng.choice(alphabet) for _ in range(rng.randrange(1, 40))]
    stops = rng.sample(["ab", "ba", "lo w", "é", "zz", "d h"], 2)
    whole, k, stop = feed(tokens, stops)
    s, out, at = TextStream(decode, stops), [], 0
    while at < len(tokens) and s.stopped is None:
        n = rng.randrange(1, 9)
        out.append(s.extend(tokens[at : at + n]))
        at += n
    out.append(s.finish())
    assert "".join(out) == "".join(whole) and s.stopped == stop
