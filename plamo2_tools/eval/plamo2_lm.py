"""The lm-eval model ``plamo`` (PLaMo 2 and PLaMo 3; ``plamo2``, its name before PLaMo 3, still
works in lm-eval configs): lm-eval's request types answered by plamo2_tools' `Runtime`.

Semantics are lm-eval's vLLM backend's (the PLaMo 2 reference numbers come from vLLM): BOS as the
tokenizer config says and never twice, prefix token = BOS, greedy, stop strings = ``until`` + the
decoded EOS, stop on EOS ids, ``max_gen_toks`` 256, special tokens kept in the text, prompts
left-truncated to ``max_length - max_gen_toks``.  See `stop_rules` for the generation details.

Tensor / pipeline parallelism is the runtime's business.  Every rank (thread or torchrun process)
answers every request in lock-step and the model reports rank 0 of world size 1 to lm-eval, so
the harness neither shards documents nor gathers; only the process with LOCAL_RANK 0 writes
results (lm-eval's own TP pattern, docs/eval.md §3).

Use it from Python (``PlamoLM(runtime=rt)`` or ``PlamoLM(pretrained=shard_dir)``) or through
lm-eval's CLI as ``--model plamo --model_args pretrained=<shard dir>`` (see `lm_eval_cli`).
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lm_eval.models  # noqa: F401  - import the built-ins first, or registering empties the registry (docs/eval.md §4)
import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator, has_bos_prefix, maybe_truncate
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from .. import timeline
from ..dtypes import dtype_name
from ..errors import Plamo2Error, UserError
from ..kernels.devices import check_backend, check_device
from ..runtime.batching.engine import Runtime, load_tokenizer
from ..version import __version__
from .stop_rules import (
    DEFAULT_MAX_GEN_TOKS,
    GenSettings,
    StopStringWatcher,
    decode_kept_specials,
    finish_text,
    gen_settings,
    stop_token_ids,
)

log = logging.getLogger(__name__)

# batch_size="auto" (the default): generation decodes as many sequences at once as the device's
# memory holds (runtime/batching/memory.py, `Runtime.auto_batch_size`); loglikelihood batches are
# also bounded by tokens, since a score holds float32 logits of every token.
AUTO = "auto"
AUTO_SCORE_TOKENS = 16384

# A loglikelihood request as TemplateLM hands it over: ((context, continuation) or None, ids, ids).
TokenRequest = tuple[Any, list[int], list[int]]


def _family_option_names(pretrained: Any) -> set[str]:
    """The forward options the family of a shard directory declares (none when it is not one: the
    model's own load then says why in one line)."""
    from ..shards.manifest import load_manifest

    if pretrained is None:
        return set()
    try:
        family = load_manifest(pretrained).family
    except (Plamo2Error, OSError):
        return set()
    return {o.name for o in family.runtime_options}


@register_model("plamo", "plamo2")  # "plamo2": the name configs written before PLaMo 3 use
class PlamoLM(TemplateLM):
    """lm-eval model over a plamo2_tools shard directory of any family (any TP x PP layout)."""

    backend = "causal"

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> PlamoLM:
        """lm-eval's `--model_args` as a string (the Python API's form): the rule of `create_from_arg_obj`."""
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict | None = None) -> PlamoLM:
        """lm-eval's `--model_args` plus the settings its CLI adds (`device`, `batch_size`,
        `max_batch_size`).  lm-eval passes both as keywords, so a key in both (`device=cpu` in
        --model_args) was a TypeError.  The rule: what --model_args says wins; a different value
        from lm-eval's own option is named in a warning.  lm-eval 0.4.13's CLI parses --model_args
        itself and calls this one, not `create_from_arg_string` (issue 28: still exit 70 there).
        A key the model does not take is one line, not a TypeError."""
        args = dict(arg_dict)
        params = inspect.signature(cls.__init__).parameters
        known = {k for k, p in params.items() if p.kind is not p.VAR_KEYWORD} - {"self", "runtime"}
        # Any other key is a choice of the model family's forward (**forward_options), when the
        # family of `pretrained` declares it; the family checks its value when the shards load.
        known |= _family_option_names(args.get("pretrained"))
        unknown = sorted(set(args) - known)
        if unknown:
            raise UserError(
                f"--model_args: the plamo2 model takes no {', '.join(unknown)} (it takes {', '.join(sorted(known))})"
            )
        added = {k: v for k, v in (additional_config or {}).items() if v is not None}
        for key in sorted(set(args) & set(added)):
            if str(args[key]) != str(added[key]):
                log.warning("%s=%s from --model_args wins over lm-eval's %s", key, args[key], added[key])
        return cls(**{**added, **args})

    def __init__(
        self,
        pretrained: str | None = None,
        runtime: Runtime | None = None,
        device: str | None = "cpu",
        backend: str = "auto",
        batch_size: int | str | None = AUTO,
        max_batch_size: int | None = None,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        max_length: int | None = None,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
        trust_remote_code: bool = False,
        prefill_chunk: int | None = None,
        seed: int = 0,
        tp: int | None = None,
        pp: int | None = None,
        continuous_batching: bool | str = True,
        cuda_graph: bool | str = True,
        **forward_options: Any,
    ) -> None:
        """`pretrained` is a shard directory (lm-eval names its output directory after it); pass a
        loaded `runtime` instead to share one between evaluations.  `tp` / `pp` are optional checks
        of the directory's layout, which is fixed by `plamo2-tools convert`.

        `continuous_batching` (default on): all requests of one gen_kwargs group go to the runtime
        at once and `batch_size` sequences decode together, a finished one's slot refilled with the
        next request; off: lm-eval's fixed batches of `batch_size`, each run to its longest answer.
        Results are the same either way.  `batch_size="auto"` (default): as many sequences as the
        device's memory holds (reported in the results' config as `auto_batch`).
        `cuda_graph=false` keeps decode eager on CUDA.  Any other argument is a choice of the model
        family's forward (`--option` of the commands, e.g. PLaMo 3's ``window_convention=vllm``),
        checked by the family when the shards load."""
        super().__init__()
        self.device_name = _usable_device(device)
        if runtime is None:
            if pretrained is None:
                raise UserError("the plamo2 model needs pretrained=<shard directory>")
            check_device(self.device_name, "device")
            check_backend(backend, self.device_name)
            runtime = Runtime(
                pretrained,
                device=self.device_name,
                backend=backend,
                prefill_chunk=prefill_chunk,
                cuda_graph=_flag(cuda_graph),
                forward_options=forward_options,
            )
        self.runtime = runtime
        self.path = Path(pretrained) if pretrained is not None else runtime.path
        self.backend_name = backend
        mapping = runtime.manifest.mapping
        for name, want, have in (("tp", tp, mapping.tp), ("pp", pp, mapping.pp)):
            if want is not None and int(want) != have:
                raise UserError(f"{self.path} is laid out with {name}={have}, not {name}={want} (convert it again)")
        self.tokenizer = load_tokenizer(runtime.path, trust_remote_code=trust_remote_code)
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self._max_gen_toks = int(max_gen_toks)
        self._max_length = int(max_length) if max_length is not None else runtime.config.max_position_embeddings
        if self._max_length <= self._max_gen_toks:
            raise UserError(f"max_length ({self._max_length}) must exceed max_gen_toks ({self._max_gen_toks})")
        self.batch_size = _parse_batch_size(batch_size, max_batch_size)
        self.max_batch_size = int(max_batch_size) if max_batch_size else None
        self.batch_sizes: dict[str, int] = {}  # what ran, per request type (lm-eval records it)
        self.seed = int(seed)
        self.continuous_batching = _flag(continuous_batching)
        self.stop_ids = stop_token_ids(runtime.path, self.tokenizer)
        self.decode = decode_kept_specials(self.tokenizer)
        # vLLM backend: the decoded EOS id, or the configured eos string when that decodes to "".
        self.eos_text = self.tokenizer.decode([self.eot_token_id]) or getattr(self.tokenizer, "eos_token", None)
        self._bos_text = self.tokenizer.decode([self.prefix_token_id]) if self.prefix_token_id is not None else None

    # ---- identity ------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """What conditions an empty context and the first rolling window: custom, else BOS, else EOS."""
        if self.custom_prefix_token_id is not None:
            return int(self.custom_prefix_token_id)
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return str(self.path).replace("/", "__")

    def get_model_info(self) -> dict[str, Any]:
        """Merged into results["config"]: enough to tell runs of different layouts apart."""
        mapping = self.runtime.manifest.mapping
        running = bool(self.runtime.engines)
        return {
            "shards": str(self.path),
            "tp": mapping.tp,
            "pp": mapping.pp,
            "world_size": mapping.world_size,
            "dtype": dtype_name(self.runtime.dtype) if running else None,
            "backend": self.backend_name,
            "kernels": self.runtime.kernels if running else None,
            "runtime_device": self.device_name,
            "runtime_mode": self.runtime.mode,
            "forward_options": dict(getattr(self.runtime, "forward_options", {})),
            "batch_size": self.batch_size,
            "auto_batch": self.runtime.batch_plan.to_dict() if getattr(self.runtime, "batch_plan", None) else None,
            "batch_sizes_run": dict(self.batch_sizes),
            "max_length": self.max_length,
            "max_gen_toks": self.max_gen_toks,
            "stop_token_ids": list(self.stop_ids),
            "prefix_token_id": self.prefix_token_id,
            "plamo2_tools_version": __version__,
        }

    # ---- tokenization --------------------------------------------------------------------------
    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.tok_encode_many([string], add_special_tokens, **kwargs)[0]

    def tok_encode_many(
        self, strings: Sequence[str], add_special_tokens: bool | None = None, **kwargs: Any
    ) -> list[list[int]]:
        """vLLM backend's tok_encode: BOS per add_bos_token (None: the tokenizer's own setting), but
        never added to a string that already starts with the BOS text."""
        out: list[list[int]] = [[] for _ in strings]
        groups: dict[bool | None, list[int]] = {}
        for i, s in enumerate(strings):
            if not s:
                continue
            if add_special_tokens is not None:
                flag = add_special_tokens
            elif has_bos_prefix(s, self._bos_text):
                flag = False
            else:
                flag = self.add_bos_token
            groups.setdefault(flag, []).append(i)
        for flag, index in groups.items():
            special = {} if flag is None else {"add_special_tokens": flag}
            encoded = self.tokenizer([strings[i] for i in index], **kwargs, **special).input_ids
            for i, ids in zip(index, encoded, strict=True):
                out[i] = list(ids)
        return out

    # ---- loglikelihood -------------------------------------------------------------------------
    def _loglikelihood_tokens(
        self, requests: list[TokenRequest], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """Sum of log p(continuation | context) and whether every continuation token is the argmax.

        Context + continuation is left-truncated to max_length (the runtime needs no room for a
        generated token, unlike vLLM's max_len - 1)."""
        collator = Collator(requests, sort_fn=lambda r: (-len(r[1]) - len(r[2]), tuple(r[1] + r[2])))
        results: list[tuple[float, bool]] = []
        bar = tqdm(
            total=len(requests), disable=disable_tqdm or not self.runtime.is_main, desc="Running loglikelihood requests"
        )
        longest = max((min(len(c) + len(x), self.max_length) for _, c, x in requests), default=1)
        n = self._score_batch(longest)
        self.batch_sizes["loglikelihood"] = n
        for chunk in collator.get_batched(n=n):
            seqs, starts = [], []
            for _, context, continuation in chunk:
                whole = (context + continuation)[-self.max_length :]
                start = len(whole) - len(continuation)
                if start < 1:  # the continuation alone overflows max_length: its first token has no context
                    log.warning(
                        "continuation of %d tokens exceeds max_length %d; scoring its last %d tokens",
                        len(continuation),
                        self.max_length,
                        len(whole) - 1,
                    )
                    start = 1
                seqs.append(whole)
                starts.append(start)
            for (key, _, _), (logprobs, greedy) in zip(chunk, self.runtime.score(seqs, starts), strict=True):
                answer = (float(logprobs.sum()), bool(greedy.all()))
                results.append(answer)
                if key is not None:  # rolling windows have no key; their totals are cached per document
                    self.cache_hook.add_partial("loglikelihood", key, answer)
                bar.update(1)
        bar.close()
        return collator.get_original(results)

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Total log-likelihood of each text in lm-eval's disjoint rolling windows, the first one
        conditioned on the prefix token (BOS).  The text is encoded without special tokens so that
        BOS appears once, as that prefix.  Windows of all documents are batched together."""
        windows: list[TokenRequest] = []
        owners: list[int] = []
        texts = [req.args[0] for req in requests]
        for i, tokens in enumerate(self.tok_encode_many(texts, add_special_tokens=False)):
            for context, continuation in map(
                make_disjoint_window,
                # context + continuation of a window is at most max_seq_len + 1 = max_length tokens
                get_rolling_token_windows(
                    token_list=tokens, prefix_token=self.prefix_token_id, max_seq_len=self.max_length - 1, context_len=1
                ),
            ):
                windows.append((None, context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        if windows:
            scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
            for owner, (logprob, _) in zip(owners, scores, strict=True):
                totals[owner] += logprob
        for text, total in zip(texts, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return totals

    # ---- generation ----------------------------------------------------------------------------
    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, if asked) continuations: requests sorted by prompt length (longest
        first) and grouped by identical gen_kwargs; with continuous batching a whole group is one
        runtime call, else `batch_size` requests are; results come back in input order.  Sampling
        streams are keyed on each request's position in `requests`, so batching never changes them."""
        contexts = [req.args[0] for req in requests]
        encodings = self.tok_encode_many(contexts)
        items = [
            (c, e, req.args[1], i) for i, (c, e, req) in enumerate(zip(contexts, encodings, requests, strict=True))
        ]
        for context, encoding, _, _ in items:
            if not encoding:
                raise UserError(f"empty prompt (no tokens) for context {context!r}")
        collator = Collator(items, sort_fn=lambda x: (-len(x[1]), x[0]), group_fn=lambda x: x[2], group_by="gen_kwargs")
        results: list[str] = []
        bar = tqdm(
            total=len(items), disable=disable_tqdm or not self.runtime.is_main, desc="Running generate_until requests"
        )
        if self.continuous_batching:
            static = 0
        elif self.batch_size == AUTO:
            static = self._auto_slots(max(len(e) for _, e, _, _ in items) + self.max_gen_toks)
        else:
            static = int(self.batch_size)
        for chunk in collator.get_batched(n=static):
            settings = gen_settings(chunk[0][2], self.eos_text, self.max_gen_toks)
            # The bar advances as each request finishes (the runtime reports it at its next look).
            texts = self._generate(
                [enc for _, enc, _, _ in chunk], settings, [i for *_, i in chunk], on_finish=lambda _i: bar.update(1)
            )
            for (context, _, gen_kwargs, _), text in zip(chunk, texts, strict=True):
                results.append(text)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        bar.close()
        return collator.get_original(results)

    def _auto_slots(self, capacity: int) -> int:
        slots = self.runtime.auto_batch_size(capacity).slots
        return min(slots, self.max_batch_size) if self.max_batch_size else slots

    def _score_batch(self, longest: int) -> int:
        """Sequences per score call: the batch size, or for "auto" what memory and
        AUTO_SCORE_TOKENS tokens of float32 logits allow."""
        if self.batch_size != AUTO:
            return int(self.batch_size)
        return max(1, min(self._auto_slots(longest), AUTO_SCORE_TOKENS // max(1, longest)))

    def _generate(
        self,
        prompts: list[list[int]],
        settings: GenSettings,
        keys: list[int],
        on_finish: Callable[[int], None] | None = None,
    ) -> list[str]:
        truncated, limits = [], []
        for ids in prompts:
            ids, max_new = maybe_truncate(
                ids, max_gen_toks=settings.max_gen_toks, max_model_len=self.max_length, side="left"
            )
            truncated.append(ids)
            limits.append(max(0, max_new))
        if not any(limits):
            for i in range(len(prompts)) if on_finish else ():
                on_finish(i)
            return ["" for _ in prompts]
        watcher = StopStringWatcher(self.decode, settings.until)
        max_batch: int | str | None = None
        if self.continuous_batching:
            max_batch = self.batch_size
            if max_batch == AUTO and self.max_batch_size:
                max_batch = self._auto_slots(max(len(p) + n for p, n in zip(truncated, limits, strict=True)))
        start = time.perf_counter()
        generation = self.runtime.generate(
            truncated,
            limits[0] if len(set(limits)) == 1 else limits,
            eos_token_ids=self.stop_ids,
            temperature=settings.temperature,
            top_p=settings.top_p,
            seed=self.seed,
            stop=watcher,
            max_batch=max_batch,
            request_keys=keys,
            on_finish=on_finish,
        )
        timeline.add("generate", time.perf_counter() - start)
        if generation.slots:
            self.batch_sizes["generate_until"] = generation.slots
        return [finish_text(tokens, self.stop_ids, self.decode, settings.until) for tokens in generation.tokens]


def _flag(value: bool | str) -> bool:
    """lm-eval hands model_args over as strings ('true', 'False', '0')."""
    if isinstance(value, str):
        return value.strip().lower() not in ("false", "0", "no", "off", "")
    return bool(value)


def _usable_device(device: str | None) -> str:
    """lm-eval's CLI passes device='cuda:0' unless told otherwise; on a machine without CUDA that
    default (not a user choice) falls back to the CPU, as HFLM does."""
    if not device:
        return "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        log.warning("device %s requested but CUDA is not available; running on the CPU", device)
        return "cpu"
    return device


def _parse_batch_size(batch_size: int | str | None, max_batch_size: int | None) -> int | str:
    """lm-eval hands the CLI's --batch_size over as a string ('8', 'auto', 'auto:4'): a number, or
    AUTO (max_batch_size, if given, caps what auto chooses)."""
    if batch_size is None:
        return 1
    if isinstance(batch_size, str) and batch_size.strip().lower().startswith(AUTO):
        return AUTO
    try:
        size = int(batch_size)
    except ValueError:
        raise UserError(f"batch_size must be an integer or 'auto', got {batch_size!r}") from None
    if max_batch_size:
        size = min(size, int(max_batch_size))
    if size < 1:
        raise UserError(f"batch_size must be >= 1, got {size}")
    return size
