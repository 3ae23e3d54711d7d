"""lm-eval finds our model as `plamo` (PLaMo 2 and 3) and still as `plamo2`, its name before PLaMo 3,
which command lines and configs written earlier use (issue 29 item 7).  Seen failing with the
alias dropped from `register_model`."""

from __future__ import annotations

from lm_eval.api.registry import get_model

from plamo2_tools.eval.plamo2_lm import PlamoLM


def test_both_names_are_the_same_model() -> None:
    assert get_model("plamo") is PlamoLM
    assert get_model("plamo2") is PlamoLM
