"""The float reference forward's skeleton that every PLaMo family shares (each family's
`reference.py` brings its decoder layer): the token check, the embedding lookup, the layers with
their weights streamed from the unsharded checkpoint one layer at a time (memory stays at one
layer), and the final norm and head."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..token_ids import check_token_ids
from . import reference_ops as ops
from .plamo import FINAL_NORM_OFFSET

Tensor = torch.Tensor
# (hidden (T, D), the layer's weights by name relative to its prefix, layer index) -> hidden
DecoderLayer = Callable[[Tensor, dict[str, Tensor], int], Tensor]


def layer_weights(
    ckpt: Any,
    layer: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    prefix: str = "model.layers.layers.{}.",
) -> dict[str, Tensor]:
    """One layer's tensors of the checkpoint, names relative to the layer, in `dtype` on `device`."""
    start = prefix.format(layer)
    return {
        n.removeprefix(start): ckpt.get(n).to(device=device, dtype=dtype) for n in ckpt.tensors if n.startswith(start)
    }


@torch.no_grad()
def reference_logits(
    ckpt: Any,  # model.checkpoint.HFCheckpoint
    sequences: Sequence[Sequence[int]],
    dtype: torch.dtype,
    device: torch.device | str,
    decoder_layer: DecoderLayer,
    embed_scale: float | None = None,
) -> list[Tensor]:
    """float32 CPU logits (T_i, V) for each token sequence, computed in `dtype` on `device`;
    `embed_scale` multiplies the embeddings (PLaMo 3's scale_embedding)."""
    cfg = ckpt.config
    V = cfg.vocab_size
    check_token_ids(sequences, V)
    embed = ckpt.get("model.embed_tokens.weight")
    hs = [embed[torch.as_tensor(list(seq), dtype=torch.long)].to(device=device, dtype=dtype) for seq in sequences]
    if embed_scale is not None:
        hs = [h * embed_scale for h in hs]
    del embed
    for layer in range(cfg.num_hidden_layers):
        w = layer_weights(ckpt, layer, dtype, device)
        hs = [decoder_layer(h, w, layer) for h in hs]
    final = FINAL_NORM_OFFSET + ckpt.get("model.norm.weight").to(device=device, dtype=dtype)
    head_name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    head = ckpt.get(head_name)[:V].to(device=device, dtype=dtype)
    return [(ops.rms_norm(h, final, cfg.rms_norm_eps) @ head.T).float().cpu() for h in hs]
