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

import dataclasses
import json
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import Plamo2Error, UserError
from .gsm8k_task import Gsm8kData, gsm8k_task_config
from .hf_offline import hf_offline, offline_env

SUPPORTED_TASKS = ("gsm8k",)
STABLE_RESULTS_NAME = "results.json"


@dataclass
class EvalRequest:
    """Everything one evaluation needs; plain JSON values so it can travel to torchrun ranks."""

    shards: str
    data: dict[str, Any]  # Gsm8kData.to_dict()
    tasks: list[str] = field(default_factory=lambda: ["gsm8k"])
    num_fewshot: int | None = None  # None: the task's own (5 for gsm8k)
    limit: int | float | None = None
    batch_size: int = 8
    output_path: str | None = None
    device: str = "cpu"
    backend: str = "auto"
    max_gen_toks: int = 256
    max_length: int | None = None
    trust_remote_code: bool = False
    bootstrap_iters: int = 100_000
    log_samples: bool = True

    def model_args(self) -> dict[str, Any]:
        """What lm-eval records as model_args; `pretrained` also names the output directory."""
        args: dict[str, Any] = {"pretrained": self.shards, "device": self.device, "backend": self.backend,
                                "batch_size": self.batch_size, "max_gen_toks": self.max_gen_toks}  # fmt: skip
        if self.max_length is not None:
            args["max_length"] = self.max_length
        if self.trust_remote_code:
            args["trust_remote_code"] = True
        return args


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
        data = {k: self.results[k] for k in keep if k in self.results}
        data.update(files=self.files, launched=self.launched, wall_seconds=self.wall_seconds)
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
    with hf_offline(cache_root):
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
    if results is None:  # not the process that writes (torchrun rank with LOCAL_RANK != 0)
        return None
    samples = results.pop("samples", {}) if request.log_samples else {}
    results["plamo2_tools"] = {
        "gsm8k_data": request.data,
        "runtime_mode": getattr(getattr(lm, "runtime", None), "mode", None),
    }
    files = _write_outputs(tracker, results, samples, request) if request.output_path else {}
    header = (f"plamo2 ({request.model_args()}), gen_kwargs: (None), limit: {request.limit}, "
              f"num_fewshot: {request.num_fewshot}, batch_size: {request.batch_size}")  # fmt: skip
    return EvalOutcome(results, samples, files, header, make_table(results))


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
    shutil.copyfile(aggregated, stable)
    files = {"results": str(aggregated), "results_stable": str(stable)}
    if request.log_samples:
        for task_name in results["configs"]:
            files[f"samples_{task_name}"] = str(directory / f"samples_{task_name}_{date_id}.jsonl")
    return files


def _build_model(runtime: Any, request: EvalRequest) -> Any:
    from .plamo2_lm import Plamo2LM

    return Plamo2LM(
        pretrained=request.shards, runtime=runtime, device=request.device, backend=request.backend,
        batch_size=request.batch_size, max_gen_toks=request.max_gen_toks, max_length=request.max_length,
        trust_remote_code=request.trust_remote_code,
    )  # fmt: skip


def eval_job(runtime: Any, cache_root: str, **request: Any) -> EvalOutcome | None:
    """The torchrun entry (`launch("plamo2_tools.eval.harness:eval_job", ...)`): every rank runs
    the whole evaluation on its own rank of `runtime`; each keeps its own dataset cache so that
    the ranks never contend for one cache directory."""
    lm = _build_model(runtime, EvalRequest(**request))
    return evaluate_model(lm, EvalRequest(**request), Path(cache_root) / f"rank{runtime.rank}")


def run_eval(request: EvalRequest, launch: bool = False) -> EvalOutcome:
    """Evaluate `request.shards` in-process (ranks as threads) or on fresh torchrun ranks."""
    from ..convert.manifest import load_manifest

    check_tasks(request.tasks)
    world_size = load_manifest(request.shards).mapping.world_size
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="plamo2-eval-hf-") as cache_root:
        if launch:
            from ..runtime.launch import launch as launch_job

            args = {"runtime": {"shards": request.shards, "device": request.device, "backend": request.backend},
                    "cache_root": cache_root, **dataclasses.asdict(request)}  # fmt: skip
            outcome = launch_job("plamo2_tools.eval.harness:eval_job", args, nproc=world_size,
                                 extra_env=offline_env(Path(cache_root) / "launch"))  # fmt: skip
        else:
            from ..runtime.engine import Runtime

            runtime = Runtime(request.shards, device=request.device, backend=request.backend, mode="local")
            try:
                outcome = evaluate_model(_build_model(runtime, request), request, cache_root)
            finally:
                runtime.close()
    if outcome is None:
        raise Plamo2Error("the evaluation returned no results")
    outcome.launched = launch
    outcome.wall_seconds = time.perf_counter() - start
    return outcome
