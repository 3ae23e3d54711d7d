"""The public face (docs/api.md): the documented example runs as written, the wrappers give what
the runtime gives (checked against the runtime's own logits, not against themselves), and
importing the package stays free of PyTorch."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def python_ok(code: str) -> None:
    """`code` in a fresh interpreter (nothing imported yet) exits 0."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr


def documented_example() -> str:
    text = (ROOT / "docs" / "api.md").read_text()
    match = re.search(r"```python\n(.*?)```", text, flags=re.S)
    assert match, "docs/api.md has no python example"
    return match.group(1)


def test_the_documented_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    """The first python block of docs/api.md, verbatim, on a synthetic checkpoint under the name it
    uses.  Fails when a name it imports is not exported, or a call's shape or result changes."""
    from plamo2_tools.model.synth import synth

    monkeypatch.chdir(tmp_path)
    synth("plamo-2-1b", "tiny", seed=3)
    exec(compile(documented_example(), "docs/api.md", "exec"), {})  # noqa: S102 - our own documentation
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 3 and printed[1].startswith("[") and printed[2].startswith("Score(logprob=")
    assert (tmp_path / "plamo-2-1b-tp2" / "plamo2_shards.json").is_file()


def test_generate_and_score_are_the_runtimes(shards: Any) -> None:
    """`generate` is the runtime's greedy continuation decoded (EOS not shown); `score` is the sum
    of the continuation's log-softmax from the runtime's prompt logits, and `greedy` says whether
    each of its tokens is the argmax.  Fails when an off-by-one shifts the scored positions (the
    logprobs then belong to other tokens) or the BOS / special-token handling changes."""
    from plamo2_tools import Score, generate, load, score
    from plamo2_tools.runtime.batching.text import decode_kept_specials, stop_token_ids

    with load(shards("tiny", 1, 1, seed=4), backend="torch") as rt:
        tok = rt.tokenizer
        prompt = "hello world, the"
        ids = list(tok(prompt)["input_ids"])
        eos = stop_token_ids(rt.path, tok)
        gen = rt.generate([ids], 6, eos_token_ids=eos).tokens[0]
        shown = gen[:-1] if gen and gen[-1] in eos else gen
        assert generate(rt, prompt, max_new_tokens=6) == decode_kept_specials(tok)(shown)
        assert generate(rt, [prompt, ids], max_new_tokens=6) == [generate(rt, prompt, max_new_tokens=6)] * 2

        cont = [int(t) for t in rt.generate([ids], 4).tokens[0]]  # greedy, EOS or not
        logits = rt.prompt_logits([ids + cont])[0].double().log_softmax(-1)
        want = sum(float(logits[len(ids) - 1 + j, t]) for j, t in enumerate(cont))
        got = score(rt, prompt, cont)
        assert isinstance(got, Score) and got.tokens == len(cont) and got.greedy
        assert abs(got.logprob - want) < 1e-4 * max(1.0, abs(want))
        other = [(cont[0] + 1) % rt.config.vocab_size, *cont[1:]]
        assert not score(rt, prompt, other).greedy


def test_importing_the_package_loads_no_torch() -> None:
    code = (
        "import sys, plamo2_tools\n"
        "from plamo2_tools import check, convert, __version__\n"
        "assert 'torch' not in sys.modules, 'torch'\n"
        "try:\n    plamo2_tools.no_such_name\nexcept AttributeError:\n    pass\nelse:\n    raise SystemExit(1)\n"
        "assert {'load', 'generate', 'score', 'eval', 'Runtime'} <= set(dir(plamo2_tools))\n"
    )
    python_ok(code)


def test_verify_takes_prompts_and_options(checkpoint: Any, shards: Any) -> None:
    """`verify` forwards explicit prompts and the family's options (PLaMo 3's window convention)."""
    from plamo2_tools import verify

    result = verify(
        shards("tiny3", 1, 1, seed=9),
        checkpoint("tiny3", seed=9),
        prompts=[[1, 5, 9, 14]],
        max_new_tokens=2,
        options={"window_convention": "vllm"},
        backend="torch",
    )
    assert result["passed"] and result["pinned"] == {"window_convention": "vllm"}
    assert result["conventions"] == ["window_convention=vllm"]  # pinned: no other convention tried
    assert result["prompts"] == {"count": 1, "lengths": [4], "source": "api"}
    assert [t["kind"] for t in result["targets"]] == ["shards"]


def test_the_functions_keep_their_names_after_their_modules_load() -> None:
    """`convert`, `verify` and `eval` are also module names: importing `plamo2_tools.verify` (as
    the commands do) must not turn `from plamo2_tools import verify` into the module (it did, before
    the face guarded its names)."""
    code = (
        "import plamo2_tools.verify, plamo2_tools.convert.engine, plamo2_tools.eval.harness, plamo2_tools.export.fp8\n"
        "from plamo2_tools import convert, eval, export, verify\n"
        "from plamo2_tools.verify import compare\n"
        "from plamo2_tools.convert import engine\n"
        "assert all(callable(f) and f.__module__ == 'plamo2_tools.api' for f in (convert, eval, export, verify))\n"
        "assert callable(compare) and engine.__name__ == 'plamo2_tools.convert.engine'\n"
    )
    python_ok(code)


@pytest.mark.parametrize("fmt", ["gguf", "mlx", "fp8"])
def test_export_writes_each_format(checkpoint: Any, tmp_path: Path, fmt: str) -> None:
    """`export(src, out, format)` reaches each writer with its own options (unverified here: the
    verifications are the export tests' business); an unknown format is one refusal."""
    from plamo2_tools import export
    from plamo2_tools.errors import UserError

    src = checkpoint("tiny3", seed=4)
    if fmt == "gguf":
        pytest.importorskip("gguf")
        export(src, tmp_path / "m.gguf", "gguf", type_name="f32", verify=False)
        assert (tmp_path / "m.gguf").stat().st_size > 0
    elif fmt == "mlx":
        record = export(src, tmp_path / "mlx", "mlx", bits=4, group_size=32, verify=False)
        assert record["bits_per_weight"] < 8 and (tmp_path / "mlx" / "config.json").is_file()
    else:
        result = export(src, tmp_path / "fp8", "fp8", verify=False)
        assert result.quantized > 0 and (tmp_path / "fp8" / "config.json").is_file()
    with pytest.raises(UserError, match="one of gguf, mlx, fp8"):
        export(src, tmp_path / "x", "onnx")


def test_verify_judges_any_deployment_as_the_command_does(
    cli: Any, checkpoint: Any, shards: Any, tmp_path: Path
) -> None:
    """`verify` of the face takes what `plamo2-tools verify` takes (here shards and an FP8 export in one
    call, their kinds detected from the specs) and gives the command's JSON: the same judgement, number for
    number; a spec that is no deployment is one refusal before any model work."""
    import json

    from plamo2_tools import export, verify
    from plamo2_tools.errors import UserError

    src = checkpoint("tiny3", seed=9, dtype="bfloat16")
    fp8 = tmp_path / "fp8"
    export(src, fp8, "fp8", verify=False)
    targets = [shards("tiny3", 1, 1, seed=9, source_dtype="bfloat16"), fp8]
    result = verify(targets, src, random=2, max_new_tokens=2, backend="torch")
    assert [t["kind"] for t in result["targets"]] == ["shards", "fp8"]
    assert result["prompts"]["source"] == "random(n=2, seed=0)"
    command = json.loads(
        cli(
            "verify", *targets, "--reference", src, "--random", 2, "--max-new-tokens", 2, "--backend", "torch", "--json"
        ).stdout
    )
    assert [t["conventions"] for t in command["targets"]] == [t["conventions"] for t in result["targets"]]
    assert command["passed"] == result["passed"]
    with pytest.raises(UserError):
        verify(tmp_path / "no-such-thing", src)
