"""`plamo2-tools export`: the formats PLaMo users run outside our runtime, each written from an HF
checkpoint (or our shards) and verified against the reference before it is called done.

One file per format (`gguf.py` for llama.cpp / Ollama / LM Studio, `mlx.py` for mlx-lm, `fp8.py`
for vLLM / SGLang's compressed-tensors); what a *family* looks like in each format (tensor names,
transforms, metadata) lives with the family in `model/<family>/`.  Every export ends with
`deploy` verifying the output (unless `--no-verify`) and records the measured figures next to it.
"""
