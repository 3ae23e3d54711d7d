"""The batching room (`serve/` is the HTTP server on top of it): the SPMD driver of every rank
(`engine`: prompt logits, scores, generation;
`Runtime`), continuous batching (`scheduler`, `generation`), CUDA-graph decode (`graphs`) and
token selection on the device (`sampling`)."""
