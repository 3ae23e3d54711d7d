"""PLaMo 2 as mlx-lm 0.32.2 loads it (`mlx_lm/models/plamo2.py`, model_type "plamo2"; docs/export.md).

Names: mlx-lm's modules carry the HF names unchanged (`q_weight`, `A_log`, `dt_bias`,
`dt_norm_weight`, ... included) and add the norm offsets (+1, +1/5, +1, +1/5**1.5, final +1) at run
time, so values are copied as they are, with two exceptions:

* `conv1d.weight`: HF [C, 1, K]; MLX's depthwise `nn.Conv1d` holds [C, K, 1] (its `sanitize` moves
  the axis itself when the last one is not 1; we store what `mlx_lm.convert` stores: same bytes);
* an untied `lm_head.weight`: HF pads it to a multiple of 16 rows, mlx-lm's `nn.Linear` has
  vocab_size rows (a strict load refuses the padded shape), so only the first vocab_size rows go.

`--mixed`, after PFN's own MLX loader (plamo-translate-cli, `servers/mlx/loader.py`: `bcdt_proj`
and `dt_proj` unquantized, the MLPs at 4 bits, the rest at 8) with one change: the Mamba output
projection `out_proj` (llama.cpp's `ssm_out`) stays unquantized too, because a quantized `ssm_out`
is where PLaMo 2 output is known to loop or drop content (llama.cpp: Q4_0 omissions and a Q8_0
loop; keeping it in F16 is PFN's known-good GGUF recipe).  The three are small (out_proj is
hidden x Mamba width per Mamba layer), so the cost is a few percent of the size.

What mlx-lm 0.32.2 computes differently from the HF reference (`differences`), each checked by
`tests/export/test_mlx_export.py` against the real mlx-lm:
* RoPE base fixed at 10,000 (`nn.RoPE(self.qk_dim)` ignores rope_theta and PLaMo 2.1's
  rope_local_theta);
* no sliding window: every attention layer attends to the whole prefix (full `KVCache`, a causal
  mask without window), so positions past attention_window_size + 1 differ;
* dt clamped to [0.001, 100] (`ssm_update`'s default `time_step_limit`; PLaMo's softplus is
  unbounded): changes values only where softplus(dt + dt_bias) leaves that range;
* a model with num_hidden_layers <= mamba_step // 2 does not run at all (the decoder indexes its
  cache list at mamba_step // 2).
"""

from __future__ import annotations

from typing import Any

from ..mlx import BASE, BULK, KEEP, Difference, MLXLayout, mlx_table
from .config import Plamo2Config
from .tensors import TENSORS

MLX_LM_ROPE_BASE = 10000.0  # nn.RoPE's default, which plamo2.py uses for every attention layer
MLX_LM_DT_LIMIT = (0.001, 100.0)  # mlx_lm/models/ssm.py: ssm_update's default time_step_limit

TABLE = mlx_table(
    TENSORS,
    linear={
        "model.embed_tokens.weight": BASE,
        "lm_head.weight": BASE,
        "mlp.gate_up_proj.weight": BULK,
        "mlp.down_proj.weight": BULK,
        "mixer.in_proj.weight": BASE,
        "mixer.bcdt_proj.weight": KEEP,
        "mixer.dt_proj.weight": KEEP,
        "mixer.out_proj.weight": KEEP,
        "mixer.qkv_proj.weight": BASE,
        "mixer.o_proj.weight": BASE,
    },
    shapes={"mixer.conv1d.weight": lambda c: (c.mamba_inner, c.mamba_d_conv, 1)},
    rows={"lm_head.weight": lambda c: c.vocab_size},
)


def mlx_config(raw: dict[str, Any], cfg: Plamo2Config) -> dict[str, Any]:
    """mlx-lm's ModelArgs reads the HF keys as they are (hidden_size_per_head, mamba_*, ...)."""
    return dict(raw)


def differences(cfg: Plamo2Config) -> list[Difference]:
    out: list[Difference] = []
    attention = [i for i, m in enumerate(cfg.layer_is_mamba) if not m]
    if cfg.num_hidden_layers <= cfg.mamba_step // 2 and cfg.mamba_enabled:
        out.append(
            Difference(
                "does_not_run",
                f"mlx-lm cannot run this geometry: num_hidden_layers "
                f"{cfg.num_hidden_layers} <= mamba_step // 2 = {cfg.mamba_step // 2} (its decoder "
                "indexes the cache list at mamba_step // 2)",
                0,
            )
        )
    bases = {i: cfg.rope_base(i) for i in attention}
    wrong = sorted({b for b in bases.values() if b != MLX_LM_ROPE_BASE})
    if wrong:
        layers = [i for i, b in bases.items() if b != MLX_LM_ROPE_BASE]
        out.append(
            Difference(
                "rope_base",
                f"RoPE base {', '.join(f'{b:g}' for b in wrong)} on attention layer(s) "
                f"{layers}, but mlx-lm uses {MLX_LM_ROPE_BASE:g} everywhere",
                1,
            )
        )
    windowed = [i for i in attention if cfg.attention_window(i) is not None]
    if windowed:
        w = cfg.attention_window_size
        out.append(
            Difference(
                "sliding_window",
                f"attention layer(s) {windowed} see {w} earlier tokens, but mlx-lm "
                f"attends to all of them: positions from {w + 1} on differ",
                w + 1,
            )
        )
    if attention != list(range(cfg.num_hidden_layers)):
        lo, hi = MLX_LM_DT_LIMIT
        out.append(
            Difference(
                "dt_clamp",
                f"mlx-lm clamps the Mamba time step softplus(dt + dt_bias) to [{lo:g}, "
                f"{hi:g}]; the reference does not (values outside that range differ)",
            )
        )
    return out


LAYOUT = MLXLayout("plamo2", TABLE, mlx_config, differences, "0.32.2")
