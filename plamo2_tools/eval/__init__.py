"""Evaluation of shard directories through EleutherAI's lm-evaluation-harness (lm-eval 0.4.13).

Modules:
  plamo2_lm    the lm-eval model ``plamo`` (alias ``plamo2``; a TemplateLM over `Runtime`), vLLM's semantics
  stop_rules   what ends a generation and which text comes back (stop strings, EOS ids)
  gsm8k_task   the local GSM8K files (sha256-checked) and the stock gsm8k task pointed at them
  hf_offline   a job-local, offline Hugging Face environment
  harness      `run_eval`: simple_evaluate + EvaluationTracker outputs, in-process or on torchrun ranks
  lm_eval_cli  ``plamo2-tools lm-eval``: lm-eval's own CLI with ``plamo`` registered

Nothing here is imported by the package itself: lm-eval is loaded only when evaluation runs.
"""
