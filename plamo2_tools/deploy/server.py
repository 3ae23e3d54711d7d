"""An OpenAI-compatible server as a verify target (vLLM, SGLang, our `serve`, llama-server, ...).

What we ask (docs/deploy.md has the details and the sources):

* `GET /v1/models`: the model to name in requests (the first one, or `model=`), and a first sign
  of life: a server that is down, refuses (401) or answers something that is not JSON stops here,
  in one line, before the reference forward starts.
* Teacher-forced scoring, one request per sequence: `POST /v1/completions` with the token ids as
  the prompt, `echo: true`, `max_tokens: 1`, `temperature: 0`, `logprobs: K` — the shape lm-eval's
  `local-completions` sends for loglikelihood.  The answer's `logprobs.token_logprobs[j]` is
  log p(ids[j] | ids[:j]) (None for j = 0) and `top_logprobs[j]` the K best alternatives there.
* Where the server cannot echo prompt log-probs (llama-server answers "Only no echo is
  supported"; some servers ignore `echo` and return the generated token only), scoring is off and
  `verify` compares the greedy continuation alone.
* Greedy: `temperature: 0`, `max_tokens: N`, `logprobs: K`, `ignore_eos: true`.
* Token ids, not texts: we ask for vLLM's `return_tokens_as_token_ids` (tokens named "token_id:N")
  and `return_token_ids`; llama.cpp's `content` logprobs carry `id`; otherwise a text is mapped
  back through the reference tokenizer's one-token texts when exactly one id has it (a top-K
  entry whose text is ambiguous is dropped and counted).
* `POST /tokenize` (vLLM, SGLang, ours, llama-server): tokenizer parity, when offered.

Every answer is read bounded (`MAX_ANSWER_BYTES`, `jsonio` depth) and type-checked: a wrong type
is one line naming the field, never a traceback.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from ..errors import EnvironmentLimitError, UserError
from ..jsonio import MiB, parse_json
from .target import Continuation, Scores

MAX_ANSWER_BYTES = 64 * MiB  # a 2,000-token echo with 20 alternatives each is ~2 MB
DEFAULT_TOP_K = 20  # vLLM's default max_logprobs, and ours; OpenAI allowed 5
EXTENSIONS = {"return_tokens_as_token_ids": True, "return_token_ids": True}  # vLLM's; others ignore them
ID_PREFIX = "token_id:"


class ServerRefused(UserError):
    """The server answered with an HTTP error (other than 401/403/404): its status and message."""

    def __init__(self, line: str, status: int, message: str) -> None:
        super().__init__(line)
        self.status = status
        self.message = message


class Http:
    """JSON over HTTP with the standard library: one line for every way a server can fail."""

    def __init__(self, base: str, api_key: str | None, timeout: float) -> None:
        self.root = root_url(base)
        self.timeout = timeout
        self.headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def get(self, path: str) -> Any:
        return self._call("GET", path, None)

    def post(self, path: str, body: dict[str, Any]) -> Any:
        return self._call("POST", path, json.dumps(body).encode())

    def _call(self, method: str, path: str, data: bytes | None) -> Any:
        url = self.root + path
        req = urllib.request.Request(url, data=data, method=method, headers=self.headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read(MAX_ANSWER_BYTES + 1)
        except urllib.error.HTTPError as e:
            raise self._refused(url, e) from None
        except TimeoutError:
            raise EnvironmentLimitError(f"{url}: no answer within {self.timeout:g} s (--timeout)") from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, TimeoutError):
                raise EnvironmentLimitError(f"{url}: no answer within {self.timeout:g} s (--timeout)") from None
            raise EnvironmentLimitError(f"{url}: cannot reach the server ({_reason(e.reason)})") from None
        except (ConnectionError, OSError) as e:  # reset mid-answer, ...
            raise EnvironmentLimitError(f"{url}: the connection failed ({_reason(e)})") from None
        if len(raw) > MAX_ANSWER_BYTES:
            raise UserError(f"{url}: the answer is larger than {MAX_ANSWER_BYTES // MiB} MiB")
        return parse_json(raw, f"{url}: the answer")

    def _refused(self, url: str, e: urllib.error.HTTPError) -> UserError:
        message = _error_message(e)
        status = f"HTTP {e.code}" + (f": {message}" if message else "")
        if e.code in (401, 403):
            return UserError(
                f"{url}: the server refused the request ({status}); pass its key with --api-key or PLAMO2_API_KEY"
            )
        if e.code == 404:
            return ServerRefused(f"{url}: not found ({status})", e.code, message)
        return ServerRefused(f"{url}: the server refused the request ({status})", e.code, message)


def _error_message(e: urllib.error.HTTPError) -> str:
    """OpenAI's {"error": {"message": ...}} (or llama.cpp's, or FastAPI's "detail"), one line."""
    try:
        body = json.loads(e.read(64 * 1024) or b"null")
    except (ValueError, OSError, RecursionError):
        return ""
    found: Any = None
    if isinstance(body, dict):
        err = body.get("error")
        found = err.get("message") if isinstance(err, dict) else err if isinstance(err, str) else body.get("detail")
    return " ".join(str(found).split())[:300] if isinstance(found, (str, int, float)) else ""


def _reason(reason: Any) -> str:
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror.lower()
    return str(reason) or type(reason).__name__


def root_url(base: str) -> str:
    """The server's root from what the user typed: `http://h:8000`, `.../v1`, `.../v1/` or lm-eval's
    `.../v1/completions` alike (`/tokenize` lives at the root, the OpenAI routes under /v1)."""
    parts = urlsplit(base)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UserError(f"{base}: not an http(s):// URL")
    if parts.query or parts.fragment:
        raise UserError(f"{base}: a base URL has no query or fragment")
    path = parts.path.rstrip("/")
    path = path.removesuffix("/v1/completions").removesuffix("/v1")
    return f"{parts.scheme}://{parts.netloc}{path}"


# ---- reading answers (every field type-checked) ------------------------------------------------
def _need(value: Any, kind: type | tuple[type, ...], where: str) -> Any:
    if isinstance(value, bool) or not isinstance(value, kind):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        names = {dict: "an object", list: "an array", str: "a string", float: "a number", int: "an integer"}
        want = "a number" if set(kinds) == {int, float} else " or ".join(names.get(k, k.__name__) for k in kinds)
        raise UserError(f"{where} is not {want}")
    return value


def _number(value: Any, where: str) -> float:
    """A log-probability: a JSON number (null means none, e.g. the first echoed token)."""
    v = float(_need(value, (int, float), where))
    if math.isnan(v) or v > 1e-3:  # a log-probability is <= 0 (rounding allowed)
        raise UserError(f"{where} = {value!r} is not a log-probability")
    return v


class TokenNames:
    """Token names in logprobs -> ids: "token_id:N" always; a plain text only when exactly one id of
    the vocabulary has it as its one-token text (`texts()[i]`, built on the first text seen: a
    100k-token vocabulary takes seconds to decode, and a vLLM-like server never needs it)."""

    def __init__(self, texts: Callable[[], Sequence[str]] | None, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.texts = texts
        self._by_text: dict[str, int] | None = None
        self.unresolved = 0

    @property
    def by_text(self) -> dict[str, int]:
        if self._by_text is None:
            seen: dict[str, int] = {}
            for i, t in enumerate(self.texts() if self.texts is not None else ()):
                seen[t] = -1 if t in seen else i
            self._by_text = {t: i for t, i in seen.items() if i >= 0}
        return self._by_text

    def id_of(self, name: Any, where: str) -> int | None:
        _need(name, str, where)
        if name.startswith(ID_PREFIX):
            try:
                i = int(name[len(ID_PREFIX) :])
            except ValueError:
                raise UserError(f"{where} = {name[:40]!r} is not a token id") from None
            if not 0 <= i < self.vocab_size:
                raise UserError(f"{where}: token id {i} is outside the vocabulary [0, {self.vocab_size})")
            return i
        found = self.by_text.get(name)
        if found is None:
            self.unresolved += 1
        return found


def _checked_id(value: Any, vocab_size: int, where: str) -> int:
    i = _need(value, int, where)
    if not 0 <= i < vocab_size:
        raise UserError(f"{where}: token id {i} is outside the vocabulary [0, {vocab_size})")
    return i


class Steps:
    """One choice's logprobs, whichever of the two shapes a server sends, as parallel lists: token
    ids (None where unknown), log-probs (None where none) and top-K dicts {id: log-prob}."""

    def __init__(self) -> None:
        self.ids: list[int | None] = []
        self.logprobs: list[float | None] = []
        self.top: list[dict[int, float] | None] = []


def read_steps(choice: dict[str, Any], names: TokenNames, where: str) -> Steps:
    """OpenAI's legacy completions logprobs ({tokens, token_logprobs, top_logprobs}) or the
    `content` list llama-server sends ([{id, token, logprob, top_logprobs: [{id, token, logprob}]}])."""
    lp = _need(choice.get("logprobs"), dict, f"{where}.logprobs")
    steps = Steps()
    if "content" in lp and "tokens" not in lp:
        for j, entry in enumerate(_need(lp["content"], list, f"{where}.logprobs.content")):
            w = f"{where}.logprobs.content[{j}]"
            _need(entry, dict, w)
            steps.ids.append(_entry_id(entry, names, w))
            steps.logprobs.append(_number(entry.get("logprob"), f"{w}.logprob"))
            top: dict[int, float] = {}
            for k, alt in enumerate(_need(entry.get("top_logprobs", []), list, f"{w}.top_logprobs")):
                _need(alt, dict, f"{w}.top_logprobs[{k}]")
                i = _entry_id(alt, names, f"{w}.top_logprobs[{k}]")
                if i is not None:
                    top[i] = _number(alt.get("logprob"), f"{w}.top_logprobs[{k}].logprob")
            steps.top.append(top)
        return steps
    tokens = _need(lp.get("tokens"), list, f"{where}.logprobs.tokens")
    values = _need(lp.get("token_logprobs"), list, f"{where}.logprobs.token_logprobs")
    tops = _need(lp.get("top_logprobs", [None] * len(tokens)), list, f"{where}.logprobs.top_logprobs")
    if not len(tokens) == len(values) == len(tops):
        raise UserError(
            f"{where}.logprobs: tokens, token_logprobs and top_logprobs differ in length "
            f"({len(tokens)}, {len(values)}, {len(tops)})"
        )
    for j, (name, value, alts) in enumerate(zip(tokens, values, tops, strict=True)):
        steps.ids.append(names.id_of(name, f"{where}.logprobs.tokens[{j}]"))
        steps.logprobs.append(None if value is None else _number(value, f"{where}.logprobs.token_logprobs[{j}]"))
        if alts is None:
            steps.top.append(None)
            continue
        top = {}
        for name2, v in _need(alts, dict, f"{where}.logprobs.top_logprobs[{j}]").items():
            i = names.id_of(name2, f"{where}.logprobs.top_logprobs[{j}] key")
            if i is not None:
                top[i] = _number(v, f"{where}.logprobs.top_logprobs[{j}][{name2[:20]!r}]")
        steps.top.append(top)
    return steps


def _entry_id(entry: dict[str, Any], names: TokenNames, where: str) -> int | None:
    if "id" in entry:
        return _checked_id(entry["id"], names.vocab_size, f"{where}.id")
    return names.id_of(entry.get("token"), f"{where}.token")


def _one_choice(answer: Any, where: str) -> dict[str, Any]:
    _need(answer, dict, where)
    choices = _need(answer.get("choices"), list, f"{where}: choices")
    if len(choices) != 1:
        raise UserError(f"{where}: expected one choice, got {len(choices)}")
    return _need(choices[0], dict, f"{where}: choices[0]")


def _echo_refusal(e: ServerRefused) -> bool:
    """A server saying it cannot echo prompt log-probs (llama-server: "Only no echo is supported")."""
    text = e.message.lower()
    return e.status in (400, 422, 500, 501) and ("echo" in text or "prompt_logprobs" in text)


# ---- the target ----------------------------------------------------------------------------------
class ServerTarget:
    """An OpenAI-compatible server at a base URL (see the module docstring)."""

    kind = "server"
    full_logits = False

    def __init__(
        self,
        spec: str,
        vocab_size: int,
        token_texts: Callable[[], Sequence[str]] | None = None,
        api_key: str | None = None,
        timeout: float = 120.0,
        model: str | None = None,
        top_k: int = DEFAULT_TOP_K,
        on_note: Callable[[str], None] | None = None,
    ) -> None:
        if not math.isfinite(timeout) or timeout <= 0:
            raise UserError(f"--timeout {timeout:g}: must be > 0")
        if top_k < 1:
            raise UserError(f"--top-k {top_k}: must be >= 1")
        self.location = spec
        self.http = Http(spec, api_key, timeout)
        self.top_k = top_k
        self.vocab_size = vocab_size
        self.names = TokenNames(token_texts, vocab_size)
        self.notes: list[str] = []
        self.on_note = on_note
        self.extensions = dict(EXTENSIONS)
        self._echo: tuple[bool, str] | None = None
        self.models, self.max_model_len = self._models()
        if model is not None and model not in self.models:
            raise UserError(
                f"{self.http.root}/v1/models: the server does not serve {model!r} "
                f"(it serves {', '.join(map(repr, self.models))})"
            )
        self.model = model or self.models[0]

    def _note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)
            if self.on_note is not None:
                self.on_note(text)

    def _models(self) -> tuple[list[str], int | None]:
        where = f"{self.http.root}/v1/models"
        answer = _need(self.http.get("/v1/models"), dict, f"{where}: the answer")
        data = _need(answer.get("data"), list, f"{where}: data")
        ids = [
            _need(_need(m, dict, f"{where}: data[{i}]").get("id"), str, f"{where}: data[{i}].id")
            for i, m in enumerate(data)
        ]
        if not ids:
            raise UserError(f"{where}: the server lists no model")
        first = data[0].get("max_model_len")
        return ids, first if isinstance(first, int) and not isinstance(first, bool) else None

    def _complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST /v1/completions, lowering `logprobs` to what the server allows (OpenAI: 5) and
        dropping our vLLM extensions if the server rejects them, each once, with a note."""
        while True:
            try:
                return self.http.post("/v1/completions", {"model": self.model, **body, **self.extensions})
            except ServerRefused as e:
                text = e.message.lower()
                if e.status in (400, 422) and "logprobs" in text and body.get("logprobs", 0) > 5:
                    self._note(f"the server refused logprobs={body['logprobs']} ({e.message}); using 5")
                    self.top_k = 5
                    body = {**body, "logprobs": 5}
                    continue
                if e.status in (400, 422) and self.extensions and any(k in text for k in self.extensions):
                    self._note(f"the server refused vLLM's token-id extensions ({e.message}); mapping token texts")
                    self.extensions = {}
                    continue
                raise

    def info(self) -> dict[str, Any]:
        echo = self._echo
        return {
            "runtime": "OpenAI-compatible server",
            "base_url": self.http.root,
            "model": self.model,
            "models": self.models,
            "max_model_len": self.max_model_len,
            "top_k": self.top_k,
            "prompt_logprobs": None if echo is None else echo[0],
            "prompt_logprobs_detail": None if echo is None else echo[1],
            "unresolved_token_texts": self.names.unresolved,
            "notes": list(self.notes),
        }

    def can_score(self) -> bool:
        """Probe once: an echo request for two tokens must give back both with a log-prob for the
        second (a server that ignores `echo` gives the generated token only)."""
        if self._echo is None:
            self._echo = self._probe_echo()
            if not self._echo[0]:
                self._note(f"no teacher-forced scoring: {self._echo[1]}")
        return self._echo[0]

    def _probe_echo(self) -> tuple[bool, str]:
        probe = [0, 0] if self.vocab_size else [0]
        try:
            self._score_one(probe, 0, "echo probe")
        except ServerRefused as e:
            if _echo_refusal(e):
                return False, f"the server cannot echo prompt log-probs ({e.message})"
            raise
        except NoEcho as e:
            return False, str(e)
        return True, "echo with prompt logprobs"

    def score(self, seqs: Sequence[Sequence[int]], start: int = 0) -> list[Scores]:
        return [self._score_one(list(s), start, f"sequence {i}") for i, s in enumerate(seqs)]

    def _score_one(self, ids: list[int], start: int, what: str) -> Scores:
        body = {"prompt": ids, "echo": True, "max_tokens": 1, "temperature": 0, "logprobs": self.top_k}
        where = f"{self.http.root}/v1/completions ({what})"
        steps = read_steps(_one_choice(self._complete(body), where), self.names, f"{where}: choices[0]")
        n = len(ids)
        if len(steps.ids) < n or all(v is None for v in steps.logprobs[1:n]):
            raise NoEcho(
                f"the answer holds {len(steps.ids)} token(s) for a {n}-token prompt with echo: the "
                "server does not echo prompt log-probs"
            )
        echoed = steps.ids[:n]
        if any(e is not None and e != t for e, t in zip(echoed, ids, strict=True)):
            j = next(j for j, (e, t) in enumerate(zip(echoed, ids, strict=True)) if e is not None and e != t)
            raise UserError(
                f"{where}: the echoed prompt differs from the ids sent at token {j} ({echoed[j]} for "
                f"{ids[j]}): the server re-tokenized or added tokens"
            )
        values, tops = [], []
        for j in range(start + 1, n):
            v, top = steps.logprobs[j], steps.top[j]
            if v is None or top is None:
                raise UserError(f"{where}: no log-prob for prompt token {j}")
            values.append(v)
            tops.append(dict(sorted(top.items(), key=lambda kv: (-kv[1], kv[0]))[: self.top_k]))
        import numpy as np

        return Scores(start, np.asarray(values, dtype=np.float64), top=tops)

    def greedy(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[Continuation]:
        out = []
        for i, p in enumerate(prompts):
            body = {
                "prompt": list(p),
                "max_tokens": max_new_tokens,
                "temperature": 0,
                "logprobs": self.top_k,
                "ignore_eos": True,
            }
            where = f"{self.http.root}/v1/completions (greedy, prompt {i})"
            choice = _one_choice(self._complete(body), where)
            steps = read_steps(choice, self.names, f"{where}: choices[0]")
            ids = list(steps.ids)
            given = choice.get("token_ids")
            if given is not None:  # vLLM's return_token_ids: the ids themselves
                given = [
                    _checked_id(t, self.vocab_size, f"{where}: token_ids[{k}]")
                    for k, t in enumerate(_need(given, list, f"{where}: token_ids"))
                ]
                if len(given) == len(ids):
                    ids = list(given)
            if any(t is None for t in ids):
                raise UserError(
                    f"{where}: cannot tell which token ids the server generated (its logprobs name "
                    "tokens by text, and those texts are ambiguous in this vocabulary)"
                )
            if any(v is None for v in steps.logprobs):
                raise UserError(f"{where}: a generated token has no log-prob")
            reason = choice.get("finish_reason")
            tops = [dict(sorted((t or {}).items(), key=lambda kv: (-kv[1], kv[0]))[: self.top_k]) for t in steps.top]
            out.append(
                Continuation(
                    [int(t) for t in ids],
                    [float(v) for v in steps.logprobs],  # type: ignore[arg-type]
                    top=tops,
                    finish_reason=reason if isinstance(reason, str) else None,
                )
            )
        return out

    def tokenize(self, text: str) -> list[int] | None:
        """vLLM's, SGLang's and our `/tokenize` take `prompt` + `add_special_tokens`; llama-server's
        takes `content` + `add_special`: one body carries both.  None when there is no such route."""
        body = {"model": self.model, "prompt": text, "add_special_tokens": False, "content": text, "add_special": False}
        try:
            answer = self.http.post("/tokenize", body)
        except ServerRefused as e:
            if e.status in (404, 405, 501):
                return None
            raise
        where = f"{self.http.root}/tokenize: the answer"
        tokens = _need(_need(answer, dict, where).get("tokens"), list, f"{where}: tokens")
        return [_checked_id(t, self.vocab_size, f"{where}: tokens[{k}]") for k, t in enumerate(tokens)]

    def close(self) -> None:
        pass


class NoEcho(UserError):
    """The server answered an echo request without prompt log-probs."""


__all__ = ["ServerTarget", "root_url"]
