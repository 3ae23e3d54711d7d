"""vLLM 0.26.0's own Plamo3ForCausalLM on CPU against our float64 oracle (tests/model/plamo3_independent.py).

Run with the vLLM venv's interpreter (bench/vllm_compat.sh creates it; vLLM is not a project dependency):

    ~/.cache/plamo2-tools/vllm-0.26.0/bin/python bench/plamo3_vllm_forward.py [--out reports/vllm/plamo3_forward.json]

For each case the script writes a tiny random HF PLaMo 3 checkpoint itself (config.json + model.safetensors: both
layer types, a window shorter than the prompt, GQA, an odd vocabulary; one case with YaRN), then, in this process
(TP 1, one gloo rank):

1. builds vLLM's `Plamo3ForCausalLM` through vLLM's own `EngineArgs` -> `initialize_model` and loads the checkpoint
   with vLLM's default loader (`load_weights`);
2. compares the loaded state (`ShardedStateLoader._filter_subtensors(state_dict())`, what a sharded checkpoint must
   hold) bit for bit with the layout docs/plamo3.md section 5 derives from the HF tensors;
3. compares each attention layer's rotary `cos_sin_cache` (YaRN included) with the oracle's cos/sin tables;
4. runs one prefill of the prompt through vLLM's model forward and its `compute_logits`, and compares the logits with
   `independent_logits(config, weights, ids, "vllm")` and, to show the window convention matters, `"hf"`.

How vLLM runs on this CPU host (the PyPI wheel is the CUDA build; see docs/plamo3.md, "vLLM 0.26 on CPU, observed"):

* vLLM's `CpuPlatform` is forced, as bench/vllm_compat.py does; its attention backend CPU_ATTN needs
  `torch.ops._C.cpu_attention_with_kv_cache`, which only vLLM's CPU build ships (`vllm._C` is absent here), so
  `get_attn_backend_cls` is overridden to return vLLM's FLEX_ATTENTION backend (pure torch `flex_attention`,
  compiled by vLLM with `torch.compile` unless `--flex eager`). The attention math, masks and sliding window are
  vLLM's own code;
* `compilation_config.custom_ops = ["none"]`, so RMSNorm, SiluAndMul and the rotary embedding run vLLM's
  `forward_native` (the CPU `forward_cpu` paths need `_C` kernels); `_C::silu_and_mul` is registered only because
  `SiluAndMul.__init__` looks it up on CPU;
* FLEX's KV-cache write `torch.ops._C_cache_ops.reshape_and_cache_flash` (a CUDA kernel) is given a pure-torch
  equivalent: key/value of token i go to slot `slot_mapping[i]` (block slot // block_size, row slot % block_size);
* `vllm.utils.torch_utils.PIN_MEMORY` is forced False (it was computed before the platform was set);
* the attention metadata a model runner would build is built here by vLLM's `FlexAttentionMetadataBuilder` from a
  `CommonAttentionMetadata` for one request (block 0 is vLLM's null block, so the sequence uses blocks 1..n), and
  the forward runs inside vLLM's `set_forward_context`;
* `process_weights_after_loading` is vLLM's own (on this host it picks `torch.nn.functional.linear`).

This module imports no plamo2_tools code; the oracle file is imported by path.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import platform
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

# Run as a script, this file's folder is sys.path[0], where the benchmark suite's modules would shadow
# packages vLLM and transformers import by the same names (bench/kernels.py is not HF's `kernels`).
# Nothing here is imported from bench/.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

REPO = Path(__file__).resolve().parents[1]
ORACLE = REPO / "tests" / "model" / "plamo3_independent.py"
KIND = "plamo3-vllm-forward"
SCHEMA_VERSION = 1
ATTN_SCALES = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")
# fp32 vLLM against the float64 oracle; logits are O(10) here.
LOGIT_TOL = 2e-4
ROPE_TOL = 1e-5
# Below this the two window conventions would be indistinguishable and the check would prove nothing.
CONVENTION_MIN_GAP = 1e-2
WORKER_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
    # The ranks are forked after this process ran torch ops; a forked child of a process whose OpenMP pool exists
    # deadlocks in its first parallel region (seen: the ranks hung in torch.zeros). One thread: no pool.
    "OMP_NUM_THREADS": "1",
}

# A small PLaMo 3: 6 layers with pattern 3 (layers 2 and 5 full, the others sliding), window 5 < prompt 23,
# 4 query heads over 2 KV heads, head_dim 64, vocabulary 1009 (odd: vLLM pads it to 1024 rows, 1088 for an untied
# head). `form` is how config.json spells it; `flavor` is which remote-config behaviour the config class mimics.
BASE = {
    "architectures": ["Plamo3ForCausalLM"],
    "model_type": "plamo3",
    "hidden_size": 64,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 96,
    "vocab_size": 1009,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 64,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}
CASES: dict[str, dict[str, Any]] = {
    # PFN's older remote config (no rope_parameters property): transformers builds a flat rope_parameters from
    # rope_theta and vLLM takes plamo3.py's "Transformers v4" branch (sliding layers: rope_local_theta).
    "v4-tied": {
        "flavor": "rc-older",
        "config": {
            "window_size": 5,
            "sliding_window_pattern": 3,
            "rope_theta": 150000,
            "rope_local_theta": 10000,
            "tie_word_embeddings": True,
        },
    },
    # PFN's newest remote config (nested rope_parameters property), legacy spellings, untied head.
    "v4-legacy-untied": {
        "flavor": "rc-newest",
        "config": {
            "sliding_window": 5,
            "sliding_window_pattern": 3,
            "rope_global_theta": 50000,
            "rope_local_theta": 20000,
            "tie_word_embeddings": False,
        },
    },
    # transformers-v5 keys in config.json itself.
    "v5-tied": {
        "flavor": "v5",
        "config": {
            "sliding_window": 5,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 150000},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000},
            },
            "tie_word_embeddings": True,
        },
    },
    # YaRN on the full layers: factor 4 over an original context of 16 positions (vLLM: 64 cached positions).
    "yarn-tied": {
        "flavor": "rc-newest",
        "config": {
            "window_size": 5,
            "sliding_window_pattern": 3,
            "rope_theta": 150000,
            "rope_local_theta": 10000,
            "rope_scaling_factor": 4.0,
            "initial_context_length": 16,
            "tie_word_embeddings": True,
        },
    },
    # Not run by default: a vLLM trap, not a PLaMo 3 checkpoint. Every layer full (pattern 1) with the newest remote
    # config, whose `sliding_window` property is window_size: layer_types has one kind, so vLLM sets the model-wide
    # CacheConfig.sliding_window (engine/arg_utils.py) and Attention falls back to it for per_layer_sliding_window
    # None: vLLM windows every "full" layer. Passes when vLLM equals the oracle of the same model with every layer
    # sliding (`oracle_config`; one RoPE base so that only the masks differ).
    "all-full-rc-newest-trap": {
        "flavor": "rc-newest",
        "default": False,
        "config": {
            "window_size": 5,
            "sliding_window_pattern": 1,
            "rope_theta": 10000,
            "rope_local_theta": 10000,
            "tie_word_embeddings": True,
        },
        "oracle_config": {"sliding_window_pattern": 1000},
    },
}
DEFAULT_CASES = [name for name, case in CASES.items() if case.get("default", True)]
PROMPT_LEN = 23


def load_oracle() -> Any:
    spec = importlib.util.spec_from_file_location("plamo3_independent", ORACLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["plamo3_independent"] = module
    spec.loader.exec_module(module)
    return module


def prompt(vocab: int, n: int = PROMPT_LEN) -> list[int]:
    return [(7 * i * i + 3 * i + 11) % vocab for i in range(n)]


def random_checkpoint(config: dict[str, Any], seed: int) -> dict[str, Any]:
    """HF tensors of a random PLaMo 3 (norm weights small and random, so every offset matters)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    D, L, H, K = (
        config["hidden_size"],
        config["num_hidden_layers"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
    )
    d, F, V = config["head_dim"], config["intermediate_size"], config["vocab_size"]

    def rnd(*shape: int, scale: float = 1.0) -> Any:
        return torch.randn(*shape, generator=g) * scale

    w = {"model.embed_tokens.weight": rnd(V, D), "model.norm.weight": rnd(D, scale=0.1)}
    for i in range(L):
        p = f"model.layers.layers.{i}."
        w[p + "pre_mixer_norm.weight"] = rnd(D, scale=0.1)
        w[p + "mixer.qkv_proj.weight"] = rnd((H + 2 * K) * d, D, scale=D**-0.5)
        w[p + "mixer.q_norm.weight"] = rnd(d, scale=0.1)
        w[p + "mixer.k_norm.weight"] = rnd(d, scale=0.1)
        w[p + "mixer.o_proj.weight"] = rnd(D, H * d, scale=(H * d) ** -0.5)
        w[p + "post_mixer_norm.weight"] = rnd(D, scale=0.1)
        w[p + "pre_mlp_norm.weight"] = rnd(D, scale=0.1)
        w[p + "mlp.gate_up_proj.weight"] = rnd(2 * F, D, scale=D**-0.5)
        w[p + "mlp.down_proj.weight"] = rnd(D, F, scale=F**-0.5)
        w[p + "post_mlp_norm.weight"] = rnd(D, scale=0.1)
    if not config.get("tie_word_embeddings", True):
        w["lm_head.weight"] = rnd(V, D, scale=0.5)
    return w


def write_case(name: str, case: dict[str, Any], work: Path) -> tuple[dict[str, Any], dict[str, Any], Path]:
    """The case's config.json and model.safetensors under work/name (same seed, same tensors every time)."""
    from safetensors.torch import save_file

    raw = {**BASE, **case["config"]}
    model_dir = work / name
    model_dir.mkdir(parents=True, exist_ok=True)
    weights = random_checkpoint(raw, seed=sum(map(ord, name)))
    (model_dir / "config.json").write_text(json.dumps(raw, indent=1) + "\n")
    save_file({k: v.contiguous() for k, v in weights.items()}, str(model_dir / "model.safetensors"))
    return raw, weights, model_dir


# ----------------------------------------------------------------------------------------------------------------
# vLLM on this CPU host
# ----------------------------------------------------------------------------------------------------------------


def setup_vllm(flex: str, backend: str = "flex") -> dict[str, Any]:
    """Force CpuPlatform with vLLM's FLEX_ATTENTION backend (`backend="cpu_attn"` keeps CpuPlatform's own choice,
    to record how that fails here) and give the two CUDA-only kernels a torch body.
    Returns what was probed and replaced (recorded in the report)."""
    import torch
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    class CpuFlexPlatform(CpuPlatform):
        @classmethod
        def get_attn_backend_cls(cls, selected_backend: Any, attn_selector_config: Any, num_heads: Any = None) -> str:
            return AttentionBackendEnum.FLEX_ATTENTION.get_path()

    vllm.platforms._current_platform = CpuFlexPlatform() if backend == "flex" else CpuPlatform()
    import vllm.utils.torch_utils as torch_utils

    pin_memory_was = bool(torch_utils.PIN_MEMORY)
    torch_utils.PIN_MEMORY = False

    probe: dict[str, Any] = {"pin_memory_was": pin_memory_was}
    try:
        import vllm._C  # noqa: F401

        probe["vllm._C"] = "importable"
    except ImportError as e:
        probe["vllm._C"] = f"{type(e).__name__}: {e}"
    probe["cpu_attn_ops"] = {
        op: hasattr(torch.ops._C, op)
        for op in ("cpu_attention_with_kv_cache", "cpu_attn_reshape_and_cache", "get_scheduler_metadata")
    }

    shims = []
    if not hasattr(torch.ops._C, "silu_and_mul"):

        @torch.library.custom_op("_C::silu_and_mul", mutates_args=("out",), schema="(Tensor(a!) out, Tensor x) -> ()")
        def _silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
            half = x.shape[-1] // 2
            out.copy_(torch.nn.functional.silu(x[..., :half]) * x[..., half:])

        shims.append("_C::silu_and_mul (looked up by SiluAndMul.__init__; forward_native is what runs)")

    if not hasattr(torch.ops, "_C_cache_ops") or not hasattr(torch.ops._C_cache_ops, "reshape_and_cache_flash"):

        @torch.library.custom_op(
            "_C_cache_ops::reshape_and_cache_flash",
            mutates_args=("key_cache", "value_cache"),
            schema="(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping, "
            "str kv_cache_dtype, Tensor k_scale, Tensor v_scale) -> ()",
        )
        def _reshape_and_cache_flash(
            key: torch.Tensor,
            value: torch.Tensor,
            key_cache: torch.Tensor,
            value_cache: torch.Tensor,
            slot_mapping: torch.Tensor,
            kv_cache_dtype: str,
            k_scale: torch.Tensor,
            v_scale: torch.Tensor,
        ) -> None:
            assert kv_cache_dtype == "auto", kv_cache_dtype
            block = key_cache.shape[1]  # key_cache: (num_blocks, block_size, kv_heads, head_dim)
            for i, slot in enumerate(slot_mapping.tolist()):
                if slot >= 0:
                    key_cache[slot // block, slot % block] = key[i]
                    value_cache[slot // block, slot % block] = value[i]

        shims.append("_C_cache_ops::reshape_and_cache_flash (KV-cache write; pure torch, slot -> block, row)")

    if flex == "eager":
        import vllm.v1.attention.backends.flex_attention as flex_attention

        flex_attention.flex_attention_compiled = flex_attention.flex_attention
        shims.append("flex_attention_compiled = eager torch flex_attention (--flex eager)")
    return {"probe": probe, "shims": shims}


def register_config(flavor: str) -> None:
    """Register a transformers config class for model_type plamo3 that behaves like the named remote config."""
    from transformers import AutoConfig, PretrainedConfig

    class Plamo3ConfigBase(PretrainedConfig):
        model_type = "plamo3"

        def __init__(
            self,
            hidden_size: int = 4096,
            num_hidden_layers: int = 32,
            rms_norm_eps: float = 1e-6,
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
            **kwargs: Any,
        ) -> None:
            self.hidden_size = hidden_size
            self.num_hidden_layers = num_hidden_layers
            self.rms_norm_eps = rms_norm_eps
            self.num_attention_heads = num_attention_heads
            self.num_key_value_heads = num_key_value_heads
            self.head_dim = head_dim
            self.max_position_embeddings = max_position_embeddings
            self.window_size = window_size
            self.sliding_window_pattern = sliding_window_pattern
            self.rope_theta = rope_theta
            self.rope_local_theta = rope_local_theta
            self.rope_scaling_factor = rope_scaling_factor
            self.initial_context_length = initial_context_length
            self.intermediate_size = intermediate_size
            self.vocab_size = vocab_size
            super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

        def _windows(self) -> list[int | None]:
            n, p = self.num_hidden_layers, self.sliding_window_pattern
            return [None if (i + 1) % p == 0 else self.window_size for i in range(n)]

    class Plamo3ConfigOlder(Plamo3ConfigBase):
        """Like the remote config in sgl-project/sglang's configs/plamo3.py: interleaved_sliding_window is a real
        attribute, no rope_parameters of its own (transformers standardises rope_theta into a flat dict)."""

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.interleaved_sliding_window = self._windows()

        @property
        def layer_types(self) -> list[str]:
            return ["full_attention" if w is None else "sliding_attention" for w in self.interleaved_sliding_window]

    class Plamo3ConfigNewest(Plamo3ConfigBase):
        """Like PFN's newest remote config: legacy rope_global_theta / sliding_window accepted, and a read-only
        rope_parameters keyed by layer type (its setter ignores what transformers writes)."""

        def __init__(self, **kwargs: Any) -> None:
            legacy_theta = kwargs.pop("rope_global_theta", None)
            if legacy_theta is not None and kwargs.get("rope_theta", 150_000) == 150_000:
                kwargs["rope_theta"] = legacy_theta
            legacy_window = kwargs.pop("sliding_window", None)
            if isinstance(legacy_window, int):
                kwargs["window_size"] = legacy_window
            elif isinstance(legacy_window, list):
                sizes = {w for w in legacy_window if w is not None}
                if len(sizes) == 1:
                    kwargs["window_size"] = sizes.pop()
            super().__init__(**kwargs)

        @property
        def sliding_window(self) -> int:
            return self.window_size

        @property
        def interleaved_sliding_window(self) -> list[int | None]:
            return self._windows()

        @property
        def layer_types(self) -> list[str]:
            return ["full_attention" if w is None else "sliding_attention" for w in self._windows()]

        @property
        def rope_parameters(self) -> dict[str, Any]:
            full: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
            if self.rope_scaling_factor != 1:
                full = {
                    "rope_type": "yarn",
                    "rope_theta": self.rope_theta,
                    "factor": self.rope_scaling_factor,
                    "original_max_position_embeddings": self.initial_context_length,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                    "truncate": False,
                }
            every = {
                "full_attention": full,
                "sliding_attention": {"rope_type": "default", "rope_theta": self.rope_local_theta},
            }
            return {t: every[t] for t in set(self.layer_types)}

        @rope_parameters.setter
        def rope_parameters(self, value: Any) -> None:
            pass

    class Plamo3ConfigV5(PretrainedConfig):
        """config.json already in transformers-v5 form: layer_types, sliding_window, nested rope_parameters."""

        model_type = "plamo3"

        def __init__(self, layer_types: list[str] | None = None, sliding_window: int = 128, **kwargs: Any) -> None:
            rope_parameters = kwargs.pop("rope_parameters", None)
            self.layer_types = list(layer_types or [])
            self.sliding_window = sliding_window
            self.interleaved_sliding_window = [
                None if t == "full_attention" else sliding_window for t in self.layer_types
            ]
            for k in (
                "hidden_size",
                "num_hidden_layers",
                "rms_norm_eps",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "max_position_embeddings",
                "intermediate_size",
                "vocab_size",
            ):
                setattr(self, k, kwargs.pop(k))
            super().__init__(**kwargs)
            self.rope_parameters = rope_parameters

    cls = {"rc-older": Plamo3ConfigOlder, "rc-newest": Plamo3ConfigNewest, "v5": Plamo3ConfigV5}[flavor]
    AutoConfig.register("plamo3", cls, exist_ok=True)


def engine_config(model_dir: str, max_model_len: int, tp: int = 1, pp: int = 1) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=model_dir,
        skip_tokenizer_init=True,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        dtype="float32",
        max_model_len=max_model_len,
        enforce_eager=True,
        compilation_config={"custom_ops": ["none"]},
    ).create_engine_config()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(vc: Any, tp: int = 1, pp: int = 1, rank: int = 0, port: int | None = None) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel

    with set_current_vllm_config(vc):
        init_distributed_environment(
            world_size=tp * pp,
            rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{port or free_port()}",
            local_rank=rank,
            backend="gloo",
        )
        initialize_model_parallel(tp, pp)


def expected_state(config: dict[str, Any], w: dict[str, Any]) -> dict[str, Any]:
    """vLLM 0.26's TP-1 state for these HF tensors, as docs/plamo3.md section 5 derives it from vLLM's code."""
    import torch

    V = config["vocab_size"]
    pad64 = -(-V // 64) * 64
    round16 = -(-V // 16) * 16
    lm_rows = -(-(pad64 + round16 - V) // 64) * 64  # ParallelLMHead(round16(V), org_num_embeddings=V)
    f32 = torch.float32

    def rows(t: Any, n: int) -> Any:
        out = torch.zeros(n, t.shape[1], dtype=f32)
        out[: t.shape[0]] = t.to(f32)
        return out

    offsets = {
        "pre_mixer_norm": 1.0,
        "post_mixer_norm": 1.0 / 5,
        "pre_mlp_norm": 1.0,
        "post_mlp_norm": 1.0 / (5**1.5),
        "mixer.q_norm": 1.0,
        "mixer.k_norm": 1.0,
    }
    out: dict[str, Any] = {}
    for name, t in w.items():
        if name == "model.embed_tokens.weight":
            # tied: the one storage is saved as lm_head.weight (the smaller key among the aliases)
            key = "lm_head.weight" if config.get("tie_word_embeddings", True) else name
            out[key] = rows(t, pad64)
        elif name == "lm_head.weight":
            if not config.get("tie_word_embeddings", True):
                out[name] = rows(t, lm_rows)
        elif name == "model.norm.weight":
            out[name] = t.to(f32) + 1.0
        else:
            stem = name.removeprefix("model.layers.layers.").split(".", 1)[1].removesuffix(".weight")
            out[name] = t.to(f32) + offsets[stem] if stem in offsets else t.to(f32)
            if stem == "mixer.qkv_proj":
                prefix = name.removesuffix("qkv_proj.weight") + "attn."
                for s in ATTN_SCALES:
                    out[prefix + s] = torch.tensor(1.0, dtype=f32)
    return out


def pp_layers(layers: int, pp: int, pp_rank: int) -> range:
    """Stage pp_rank's layers: layers // pp each, the remainder one each to the stages just before the last."""
    parts = [layers // pp] * pp
    for i in range(2, layers % pp + 2):
        parts[-i] += 1
    start = sum(parts[:pp_rank])
    return range(start, start + parts[pp_rank])


def expected_rank_state(config: dict[str, Any], w: dict[str, Any], tp: int, tp_rank: int, pp: int, pp_rank: int):
    """What one (tp_rank, pp_rank) of vLLM 0.26 holds, by docs/plamo3.md section 5 (the per-rank rules)."""
    import torch

    H, K, d, F, V = (
        config[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size")
    )
    tied = config.get("tie_word_embeddings", True)
    full = expected_state(config, w)  # TP 1: offsets, padding rows, scales
    pad64 = -(-V // 64) * 64
    round16 = -(-V // 16) * 16
    head_rows = -(-(pad64 + round16 - V) // 64) * 64
    hq, f = H // tp, F // tp
    replicas, nkv = max(1, tp // K), max(1, K // tp)
    kr = tp_rank // replicas

    def vocab_rows(t: Any, total: int) -> Any:  # the rank's original rows, then zeros
        per, per_org = total // tp, pad64 // tp
        out = torch.zeros(per, t.shape[1], dtype=t.dtype)
        lo, hi = min(tp_rank * per_org, V), min((tp_rank + 1) * per_org, V)
        out[: hi - lo] = t[lo:hi]
        return out

    out: dict[str, Any] = {}
    layers = pp_layers(config["num_hidden_layers"], pp, pp_rank)
    for name, t in full.items():
        if name in ("lm_head.weight", "model.embed_tokens.weight"):
            out[name] = vocab_rows(t, head_rows if (name == "lm_head.weight" and not tied) else pad64)
            continue
        if name == "model.norm.weight":
            out[name] = t
            continue
        i = int(name.split(".")[3])
        if i not in layers:
            continue
        if name.endswith("qkv_proj.weight"):
            q, k, v = t[: H * d], t[H * d : (H + K) * d], t[(H + K) * d :]
            rows = lambda x, r, n: x[r * n * d : (r + 1) * n * d]  # noqa: E731
            out[name] = torch.cat((rows(q, tp_rank, hq), rows(k, kr, nkv), rows(v, kr, nkv)))
        elif name.endswith("o_proj.weight"):
            out[name] = t[:, tp_rank * hq * d : (tp_rank + 1) * hq * d].contiguous()
        elif name.endswith("gate_up_proj.weight"):
            out[name] = torch.cat((t[tp_rank * f : (tp_rank + 1) * f], t[F + tp_rank * f : F + (tp_rank + 1) * f]))
        elif name.endswith("down_proj.weight"):
            out[name] = t[:, tp_rank * f : (tp_rank + 1) * f].contiguous()
        else:  # norms (q/k norm included: one [head_dim] vector, replicated) and the attention scales
            out[name] = t
    return out


def rank_worker(
    model_dir: str, flavor: str, tp: int, pp: int, rank: int, port: int, result: str, timeout: float
) -> None:
    """One forked rank: build vLLM's model at (tp, pp), load the HF checkpoint, write its state comparison."""
    res: dict[str, Any] = {"rank": rank}
    import faulthandler

    faulthandler.dump_traceback_later(max(1.0, timeout - 5), exit=False)  # where a hung rank hangs, before its kill
    try:
        import torch
        from safetensors.torch import load_file
        from vllm.config import set_current_vllm_config
        from vllm.distributed import get_tensor_model_parallel_rank
        from vllm.distributed.parallel_state import get_pp_group
        from vllm.model_executor.model_loader import get_model_loader
        from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader
        from vllm.model_executor.model_loader.utils import initialize_model
        from vllm.utils.torch_utils import set_default_torch_dtype

        register_config(flavor)
        raw = json.loads((Path(model_dir) / "config.json").read_text())
        vc = engine_config(model_dir, raw["max_position_embeddings"], tp, pp)
        init_distributed(vc, tp, pp, rank, port)
        with set_current_vllm_config(vc), set_default_torch_dtype(torch.float32), torch.device("cpu"):
            model = initialize_model(vllm_config=vc, model_config=vc.model_config)
            get_model_loader(vc.load_config).load_weights(model, vc.model_config)
            state = ShardedStateLoader._filter_subtensors(model.state_dict())
        tp_rank, pp_rank = get_tensor_model_parallel_rank(), get_pp_group().rank_in_group
        weights = load_file(str(Path(model_dir) / "model.safetensors"))
        ref = expected_rank_state(raw, weights, tp, tp_rank, pp, pp_rank)
        layers = sorted({int(k.split(".")[3]) for k in state if k.startswith("model.layers.layers.")})
        # Parameters under every name, aliases included (the filtered state keeps one name per storage).
        names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
        first = f"model.layers.layers.{layers[0]}." if layers else None
        res.update(
            tp_rank=tp_rank,
            pp_rank=pp_rank,
            keys=len(state),
            layers=layers,
            has_embed_norm_head=[
                any(n.startswith(p) for n in names) for p in ("model.embed_tokens.", "model.norm.", "lm_head.")
            ],
            shapes={
                k: list(v.shape)
                for k, v in state.items()
                if not k.startswith("model.layers.") or k.startswith(str(first))
            },
            mismatches=compare_state(ref, state),
        )
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()[-3000:]
    Path(result).write_text(json.dumps(res) + "\n")


def run_parallel_state(work: Path, names: list[str], layouts: list[tuple[int, int]], timeout: float) -> list[dict]:
    """Fork tp*pp ranks per (case, layout); each compares its vLLM state with expected_rank_state."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    out = []
    for name in names:
        _, _, model_dir = write_case(name, CASES[name], work)
        for tp, pp in layouts:
            port, t0 = free_port(), time.perf_counter()
            results = [work / f"{name}-tp{tp}-pp{pp}-rank{r}.json" for r in range(tp * pp)]
            args = [
                (str(model_dir), CASES[name]["flavor"], tp, pp, r, port, str(results[r]), timeout)
                for r in range(tp * pp)
            ]
            procs = [ctx.Process(target=rank_worker, args=a) for a in args]
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout
            for p in procs:
                p.join(max(0.1, deadline - time.monotonic()))
            for p in procs:
                if p.is_alive():
                    p.kill()  # only the ranks forked here, by their own pid
                    p.join()
            ranks = [
                json.loads(f.read_text()) if f.exists() else {"error": "no result (died or timed out)"} for f in results
            ]
            bad = [r for r in ranks if "error" in r or r["mismatches"] or not all(r["has_embed_norm_head"])]
            out.append(
                {
                    "case": name,
                    "tp": tp,
                    "pp": pp,
                    "status": "fail" if bad else "pass",
                    "wall_s": round(time.perf_counter() - t0, 1),
                    "ranks": ranks,
                }
            )
            r0 = ranks[0]
            why = "; " + (r0.get("error") or str(r0.get("mismatches"))[:300]) if bad else ""
            status = out[-1]["status"].upper()
            print(
                f"state {name:<17} tp={tp} pp={pp} {status:<5} layers per rank {[r.get('layers') for r in ranks]}{why}"
            )
    return out


def compare_state(ref: dict[str, Any], got: dict[str, Any]) -> list[dict[str, Any]]:
    import torch

    diffs: list[dict[str, Any]] = []
    for k in sorted(ref.keys() - got.keys()):
        diffs.append({"key": k, "what": "missing"})
    for k in sorted(got.keys() - ref.keys()):
        diffs.append({"key": k, "what": "unexpected", "shape": list(got[k].shape), "dtype": str(got[k].dtype)})
    for k in sorted(ref.keys() & got.keys()):
        a, b = ref[k], got[k]
        if a.dtype != b.dtype or a.shape != b.shape:
            diffs.append(
                {
                    "key": k,
                    "what": "dtype/shape",
                    "expected": [str(a.dtype), list(a.shape)],
                    "got": [str(b.dtype), list(b.shape)],
                }
            )
        elif not torch.equal(a, b):
            diffs.append({"key": k, "what": "value", "max_abs_diff": float((a.double() - b.double()).abs().max())})
    return diffs


def prefill(model: Any, vc: Any, ids: list[int]) -> Any:
    """One request, prefill from position 0: vLLM's metadata builder, KV caches in vLLM's layout, its forward
    context."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.attention.backend import CommonAttentionMetadata

    steps = len(ids)
    metadata, slots = {}, {}
    for layer in (m for m in model.modules() if isinstance(m, Attention)):
        spec = layer.get_kv_cache_spec(vc)
        block = spec.block_size
        blocks = -(-steps // block) + 1  # block 0 is vLLM's null block (physical_to_logical_mapping resets it)
        vc.cache_config.num_gpu_blocks = blocks
        backend = layer.attn_backend
        shape = backend.get_kv_cache_shape(blocks, block, layer.num_kv_heads, layer.head_size)
        try:
            order = backend.get_kv_cache_stride_order()
        except NotImplementedError:  # as vLLM's runner: no preference means the logical layout
            order = tuple(range(len(shape)))
        physical = torch.zeros(tuple(shape[i] for i in order), dtype=torch.float32)
        layer.kv_cache = physical.permute(*[order.index(i) for i in range(len(order))])
        start = torch.tensor([0, steps], dtype=torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=start,
            query_start_loc_cpu=start.clone(),
            seq_lens=torch.tensor([steps], dtype=torch.int32),
            num_reqs=1,
            num_actual_tokens=steps,
            max_query_len=steps,
            max_seq_len=steps,
            block_table_tensor=torch.arange(1, blocks, dtype=torch.int32)[None],
            slot_mapping=torch.arange(steps, dtype=torch.int64) + block,
            causal=True,
        )
        builder = backend.get_builder_cls()(spec, [layer.layer_name], vc, torch.device("cpu"))
        metadata[layer.layer_name] = builder.build(0, common)
        slots[layer.layer_name] = common.slot_mapping
    with (
        set_current_vllm_config(vc),
        torch.inference_mode(),
        set_forward_context(metadata, vc, num_tokens=steps, slot_mapping=slots),
    ):
        hidden = model(torch.tensor(ids), torch.arange(steps))
        return model.compute_logits(hidden)


def rope_report(model: Any, vc: Any, oracle: Any, raw: dict[str, Any]) -> dict[str, Any]:
    """Each layer's rotary table against the oracle's; records what vLLM built."""
    import torch

    hf = vc.model_config.hf_config
    spec = oracle.read_config(raw)
    layers = []
    worst = 0.0
    for i, layer in enumerate(model.model.layers.layers):
        rot = layer.mixer.rotary_emb
        kind = hf.layer_types[i]  # what vLLM built the layer as
        rope = spec.rope[spec.layer_types[i]]  # the oracle's table for the layer (the same type, bar the trap case)
        cache = rot.cos_sin_cache.double()
        n, d = cache.shape
        cos, sin = oracle.cos_sin(rope, d, list(range(n)))
        diff = float(torch.cat(((cache[:, : d // 2] - cos).abs(), (cache[:, d // 2 :] - sin).abs())).max())
        worst = max(worst, diff)
        params = hf.rope_parameters
        branch = "v5 (rope_parameters[layer_type])" if kind in params else "v4 (flat rope_parameters; local theta)"
        controls = {}
        if rope.yarn:  # how far plausible mistakes land from vLLM's table: the check must see each of them
            variants = {
                "truncate_true": dataclasses.replace(rope, truncate=not rope.truncate),
                "no_mscale": dataclasses.replace(rope, apply_yarn_scaling=False),
                "plain_rope": dataclasses.replace(rope, yarn=False),
            }
            for label, variant in variants.items():
                c, s = oracle.cos_sin(variant, d, list(range(n)))
                controls[label] = float(
                    torch.cat(((cache[:, : d // 2] - c).abs(), (cache[:, d // 2 :] - s).abs())).max()
                )
        layers.append(
            {
                "layer": i,
                "type": kind,
                "plamo3_py_branch": branch,
                "class": type(rot).__name__,
                "base": float(rot.base),
                "neox": bool(rot.is_neox_style),
                "rotary_dim": int(rot.rotary_dim),
                "cache_rows": n,
                "mscale": float(getattr(rot, "mscale", 1.0)),
                "max_abs_diff_vs_oracle": diff,
                **({"oracle_variant_diffs": controls} if controls else {}),
            }
        )
    return {"max_abs_diff": worst, "layers": layers}


def compare_logits(got: Any, ref_vllm: Any, ref_hf: Any, window: int) -> dict[str, Any]:
    g = got.double()
    per_pos_v = (g - ref_vllm).abs().amax(-1)
    per_pos_h = (g - ref_hf).abs().amax(-1)
    gap = (ref_vllm - ref_hf).abs().amax(-1)
    return {
        "max_abs_diff_vs_oracle_vllm": float(per_pos_v.max()),
        "max_rel_diff_vs_oracle_vllm": float(per_pos_v.max() / ref_vllm.abs().max()),
        "argmax_equal_vs_oracle_vllm": bool((g.argmax(-1) == ref_vllm.argmax(-1)).all()),
        "per_position_max_abs_diff_vs_oracle_vllm": [float(x) for x in per_pos_v],
        "max_abs_diff_vs_oracle_hf_before_window": float(per_pos_h[:window].max()),
        "max_abs_diff_vs_oracle_hf_from_window": float(per_pos_h[window:].max()),
        "oracle_vllm_vs_hf_before_window": float(gap[:window].max()),
        "oracle_vllm_vs_hf_from_window": float(gap[window:].max()),
        "logit_abs_max": float(ref_vllm.abs().max()),
    }


def run_case(name: str, case: dict[str, Any], work: Path, oracle: Any, first: bool) -> dict[str, Any]:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    raw, weights, model_dir = write_case(name, case, work)
    out: dict[str, Any] = {"case": name, "flavor": case["flavor"], "config": raw, "timings": {}}
    ids = prompt(raw["vocab_size"])
    oracle_raw = {**raw, **case.get("oracle_config", {})}
    spec = oracle.read_config(oracle_raw)
    if "oracle_config" in case:
        out["oracle_config"] = case["oracle_config"]
    out["prompt_len"] = len(ids)
    out["window"] = spec.window
    out["layer_types"] = list(spec.layer_types)

    register_config(case["flavor"])
    t0 = time.perf_counter()
    vc = engine_config(str(model_dir), raw["max_position_embeddings"])
    if first:
        init_distributed(vc)
    hf = vc.model_config.hf_config
    out["vllm_saw"] = {
        "config_class": type(hf).__name__,
        "layer_types": list(hf.layer_types),
        "interleaved_sliding_window": list(hf.interleaved_sliding_window),
        "rope_parameters": json.loads(json.dumps(hf.rope_parameters, default=str)),
        "max_model_len": vc.model_config.max_model_len,
    }
    with set_current_vllm_config(vc), set_default_torch_dtype(torch.float32), torch.device("cpu"):
        model = initialize_model(vllm_config=vc, model_config=vc.model_config)
        get_model_loader(vc.load_config).load_weights(model, vc.model_config)
        state = {k: v.detach().clone() for k, v in ShardedStateLoader._filter_subtensors(model.state_dict()).items()}
        process_weights_after_loading(model, vc.model_config, torch.device("cpu"))
    out["timings"]["build_load_s"] = round(time.perf_counter() - t0, 2)
    out["attention_impl"] = sorted({type(m.mixer.attn.impl).__name__ for m in model.model.layers.layers})
    out["sliding_window_per_layer"] = [m.mixer.attn.impl.sliding_window for m in model.model.layers.layers]

    diffs = compare_state(expected_state(raw, weights), state)
    out["state"] = {"keys": len(state), "mismatches": diffs}
    out["rope"] = rope_report(model, vc, oracle, oracle_raw)

    t0 = time.perf_counter()
    logits = prefill(model, vc, ids)
    out["timings"]["vllm_forward_s"] = round(time.perf_counter() - t0, 2)
    out["vllm_logits_shape"] = list(logits.shape)
    t0 = time.perf_counter()
    ref_vllm = oracle.independent_logits(oracle_raw, weights, ids, "vllm")
    ref_hf = oracle.independent_logits(oracle_raw, weights, ids, "hf")
    out["timings"]["oracle_s"] = round(time.perf_counter() - t0, 2)
    out["logits"] = compare_logits(logits, ref_vllm, ref_hf, spec.window)

    lg = out["logits"]
    problems = []
    if diffs:
        problems.append(f"{len(diffs)} state keys differ from the derived layout")
    if out["rope"]["max_abs_diff"] > ROPE_TOL:
        problems.append(f"rotary table differs by {out['rope']['max_abs_diff']:.3g}")
    if list(logits.shape) != [len(ids), raw["vocab_size"]]:
        problems.append(f"logits shape {list(logits.shape)}")
    if lg["max_abs_diff_vs_oracle_vllm"] > LOGIT_TOL:
        problems.append(f"logits differ from the oracle (W keys) by {lg['max_abs_diff_vs_oracle_vllm']:.3g}")
    if lg["oracle_vllm_vs_hf_from_window"] < CONVENTION_MIN_GAP:
        problems.append("the two window conventions do not differ: the case cannot tell them apart")
    out["status"] = "fail" if problems else "pass"
    out["problems"] = problems
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "reports" / "vllm" / "plamo3_forward.json")
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES), help="comma-separated, from: " + ", ".join(CASES))
    ap.add_argument(
        "--flex",
        choices=("compiled", "eager"),
        default="compiled",
        help="vLLM's torch.compile'd flex_attention (its own code path) or eager flex_attention (faster)",
    )
    ap.add_argument(
        "--backend",
        choices=("flex", "cpu_attn"),
        default="flex",
        help="cpu_attn: leave CpuPlatform's CPU_ATTN in place (needs vLLM's CPU build; fails on the CUDA wheel)",
    )
    ap.add_argument("--work", type=Path, help="where the checkpoints go (default: a temporary directory)")
    ap.add_argument(
        "--parallel",
        default="2x1,4x1,1x2,1x4,2x2",
        help="TPxPP layouts whose per-rank loaded state is checked (forked gloo ranks); '' for none",
    )
    ap.add_argument("--parallel-cases", default="v4-tied,v4-legacy-untied")
    ap.add_argument("--rank-timeout", type=float, default=300.0)
    a = ap.parse_args(argv)
    os.environ.update(WORKER_ENV)
    t_start = time.perf_counter()

    import torch
    import transformers
    import vllm

    oracle = load_oracle()
    setup = setup_vllm(a.flex, a.backend)
    results: list[dict[str, Any]] = []
    parallel: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        work = a.work or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="plamo3-vllm-")))
        # Forked ranks first: this process must not have a process group yet when it forks.
        layouts = [tuple(int(x) for x in lay.split("x")) for lay in a.parallel.split(",") if lay]
        if layouts:
            parallel = run_parallel_state(work, a.parallel_cases.split(","), layouts, a.rank_timeout)  # type: ignore[arg-type]
        for n, name in enumerate(a.cases.split(",")):
            try:
                r = run_case(name, CASES[name], work, oracle, first=n == 0)
            except Exception as e:  # a vLLM refusal is a result, not a crash of the harness
                r = {
                    "case": name,
                    "status": "fail",
                    "problems": [f"{type(e).__name__}: {e}"],
                    "traceback": traceback.format_exc()[-4000:],
                }
            results.append(r)
            lg = r.get("logits", {})
            print(
                f"{name:<17} {r['status'].upper():<5} logits max|diff| vs oracle(W keys) "
                f"{lg.get('max_abs_diff_vs_oracle_vllm', math.nan):.3g}, vs oracle(W+1 keys) from position W "
                f"{lg.get('max_abs_diff_vs_oracle_hf_from_window', math.nan):.3g}; rope "
                f"{r.get('rope', {}).get('max_abs_diff', math.nan):.3g}; state mismatches "
                f"{len(r.get('state', {}).get('mismatches', [])) if 'state' in r else '-'} "
                f"{'; '.join(r['problems'])}",
                flush=True,
            )
    report = {
        "kind": KIND,
        "schema_version": SCHEMA_VERSION,
        "command": " ".join([Path(sys.executable).name, "bench/plamo3_vllm_forward.py", *(argv or sys.argv[1:])]),
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python": platform.python_version(),
        "host": {"cpus": os.cpu_count(), "machine": platform.machine()},
        "flex": a.flex,
        "backend": a.backend,
        "tolerances": {"logits_abs": LOGIT_TOL, "rope_abs": ROPE_TOL, "convention_min_gap": CONVENTION_MIN_GAP},
        "setup": setup,
        "wall_s": round(time.perf_counter() - t_start, 1),
        "summary": {s: sum(r["status"] == s for r in results + parallel) for s in ("pass", "fail")},
        "cases": results,
        "parallel_state": parallel,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{json.dumps(report['summary'])} in {report['wall_s']} s -> {a.out}", flush=True)
    return 1 if report["summary"]["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
