"""Verify any deployment of a PLaMo model against the reference (`plamo2-tools verify TARGET`).

A *target* is whatever runs the model outside our reference forward: our own shards on the bundled
runtime, an OpenAI-compatible server (vLLM, SGLang, our `serve`, llama-server), a GGUF file run by
llama.cpp, an MLX directory run by mlx-lm.  Each target answers the same two questions through
`target.Target` (teacher-forced scores of token sequences, and a greedy continuation), so one
comparison (`compare.py`) judges them all against the float64 reference and one report shows it.
Which target a command line names is decided by `target.detect_kind`; the adapters load lazily
(`target.TARGETS`), so a user without llama.cpp or MLX installed can still verify a server.
"""
