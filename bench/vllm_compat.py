"""Compatibility check against vLLM itself: do our shards load into vLLM's model classes bit for bit?

Runs inside a vLLM venv (bench/vllm_compat.sh creates one per version: 0.26.0, the last with PLaMo 2, by default;
`--vllm-version 0.34.0` the newest, for PLaMo 3; the JSON records the version it ran). With --fp8 it checks
`plamo2-tools export fp8` instead of shards (`fp8_rank`). For every tiny preset and every valid TP (PP = 1):

1. the project's CLI synthesises the checkpoint, says which TP sizes are valid and converts it;
2. one process per TP rank (forked from one launcher that imported vLLM once), joined over gloo on 127.0.0.1,
   builds on CPU the vLLM model class the checkpoint's config names (`architectures`: `Plamo2ForCausalLM` for
   the PLaMo 2 presets, `Plamo3ForCausalLM` for the PLaMo 3 ones; vLLM's own registry resolves it, the harness
   only checks that it did) and
   (a) loads the HF checkpoint with vLLM's default loader, (b) loads our shards with vLLM's `ShardedStateLoader`;
3. our shard files and the model state after (b) are compared with the state after (a) key by key: names, dtypes,
   shapes and bytes (the "state" is what `ShardedStateLoader` itself requires: `_filter_subtensors(state_dict())`).

Neither family's config class is available to vLLM without remote code (transformers 5.24 ships neither, vLLM's
own registry neither, and the tiny checkpoints carry no `configuration_*.py`): PLaMo 2 gets a bare config class,
PLaMo 3 a clearly labelled STAND-IN for PFN's remote `Plamo3Config` (`_plamo3_config_standin`, reports/vllm/README.md).

Where vLLM 0.26's own HF loader is wrong (an untied `lm_head` with rows != vocab_size asserts; `k_norm` for
1 < KV heads < TP crashes or loads the wrong row), the reference (a) is vLLM's loader fed a fixed input (lm_head cut
to vocab_size rows; k_weight with each KV head's row repeated TP/Hkv times, so vLLM's narrow picks the KV head the
rank's k_proj holds), and vLLM's genuine outcome is recorded as vLLM's bug.

This module imports no plamo2_tools code (the package may not be installed here and its modules move); the main
process imports neither torch nor vLLM (bar the debug --inject-missing-scales), so a broken vLLM install is a
reported failure, not a crash.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# Run as a script, this file's folder is sys.path[0], where the benchmark suite's modules would shadow
# packages vLLM and transformers import by the same names (bench/kernels.py is not HF's `kernels`).
# Nothing here is imported from bench/.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

KIND = "plamo2-vllm-compat"
VERSION = 1
PLAMO2_PRESETS = ("tiny", "tiny-gqa", "tiny-edge")
PLAMO3_PRESETS = ("tiny3", "tiny3-mqa", "tiny3-yarn")
PRESETS = PLAMO2_PRESETS + PLAMO3_PRESETS
# --presets also takes these names for a whole family; the default is PLaMo 2's list, as before PLaMo 3 existed.
PRESET_GROUPS = {"plamo2": PLAMO2_PRESETS, "plamo3": PLAMO3_PRESETS, "all": PRESETS}
TPS = (1, 2, 4, 8)
STATUSES = ("pass", "pass-vllm-hf-bug", "pass-cuda-rounding", "pass-exp-rounding", "fail", "skipped")
# What vLLM's Attention registers per attention layer for an unquantized model (set_default_quant_scales in
# vllm/model_executor/layers/attention/attention.py): persistent 0-dim fp32 buffers holding 1.0.
ATTN_SCALES = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")
# The norm offsets vLLM 0.26 adds while loading an HF checkpoint (plamo2.py load_weights: to the source tensor,
# before the copy; plamo3.py rms_norm_weight_loader: to the parameter, after the copy, in the parameter's dtype).
# Used only to explain a value difference in a norm weight (_explain_offset_rounding), never to build a reference.
VLLM_NORM_OFFSETS = (1.0, 1.0 / 5, 1.0 / 5**1.5)
# No network: vLLM and transformers must read local files only and send no usage statistics.
WORKER_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "OMP_NUM_THREADS": "1",  # up to 8 ranks share 2 cores; nothing here is compute-bound
    "TOKENIZERS_PARALLELISM": "false",
    # vLLM >= 0.3x refuses CpuPlatform on x86 without Triton, and counts Triton as absent when it finds no active
    # GPU driver -- unless no GPU is visible on purpose (vllm/triton_utils/importing.py: an empty
    # CUDA_VISIBLE_DEVICES is its "distributed environment" case). True here: the harness never uses a GPU.
    "CUDA_VISIBLE_DEVICES": "",
}


# ----------------------------------------------------------------------------------------------------------------
# worker: one TP rank, inside the vLLM venv
# ----------------------------------------------------------------------------------------------------------------


def _setup_vllm() -> None:
    """Make vLLM 0.26 build Plamo2/Plamo3ForCausalLM on a GPU-less host; must run before vLLM modules are imported."""
    import torch
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    # The CUDA wheel finds no GPU and no CPU build tag, so it would resolve to UnspecifiedPlatform; modules that
    # `from vllm.platforms import current_platform` bind whatever is set when they are first imported.
    vllm.platforms._current_platform = CpuPlatform()

    # SiluAndMul looks up torch.ops._C.silu_and_mul at construction on CPU; the CUDA wheel's _C has none for CPU.
    # Never called here (no forward), but give it the right semantics anyway.
    try:
        torch.ops._C.silu_and_mul  # noqa: B018
    except (AttributeError, RuntimeError):
        # Explicit schema: this module's postponed annotations are strings that infer_schema cannot read.
        @torch.library.custom_op("_C::silu_and_mul", mutates_args=("out",), schema="(Tensor(a!) out, Tensor x) -> ()")
        def _silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
            d = x.shape[-1] // 2
            out.copy_(torch.nn.functional.silu(x[..., :d]) * x[..., d:])

    # transformers has no plamo2 config class and tiny checkpoints carry no remote code: a bare one is enough,
    # vLLM reads the attributes from config.json and patches rope_theta into rope_parameters itself.
    from transformers import AutoConfig, PretrainedConfig

    class Plamo2Config(PretrainedConfig):
        model_type = "plamo2"

    with contextlib.suppress(ValueError):  # already registered (a newer transformers may ship one)
        AutoConfig.register("plamo2", Plamo2Config)
    # PLaMo 3: vLLM's plamo3.py reads attributes only PFN's remote config class derives (layer_types,
    # interleaved_sliding_window, per-layer-type rope_parameters); a bare class would fail with AttributeError.
    with contextlib.suppress(ValueError):
        AutoConfig.register("plamo3", _plamo3_config_standin())


def _plamo3_config_standin() -> type:
    """HARNESS STAND-IN for PFN's remote `Plamo3Config` -- NOT PFN's code, NOT used by anything but this harness.

    vLLM 0.26 resolves a `model_type: plamo3` config only through `AutoConfig`: neither transformers 5.24 nor vLLM's
    `_CONFIG_REGISTRY` has a plamo3 class, so a real checkpoint needs `trust_remote_code=True` and the
    `configuration_plamo3.py` shipped in PFN's HF repos, which the tiny checkpoints do not have. This class derives
    exactly the attributes PFN's newest public class derives from a v4-form config.json, with its rules:
      sliding_window             = window_size
      interleaved_sliding_window = [None if (i + 1) % sliding_window_pattern == 0 else window_size for each layer]
      layer_types                = "full_attention" where that is None, else "sliding_attention"
      layers_block_type          = ["attention"] * num_hidden_layers
      rope_parameters            = {"full_attention": {"rope_type": "default", "rope_theta": rope_theta} or, when
                                    rope_scaling_factor != 1, YaRN {factor, original_max_position_embeddings =
                                    initial_context_length, beta_fast 32, beta_slow 1, truncate False},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": rope_local_theta}},
                                   restricted to the layer types present; a property whose setter does nothing, so
                                   transformers' standardize_rope_params cannot rewrite it
      rope_local_base_freq       = rope_local_theta
    plus PFN's legacy keys (`rope_global_theta`, an int or uniform-list `sliding_window`) and its defaults.
    ONE EXTENSION, for the transformers-v5 form (explicit `layer_types` and per-layer-type `rope_parameters` in
    config.json, preset tiny3-yarn): those are taken as given. PFN's public class cannot read that form at all
    (`layer_types` is a property without a setter: PretrainedConfig.__init__ raises AttributeError, and a given
    `rope_parameters` would be dropped by the no-op setter).
    """
    from transformers import PretrainedConfig

    layer_kinds = ("full_attention", "sliding_attention")

    class Plamo3Config(PretrainedConfig):  # the harness stand-in (see the docstring above)
        model_type = "plamo3"

        def __init__(
            self,
            hidden_size: int = 4096,
            num_hidden_layers: int = 32,
            rms_norm_eps: float = 1e-6,
            scale_embedding: bool = False,
            tie_word_embeddings: bool = True,
            num_attention_heads: int = 32,
            num_key_value_heads: int = 4,
            head_dim: int = 128,
            max_position_embeddings: int = 2048,
            window_size: int = 128,
            sliding_window_pattern: int = 8,
            rope_theta: float = 150_000,
            rope_local_theta: float = 10_000,
            rope_scaling_factor: float = 1,
            initial_context_length: int | None = None,
            intermediate_size: int = 13312,
            vocab_size: int = 32000,
            pad_token_id: int | None = None,
            bos_token_id: int = 1,
            eos_token_id: int = 2,
            use_cache: bool = True,
            **kwargs: Any,
        ) -> None:
            legacy_theta = kwargs.pop("rope_global_theta", None)
            if legacy_theta is not None and rope_theta == 150_000:
                rope_theta = legacy_theta
            legacy_window = kwargs.pop("sliding_window", None)
            if isinstance(legacy_window, list):
                windows = {w for w in legacy_window if w is not None}
                if len(windows) == 1:
                    window_size = windows.pop()
            elif isinstance(legacy_window, int):
                window_size = legacy_window
            # The v5-form extension (not in PFN's class): explicit layer types and per-type RoPE.
            given_types = kwargs.pop("layer_types", None)
            given_rope = kwargs.pop("rope_parameters", None)
            self._given_layer_types = list(given_types) if given_types is not None else None
            nested = isinstance(given_rope, dict) and given_rope and set(given_rope) <= set(layer_kinds)
            self._given_rope_parameters = {k: dict(v) for k, v in given_rope.items()} if nested else None
            self.hidden_size, self.num_hidden_layers, self.rms_norm_eps = hidden_size, num_hidden_layers, rms_norm_eps
            self.num_attention_heads, self.num_key_value_heads = num_attention_heads, num_key_value_heads
            self.head_dim, self.max_position_embeddings = head_dim, max_position_embeddings
            self.window_size, self.sliding_window_pattern = window_size, sliding_window_pattern
            self.rope_theta, self.rope_local_theta = rope_theta, rope_local_theta
            self.rope_scaling_factor, self.initial_context_length = rope_scaling_factor, initial_context_length
            self.intermediate_size, self.vocab_size = intermediate_size, vocab_size
            self.scale_embedding, self.use_cache = scale_embedding, use_cache
            super().__init__(
                pad_token_id=pad_token_id,
                bos_token_id=bos_token_id,
                eos_token_id=eos_token_id,
                tie_word_embeddings=tie_word_embeddings,
                **kwargs,
            )

        @property
        def sliding_window(self) -> int:
            return self.window_size

        @property
        def interleaved_sliding_window(self) -> list[int | None]:
            if self._given_layer_types is not None:
                return [None if t == "full_attention" else self.window_size for t in self._given_layer_types]
            full = [(i + 1) % self.sliding_window_pattern == 0 for i in range(self.num_hidden_layers)]
            return [None if f else self.window_size for f in full]

        @property
        def layer_types(self) -> list[str]:
            return ["full_attention" if w is None else "sliding_attention" for w in self.interleaved_sliding_window]

        @property
        def layers_block_type(self) -> list[str]:
            return ["attention"] * self.num_hidden_layers

        @property
        def rope_parameters(self) -> dict[str, Any]:
            if self._given_rope_parameters is not None:
                return {k: dict(v) for k, v in self._given_rope_parameters.items()}
            if self.rope_scaling_factor == 1:
                full: dict[str, Any] = {"rope_theta": self.rope_theta, "rope_type": "default"}
            else:
                full = {
                    "rope_theta": self.rope_theta,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                    "factor": self.rope_scaling_factor,
                    "original_max_position_embeddings": self.initial_context_length,
                    "rope_type": "yarn",
                    "truncate": False,
                }
            every = {
                "full_attention": full,
                "sliding_attention": {"rope_theta": self.rope_local_theta, "rope_type": "default"},
            }
            return {t: every[t] for t in set(self.layer_types)}

        @rope_parameters.setter
        def rope_parameters(self, value: dict[str, Any]) -> None:
            pass  # as PFN's: transformers normalises rope_parameters during init and in standardize_rope_params

        @property
        def rope_local_base_freq(self) -> float:
            return self.rope_local_theta

    Plamo3Config.__qualname__ = "HarnessStandinPlamo3Config"
    return Plamo3Config


def _vllm_config(model_dir: str, tp: int, load_format: str, dtype: str) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=model_dir,
        skip_tokenizer_init=True,
        tensor_parallel_size=tp,
        load_format=load_format,
        dtype=dtype,
        max_model_len=64,  # bounds the RoPE cache (max_position_embeddings is 10M in PLaMo 2 configs)
        enforce_eager=True,
    ).create_engine_config()


class _LoadFailed(Exception):
    pass


def _load_state(
    model_dir: str, tp: int, load_format: str, dtype: str, fix_input: Any = None
) -> tuple[dict, dict, dict[str, Any]]:
    """Build the rank's model, run the loader's load_weights and return (state, buffer info, what vLLM built).

    Not `loader.load_model`: on CpuPlatform its process_weights_after_loading replaces linear weights with packed
    kernels' copies, and the state a sharded checkpoint must hold is the one load_weights fills."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import DefaultModelLoader, get_model_loader
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    cfg = _vllm_config(model_dir, tp, load_format, dtype)
    with set_current_vllm_config(cfg), set_default_torch_dtype(cfg.model_config.dtype), torch.device("cpu"):
        model = initialize_model(vllm_config=cfg, model_config=cfg.model_config)
        loader = get_model_loader(cfg.load_config)
        if fix_input is not None:
            assert isinstance(loader, DefaultModelLoader)
            inner = loader.get_all_weights
            loader.get_all_weights = lambda mc, m: (fix_input(n, w) for n, w in inner(mc, m))  # type: ignore[method-assign]
        try:
            loader.load_weights(model, cfg.model_config)
        except Exception as e:  # vLLM's own refusal is a result here, not a crash of the harness
            import traceback

            # Where it failed, since vLLM's asserts carry no message.
            frames = traceback.extract_tb(e.__traceback__)
            at = next((f for f in reversed(frames) if "/vllm/" in f.filename), frames[-1])
            where = f"{at.filename.rsplit('site-packages/', 1)[-1]}:{at.lineno}: {at.line}"
            raise _LoadFailed(f"{type(e).__name__}: {e} [at {where}]".replace(":  [", ": [")) from e
        state = {k: v.detach().clone() for k, v in ShardedStateLoader._filter_subtensors(model.state_dict()).items()}
        params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        buffers = {
            k: {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape), "value": _scalar(v)}
            for k, v in state.items()
            if k not in params
        }
    return state, buffers, _built(model, cfg)


def _built(model: Any, cfg: Any) -> dict[str, Any]:
    """What vLLM built from the checkpoint's config: the model class its registry picked for `architectures`, the
    config class and the derived attributes the model read, and per attention layer its RoPE and window."""
    hf = cfg.model_config.hf_config
    cls = type(hf)
    out: dict[str, Any] = {
        "architectures": list(getattr(hf, "architectures", None) or []),
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "config_class": f"{cls.__module__}.{cls.__qualname__}",
        "config": {},
        "attention_layers": [],
    }
    for attr in ("layer_types", "interleaved_sliding_window", "sliding_window", "rope_parameters"):
        with contextlib.suppress(Exception):
            out["config"][attr] = json.loads(json.dumps(getattr(hf, attr), default=str))
    for name, m in model.named_modules():
        if hasattr(m, "rotary_emb") and hasattr(m, "attn"):
            rope = m.rotary_emb
            out["attention_layers"].append(
                {
                    "module": name,
                    "rope": type(rope).__name__,
                    "base": getattr(rope, "base", None),
                    "scaling_factor": getattr(rope, "scaling_factor", None),
                    "sliding_window": getattr(m.attn, "sliding_window", None),
                }
            )
    return out


def _scalar(t: Any) -> float | None:
    return float(t.reshape(-1)[0]) if t.numel() == 1 else None


def _hf_fixes(hf_dir: str, tp: int) -> dict[str, tuple[str, Callable[[str, Any], Any]]]:
    """The input fixes that make vLLM 0.26's HF loader produce the correct rank state: name -> (why, fn)."""
    from safetensors import safe_open

    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    vocab, hkv = cfg["vocab_size"], cfg["num_key_value_heads"]
    model_type = cfg.get("model_type")
    lm_rows = None
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            if "lm_head.weight" in st.keys():  # noqa: SIM118
                lm_rows = st.get_slice("lm_head.weight").get_shape()[0]
    fixes: dict[str, tuple[str, Callable[[str, Any], Any]]] = {}
    if not cfg.get("tie_word_embeddings", True) and lm_rows is not None and lm_rows != vocab:
        # VocabParallelEmbedding.weight_loader asserts rows == vocab_size; the HF remote code rounds the untied
        # head up to a multiple of 16 and never uses the extra rows.
        fixes["lm_head_rows"] = (
            f"lm_head.weight cut from {lm_rows} to vocab_size {vocab} rows (vLLM asserts rows == vocab_size)",
            lambda n, w: w[:vocab] if n == "lm_head.weight" else w,
        )
    if model_type == "plamo2" and 1 < hkv < tp:
        # PLaMo 2 only (its k_weight is [Hkv, d]; PLaMo 3's k_norm is one [d] vector, replicated on every rank):
        # k_norm's sharded_weight_loader(0) narrows row tp_rank, but the rank's k_proj holds KV head
        # tp_rank // (tp / hkv): rows tp_rank >= hkv crash, the others are the wrong head.
        fixes["k_norm_kv_head"] = (
            f"k_weight rows repeated {tp // hkv}x (vLLM narrows k_norm at tp_rank, not at the rank's KV head)",
            lambda n, w: w.repeat_interleave(tp // hkv, dim=0) if n.endswith(".k_weight") else w,
        )
    return fixes


def _compose(fns: list[Callable[[str, Any], Any]]) -> Callable[[str, Any], tuple[str, Any]]:
    def fix(name: str, w: Any) -> tuple[str, Any]:
        for fn in fns:
            w = fn(name, w)
        return name, w

    return fix


def _bits_equal(a: Any, b: Any) -> bool:
    import torch

    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def _desc(t: Any) -> dict[str, Any]:
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "value": _scalar(t)}


def compare(ref: dict, got: dict) -> list[dict[str, Any]]:
    """Every difference between two state dicts: missing/unexpected keys, dtype, shape, bytes."""
    out: list[dict[str, Any]] = []
    for k in sorted(ref.keys() - got.keys()):
        out.append({"key": k, "what": "missing", "expected": _desc(ref[k])})
    for k in sorted(got.keys() - ref.keys()):
        out.append({"key": k, "what": "unexpected", "got": _desc(got[k])})
    for k in sorted(ref.keys() & got.keys()):
        a, b = ref[k], got[k]
        if a.dtype != b.dtype:
            out.append({"key": k, "what": "dtype", "expected": str(a.dtype), "got": str(b.dtype)})
        elif a.shape != b.shape:
            out.append({"key": k, "what": "shape", "expected": list(a.shape), "got": list(b.shape)})
        elif not _bits_equal(a, b):
            diff = a.ne(b) if a.is_floating_point() else a != b
            delta = (a.double() - b.double()).abs().nan_to_num(nan=float("inf")).max().item()
            m = {"key": k, "what": "value", "elements": int(diff.sum()), "of": a.numel(), "max_abs_diff": delta}
            if a.is_floating_point():
                m["max_ulps"] = _max_ulps(a, b)
            out.append(m)
    return out


def _max_ulps(a: Any, b: Any) -> int:
    """The largest distance between a and b in units in the last place of their dtype (adjacent values: 1)."""
    import torch

    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    low = -(2 ** (8 * a.element_size() - 1))

    def ordered(t: Any) -> Any:  # sign-magnitude bit patterns -> integers in the order of the values
        i = t.reshape(-1).contiguous().view(ints).long()
        return torch.where(i < 0, low - i, i)

    return int((ordered(a) - ordered(b)).abs().max())


def _explain_offset_rounding(hf_dir: str, key: str, ref: Any, ours: Any) -> dict[str, Any] | None:
    """For a norm weight whose bytes differ: is vLLM's value `param + offset` computed in the parameter's dtype after
    the source was copied (rounded) into it (plamo3.py's composed_weight_loader), and ours what the same loader
    computes on CUDA? torch on the CPU rounds the Python scalar offset to bf16 before the bf16 add; on CUDA it adds
    the float32 offset to the upcast value and rounds once (the converter's `cast_first` rule, which is what vLLM
    serving on a GPU holds).  None when the key has no same-shaped HF tensor or neither rule matches."""
    from safetensors import safe_open

    src = None
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            if key in st.keys():  # noqa: SIM118
                src = st.get_tensor(key)
    if src is None or src.shape != ref.shape or not ref.is_floating_point():
        return None
    for off in VLLM_NORM_OFFSETS:
        twice = src.to(ref.dtype) + off  # vLLM: default_weight_loader's copy_, then `param + offset` (this torch, CPU)
        cuda = (src.to(ref.dtype).float() + off).to(ref.dtype)  # the same on CUDA: the offset stays float32
        once = (src.float() + off).to(ref.dtype)  # fp32 sum rounded once (the converter before cast_first)
        if _bits_equal(twice, ref) or _bits_equal(cuda, ours) or _bits_equal(once, ours):
            exact = (src.double() + off).to(ref.dtype)  # the sum rounded (from float64) into the dtype
            return {
                "offset": off,
                "source_dtype": str(src.dtype).removeprefix("torch."),
                "vllm_equals_param_plus_offset": _bits_equal(twice, ref),
                "ours_equals_cuda_rule": _bits_equal(cuda, ours),
                "ours_equals_fp32_sum_rounded_once": _bits_equal(once, ours),
                "vllm_max_ulps_from_exact": _max_ulps(ref, exact),
                "ours_max_ulps_from_exact": _max_ulps(ours, exact),
                "vllm_elements_not_exact": int(ref.ne(exact).sum()),
                "ours_elements_not_exact": int(ours.ne(exact).sum()),
            }
    return None


def rank_main(case: dict[str, Any], rank: int) -> None:
    """One TP rank (a forked child of the launcher): loads (a) and (b), writes its result JSON."""
    tp, dtype, hf, shards = case["tp"], case["dtype"], case["hf"], case.get("shards")
    res: dict[str, Any] = {"rank": rank, "timings": {}}
    try:
        if case.get("fp8"):
            _init_ranks(case, rank, hf, tp, dtype)
            fp8_rank(case, rank, res)
            raise _Done
        t0 = time.perf_counter()
        _init_ranks(case, rank, hf, tp, dtype)
        res["timings"]["setup_s"] = round(time.perf_counter() - t0, 2)

        # (a) vLLM's default loader on the HF checkpoint, exactly as a user would run it.
        t0 = time.perf_counter()
        genuine = built = None
        try:
            genuine, buffers, built = _load_state(hf, tp, "auto", dtype)
            res["hf_load"] = {"ok": True}
        except _LoadFailed as e:
            res["hf_load"] = {"ok": False, "error": str(e)}
        fixes = _hf_fixes(hf, tp)
        ref = genuine
        if fixes:
            # (a') the same loader fed the corrected input: the reference where vLLM's HF path is wrong.
            res["hf_fixes"] = {k: why for k, (why, _) in fixes.items()}
            try:
                ref, buffers, built = _load_state(hf, tp, "auto", dtype, _compose([fn for _, fn in fixes.values()]))
            except _LoadFailed as e:
                res["hf_fixed_load"] = {"ok": False, "error": str(e)}
                ref = None
            if ref is not None:
                # vLLM's outcome without each fix, so each bug shows on its own (one assert can hide another).
                without: dict[str, Any] = {}
                for k in fixes if len(fixes) > 1 else ():
                    others = _compose([fn for j, (_, fn) in fixes.items() if j != k])
                    try:
                        state, _, _ = _load_state(hf, tp, "auto", dtype, others)
                        without[k] = {"ok": True, "wrong_keys": [m["key"] for m in compare(ref, state)]}
                    except _LoadFailed as e:
                        without[k] = {"ok": False, "error": str(e)}
                res["hf_without_fix"] = without
                if genuine is not None:
                    # Where vLLM's genuine HF load "succeeded" but put different bytes (k_norm rows).
                    res["hf_load"]["wrong_keys"] = [m["key"] for m in compare(ref, genuine)]
        res["timings"]["hf_load_s"] = round(time.perf_counter() - t0, 2)
        if ref is None:
            raise RuntimeError("no reference state: vLLM's HF loader failed and no input fix applies")
        res["state_keys"] = len(ref)
        res["buffers"] = buffers
        res["vllm_built"] = built
        # vLLM's registry picked the class from the checkpoint's `architectures`; make sure it is the one named there.
        if built is not None and built["model_class"].rsplit(".", 1)[-1] not in case["architectures"]:
            raise RuntimeError(f"vLLM built {built['model_class']}, the checkpoint names {case['architectures']}")

        # (b) vLLM's ShardedStateLoader on our shards.
        t0 = time.perf_counter()
        try:
            loaded, _, _ = _load_state(shards, tp, "sharded_state", dtype)
            res["sharded_load"] = {"ok": True}
            res["sharded_state_mismatches"] = compare(ref, loaded)
        except _LoadFailed as e:
            res["sharded_load"] = {"ok": False, "error": str(e)}
        res["timings"]["sharded_load_s"] = round(time.perf_counter() - t0, 2)

        # Our files themselves: ShardedStateLoader copy_()s into the parameters, which would silently cast a wrong
        # dtype and narrow a too-large tensor, so the files are compared too, not only the state after (b).
        from safetensors.torch import load_file

        files: dict[str, Any] = {}
        for f in sorted(Path(shards).glob(f"model-rank-{rank}-part-*.safetensors")):
            files.update(load_file(str(f)))
        res["file_mismatches"] = compare(ref, files)
        for m in res["file_mismatches"]:
            if m["what"] == "value":
                why = _explain_offset_rounding(hf, m["key"], ref[m["key"]], files[m["key"]])
                if why is not None:
                    m["offset_rounding"] = why
    except _Done:
        pass
    except Exception as e:  # reported per rank; the main process turns it into the case's failure
        import traceback

        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()[-4000:]
    Path(case["result_dir"], f"rank{rank}.json").write_text(json.dumps(res, indent=1))
    with contextlib.suppress(Exception):  # frees the TP group's shared-memory broadcaster
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()


class _Done(Exception):
    """An FP8 rank finished (rank_main's early exit to its common result writing)."""


def _init_ranks(case: dict[str, Any], rank: int, hf: str, tp: int, dtype: str) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel

    # initialize_model_parallel reads the current vLLM config, as in vLLM's own workers.
    with set_current_vllm_config(_vllm_config(hf, tp, "auto", dtype)):
        init_distributed_environment(
            world_size=tp,
            rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{case['port']}",
            local_rank=rank,
            backend="gloo",
        )
        initialize_model_parallel(tp, 1)


# ---- FP8 (--fp8): our compressed-tensors export through vLLM's own compressed-tensors loader ---------------------
def dequantized_copy(fp8_dir: str, out_dir: str) -> None:
    """The export with every FP8 weight replaced by its dequantization (compressed-tensors' `_dequantize`:
    q.to(scale.dtype) * scale, in the scale's dtype) and no quantization_config: an unquantized checkpoint whose
    TP layout vLLM's ordinary loader makes, the reference for the FP8 path's."""
    import torch
    from safetensors.torch import load_file, save_file

    src, out = Path(fp8_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, Any] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    plain = {}
    for k, v in tensors.items():
        scale = tensors.get(k.removesuffix(".weight") + ".weight_scale") if k.endswith(".weight") else None
        if k.endswith(".weight_scale"):
            continue
        plain[k] = (v.to(scale.dtype) * scale).to(scale.dtype) if v.dtype == torch.float8_e4m3fn else v
    save_file(plain, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for side in ("generation_config.json",):
        if (src / side).is_file():
            shutil.copyfile(src / side, out / side)


def fp8_rank(case: dict[str, Any], rank: int, res: dict[str, Any]) -> None:
    """One rank of an FP8 case: (c) vLLM's default loader on our FP8 export (its compressed-tensors path) and
    (d) on the dequantized copy; every FP8 weight of (c), times its per-row scale, must equal (d)'s weight bit for
    bit, every other key too.  The FP8 weights and scales of (c) are kept for tests/compat/test_vllm_fp8.py."""
    import torch
    from safetensors.torch import save_file

    tp, dtype = case["tp"], case["dtype"]
    # vLLM 0.26's own HF-loader bugs (an untied head with padded rows, k_norm for 1 < Hkv < TP) hit both loads
    # alike; the same input fixes as for shards, to both, so that what is compared is the FP8 path.
    fixes = _hf_fixes(case["hf"], tp)
    fix = _compose([fn for _, fn in fixes.values()]) if fixes else None
    res["hf_fixes_applied"] = {k: why for k, (why, _) in fixes.items()}
    t0 = time.perf_counter()
    try:
        got, _, built = _load_state(case["fp8"], tp, "auto", dtype, fix)
        res["fp8_load"] = {"ok": True}
    except _LoadFailed as e:
        res["fp8_load"] = {"ok": False, "error": str(e)}
        return
    res["timings"]["fp8_load_s"] = round(time.perf_counter() - t0, 2)
    res["vllm_built"] = built
    ref, _, _ = _load_state(case["reference"], tp, "auto", dtype, fix)
    fp8 = {k for k, v in got.items() if v.dtype == torch.float8_e4m3fn}
    layers: dict[str, dict[str, Any]] = {}
    deq: dict[str, Any] = {}
    for k, v in got.items():
        scale_key = k.removesuffix(".weight") + ".weight_scale"
        if k in fp8:
            scale = got[scale_key]
            deq[k] = (v.float() * scale.float()).to(ref[k].dtype if k in ref else v.dtype)
            pattern = re.sub(r"layers\.layers\.\d+\.", "layers.layers.{i}.", k.removesuffix(".weight"))
            layers.setdefault(
                pattern,
                {
                    "weight": list(v.shape),
                    "weight_scale": list(scale.shape),
                    "scale_dtype": str(scale.dtype).removeprefix("torch."),
                },
            )
        elif not (k.endswith(".weight_scale") and k.removesuffix("_scale") in fp8):
            deq[k] = v
    res["fp8_layers"] = layers
    res["fp8_mismatches"] = compare(ref, deq)
    res["state_keys"] = len(got)
    keep = {k: v.contiguous() for k, v in got.items() if k in fp8 or k.removesuffix("_scale") in fp8}
    save_file(keep, str(Path(case["result_dir"], f"rank{rank}-fp8.safetensors")))


def run_launcher(plan_path: str) -> None:
    """Import vLLM once, then per case fork one child per TP rank (vLLM's own default worker start method).

    Per-rank interpreters would each import torch + vLLM (~30 s of CPU and disk each): TP 8 on 2 cores took 6.5
    minutes that way. Progress goes to the original stdout, one JSON line per finished case; vLLM's logs go to
    stderr, which the main process sends to a log file."""
    import multiprocessing as mp

    progress = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM logs to stdout; keep the progress channel clean
    t0 = time.perf_counter()
    _setup_vllm()
    # Everything the ranks import, imported before the fork so that the children share it.
    import safetensors.torch  # noqa: F401
    import vllm.engine.arg_utils  # noqa: F401
    import vllm.model_executor.model_loader  # noqa: F401
    from vllm.model_executor.models import ModelRegistry

    plan = json.loads(Path(plan_path).read_text())
    # The model modules of the architectures the checkpoints name, as vLLM's registry maps them (plamo2, plamo3).
    for arch in sorted({a for c in plan["cases"] for a in c["architectures"]}):
        with contextlib.suppress(Exception):  # an unknown architecture is vLLM's error, reported by the ranks
            importlib.import_module(ModelRegistry.models[arch].module_name)
    progress.write(json.dumps({"event": "ready", "import_s": round(time.perf_counter() - t0, 2)}) + "\n")
    ctx = mp.get_context("fork")
    for case in plan["cases"]:
        Path(case["result_dir"]).mkdir(parents=True, exist_ok=True)
        if case.get("fp8") and not Path(case["reference"], "config.json").exists():
            dequantized_copy(case["fp8"], case["reference"])
        case["port"] = _free_port()
        t0 = time.perf_counter()
        procs = [ctx.Process(target=rank_main, args=(case, r), name=f"rank{r}") for r in range(case["tp"])]
        for p in procs:
            p.start()
        deadline = time.monotonic() + plan["case_timeout"]
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
        timed_out = [p.name for p in procs if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()  # only the ranks this launcher forked, by their own pid
                p.join()
        event = {"event": "case", "id": case["id"], "wall_s": round(time.perf_counter() - t0, 2)}
        progress.write(json.dumps({**event, "timed_out": timed_out, "exitcodes": [p.exitcode for p in procs]}) + "\n")
    progress.write(json.dumps({"event": "done"}) + "\n")


# ----------------------------------------------------------------------------------------------------------------
# main: presets x TP through the project's CLI, the vLLM launcher, JSON + one line per case
# ----------------------------------------------------------------------------------------------------------------


def _cli(cli: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([cli, *args], capture_output=True, text=True, timeout=600)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _valid_tps(cli: str, src: Path, wanted: list[int]) -> tuple[list[int], dict[int, str]]:
    """TP sizes `inspect --json` allows; if inspect is unavailable every size is tried and convert decides."""
    r = _cli(cli, "inspect", str(src), "--json")
    try:
        rows = {row["tp"]: row for row in json.loads(r.stdout)["splits"]["tp"]}
    except (ValueError, KeyError, TypeError):
        return wanted, {}
    ok = [t for t in wanted if rows.get(t, {}).get("ok")]
    why = {t: "; ".join(rows[t]["reasons"]) if t in rows else "not listed by inspect" for t in wanted if t not in ok}
    return ok, why


def inject_scales(src: Path, dst: Path) -> int:
    """DEBUG (--inject-missing-scales): a copy of the shards with vLLM's attention scale buffers added."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    added = 0
    for f in sorted(dst.glob("model-rank-*-part-*.safetensors")):
        with safe_open(str(f), "pt") as st:
            meta = st.metadata()
            tensors = {k: st.get_tensor(k) for k in st.keys()}  # noqa: SIM118
        for k in list(tensors):
            if k.endswith(".mixer.qkv_proj.weight"):
                prefix = k.removesuffix("qkv_proj.weight") + "attn."
                for s in ATTN_SCALES:
                    tensors.setdefault(prefix + s, torch.tensor(1.0, dtype=torch.float32))
                    added += 1
        save_file(tensors, str(f), metadata=meta)
    return added


def _model_dtype(src: Path, dtype: str) -> str:
    """The dtype vLLM must run at to see our files' bytes: the converter's output dtype. Not vLLM's "auto", which
    turns a float32 checkpoint into bfloat16 (ShardedStateLoader would then cast our files silently)."""
    if dtype != "auto":
        return dtype
    cfg = json.loads((src / "config.json").read_text())
    return str(cfg.get("torch_dtype") or cfg.get("dtype") or "auto")


def prepare_case(a: argparse.Namespace, work: Path, preset: str, src: Path, tp: int) -> dict[str, Any]:
    """Convert with the project's CLI; the case dict is what the launcher needs (status set only if it failed)."""
    cfg = json.loads((src / "config.json").read_text())
    case: dict[str, Any] = {"preset": preset, "tp": tp, "pp": 1, "dtype": _model_dtype(src, a.dtype), "timings": {}}
    case["model_type"], case["architectures"] = cfg.get("model_type"), list(cfg.get("architectures") or [])
    case_id = f"{preset}-tp{tp}"
    if a.fp8:  # one export per checkpoint, loaded at every TP
        fp8 = src.with_name(src.name + "-fp8")
        t0 = time.perf_counter()
        if not (fp8 / "config.json").exists():
            r = _cli(a.plamo2_tools, "export", "fp8", str(src), str(fp8), "--no-verify")
            if r.returncode != 0:
                return {**case, "status": "fail", "error": f"export fp8 exit {r.returncode}: {r.stderr[-2000:]}"}
        case["timings"]["export_s"] = round(time.perf_counter() - t0, 2)
        return {
            **case,
            "mode": "fp8",
            "id": case_id,
            "hf": str(src),
            "fp8": str(fp8),
            "reference": str(fp8) + "-dequantized",
            "result_dir": str(work / "results" / case_id),
        }
    shards = work / f"{preset}-tp{tp}"
    t0 = time.perf_counter()
    r = _cli(a.plamo2_tools, "convert", str(src), str(shards), "--tp", str(tp), "--dtype", a.dtype)
    case["timings"]["convert_s"] = round(time.perf_counter() - t0, 2)
    if r.returncode == 2:  # the converter refuses a split it cannot do (inspect was unavailable)
        return {**case, "status": "skipped", "reason": (r.stderr.strip().splitlines() or ["refused"])[-1]}
    if r.returncode != 0:
        return {**case, "status": "fail", "error": f"convert exit {r.returncode}: {r.stderr.strip()[-2000:]}"}
    if a.inject_missing_scales:
        injected = shards.with_name(shards.name + "-injected")
        case["injected_scales"] = inject_scales(shards, injected)
        shards = injected
    return {**case, "id": case_id, "hf": str(src), "shards": str(shards), "result_dir": str(work / "results" / case_id)}


def collect(case: dict[str, Any], event: dict[str, Any] | None, log: Path) -> dict[str, Any]:
    """Read the ranks' results of a case the launcher ran (or did not) and judge it."""
    case["timings"]["ranks_wall_s"] = event["wall_s"] if event else None
    ranks = []
    for rank in range(case["tp"]):
        rf = Path(case["result_dir"], f"rank{rank}.json")
        if rf.exists():
            ranks.append(json.loads(rf.read_text()))
        elif event and f"rank{rank}" in event["timed_out"]:
            ranks.append({"rank": rank, "error": "timed out"})
        else:
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            ranks.append({"rank": rank, "error": "rank or launcher died without a result", "log_tail": tail})
    for k in ("id", "hf", "shards", "result_dir", "fp8", "reference"):
        case.pop(k, None)
    return {**case, "ranks": ranks, **_judge(ranks)}


def _judge(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """pass: our shards equal vLLM's HF-loaded state and load with sharded_state on every rank;
    pass-vllm-hf-bug: the same, against the fixed-input reference, and vLLM's own HF loader is wrong here."""
    problems = []
    exp_rounding: list[dict[str, Any]] = []
    for r in ranks:
        if "error" in r:
            problems.append(f"rank {r['rank']}: {r['error']}")
            continue
        if "fp8_load" in r:  # --fp8: vLLM's compressed-tensors load of our export against its plain load
            if not r["fp8_load"]["ok"]:
                problems.append(f"rank {r['rank']}: vLLM's FP8 load: {r['fp8_load']['error'][:300]}")
            keys = sorted({m["key"] for m in r.get("fp8_mismatches", [])})
            if keys:
                more = ", ..." if len(keys) > 3 else ""
                problems.append(f"rank {r['rank']}: {len(keys)} keys differ ({', '.join(keys[:3])}{more})")
            continue
        if not r["sharded_load"]["ok"]:
            problems.append(f"rank {r['rank']}: sharded_state load: {r['sharded_load']['error'][:300]}")
        mismatches = [m for m in r["file_mismatches"] + r.get("sharded_state_mismatches", []) if not _exp_rounding(m)]
        exp_rounding += [m for m in r["file_mismatches"] if _exp_rounding(m)]
        if mismatches:
            keys = sorted({m["key"] for m in mismatches})
            more = ", ..." if len(keys) > 3 else ""
            problems.append(f"rank {r['rank']}: {len(keys)} keys differ ({', '.join(keys[:3])}{more})")
    # vLLM's own HF-loader bugs, by the fix that avoids them: the evidence is vLLM's outcome without that fix (or,
    # with one fix only, its genuine outcome): an error, or bytes that differ from the fixed load.
    bugs: dict[str, list[str]] = {}
    for r in ranks:
        names = list(r.get("hf_fixes", {}))
        alone = {names[0]: r["hf_load"]} if len(names) == 1 else r.get("hf_without_fix", {})
        for name, o in alone.items():
            if not o["ok"] or o.get("wrong_keys"):
                bugs.setdefault(name, []).append(
                    f"rank {r['rank']}: {o.get('error') or 'loads wrong bytes into ' + ', '.join(o['wrong_keys'])}"
                )
        if "hf_load" in r and not r["hf_load"]["ok"] and not names:
            problems.append(f"rank {r['rank']}: vLLM's HF loader failed, no known vLLM bug: {r['hf_load']['error']}")
    status = "fail" if problems else ("pass-vllm-hf-bug" if bugs else "pass")
    out: dict[str, Any] = {"status": status, "problems": problems, "vllm_hf_loader_bugs": bugs}
    if exp_rounding and not problems:
        # PLaMo 2's A = -exp(A_log): vLLM's loader takes torch's float32 exp (not correctly rounded: 1 ulp off on
        # ~1% of inputs, and CUDA's differs from the CPU's), our converter a correctly rounded one (docs/convert.md).
        out["exp_rounding_only"] = {
            "keys": len({m["key"] for m in exp_rounding}),
            "elements": sum(m["elements"] for m in exp_rounding),
            "max_ulps": max(m["max_ulps"] for m in exp_rounding),
        }
        if status == "pass":
            out["status"] = "pass-exp-rounding"
    rounding = _offset_rounding_summary(ranks)
    if rounding is not None:
        out["offset_rounding_only"] = rounding
        # Every difference is vLLM-on-CPU's extra rounding of the offset; our bytes are what vLLM holds on CUDA.
        out["status"] = "pass-cuda-rounding"
    return out


def _exp_rounding(m: dict[str, Any]) -> bool:
    """A value difference of PLaMo 2's `A` (exp-made) of at most one unit in the last place."""
    return m.get("what") == "value" and m["key"].endswith(".mixer.A") and m.get("max_ulps", 2) <= 1


def _offset_rounding_summary(ranks: list[dict[str, Any]]) -> dict[str, Any] | None:
    """When every difference of a case is a norm weight whose vLLM value is `param + offset` in the parameter's dtype
    and ours the fp32 sum rounded once (_explain_offset_rounding): how many elements, by norm, how far apart. Still a
    failure (the bytes differ); this says what the difference is. None otherwise."""
    by_kind: dict[str, dict[str, Any]] = {}
    for r in ranks:
        if "error" in r or not r.get("sharded_load", {}).get("ok"):
            return None
        file_keys = set()
        for m in r["file_mismatches"]:
            o = m.get("offset_rounding")
            if not (o and o["vllm_equals_param_plus_offset"] and o["ours_equals_cuda_rule"]):
                return None
            file_keys.add(m["key"])
            kind = re.sub(r"layers\.layers\.\d+\.", "layers.layers.{i}.", m["key"])
            k = by_kind.setdefault(
                kind,
                {
                    "offset": o["offset"],
                    "keys": 0,
                    "elements": 0,
                    "of": 0,
                    "max_ulps": 0,
                    "max_abs_diff": 0.0,
                    "vllm_elements_not_exact": 0,
                    "ours_elements_not_exact": 0,
                },
            )
            k["keys"] += 1
            k["elements"] += m["elements"]
            k["of"] += m["of"]
            k["max_ulps"] = max(k["max_ulps"], m["max_ulps"])
            k["max_abs_diff"] = max(k["max_abs_diff"], m["max_abs_diff"])
            k["vllm_elements_not_exact"] += o["vllm_elements_not_exact"]
            k["ours_elements_not_exact"] += o["ours_elements_not_exact"]
        if not {m["key"] for m in r.get("sharded_state_mismatches", [])} <= file_keys:
            return None
    if not by_kind:
        return None
    total = {f: sum(k[f] for k in by_kind.values()) for f in ("keys", "elements", "of")}
    return {
        **total,
        "max_ulps": max(k["max_ulps"] for k in by_kind.values()),
        "max_abs_diff": max(k["max_abs_diff"] for k in by_kind.values()),
        "by_norm": dict(sorted(by_kind.items())),
    }


def required_extras(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The non-parameter entries of vLLM's rank state (what a sharded checkpoint needs beyond the weights)."""
    seen: dict[str, dict[str, Any]] = {}
    for c in cases:
        for r in c.get("ranks", []):
            for k, v in r.get("buffers", {}).items():
                pattern = re.sub(r"layers\.layers\.\d+\.", "layers.layers.{i}.", k)
                seen.setdefault(pattern, {"key": pattern, **v})
    return sorted(seen.values(), key=lambda d: d["key"])


def _line(c: dict[str, Any]) -> str:
    head = f"{c['preset']:<10} tp={c['tp']} pp=1 {c.get('dtype', ''):<8} {c['status'].upper():<16}"
    if c["status"] == "skipped":
        return f"{head} {c['reason']}"
    t = c.get("timings", {})
    made = (
        f"export {t.get('export_s') or 0:.1f}s" if c.get("mode") == "fp8" else f"convert {t.get('convert_s') or 0:.1f}s"
    )
    tail = f"{made}, vLLM ranks {t.get('ranks_wall_s') or 0:.1f}s"
    if "error" in c:
        return f"{head} {(c['error'].strip().splitlines() or ['?'])[-1][:300]} ({tail})"
    fp8 = "every FP8 weight times its scale (and every other key) bit-identical to vLLM's plain load of the export"
    ok = fp8 + " dequantized" if c.get("mode") == "fp8" else "all keys bit-identical, sharded_state loads"
    detail = "; ".join(c.get("problems", [])[:2]) or ok
    if o := c.get("offset_rounding_only"):
        detail = (
            f"only norm offsets rounded differently (vLLM on CPU: {c.get('dtype')} param + offset rounded to "
            f"{c.get('dtype')}; ours = vLLM on CUDA: param + fp32 offset, rounded once): "
            f"{o['elements']} elements in {o['keys']} keys over all ranks, at most {o['max_ulps']} ulp "
            f"({o['max_abs_diff']:g}); sharded_state loads: {all(r['sharded_load']['ok'] for r in c['ranks'])}"
        )
    for name, evidence in c.get("vllm_hf_loader_bugs", {}).items():
        detail += f" | vLLM bug {name} on {len(evidence)}/{c['tp']} ranks, e.g. {evidence[-1][:150]}"
    return f"{head} {detail} ({tail})"


def run_vllm(
    a: argparse.Namespace, work: Path, todo: list[dict[str, Any]], timings: dict[str, Any]
) -> Iterator[dict[str, Any]]:
    """Start the launcher in the vLLM venv (this interpreter), yield each case judged as it finishes."""
    plan = work / "plan.json"
    plan.write_text(json.dumps({"case_timeout": a.case_timeout, "cases": todo}, indent=1))
    log = work / "vllm.log"
    with open(log, "w") as logf:
        proc = subprocess.Popen(
            [sys.executable, __file__, "--launcher", str(plan)],
            stdout=subprocess.PIPE,
            stderr=logf,
            text=True,
            env={**os.environ, **WORKER_ENV},
            start_new_session=True,  # its own process group: a hang is ended with the ranks it forked, nothing else
        )
        budget = 300 + a.case_timeout * len(todo)
        timer = threading.Timer(budget, lambda: os.killpg(proc.pid, signal.SIGKILL))
        timer.start()
        pending = {c["id"]: c for c in todo}
        try:
            assert proc.stdout is not None
            for raw in proc.stdout:
                with contextlib.suppress(ValueError):
                    ev = json.loads(raw)
                    if ev.get("event") == "ready":
                        timings["vllm_import_s"] = ev["import_s"]
                    elif ev.get("event") == "case" and ev["id"] in pending:
                        yield collect(pending.pop(ev["id"]), ev, log)
            proc.wait()
        finally:
            timer.cancel()
    for c in pending.values():  # the launcher died (or was ended) before these ran
        yield collect(c, None, log)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plamo2-tools", default=os.environ.get("PLAMO2_TOOLS_CLI", "plamo2-tools"))
    ap.add_argument(
        "--presets",
        default=",".join(PLAMO2_PRESETS),
        help=f"comma-separated presets or family names ({', '.join(PRESET_GROUPS)}); known: {', '.join(PRESETS)}",
    )
    ap.add_argument("--tp", default=",".join(map(str, TPS)), help="comma-separated TP sizes to try (PP is 1)")
    ap.add_argument(
        "--dtype",
        default="auto",
        help="convert --dtype, and the dtype vLLM builds the model in (auto: the checkpoint's dtype)",
    )
    ap.add_argument(
        "--synth-dtype",
        help="synth --dtype: the HF checkpoint's own dtype (default: the preset's, float32 for the tiny presets)",
    )
    ap.add_argument("--out", type=Path, help="result JSON (default: WORK/vllm_compat.json)")
    ap.add_argument("--work", type=Path, help="work directory (default: a temporary one, removed unless --keep)")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--case-timeout", type=float, default=600.0, help="seconds for all ranks of one case")
    ap.add_argument(
        "--inject-missing-scales",
        action="store_true",
        help="DEBUG: load a copy of the shards with vLLM's four attention scale buffers added",
    )
    ap.add_argument(
        "--fp8",
        action="store_true",
        help="check `plamo2-tools export fp8` instead of shards: vLLM's compressed-tensors loader on the export, "
        "its FP8 weights times their scales against its plain loader on the dequantized export, at every TP",
    )
    ap.add_argument("--launcher", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.launcher:
        run_launcher(a.launcher)
        return 0
    a.presets = ",".join(p for name in a.presets.split(",") for p in PRESET_GROUPS.get(name, (name,)))

    work = a.work or Path(tempfile.mkdtemp(prefix="plamo2-vllm-compat-"))
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    cases: list[dict[str, Any]] = []
    timings: dict[str, Any] = {}
    try:
        tps = [int(t) for t in a.tp.split(",")]
        for preset in a.presets.split(","):
            src = work / (f"src-{preset}" + (f"-{a.synth_dtype}" if a.synth_dtype else ""))
            if not (src / "config.json").exists():
                dt = ("--dtype", a.synth_dtype) if a.synth_dtype else ()
                r = _cli(a.plamo2_tools, "synth", str(src), "--preset", preset, *dt)
                if r.returncode != 0:
                    cases.append({"preset": preset, "tp": None, "status": "fail", "error": r.stderr[-2000:]})
                    print(f"{preset:<10} synth failed: {r.stderr.strip()[-300:]}", flush=True)
                    continue
            _, why = _valid_tps(a.plamo2_tools, src, tps)
            for tp in tps:
                if tp in why:
                    c = {"preset": preset, "tp": tp, "pp": 1, "status": "skipped", "reason": why[tp]}
                else:
                    c = prepare_case(a, work, preset, src, tp)
                cases.append(c)
                if "status" in c:
                    print(_line(c), flush=True)
        timings["prepare_s"] = round(time.perf_counter() - t_start, 1)
        todo = [c for c in cases if "status" not in c]
        where = {c["id"]: i for i, c in enumerate(cases) if "status" not in c}
        for c in run_vllm(a, work, todo, timings) if todo else ():
            cases[where[f"{c['preset']}-tp{c['tp']}"]] = c
            print(_line(c), flush=True)
    finally:
        for c in cases:  # interrupted before the launcher judged it
            if "status" not in c:
                c.update(status="fail", error="not run (interrupted)")
        result = {
            "kind": KIND,
            "schema_version": VERSION,
            "vllm_version": _pkg_version("vllm"),
            "torch_version": _pkg_version("torch"),
            "python": platform.python_version(),
            "host": {"cpus": os.cpu_count(), "machine": platform.machine()},
            "options": {
                k: getattr(a, k) for k in ("presets", "tp", "dtype", "synth_dtype", "inject_missing_scales", "fp8")
            },
            "wall_s": round(time.perf_counter() - t_start, 1),
            "timings": timings,
            "summary": {s: sum(c["status"] == s for c in cases) for s in STATUSES},
            "vllm_required_extras": required_extras(cases),
            "cases": cases,
        }
        out = a.out or work / "vllm_compat.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"{json.dumps(result['summary'])} in {result['wall_s']} s -> {out}", flush=True)
        if not a.keep and a.work is None:
            shutil.rmtree(work, ignore_errors=True)
    return 1 if result["summary"]["fail"] else 0


def _pkg_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
