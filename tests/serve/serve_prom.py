"""A strict reader of Prometheus' text exposition format 0.0.4, written from the format's
specification (not from our writer), plus the official client's parser as a second judge.

Checked: line grammar (HELP, TYPE, samples with escaped label values and Go float values), one
HELP/TYPE per family and before its samples, a family's samples contiguous, no duplicate series,
counters named *_total and never negative, histograms with increasing `le`, cumulative buckets,
+Inf bucket == _count, and _sum present; the text ends in a newline.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
LABEL_VALUE = r'"(?:[^"\\\n]|\\[\\"n])*"'
LABEL = rf"[a-zA-Z_][a-zA-Z0-9_]*={LABEL_VALUE}"
VALUE = r"[+-]?(?:Inf|NaN|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)"
SAMPLE = re.compile(rf"({NAME})(?:\{{((?:{LABEL})(?:,{LABEL})*,?)?\}})? ({VALUE})(?: -?\d+)?")
HELP = re.compile(rf"# HELP ({NAME}) (.*)")
TYPE = re.compile(rf"# TYPE ({NAME}) (counter|gauge|histogram|summary|untyped)")
LABEL_PAIR = re.compile(rf"([a-zA-Z_][a-zA-Z0-9_]*)=({LABEL_VALUE})")


def _unescape(v: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n"}.get(m.group(1), m.group(1)), v[1:-1])


@dataclass
class Family:
    name: str
    type: str = "untyped"
    help: str | None = None
    samples: list[tuple[str, dict[str, str], float]] = field(default_factory=list)

    def value(self, **labels: str) -> float:
        hits = [v for n, lab, v in self.samples if n == self.name and lab == labels]
        assert len(hits) == 1, f"{self.name}{labels}: {len(hits)} samples"
        return hits[0]


def _family_of(sample: str, families: dict[str, Family]) -> str:
    for suffix in ("_bucket", "_sum", "_count", ""):
        base = sample[: len(sample) - len(suffix)] if suffix and sample.endswith(suffix) else sample
        if base in families and (not suffix or families[base].type in ("histogram", "summary")):
            return base
    return sample


def parse_exposition(text: str) -> dict[str, Family]:
    """Families by name; raises AssertionError on anything the format forbids."""
    assert text.endswith("\n"), "the exposition must end with a newline"
    families: dict[str, Family] = {}
    closed: set[str] = set()  # families whose samples have ended
    current: str | None = None
    seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    for no, line in enumerate(text[:-1].split("\n"), 1):
        where = f"line {no}: {line!r}"
        if m := HELP.fullmatch(line):
            fam = families.setdefault(m.group(1), Family(m.group(1)))
            assert fam.help is None and not fam.samples, f"{where}: HELP repeated or after samples"
            fam.help = m.group(2)
            continue
        if m := TYPE.fullmatch(line):
            fam = families.setdefault(m.group(1), Family(m.group(1)))
            assert fam.type == "untyped" and not fam.samples, f"{where}: TYPE repeated or after samples"
            fam.type = m.group(2)
            continue
        if line.startswith("#") or line == "":
            assert line == "" or not line.startswith(("# HELP", "# TYPE")), f"{where}: malformed HELP/TYPE"
            continue
        m = SAMPLE.fullmatch(line)
        assert m, f"{where}: not a sample line"
        name, labels_text, value = m.group(1), m.group(2) or "", float(m.group(3))
        labels = {k: _unescape(v) for k, v in LABEL_PAIR.findall(labels_text)}
        base = _family_of(name, families)
        if base != current:
            assert base not in closed, f"{where}: samples of {base} are not contiguous"
            if current is not None:
                closed.add(current)
            current = base
        key = (name, tuple(sorted(labels.items())))
        assert key not in seen, f"{where}: duplicate series"
        seen.add(key)
        families.setdefault(base, Family(base)).samples.append((name, labels, value))
    for fam in families.values():
        _check_family(fam)
    # The official parser must read it too (and agree on the family names).
    official = {f.name for f in text_string_to_metric_families(text)}
    assert {n.removesuffix("_total") for n in families} == {n.removesuffix("_total") for n in official}
    return families


def _check_family(fam: Family) -> None:
    if fam.type == "counter":
        assert fam.name.endswith("_total"), f"counter {fam.name} should end in _total"
        assert all(v >= 0 for _, _, v in fam.samples), f"negative counter {fam.name}"
    if fam.type == "histogram":
        buckets = [(float(lab["le"]), v) for n, lab, v in fam.samples if n == f"{fam.name}_bucket"]
        assert buckets and math.isinf(buckets[-1][0]), f"{fam.name}: no +Inf bucket"
        assert [b for b, _ in buckets] == sorted({b for b, _ in buckets}), f"{fam.name}: le not increasing"
        counts = [v for _, v in buckets]
        assert counts == sorted(counts), f"{fam.name}: buckets not cumulative"
        total = [v for n, _, v in fam.samples if n == f"{fam.name}_count"]
        assert total == [counts[-1]], f"{fam.name}: +Inf bucket != _count"
        assert [n for n, _, _ in fam.samples].count(f"{fam.name}_sum") == 1, f"{fam.name}: no _sum"
