"""lm-eval's `apply_template` with each Jinja template compiled once (harness._compiled_templates):
the same text as lm-eval's own for every GSM8K-shaped template and document, and lm-eval's function
back in place afterwards."""

from __future__ import annotations

import lm_eval.utils

from plamo2_tools.eval.harness import _compiled_templates

DOCS = [
    {"question": "Tom has 3 apples.\nHe eats {{one}}?", "answer": "3 - 1 = <<3-1=2>>2\n#### 2"},
    {"question": "Ünïcode — 12 × 7?", "answer": "#### 84"},
]
TEMPLATES = [
    "Question: {{question}}\nAnswer:",
    "{{answer}}",
    "{{answer.split('####')[-1].strip()}}",
    "{{question|upper}}",
]


def test_same_text_as_lm_evals_own_and_restored() -> None:
    original = lm_eval.utils.apply_template
    want = [original(t, d) for t in TEMPLATES for d in DOCS]
    with _compiled_templates():
        assert lm_eval.utils.apply_template is not original
        got = [lm_eval.utils.apply_template(t, d) for t in TEMPLATES for d in DOCS]
        again = [lm_eval.utils.apply_template(t, d) for t in TEMPLATES for d in DOCS]  # from the cache
    assert got == want and again == want
    assert lm_eval.utils.apply_template is original
