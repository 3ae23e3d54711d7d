"""The serving room: the SPMD driver of every rank (`engine`: prompt logits, scores, generation;
`Runtime`), continuous batching (`scheduler`, `generation`), CUDA-graph decode (`graphs`) and
token selection on the device (`sampling`)."""
