"""Issue 28 §3: hostile checkpoints and shard directories that ended in exit 70, a hang or all
memory: PLaMo 3 configs, tokenizer.jsonl rows, manifests that contradict their files or their
layers, `check --source` on a damaged source, lm-eval's own CLI, library refusals spanning lines,
and `convert --force` over a manifest of someone else's.

Each test runs the real CLI in a subprocess and checks the exit code, exactly one stderr line, no
traceback, and (the `outside` fixture) that nothing beside the working directory changed.  Each was
seen failing on the code before its fix with `PLAMO2_CLI_ROOT=<checkout of 6fb717f>` (the tests'
switch to another checkout's CLI, docs/security.md "Tests"); what it did there is in its docstring.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

MANIFEST = "plamo2_shards.json"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_json(path: Path, edit) -> None:  # type: ignore[no-untyped-def]
    value = json.loads(path.read_text())
    edit(value)
    path.write_text(json.dumps(value))


# ---- one line, always ---------------------------------------------------------------------------------
def test_a_library_message_spanning_lines_is_one_line(run, one_line_error, tiny_shards, work, outside) -> None:
    """A tokenizer whose remote code refuses with a message of three lines (transformers' own
    errors do): main printed all three after `error:`."""
    src = _copy(tiny_shards, work / "ckpt")
    (src / MANIFEST).unlink()
    (src / "tokenization_hostile.py").write_text(
        "from transformers import PreTrainedTokenizer\n"
        "class HostileTokenizer(PreTrainedTokenizer):\n"
        "    def __init__(self, *a, **k):\n"
        "        raise ValueError('first line\\nsecond line\\n\\n  third line')\n"
    )
    auto_map = {"AutoTokenizer": ["tokenization_hostile.HostileTokenizer", None]}
    _edit_json(src / "tokenizer_config.json", lambda c: c.update(auto_map=auto_map))
    line = one_line_error(run("tokenize", src, "--trust-remote-code", input='"hi"\n'), 2)
    assert "first line | second line | third line" in line, line


# ---- lm-eval's own CLI -------------------------------------------------------------------------------
@pytest.mark.slow
def test_lm_eval_run_with_device_in_model_args(run, tiny_shards, work) -> None:
    """`lm-eval run --model plamo2 --model_args pretrained=...,device=cpu`: lm-eval 0.4.13's CLI
    calls `create_from_arg_obj`, which passed `device` twice (exit 70, TypeError) although
    `create_from_arg_string` had been fixed.  It runs now (exit 0); an unknown key is one line."""
    tasks = work / "tasks"
    data = Path(__file__).resolve().parents[1] / "eval" / "data" / "gsm8k_mini"
    r = run("gsm8k-task", tasks, "--gsm8k-dir", data, "--allow-unverified-data")
    assert r.returncode == 0, r.stderr
    common = [
        "lm-eval",
        "run",
        "--model",
        "plamo2",
        "--tasks",
        "gsm8k",
        "--include_path",
        tasks,
        "--num_fewshot",
        "0",
        "--limit",
        "1",
        "--output_path",
        work / "out",
    ]
    r = run(*common, "--model_args", f"pretrained={tiny_shards},device=cpu,max_gen_toks=4", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "gsm8k" in r.stdout
    r = run(*common, "--model_args", f"pretrained={tiny_shards},colour=blue", timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "the plamo2 model takes no colour" in errors[0], r.stderr[-2000:]


# ---- PLaMo 3 configs -------------------------------------------------------------------------------------
def _yarn(**change):  # type: ignore[no-untyped-def]
    return lambda c: c["rope_parameters"]["full_attention"].update(change)


@pytest.mark.parametrize(
    ("preset", "edit", "says"),
    [
        ("tiny3", lambda c: c.update(sliding_window_pattern=0), "sliding_window_pattern = 0: must be a positive"),
        ("tiny3", lambda c: c.update(num_hidden_layers=10**9), "num_hidden_layers = 1000000000: must be at most"),
        ("tiny3", lambda c: c.update(num_hidden_layers=1e300), "num_hidden_layers = 1e+300: must be at most 4096"),
        ("tiny3", lambda c: c.update(rope_scaling="yarn"), 'rope_scaling = "yarn": must be an object'),
        ("tiny3", lambda c: c.update(rope_scaling=[1, 2]), "rope_scaling = [1, 2]: must be an object"),
        ("tiny3-yarn", lambda c: c.update(rope_parameters=[1]), "rope_parameters = [1]: must be an object"),
        ("tiny3-yarn", _yarn(original_max_position_embeddings=-64), "original_max_position_embeddings of the"),
        ("tiny3-yarn", _yarn(beta_fast=1.0), "must be > beta_slow = 1.0"),
        ("tiny3-yarn", _yarn(beta_slow=0), "beta_slow of the full-attention layers = 0.0: must be > 0"),
        ("tiny3-yarn", _yarn(rope_theta=1.0), "must be > 1 with YaRN"),
        ("tiny3", lambda c: c.update(eos_token_id="2"), "eos_token_id = '2': must be a token id"),
        # PLaMo 2's config, checked for the same classes
        ("tiny", lambda c: c.update(num_hidden_layers=10**9), "num_hidden_layers = 1000000000: must be at most 4096"),
        ("tiny", lambda c: c.update(rope_theta=float("inf")), "rope_theta = inf: must be a finite number"),
        ("tiny", lambda c: c.update(eos_token_id=[2, "x"]), "eos_token_id = [2, 'x']: must be a token id"),
    ],
    ids=[
        "pattern-0",
        "layers-1e9",
        "layers-1e300",
        "scaling-str",
        "scaling-list",
        "parameters-list",
        "yarn-orig-neg",
        "yarn-beta-equal",
        "yarn-beta-slow-0",
        "yarn-theta-1",
        "eos-string",
        "plamo2-layers-1e9",
        "plamo2-theta-inf",
        "plamo2-eos-list",
    ],
)
def test_hostile_config(run, one_line_error, checkpoint, work, outside, preset: str, edit, says: str) -> None:  # type: ignore[no-untyped-def]
    """main: the pattern 0 was a ZeroDivisionError (exit 70); 1e9 layers built a per-layer tuple
    before any check (25 s and all memory: exit 3 here under the 4 GB cap); rope_scaling or
    rope_parameters of the wrong type were ignored (exit 0: a model without YaRN); YaRN values no
    run can compute with passed convert and check (exit 0) and crashed every run; a string EOS id
    passed; PLaMo 2's config had no upper bound on its layers (inspect walked 1e9 of them), took an
    infinite RoPE base, and EOS ids of any type.  Now inspect and convert refuse each (exit 2) at
    once, with memory capped."""
    src = _copy(checkpoint(preset), work / "ckpt")
    _edit_json(src / "config.json", edit)
    for args in (["inspect", src], ["convert", src, work / "out"]):
        line = one_line_error(run(*args, memory=4 << 30, timeout=60), 2)
        assert says.replace("\\", "") in line, (args, line)
    assert not (work / "out" / MANIFEST).exists()


def test_a_hostile_plamo3_config_in_shards_is_refused_by_check(run, one_line_error, checkpoint, work, outside) -> None:
    """A YaRN config changed in a shard directory after converting: main's `check` reported a
    changed config (exit 1) and every run crashed; it is refused where the config is read (exit 2)
    by check and by the runtime alike."""
    shards = work / "shards"
    r = run("convert", checkpoint("tiny3-yarn"), shards, "--json")
    assert r.returncode == 0, r.stderr
    _edit_json(shards / "config.json", _yarn(beta_fast=1.0))
    for args in (["check", shards], ["generate", shards, "--prompt", "x", "--max-new-tokens", 1]):
        line = one_line_error(run(*args), 2)
        assert "must be > beta_slow" in line, (args, line)


# ---- tokenizer.jsonl ----------------------------------------------------------------------------------------
def _edit_rows(path: Path, edit) -> None:  # type: ignore[no-untyped-def]
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    edit(rows)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda rows: rows.append(["x" * 1_000_000, -1.0, "NORMAL"]), "a piece of 1000000 characters"),
        (lambda rows: rows[300].__setitem__(1, 1e308), "does not fit PLaMo's int32 score table"),
        (lambda rows: rows[300].__setitem__(0, "a\ud800b"), "lone surrogate (U+D800)"),
        (lambda rows: rows.extend([[f"{i:04d}" + "y" * 1000, -5.0] for i in range(200)]), "characters of suffixes"),
    ],
    ids=["piece-1e6", "score-1e308", "surrogate", "suffix-budget"],
)
def test_hostile_tokenizer_rows(run, one_line_error, checkpoint, work, outside, edit, says: str) -> None:  # type: ignore[no-untyped-def]
    """main: a million-character piece took quadratic memory (22.9 GB until the OOM killer; exit 3
    here under the 2 GB cap); score 1e308 was OverflowError (exit 70); a lone surrogate passed
    tokenize and convert (exit 0), then crashed every decode.  Now tokenize and convert refuse
    each in one line (exit 2), memory capped."""
    src = _copy(checkpoint("tiny"), work / "ckpt")
    _edit_rows(src / "tokenizer.jsonl", edit)
    for args, stdin in ((["tokenize", src], '"hi"\n'), (["convert", src, work / "out"], None)):
        line = one_line_error(run(*args, input=stdin, memory=2 << 30, timeout=120), 2)
        assert says in line and "tokenizer.jsonl" in line, (args, line)
    assert not (work / "out" / MANIFEST).exists()


# ---- manifests and check --------------------------------------------------------------------------------
@pytest.mark.parametrize("stages", [[[0, 2], [2, 9]], [[0, 2], [2, 3]], [[0, 3], [2, 4]], [[0, 4]]])
def test_manifest_stages_beyond_or_short_of_the_layers(run, one_line_error, checkpoint, work, stages) -> None:  # type: ignore[no-untyped-def]
    """main: stages past the last layer made `generate` exit 70; stages short of it ran a model
    with fewer layers (exit 0).  Refused where the manifest is read (exit 2), by every reader."""
    shards = work / "shards"
    r = run("convert", checkpoint("tiny"), shards, "--pp", 2, "--json")
    assert r.returncode == 0, r.stderr
    _edit_json(shards / MANIFEST, lambda m: m["mapping"].update(stages=stages))
    for args in (
        ["check", shards],
        ["generate", shards, "--prompt", "x", "--max-new-tokens", 1],
        ["convert", shards, work / "tp1", "--tp", 1],
    ):
        line = one_line_error(run(*args), 2)
        assert "mapping.stages" in line and "consecutive non-empty ranges" in line, (args, line)


@pytest.mark.parametrize(("field", "value"), [("shape", [512, 128]), ("dtype", "bfloat16")])
def test_check_finds_a_tensor_record_that_disagrees_with_its_file(run, tiny_shards, work, field: str, value) -> None:  # type: ignore[no-untyped-def]
    """main: `check` compared the headers with the planned layout, not with the manifest's own
    records (exit 0), while the runtime's load refused the directory.  Now a finding (exit 1)."""
    shards = _copy(tiny_shards, work / "shards")
    key = "model.layers.layers.0.mixer.out_proj.weight"  # a [64, 64] float32 tensor of rank 0
    _edit_json(shards / MANIFEST, lambda m: m["tensors"]["0"][key].update({field: value}))
    r = run("check", shards, "--json")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    found = json.loads(r.stdout)["checks"]["headers"]
    assert any(key in p and "the manifest says" in p for p in found), found


def test_check_source_on_a_truncated_source(run, one_line_error, checkpoint, tiny_shards, work) -> None:
    """main: the safetensors library's exception reached the user (exit 70) in the very command
    meant to find damage.  One line naming the file (exit 2)."""
    src = _copy(checkpoint("tiny"), work / "ckpt")
    weights = src / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    line = one_line_error(run("check", tiny_shards, "--source", src), 2)
    assert "model.safetensors: the safetensors library cannot read it" in line and "truncated" in line, line


def test_check_source_with_a_hostile_index(run, one_line_error, checkpoint, tiny_shards, work, outside) -> None:
    """An index naming `../outside/secret.txt` (main opened it) or holding no weight_map (KeyError, exit 70)."""
    src = _copy(checkpoint("tiny"), work / "ckpt")
    index = src / "model.safetensors.index.json"
    for content, says in (
        ({"weight_map": {"model.embed_tokens.weight": "../outside/secret.txt"}}, "not a plain file"),
        ({"metadata": {}}, "no `weight_map` object"),
    ):
        index.write_text(json.dumps(content))
        line = one_line_error(run("check", tiny_shards, "--source", src), 2)
        assert says in line, line


def test_force_over_a_manifest_naming_outside_files_says_how_to_clear_it(
    run, one_line_error, checkpoint, work, outside
) -> None:
    """main refused (rightly: the manifest cannot say which files are ours) without saying what to
    do about it.  Still refused, nothing deleted, and the line says how to clear the way."""
    out = work / "out"
    assert run("convert", checkpoint("tiny"), out, "--json").returncode == 0
    _edit_json(out / MANIFEST, lambda m: m["files"].update({"../outside/secret.txt": {"size": 1, "digest": "0"}}))
    before = sorted(p.name for p in out.iterdir())
    line = one_line_error(run("convert", checkpoint("tiny"), out, "--force"), 2)
    assert "'../outside/secret.txt' is not a plain file name" in line, line
    assert f"delete {out} yourself" in line and "or write into another directory" in line, line
    assert sorted(p.name for p in out.iterdir()) == before


def test_manifest_piece_along_an_axis_the_tensor_lacks(run, one_line_error, tiny_shards, work) -> None:
    """Found by the long fuzz campaign (reports/fuzz/fuzz-issue28.json): a 2-d tensor's record with
    shape [] kept its pieces cut along dim 1; resharding and merging indexed the missing axis
    (IndexError, exit 70 on 6fb717f; `check` there: exit 1).  Malformed where it is read (exit 2)."""
    shards = _copy(tiny_shards, work / "shards")
    key = "model.layers.layers.0.mixer.bcdt_proj.weight"  # cut along dim 1 at tp 2
    _edit_json(shards / MANIFEST, lambda m: m["tensors"]["0"][key].update(shape=[]))
    for args in (["convert", shards, work / "tp1", "--tp", 1], ["merge", shards, work / "merged"], ["check", shards]):
        line = one_line_error(run(*args), 2)
        assert "malformed manifest" in line and "a piece cut along dim 1 of its 0-d shape" in line, (args, line)
