"""A GGUF file run by llama.cpp, as a verify target (`deploy.target.Target`; docs/deploy.md, "GGUF").

The file runs through `llama-cpp-python` (the optional extra `[gguf]`) with `logits_all`: llama.cpp
returns the logits of every evaluated position, so `score` gives full distributions and the
comparison computes the full-vocabulary KL.  Every sequence starts from an empty state (`reset`:
the KV cache, and the recurrent state of PLaMo 2's Mamba layers, cleared) and is evaluated in one
pass; `greedy` then feeds one token at a time, as llama.cpp decodes.

Before anything runs, `lint` reads the file's metadata with the `gguf` package and compares it with
the reference's config.json: what the runtime will do differently (a RoPE base, a window, YaRN, the
end-of-text ids, the vocabulary) is said before a single logit is compared, and the family's own
knowledge of llama.cpp's graph (`model/<family>/gguf.py:runtime_notes`, e.g. PLaMo 2's RoPE turned
off by n_rot = 0) is added to it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckFailed, CheckpointError, EnvironmentLimitError, UserError
from ..model.registry import family_of, load_config
from .target import Continuation, Scores

PLAMO_EOT_PIECE = "<|plamo:op|>"
# What llama.cpp does with a PLaMo 2 GGUF whose layer 0 has head count 0 (every file llama.cpp's own
# converter writes; model/plamo2/gguf.py, ROPE_FIX): measured with llama-cpp-python 0.3.36.
NO_ROPE = (
    "n_rot = 0: llama.cpp takes the RoPE size from layer 0's head count, 0 on a Mamba layer; this "
    "llama.cpp (llama-cpp-python 0.3.36, CPU) then never finishes a forward, older ones run without RoPE. "
    "Re-export with plamo2-tools (head_count[0] set) to run it"
)


# ---- the metadata lint --------------------------------------------------------------------------
@dataclass(frozen=True)
class Finding:
    """One difference between what the GGUF says and what the reference's config says."""

    key: str  # the GGUF key (or the fact) concerned
    gguf: Any
    reference: Any
    effect: str  # what the runtime will do differently, one line
    diverges: bool = True  # False: a difference that no logit shows (stop tokens, a context limit)


def read_metadata(path: str | Path) -> dict[str, Any]:
    """Every key/value of a GGUF file (the `gguf` package's reader), arrays as lists; one line
    when the file is not GGUF."""
    try:
        import gguf
    except ImportError:
        why = "reading a GGUF file needs the gguf package (pip install 'plamo2-tools[gguf]')"
        raise EnvironmentLimitError(why) from None
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError, IndexError, KeyError) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({str(e)[:120]})") from None
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        try:
            out[key] = field.contents()
        except (ValueError, IndexError):
            out[key] = None
    return out


# llama.cpp's file types (LLAMA_FTYPE, gguf.LlamaFileType) that are plain float dtypes: the
# thresholds `verify` judges them by (deploy/compare.THRESHOLDS); any other type is "quantized".
FLOAT_FILE_TYPES = {0: "float32", 1: "float16", 32: "bfloat16"}


def precision_of(meta: dict[str, Any]) -> str | None:
    """The precision a GGUF declares (`general.file_type`): float32 / float16 / bfloat16, or the
    quantization's name ("q8_0", "q4_k_m", ...); None when the file does not say."""
    ftype = meta.get("general.file_type")
    if not isinstance(ftype, int) or isinstance(ftype, bool):
        return None
    if ftype in FLOAT_FILE_TYPES:
        return FLOAT_FILE_TYPES[ftype]
    import gguf

    try:
        return gguf.LlamaFileType(ftype).name.removeprefix("MOSTLY_").lower()
    except ValueError:
        return f"file_type {ftype}"


def _close(a: Any, b: Any) -> bool:
    """Equal as GGUF stores it (float32 keys hold a rounded double)."""
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=0.0)
    return a == b


def lint(meta: dict[str, Any], reference: str | Path) -> list[Finding]:
    """Compare a GGUF's metadata with the reference checkpoint's config (see the module doc)."""
    cfg = load_config(Path(reference))
    family = family_of(cfg)
    arch = family.gguf
    found: list[Finding] = []

    def check(key: str, expected: Any, effect: str, diverges: bool = True) -> None:
        value = meta.get(key)
        if not _close(value, expected):
            found.append(Finding(key, value, expected, effect, diverges))

    if arch is None:
        return [
            Finding(
                "general.architecture",
                meta.get("general.architecture"),
                None,
                f"{family.description} has no llama.cpp architecture",
            )
        ]
    got_arch = meta.get("general.architecture")
    if got_arch != arch.arch:
        return [Finding("general.architecture", got_arch, arch.arch, "not this model's llama.cpp architecture")]
    a = arch.arch
    tokens = meta.get("tokenizer.ggml.tokens") or []
    if len(tokens) != cfg.vocab_size:
        found.append(
            Finding(
                "tokenizer.ggml.tokens",
                len(tokens),
                cfg.vocab_size,
                "llama.cpp's vocabulary (and logits) have another size",
            )
        )
    check(f"{a}.block_count", cfg.num_hidden_layers, "another number of layers")
    check(f"{a}.embedding_length", cfg.hidden_size, "another hidden size")
    check(f"{a}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps, "another RMSNorm epsilon")
    found += _family_lint(meta, cfg, a, family.name)
    eos = set(cfg.eos_token_ids)
    if eos and meta.get("tokenizer.ggml.eos_token_id") not in eos:
        found.append(
            Finding(
                "tokenizer.ggml.eos_token_id",
                meta.get("tokenizer.ggml.eos_token_id"),
                sorted(eos),
                "llama.cpp ends generation on another token",
                diverges=False,
            )
        )
    if cfg.bos_token_id is not None and meta.get("tokenizer.ggml.bos_token_id") not in (None, cfg.bos_token_id):
        found.append(
            Finding(
                "tokenizer.ggml.bos_token_id",
                meta.get("tokenizer.ggml.bos_token_id"),
                cfg.bos_token_id,
                "llama.cpp starts a text with another token",
            )
        )
    if meta.get("tokenizer.ggml.add_bos_token") is not True:
        found.append(
            Finding(
                "tokenizer.ggml.add_bos_token",
                meta.get("tokenizer.ggml.add_bos_token"),
                True,
                "llama.cpp's tokenizer adds no BOS to a text (PLaMo's does); token-id prompts are not affected",
                diverges=False,
            )
        )
    eot_piece = PLAMO_EOT_PIECE in tokens and tokens.index(PLAMO_EOT_PIECE)
    if meta.get("tokenizer.ggml.eot_token_id") != eot_piece:
        found.append(
            Finding(
                "tokenizer.ggml.eot_token_id",
                meta.get("tokenizer.ggml.eot_token_id"),
                eot_piece if eot_piece is not False else None,
                f"end of turn is not {PLAMO_EOT_PIECE}",
                diverges=False,
            )
        )
    notes = [Finding(n.fact, None, None, n.text, n.diverges) for n in arch.runtime_notes(cfg)]
    return found + notes


def _family_lint(meta: dict[str, Any], cfg: Any, a: str, family: str) -> list[Finding]:
    """The RoPE, head and window facts of each family's llama.cpp graph."""
    found: list[Finding] = []
    heads = meta.get(f"{a}.attention.head_count")
    kv = meta.get(f"{a}.attention.head_count_kv")
    if family == "plamo2":
        kinds = cfg.layer_kinds
        want_kv = [0 if k == "mamba" else cfg.num_key_value_heads for k in kinds]
        # a Mamba layer's q head count is 0 (the converter) or the attention count (our RoPE fix on layer 0)
        q_ok = (
            isinstance(heads, list)
            and len(heads) == len(kinds)
            and all(
                h == cfg.num_attention_heads or (k == "mamba" and h == 0) for h, k in zip(heads, kinds, strict=True)
            )
        )
        if kv != want_kv or not q_ok:
            why = "llama.cpp decides which layers are Mamba (head_count_kv 0) and their heads from these"
            found.append(Finding(f"{a}.attention.head_count(_kv)", [heads, kv], want_kv, why))
        head_dim, theta = cfg.hidden_size_per_head, cfg.rope_theta
        key = meta.get(f"{a}.attention.key_length")
        if key != head_dim:
            found.append(Finding(f"{a}.attention.key_length", key, head_dim, "another head size"))
        if isinstance(heads, list) and heads and heads[0] == 0:
            found.append(Finding(f"{a}.rope.dimension_count", 0, head_dim, NO_ROPE))
        for key, want, what in (
            (f"{a}.ssm.state_size", cfg.mamba_d_state, "Mamba state size"),
            (f"{a}.ssm.conv_kernel", cfg.mamba_d_conv, "Mamba convolution width"),
            (f"{a}.ssm.time_step_rank", cfg.mamba_num_heads, "Mamba head count"),
            (f"{a}.ssm.inner_size", cfg.mamba_inner, "Mamba inner width"),
        ):
            if meta.get(key) != want:
                found.append(Finding(key, meta.get(key), want, f"another {what}"))
    else:
        if heads != cfg.num_attention_heads or kv != cfg.num_key_value_heads:
            want = [cfg.num_attention_heads, cfg.num_key_value_heads]
            found.append(Finding(f"{a}.attention.head_count(_kv)", [heads, kv], want, "another head layout"))
        head_dim, theta = cfg.head_dim, cfg.rope_full.theta
        key = meta.get(f"{a}.attention.key_length", cfg.hidden_size // cfg.num_attention_heads)
        if key != head_dim:
            found.append(Finding(f"{a}.attention.key_length", key, head_dim, "another head size"))
        local = meta.get(f"{a}.rope.freq_base_swa")
        if not _close(local, cfg.rope_sliding.theta):
            found.append(
                Finding(
                    f"{a}.rope.freq_base_swa",
                    local,
                    cfg.rope_sliding.theta,
                    "the sliding layers rotate with another RoPE base",
                )
            )
        if "sliding_attention" in cfg.layer_types:
            window = meta.get(f"{a}.attention.sliding_window")
            if window != cfg.window_size:
                found.append(
                    Finding(
                        f"{a}.attention.sliding_window",
                        window,
                        cfg.window_size,
                        "the sliding layers see another window",
                    )
                )
            pattern = meta.get(f"{a}.attention.sliding_window_pattern", 8)
            if pattern != cfg.sliding_window_pattern:
                found.append(
                    Finding(
                        f"{a}.attention.sliding_window_pattern",
                        pattern,
                        cfg.sliding_window_pattern,
                        "other layers are sliding",
                    )
                )
        found += _yarn_lint(meta, cfg, a)
    base = meta.get(f"{a}.rope.freq_base", 10000.0)
    if not _close(base, theta):
        found.append(Finding(f"{a}.rope.freq_base", base, theta, "queries and keys rotate with another RoPE base"))
    return found


def _yarn_lint(meta: dict[str, Any], cfg: Any, a: str) -> list[Finding]:
    rope = cfg.rope_full
    kind = meta.get(f"{a}.rope.scaling.type")
    if not rope.is_yarn:
        if kind not in (None, "none", "linear") or meta.get(f"{a}.rope.scaling.factor") not in (None, 1.0, 0.0):
            return [Finding(f"{a}.rope.scaling.type", kind, None, "llama.cpp scales RoPE; the reference does not")]
        return []
    found = []
    if kind != "yarn":
        found.append(
            Finding(
                f"{a}.rope.scaling.type",
                kind,
                "yarn",
                "no YaRN: llama.cpp runs the plain RoPE where the reference scales it",
            )
        )
    for key, want in (
        ("factor", rope.yarn_factor),
        ("original_context_length", rope.original_max_positions),
        ("yarn_beta_fast", rope.beta_fast),
        ("yarn_beta_slow", rope.beta_slow),
    ):
        default = {"yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0}.get(key)
        got = meta.get(f"{a}.rope.scaling.{key}", default)
        if not _close(got, want):
            found.append(Finding(f"{a}.rope.scaling.{key}", got, want, f"another YaRN {key}"))
    return found


def _finding_text(f: Finding) -> str:
    values = f" (file {f.gguf!r}, reference {f.reference!r})" if f.gguf is not None or f.reference is not None else ""
    return f"{f.effect}{values}" + ("" if f.diverges else "; no logit shows it")


# ---- the target ----------------------------------------------------------------------------------
_LOG: list[str] = []  # llama.cpp's own log lines, kept (not printed): a load failure quotes its error
_CALLBACK: Any = None  # the ctypes callback must outlive every call into llama.cpp


def _capture_llama_log(llama_cpp: Any) -> None:
    """Route llama.cpp's log into _LOG: it writes warnings to stderr even with verbose=False, and a
    command's stderr is one line on refusal."""
    global _CALLBACK
    if _CALLBACK is not None:
        return
    import ctypes

    @llama_cpp.llama_log_callback
    def keep(level: int, text: bytes, user_data: Any) -> None:
        line = text.decode("utf-8", "replace").strip()
        if line:
            _LOG.append(line)
            del _LOG[:-200]

    _CALLBACK = keep
    llama_cpp.llama_log_set(keep, ctypes.c_void_p(0))


def _last_error() -> str:
    """The most telling line llama.cpp logged: its loader's reason ("error loading model: ... wrong
    shape ..."), else the last error or failure."""
    for marks in (("error loading",), ("error", "failed", "wrong")):
        found = [line for line in _LOG if any(m in line.lower() for m in marks)]
        if found:
            return found[-1][:200]
    return ""


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


class GGUFTarget:
    """A GGUF file run by llama.cpp through llama-cpp-python (see the module doc)."""

    kind = "gguf"
    full_logits = True
    top_k = 0

    def __init__(
        self,
        spec: str,
        reference: str | Path | None = None,
        n_ctx: int = 4096,
        n_threads: int | None = None,
        vocab_size: int | None = None,
        **options: Any,
    ) -> None:
        self.location = spec
        self.llm: Any = None
        path = Path(spec)
        if not path.is_file():
            raise UserError(f"{spec}: no such GGUF file")
        try:  # checked first: `verify` refuses a target it cannot run before any work, in open_target's words
            import gguf  # noqa: F401
            import llama_cpp
        except ImportError as e:
            raise UserError(
                f"{spec}: verifying a gguf target needs {e.name or 'llama_cpp'} "
                "(pip install 'plamo2-tools[gguf]'; bench/llama_cpp.sh)"
            ) from None
        self.metadata = read_metadata(path)
        self.findings = lint(self.metadata, reference) if reference is not None else []
        self._llama_cpp = llama_cpp
        _capture_llama_log(llama_cpp)
        self.n_ctx = n_ctx
        try:
            self.llm = llama_cpp.Llama(
                model_path=str(path),
                n_ctx=n_ctx,
                n_batch=min(n_ctx, 512),
                n_ubatch=min(n_ctx, 512),
                logits_all=True,
                verbose=False,
                n_threads=n_threads or max(1, min(8, os.cpu_count() or 1)),
            )
        except (ValueError, RuntimeError) as e:
            why = _last_error() or str(e)[:160]
            known = [f.effect for f in self.findings if f.key == "vocab"]
            raise CheckpointError(
                f"{spec}: llama.cpp cannot load it ({why})" + (f"; {known[0]}" if known else "")
            ) from None
        self.vocab = int(self.llm.n_vocab())
        # Scores are over the model's vocabulary (target.py); a GGUF's vocabulary is the config's.
        self.model_vocab = min(self.vocab, vocab_size) if vocab_size else self.vocab

    def info(self) -> dict[str, Any]:
        m = self.metadata
        arch = m.get("general.architecture")
        return {
            "runtime": f"llama.cpp via llama-cpp-python {self._llama_cpp.__version__}",
            "model": self.location,
            "architecture": arch,
            "file_type": m.get("general.file_type"),
            **({"precision": p} if (p := precision_of(m)) else {}),
            "rope_base": m.get(f"{arch}.rope.freq_base"),
            "rope_base_swa": m.get(f"{arch}.rope.freq_base_swa"),
            "sliding_window": m.get(f"{arch}.attention.sliding_window"),
            "eos_token_id": m.get("tokenizer.ggml.eos_token_id"),
            "eot_token_id": m.get("tokenizer.ggml.eot_token_id"),
            "lint": [asdict(f) for f in self.findings],
            # the shape every target's report shows (deploy/mlx.py's too): what the runtime does differently
            "known_differences": [{"key": f.key, "text": _finding_text(f)} for f in self.findings],
        }

    def can_score(self) -> bool:
        return True

    def _evaluate(self, seq: Sequence[int]) -> np.ndarray:
        """Logits (len(seq), V) of one sequence from an empty state."""
        heads = self.metadata.get("plamo2.attention.head_count")
        if self.metadata.get("general.architecture") == "plamo2" and isinstance(heads, list) and heads[:1] == [0]:
            raise CheckFailed(f"{self.location}: not run: {NO_ROPE}")
        if len(seq) > self.n_ctx:
            raise UserError(
                f"{self.location}: a sequence of {len(seq)} tokens is longer than the context n_ctx = {self.n_ctx}"
            )
        bad = [t for t in seq if not 0 <= int(t) < self.vocab]
        if bad:
            raise UserError(f"token id(s) {bad[:5]} outside the GGUF vocabulary [0, {self.vocab})")
        self.llm.reset()
        self.llm.eval(list(map(int, seq)))
        return np.array(self.llm.scores[: len(seq), : self.model_vocab], dtype=np.float32)

    def logits(self, seq: Sequence[int]) -> np.ndarray:
        """Raw float32 logits of every position (what llama.cpp computed), for callers that compare
        them themselves (the export's own check)."""
        return self._evaluate(seq)

    def score(self, seqs: Sequence[Sequence[int]], start: int = 0) -> list[Scores]:
        out = []
        for seq in seqs:
            lp = _log_softmax(self._evaluate(seq)[start : len(seq) - 1])
            nxt = np.asarray(seq[start + 1 :], dtype=np.int64)
            out.append(Scores(start, lp[np.arange(len(nxt)), nxt], logprobs=lp))
        return out

    def greedy(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[Continuation]:
        out = []
        for prompt in prompts:
            logits = self._evaluate(prompt)[-1]
            tokens, chosen, rows = [], [], []
            for step in range(max_new_tokens):
                lp = _log_softmax(logits[None])[0]
                token = int(np.argmax(lp))
                tokens.append(token)
                chosen.append(float(lp[token]))
                rows.append(lp)
                if step + 1 < max_new_tokens:
                    if len(prompt) + len(tokens) > self.n_ctx:
                        break
                    self.llm.eval([token])
                    logits = np.array(self.llm.scores[self.llm.n_tokens - 1, : self.model_vocab], dtype=np.float32)
            finish = "length" if len(tokens) == max_new_tokens else "context"
            out.append(Continuation(tokens, chosen, np.stack(rows) if rows else None, finish_reason=finish))
        return out

    def tokenize(self, text: str) -> list[int] | None:
        return list(self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=False))

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.close()
