"""The built-in text prompts of `verify --gsm8k-like` (written for this project, not taken from
GSM8K): grade-school word problems in GSM8K's "Question: … Answer:" shape, one in Japanese, so
that a deployment is checked on the kind of text PLaMo is evaluated on, through the reference's
own tokenizer.  They are also the text of the tokenizer parity check (`/tokenize`)."""

from __future__ import annotations

GSM8K_LIKE = (
    "Question: A library has 4 shelves with 35 books on each shelf. It lends out 28 books on Monday "
    "and gets 9 back on Tuesday. How many books are on the shelves now?\nAnswer:",
    "Question: Ken runs 3 kilometres every weekday and 5 kilometres on each day of the weekend. "
    "How far does he run in two weeks?\nAnswer:",
    "Question: A bag of rice weighs 2.5 kg and costs $6. Nora needs 20 kg of rice for a festival. "
    "How much will she pay?\nAnswer:",
    "Question: There are 120 seats in a hall. Two thirds of them are taken, and 14 more people arrive. "
    "How many seats are still empty?\nAnswer:",
    "質問: 花屋は一日に赤いバラを 48 本、白いバラをその半分売ります。三日間で何本のバラを売りますか。\n答え:",
)

# The parity text: every prompt, plus spacing, digits and punctuation the prompts lack.
PARITY_TEXT = "\n\n".join(GSM8K_LIKE) + "\n  x = 3.14; y = (x * 2) - 1  # …\tend"
