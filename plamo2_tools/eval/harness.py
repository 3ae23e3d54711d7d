"""`run_eval`: a shard directory through lm-eval's own gsm8k (prompt, filters, metrics), offline.

The flow is lm-eval's CLI flow driven from Python, so the outputs are the ones lm-eval writes:
``simple_evaluate`` with an `EvaluationTracker`, then ``<output>/<sanitized pretrained>/
results_<date>.json`` and ``samples_gsm8k_<date>.jsonl``; we add a stable-named ``results.json``
copy beside them for reports.

Where the ranks run:
* in-process (default): one `Runtime` whose TP x PP ranks are threads of this process;
* ``launch=True``: `launch()` starts one torchrun process per rank and each runs `eval_job`; every
  rank evaluates the same requests in lock-step (the model reports rank 0 / world size 1) and only
  the LOCAL_RANK 0 process gets results back from simple_evaluate and writes them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import timeline
from ..errors import Plamo2Error, UserError
from ..kinds import EVAL_KIND, EVAL_SCHEMA_VERSION
from ..runtime.process.result_io import result_type
from ..safetensors_io import atomic_write_text
from .gsm8k_task import Gsm8kData, gsm8k_task_config
from .hf_offline import hf_offline, offline_env

SUPPORTED_TASKS = ("gsm8k",)
STABLE_RESULTS_NAME = "results.json"
# results.json and `eval --json`: lm-eval's aggregated results object (results, versions, n-shot,
# config, ...) as lm-eval 0.4 writes it, tagged with EVAL_KIND and EVAL_SCHEMA_VERSION (kinds.py) so
# that `plamo2-tools report` knows it for ours; lm-eval's own results_<date>.json beside it stays untouched.


@dataclass
class EvalRequest:
    """Everything one evaluation needs; plain JSON values so it can travel to torchrun ranks."""

    shards: str
    data: dict[str, Any]  # Gsm8kData.to_dict()
    tasks: list[str] = field(default_factory=lambda: ["gsm8k"])
    num_fewshot: int | None = None  # None: the task's own (5 for gsm8k)
    limit: int | float | None = None
    batch_size: int | str = "auto"  # decode slots, or "auto": as many as the device's memory holds
    output_path: str | None = None
    device: str = "cpu"
    backend: str = "auto"
    max_gen_toks: int = 256
    max_length: int | None = None
    trust_remote_code: bool = False
    bootstrap_iters: int = 100_000
    log_samples: bool = True
    verify_files: bool = True  # False: skip the shard digests at load (headers are still checked)
    forward_options: dict[str, Any] = field(default_factory=dict)  # the family's (e.g. PLaMo 3's window convention)

    def model_args(self) -> dict[str, Any]:
        """What lm-eval records as model_args; `pretrained` also names the output directory."""
        args: dict[str, Any] = {
            "pretrained": self.shards,
            "device": self.device,
            "backend": self.backend,
            "batch_size": self.batch_size,
            "max_gen_toks": self.max_gen_toks,
        }
        if self.max_length is not None:
            args["max_length"] = self.max_length
        if self.trust_remote_code:
            args["trust_remote_code"] = True
        args.update(self.forward_options)
        return args


@result_type  # comes back from torchrun rank 0 as data (runtime/process/result_io.py), not as a pickle
@dataclass
class EvalOutcome:
    results: dict[str, Any]  # lm-eval's results dict, without "samples"
    samples: dict[str, list[dict[str, Any]]]  # task -> rows as written to samples_<task>_<date>.jsonl
    files: dict[str, str]  # results / results_stable / samples_<task> -> path (empty without output_path)
    header: str  # lm-eval CLI's line above the table
    table: str  # lm_eval.utils.make_table(results)
    launched: bool = False
    wall_seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        """JSON-ready: metrics, sizes, config and where the files are."""
        from lm_eval.utils import handle_non_serializable

        keep = ("results", "versions", "n-shot", "n-samples", "config", "task_hashes")
        data: dict[str, Any] = {"kind": EVAL_KIND, "schema_version": EVAL_SCHEMA_VERSION}
        data.update((k, self.results[k]) for k in keep if k in self.results)
        data.update(
            files=self.files, launched=self.launched, wall_seconds=self.wall_seconds, timeline=timeline.timeline()
        )
        return json.loads(json.dumps(data, default=handle_non_serializable))


def check_tasks(tasks: list[str]) -> None:
    unknown = [t for t in tasks if t not in SUPPORTED_TASKS]
    if unknown or not tasks:
        raise UserError(f"unsupported task(s) {unknown or tasks}; plamo2-tools eval runs: {', '.join(SUPPORTED_TASKS)}")


def evaluate_model(lm: Any, request: EvalRequest, cache_root: str | Path) -> EvalOutcome | None:
    """Run lm-eval on an already built model; the outcome on the writing process, None elsewhere."""
    import lm_eval
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import make_table

    check_tasks(request.tasks)
    data = Gsm8kData(
        {k: Path(v) for k, v in request.data["files"].items()}, request.data["sha256"], request.data["verified"]
    )
    tracker = EvaluationTracker(output_path=request.output_path)
    timeline.mark("lm_eval_start")
    with hf_offline(cache_root), _quiet_git_hash(), contextlib.ExitStack() as fixes:
        for workaround in LM_EVAL_WORKAROUNDS:
            fixes.enter_context(workaround())
        results = lm_eval.simple_evaluate(
            model=lm,
            model_args=request.model_args(),
            tasks=[gsm8k_task_config(data)],
            task_manager=TaskManager(include_defaults=False),  # no scan of ~all built-in YAMLs
            num_fewshot=request.num_fewshot,
            limit=request.limit,
            batch_size=request.batch_size,
            device=request.device,
            bootstrap_iters=request.bootstrap_iters,
            log_samples=request.log_samples,
            evaluation_tracker=tracker,
        )
    timeline.mark("lm_eval_end")
    if results is None:  # not the process that writes (torchrun rank with LOCAL_RANK != 0)
        return None
    samples = results.pop("samples", {}) if request.log_samples else {}
    results["plamo2_tools"] = {
        "gsm8k_data": request.data,
        "runtime_mode": getattr(getattr(lm, "runtime", None), "mode", None),
    }
    files = _write_outputs(tracker, results, samples, request) if request.output_path else {}
    header = (
        f"plamo2 ({request.model_args()}), gen_kwargs: (None), limit: {request.limit}, "
        f"num_fewshot: {request.num_fewshot}, batch_size: {request.batch_size}"
    )
    return EvalOutcome(results, samples, files, header, make_table(results))


@contextmanager
def _compiled_templates() -> Iterator[None]:
    """lm-eval 0.4.13's `utils.apply_template` compiles its Jinja template again for every call:
    6 per GSM8K document (5 shots + the question), ~4.6 s of a full 5-shot run on the H200 host's
    CPU (reports/e2e/session4/callD/stacks_eval_1b.txt).  The same function with each template
    string compiled once; the rendered text is the same (a compiled template holds no state)."""
    import functools

    import lm_eval.utils

    saved = lm_eval.utils.apply_template
    compiled = functools.lru_cache(maxsize=256)(lm_eval.utils.env.from_string)

    def apply_template(template: str, doc: dict) -> str:
        return compiled(template).render(**doc)

    lm_eval.utils.apply_template = apply_template
    try:
        yield
    finally:
        lm_eval.utils.apply_template = saved


@contextmanager
def _env_info_ahead() -> Iterator[None]:
    """lm-eval's `add_env_info` runs torch's `collect_env` after the evaluation, on the critical
    path: `pip list`, `nvidia-smi` and a dozen more subprocesses, seconds of waiting (4.7 s of a
    50-document run on the 2-core VM, reports/startup/lm_eval_parts_*.json).  The same text is
    computed on a thread from the start of the run (it waits on subprocesses, so the evaluation
    goes on meanwhile) and handed to lm-eval's own `add_env_info`, which writes the results as before."""
    import lm_eval.evaluator
    import torch.utils.collect_env as collect_env

    real = collect_env.get_pretty_env_info
    found: dict[str, str] = {}

    def compute() -> None:
        try:
            found["info"] = real()
        except Exception as e:  # noqa: BLE001 - what lm-eval's add_env_info records in that case
            found["info"] = str(e)

    thread = threading.Thread(target=compute, name="plamo2-env-info", daemon=True)
    thread.start()
    original = lm_eval.evaluator.add_env_info

    def add_env_info(storage: dict[str, Any]) -> None:
        thread.join()
        collect_env.get_pretty_env_info = lambda: found["info"]
        try:
            original(storage)
        finally:
            collect_env.get_pretty_env_info = real

    lm_eval.evaluator.add_env_info = add_env_info
    try:
        yield
    finally:
        lm_eval.evaluator.add_env_info = original


# lm-eval's own costs, worked around without forking it (bench/lm_eval_parts.py measures each; its
# --no-fix runs without them): context managers around simple_evaluate.
LM_EVAL_WORKAROUNDS: tuple[Callable[[], contextlib.AbstractContextManager[None]], ...] = (
    _compiled_templates,
    _env_info_ahead,
)


@contextmanager
def _quiet_git_hash() -> Iterator[None]:
    """lm-eval records `git describe` of the working directory and lets git print "fatal: not a git
    repository" on stderr outside a checkout; the same lookup, with git's complaint discarded."""
    import lm_eval.evaluator

    saved = lm_eval.evaluator.get_git_commit_hash
    lm_eval.evaluator.get_git_commit_hash = _git_hash
    try:
        yield
    finally:
        lm_eval.evaluator.get_git_commit_hash = saved


def _git_hash() -> str | None:
    from lm_eval.loggers.utils import get_commit_from_path

    try:
        cmd = ["git", "describe", "--always"]
        return subprocess.check_output(cmd, stderr=subprocess.DEVNULL).strip().decode()
    except (subprocess.CalledProcessError, OSError):
        return get_commit_from_path(os.getcwd())


def _write_outputs(
    tracker: Any, results: dict[str, Any], samples: dict[str, Any], request: EvalRequest
) -> dict[str, str]:
    """What lm-eval's CLI writes after simple_evaluate, plus the stable-named results.json copy."""
    tracker.save_results_aggregated(results=results, samples=samples if request.log_samples else None)
    if request.log_samples:
        for task_name in results["configs"]:
            tracker.save_results_samples(task_name=task_name, samples=samples[task_name])
    directory = Path(request.output_path) / str(tracker.general_config_tracker.model_name_sanitized)
    date_id = getattr(tracker, "date_id", None)
    aggregated = directory / f"results_{date_id}.json"
    if date_id is None or not aggregated.exists():  # the tracker logs its write errors instead of raising
        raise Plamo2Error(f"lm-eval did not write its results under {directory} (see the log above)")
    stable = directory / STABLE_RESULTS_NAME
    write_stable_results(aggregated, stable)
    files = {"results": str(aggregated), "results_stable": str(stable)}
    if request.log_samples:
        for task_name in results["configs"]:
            files[f"samples_{task_name}"] = str(directory / f"samples_{task_name}_{date_id}.jsonl")
    return files


def write_stable_results(aggregated: Path, stable: Path) -> None:
    """results.json: lm-eval's aggregated results file tagged with our kind and version; written
    whole, then renamed, so that a reader never sees half of it."""
    tagged = {"kind": EVAL_KIND, "schema_version": EVAL_SCHEMA_VERSION, **json.loads(aggregated.read_text("utf-8"))}
    partial = stable.with_name(f".{stable.name}.partial")
    atomic_write_text(stable, json.dumps(tagged, indent=2, ensure_ascii=False) + "\n", tmp=partial)
    # (created fresh: a link planted at the temporary name is replaced, never written through)


def _build_model(runtime: Any, request: EvalRequest) -> Any:
    from .plamo2_lm import PlamoLM

    return PlamoLM(
        pretrained=request.shards,
        runtime=runtime,
        device=request.device,
        backend=request.backend,
        batch_size=request.batch_size,
        max_gen_toks=request.max_gen_toks,
        max_length=request.max_length,
        trust_remote_code=request.trust_remote_code,
    )


@contextmanager
def eval_cache_root() -> Iterator[str]:
    """Where lm-eval's Hugging Face caches live: the GSM8K files as Arrow tables, built once and read
    back by the next run (3.7 s of the task set-up on the 2-core VM, reports/startup/), under
    `$PLAMO2_CACHE_DIR/lm-eval` (default ~/.cache/plamo2-tools/lm-eval): ours, never the user's
    ~/.cache/huggingface.  PLAMO2_EVAL_CACHE=0, or a place that cannot be written, gives a temporary
    one per run instead."""
    root = os.environ.get("PLAMO2_CACHE_DIR")
    base = (Path(root) if root else Path.home() / ".cache" / "plamo2-tools") / "lm-eval"
    usable = False
    if os.environ.get("PLAMO2_EVAL_CACHE", "1") != "0":
        try:
            base.mkdir(parents=True, exist_ok=True)
            usable = os.access(base, os.W_OK)
        except OSError:
            usable = False
    if usable:
        yield str(base)
        return
    with tempfile.TemporaryDirectory(prefix="plamo2-eval-hf-") as tmp:
        yield tmp


def eval_job(runtime: Any, cache_root: str, **request: Any) -> EvalOutcome | None:
    """The job `run_eval` runs (in-process, or on every torchrun rank): each rank runs
    the whole evaluation on its own rank of `runtime`; each keeps its own dataset cache so that
    the ranks never contend for one cache directory."""
    lm = _build_model(runtime, EvalRequest(**request))
    return evaluate_model(lm, EvalRequest(**request), Path(cache_root) / f"rank{runtime.rank}")


def run_eval(request: EvalRequest, launch: bool = False) -> EvalOutcome | None:
    """Evaluate `request.shards` in-process (ranks as threads) or on fresh torchrun ranks."""
    from ..runtime.process.jobs import run_job  # the runtime (torch): imported when a run starts, not to check

    check_tasks(request.tasks)
    start = time.perf_counter()
    with eval_cache_root() as cache_root:
        runtime = {
            "shards": request.shards,
            "device": request.device,
            "backend": request.backend,
            "verify_files": request.verify_files,
            "forward_options": request.forward_options,
        }
        env = offline_env(Path(cache_root) / "launch") if launch else None
        outcome = run_job(eval_job, runtime, {"cache_root": cache_root, **dataclasses.asdict(request)}, launch, env)
    if outcome is None:
        if not launch and int(os.environ.get("LOCAL_RANK", "0")) != 0:
            return None  # one of several torchrun ranks started by the user: rank 0 reports
        raise Plamo2Error("the evaluation returned no results")
    outcome.launched = launch
    outcome.wall_seconds = time.perf_counter() - start
    return outcome
