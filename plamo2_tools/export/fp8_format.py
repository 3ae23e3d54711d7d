"""The compressed-tensors FP8_DYNAMIC format, written once: the `quantization_config` llm-compressor writes and the
per-channel quantization and dequantization compressed-tensors computes, in numpy with torch's rounding
(export/fp8.py says where each fact comes from; tests/export/test_fp8_compressed_tensors.py holds them to
compressed-tensors' own code, bit for bit)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from .. import numerics
from ..dtypes import BFLOAT16, FLOAT8_E4M3, FLOAT16, FLOAT32, DType

SCHEME = "FP8_DYNAMIC"
# The compressed-tensors release whose format this is: the one the newest llm-compressor (0.14.0.1) pins, whose
# QuantizationConfig.model_dump() gives exactly `quantization_config()` (0.20.1 drops the null fields it writes,
# and reads either form; vLLM 0.34.0 pins 0.17.0).
COMPRESSED_TENSORS_VERSION = "0.19.0"
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max, compressed-tensors' FP8_E4M3_DATA.max
SCALE_DTYPES = (FLOAT32, BFLOAT16, FLOAT16)  # initialize_qparams keeps these; compressed-tensors' eps of each:
EPS_BITS = {FLOAT32: np.uint32(0x34000000), BFLOAT16: np.uint16(0x3C00), FLOAT16: np.uint16(0x1400)}


def _args(strategy: str, dynamic: bool) -> dict[str, Any]:
    """One QuantizationArgs as compressed-tensors 0.19.0's model_dump writes it (every field)."""
    return {
        "actorder": None,
        "block_structure": None,
        "dynamic": dynamic,
        "group_size": None,
        "num_bits": 8,
        "observer": None,
        "observer_kwargs": {},
        "scale_dtype": None,
        "strategy": strategy,
        "symmetric": True,
        "type": "float",
        "zp_dtype": None,
    }


def quantization_config(ignore: list[str]) -> dict[str, Any]:
    """`quantization_config` as llm-compressor's model_free_ptq(scheme="FP8_DYNAMIC") writes it: the preset
    under its own name with targets ["Linear"], the format its compressor set, status compressed, the
    compressed-tensors version, an empty transform config (save_utils.update_config)."""
    return {
        "config_groups": {
            SCHEME: {
                "format": "float-quantized",
                "input_activations": _args("token", True),
                "output_activations": None,
                "targets": ["Linear"],
                "weights": _args("channel", False),
            }
        },
        "format": "float-quantized",
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "transform_config": {},
        "version": COMPRESSED_TENSORS_VERSION,
    }


class NonFinite(ValueError):
    """A row with inf or NaN: no scale can be derived from it."""

    def __init__(self, row: int) -> None:
        super().__init__(f"non-finite value in row {row}")
        self.row = row


class _Scratch(threading.local):
    """Each thread's work buffers, kept from chunk to chunk (numerics.float8_e4m3fn_bits says why)."""

    def __init__(self) -> None:
        self.u32: list[np.ndarray] = [np.empty(0, np.uint32) for _ in range(4)]
        self.mask = np.empty(0, bool)

    def take(self, n: int) -> tuple[np.ndarray, numerics.Work]:
        if self.mask.size < n:
            self.u32 = [np.empty(n, np.uint32) for _ in range(4)]
            self.mask = np.empty(n, bool)
        return self.u32[0][:n], (self.u32[1], self.u32[2], self.u32[3], self.mask)


_SCRATCH = _Scratch()


def quantize_rows(w: np.ndarray, dtype: DType) -> tuple[np.ndarray, np.ndarray]:
    """Rows of a weight (held as `dtype.storage`) -> (e4m3fn bits, per-row scale as `dtype.storage`, [rows, 1]),
    bit for bit what compressed-tensors' observer + calculate_qparams + quantize compute in torch.  Raises
    NonFinite naming the first row with inf or NaN (min and max propagate them, so no extra pass finds them)."""
    rows = w.shape[0]
    buf, work = _SCRATCH.take(w.size)
    wf = buf.view(np.float32).reshape(rows, -1)
    if dtype == BFLOAT16:  # the float32 whose top half the bfloat16 is: exact
        np.copyto(buf.reshape(rows, -1), w.reshape(rows, -1))
        np.left_shift(buf, np.uint32(16), out=buf)
    else:  # float16 and float32 widen exactly (NaN payloads do not matter: a NaN is refused below)
        np.copyto(wf, w.reshape(rows, -1))
    lo, hi = wf.min(axis=1), wf.max(axis=1)
    amax = np.maximum(-np.minimum(lo, 0), np.maximum(hi, 0))
    bad = ~np.isfinite(amax)
    if bad.any():
        raise NonFinite(int(np.argmax(bad)))
    scale = numerics.from_float32(amax / np.float32(FP8_MAX), dtype)  # one rounding, in the dtype
    zero = numerics.to_float32(scale, dtype) == 0
    if zero.any():  # the eps's bits, whatever numpy type holds the dtype
        scale.view(EPS_BITS[dtype].dtype)[zero] = EPS_BITS[dtype]
    np.divide(wf, numerics.to_float32(scale, dtype)[:, None], out=wf)
    numerics.round_in_place(wf, dtype, work[0])  # x / scale of two `dtype` tensors is a `dtype` tensor
    np.clip(wf, -FP8_MAX, FP8_MAX, out=wf)
    q = numerics.float8_e4m3fn_bits(wf, work)
    return q.reshape(w.shape), scale.reshape(-1, 1)


def dequantize_rows(q: np.ndarray, scale: np.ndarray, dtype: DType) -> np.ndarray:
    """compressed-tensors' `_dequantize`: `q.to(scale.dtype) * scale`, rounded to the scale's dtype."""
    return numerics.from_float32(numerics.to_float32(q, FLOAT8_E4M3) * numerics.to_float32(scale, dtype), dtype)
