"""``plamo2-tools lm-eval ARGS…``: lm-eval's own CLI, with the ``plamo`` model registered
(alias ``plamo2``).

lm-eval 0.4.13 discovers no model plugins, so ``lm-eval --model plamo`` works only in a process
that imported the adapter first; this is that process.  Everything after ``lm-eval`` goes to
lm-eval unchanged, e.g.::

    plamo2-tools lm-eval run --model plamo --model_args pretrained=shards/tp2pp2 \\
        --tasks gsm8k --include_path DIR_WITH_LOCAL_GSM8K_YAML --output_path out --log_samples

Real torchrun ranks work too (each rank answers every request; LOCAL_RANK 0 writes)::

    torchrun --standalone --nproc-per-node 4 -m plamo2_tools.eval.lm_eval_cli run --model plamo …
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Run lm-eval's CLI on `argv` (default: this process's arguments); returns its exit code."""
    from lm_eval.__main__ import cli_evaluate

    import plamo2_tools.eval.plamo2_lm  # noqa: F401  - registers "plamo" and "plamo2" (after lm-eval's built-ins)

    args = list(sys.argv[1:] if argv is None else argv)
    saved = sys.argv
    sys.argv = ["lm-eval", *args]  # lm-eval's parser reads sys.argv itself
    try:
        cli_evaluate()
    except SystemExit as e:  # argparse's --help / usage errors
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
