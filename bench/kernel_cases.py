"""The cases of the kernels benchmark (bench/kernels.py): correctness against float64 oracles and speed
of plamo2_tools.kernels (Triton) against the PyTorch path and peers, section by section.

Imported by bench/kernels.py only after it has set PLAMO2_BENCH_KERNELS_SMOKE / _EXPLORE: smoke runs
tiny shapes on the CPU under TRITON_INTERPRET=1 (which must be set before Triton is imported) to check
the benchmark itself, its timings mean nothing; explore adds tile / config sweeps (SSD output kernel,
state update).  Peers: mamba_ssm 2.3.2.post1 Triton (`mamba_chunk_scan_combined`,
`selective_state_update`) if importable (selective_scan_cuda is stubbed), PyTorch SDPA, the repo's
own PyTorch path.
"""

# ruff: noqa: B023  (every lambda below is timed before its loop variables change)
from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
import types
from collections.abc import Callable
from typing import Any

SMOKE = os.environ.get("PLAMO2_BENCH_KERNELS_SMOKE") == "1"
EXPLORE = os.environ.get("PLAMO2_BENCH_KERNELS_EXPLORE") == "1"  # extra tile / config sweeps
if SMOKE:  # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from plamo2_tools.kernels import ssd as ssd_mod  # noqa: E402
from plamo2_tools.kernels import torch_ops, triton_ops  # noqa: E402
from plamo2_tools.model import reference_ops as ref  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"
BF16, F32 = torch.bfloat16, torch.float32
# Per-model local shapes (TP = 1).  P, N, conv width, head dim are shared.
MODELS = {
    "1b": dict(H=32, Hq=16, Hkv=1, D=2048, F=8192),
    "8b": dict(H=64, Hq=32, Hkv=4, D=4096, F=16384),
}
P, N, K, HD, WINDOW = 128, 64, 4, 128, 2048
if SMOKE:
    MODELS = {"tiny": dict(H=2, Hq=4, Hkv=1, D=64, F=64)}
    P, N, HD, WINDOW = 16, 16, 16, 24
TOL = {BF16: 1.5e-2, F32: 1e-4}


class Run:
    """Results sink + clock: every record goes into the result's `records` as soon as it exists, and the
    file is rewritten at most every few seconds (and after every section), so a cut run keeps its data."""

    def __init__(self, result: Any) -> None:
        self.result = result
        self.t0 = time.time()
        self.records: list[dict] = result.results.setdefault("records", [])
        self.env: dict = result.results.setdefault("env", {})
        self.saved = 0.0

    def left(self) -> float:
        return self.result.left()

    def rec(self, **kw) -> dict:
        kw["t"] = round(time.time() - self.t0, 2)
        self.records.append(kw)
        print(json.dumps(kw, default=str), flush=True)
        if time.time() - self.saved > 5:
            self.write_summary()
        return kw

    def write_summary(self) -> None:
        self.result.save()
        self.saved = time.time()


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def timeit(fn: Callable[[], object], graph: bool = False, rep: int = 60) -> list[float]:
    """[p20, p50, p80] in ms.  do_bench flushes L2 before each call; the graph variant does not."""
    if SMOKE:
        ts = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e3)
        return sorted(ts)
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=rep // 2, quantiles=[0.2, 0.5, 0.8])
    return triton.testing.do_bench(fn, warmup=10, rep=rep, quantiles=[0.2, 0.5, 0.8])


def first_call(fn: Callable[[], object]) -> float:
    """Seconds of the first (compile + autotune) call."""
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def rel(y: torch.Tensor, y_ref: torch.Tensor) -> float:
    y, y_ref = y.double(), y_ref.double().to(y.device)
    if not torch.isfinite(y).all():
        return float("inf")
    return ((y - y_ref).norm() / y_ref.norm()).item()


@contextlib.contextmanager
def poisoned_empty():
    """torch.empty / empty_like return NaN-filled float tensors, so unwritten outputs show."""
    empty, empty_like = torch.empty, torch.empty_like

    def wrap(make):
        def alloc(*a, **k):
            t = make(*a, **k)
            return t.fill_(float("nan")) if t.is_floating_point() else t

        return alloc

    torch.empty, torch.empty_like = wrap(empty), wrap(empty_like)
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


def mamba_inputs(T: int, H: int, dtype: torch.dtype, gen: torch.Generator | None = None):
    """Realistic Mamba2 ranges: delta = softplus(dt + dt_bias) in ~[1e-3, 1e-1], A in -[1, 16]."""
    delta0 = torch.exp(torch.empty(H).uniform_(math.log(1e-3), math.log(1e-1)))
    dt_bias = torch.log(torch.expm1(delta0)).to(DEV)
    dt = (0.5 * torch.randn(T, H, device=DEV)).to(dtype)
    A = -torch.empty(H, device=DEV).uniform_(1, 16)
    B = torch.randn(T, N, device=DEV).to(dtype)
    C = torch.randn(T, N, device=DEV).to(dtype)
    D = torch.randn(H, device=DEV)
    x = torch.randn(T, H, P, device=DEV).to(dtype)
    z = torch.randn(T, H, P, device=DEV).to(dtype)
    return x, dt, A, B, C, D, z, dt_bias


def cu_of(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEV, dtype=torch.int32)


# ------------------------------------------------------------------ peers


def load_mamba():
    """mamba_ssm Triton entry points, or None.  Bypasses the package __init__ if it fails."""
    if SMOKE:
        return None
    sys.modules.setdefault("selective_scan_cuda", types.ModuleType("selective_scan_cuda"))
    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except Exception:
        import importlib.util

        for name in [m for m in sys.modules if m == "mamba_ssm" or m.startswith("mamba_ssm.")]:
            del sys.modules[name]
        spec = importlib.util.find_spec("mamba_ssm")
        if spec is None:
            return None
        pkg = types.ModuleType("mamba_ssm")
        pkg.__path__ = list(spec.submodule_search_locations or [])
        sys.modules["mamba_ssm"] = pkg
        try:
            from mamba_ssm.ops.triton.selective_state_update import selective_state_update
            from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
        except Exception:
            traceback.print_exc()
            return None
    return types.SimpleNamespace(ssd=mamba_chunk_scan_combined, ssu=selective_state_update)


def mamba_ssd_call(m, x, dt, A, B, C, D, z, dt_bias, lens: list[int], batch: int, Q: int):
    """PLaMo2 SSD through mamba_chunk_scan_combined: batch layout, or B=1 + seq_idx for varlen."""
    T, H, _ = x.shape
    if batch > 1:  # equal lengths: (batch, T / batch, ...)
        L = T // batch
        xb, zb = x.view(batch, L, H, P), z.view(batch, L, H, P)
        dtb, Bb, Cb = dt.view(batch, L, H), B.view(batch, L, 1, N), C.view(batch, L, 1, N)
        return lambda: m.ssd(
            xb,
            dtb,
            A,
            Bb,
            Cb,
            Q,
            D=D,
            z=zb,
            dt_bias=dt_bias,
            dt_softplus=True,
            return_final_states=True,
        )
    seq_idx = None
    if len(lens) > 1:
        ids = torch.repeat_interleave(torch.arange(len(lens), device=DEV), torch.tensor(lens, device=DEV))
        seq_idx = ids.to(torch.int32)[None]
    cu = cu_of(lens)
    return lambda: m.ssd(
        x[None],
        dt[None],
        A,
        B[None, :, None],
        C[None, :, None],
        Q,
        D=D,
        z=z[None],
        dt_bias=dt_bias,
        dt_softplus=True,
        seq_idx=seq_idx,
        cu_seqlens=cu if seq_idx is not None else None,
        return_final_states=seq_idx is None,
        return_varlen_states=seq_idx is not None,
    )


def mamba_ssu_call(m, state, x, dt, A, B, C, D, z, dt_bias):
    """vLLM's PLaMo2 decode call: stride-0 expanded dt/A/D/dt_bias (mamba's TIE_HDIM path)."""
    H = x.shape[1]
    dt_e = dt[:, :, None].expand(-1, H, P)
    A_e = A[:, None, None].expand(H, P, N)
    D_e, bias_e = D[:, None].expand(H, P), dt_bias[:, None].expand(H, P)
    return lambda: m.ssu(state, x, dt_e, A_e, B[:, None], C[:, None], D=D_e, z=z, dt_bias=bias_e, dt_softplus=True)


# ------------------------------------------------------------------ sections


def section_env(run: Run) -> None:
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "smoke": SMOKE,
    }
    if DEV == "cuda":
        env["device"] = torch.cuda.get_device_name()
        env["sms"] = torch.cuda.get_device_properties(0).multi_processor_count
        with contextlib.suppress(Exception):
            smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20)
            print(smi.stdout, flush=True)
            env["nvidia_smi"] = smi.stdout
        with contextlib.suppress(Exception):
            env["flash_impls"] = str(torch.nn.attention.list_flash_attention_impls())
    try:
        import mamba_ssm  # noqa: F401

        env["mamba_ssm"] = getattr(sys.modules["mamba_ssm"], "__version__", "bypassed __init__")
    except Exception as e:
        env["mamba_ssm"] = f"unavailable: {e!r}"
    n = (1 << 28) if not SMOKE else (1 << 20)  # 512 MiB of bf16 each way
    a, b = torch.randn(n, device=DEV, dtype=BF16), torch.empty(n, device=DEV, dtype=BF16)
    ms = timeit(lambda: b.copy_(a))[1]
    env["copy_GBps"] = 2 * a.numel() * 2 / ms / 1e6
    del a, b
    s = 8192 if not SMOKE else 256
    a, b = torch.randn(s, s, device=DEV, dtype=BF16), torch.randn(s, s, device=DEV, dtype=BF16)
    ms = timeit(lambda: a @ b)[1]
    env["matmul_TFLOPs"] = 2 * s**3 / ms / 1e9
    run.env.update(env)
    run.rec(section="env", **{k: v for k, v in env.items() if k != "nvidia_smi"})


def perf(
    run: Run,
    kernel: str,
    shape: dict,
    impl: str,
    fn,
    nbytes: float,
    flops: float = 0.0,
    graph: bool = False,
    **extra,
) -> dict | None:
    """Time fn, convert to GB/s and TFLOP/s and fractions of the measured copy / matmul rates."""
    if run.left() < 5:
        run.rec(section="skip", kernel=kernel, impl=impl, reason="budget", **shape)
        return None
    try:
        first = first_call(fn)
        q = timeit(fn)
        r = dict(
            kernel=kernel,
            impl=impl,
            **shape,
            **extra,
            first_call_s=round(first, 3),
            ms_p20=q[0],
            ms_p50=q[1],
            ms_p80=q[2],
        )
        gbps = nbytes / q[1] / 1e6
        r.update(GBps=round(gbps, 1), frac_copy=round(gbps / run.env["copy_GBps"], 3))
        if flops:
            tf = flops / q[1] / 1e9
            r.update(TFLOPs=round(tf, 2), frac_matmul=round(tf / run.env["matmul_TFLOPs"], 4))
        if graph and not SMOKE:
            try:  # a failed capture must not lose the eager numbers
                g = timeit(fn, graph=True)
                r.update(
                    graph_ms_p20=g[0],
                    graph_ms_p50=g[1],
                    graph_ms_p80=g[2],
                    graph_GBps=round(nbytes / g[1] / 1e6, 1),
                )
            except Exception as e:
                r["graph_error"] = repr(e)[:300]
                with contextlib.suppress(Exception):
                    sync()
        return run.rec(section="perf", **r)
    except Exception as e:
        traceback.print_exc()
        return run.rec(section="perf", kernel=kernel, impl=impl, **shape, error=repr(e)[:500])


def ratio(run: Run, kernel: str, shape: dict, ours: dict | None, peer: dict | None, name: str):
    if ours and peer and "ms_p50" in ours and "ms_p50" in peer:
        extra = {}
        if "graph_ms_p50" in ours and "graph_ms_p50" in peer:
            extra["graph_ours_over_peer_time"] = round(ours["graph_ms_p50"] / peer["graph_ms_p50"], 3)
        run.rec(
            section="ratio",
            kernel=kernel,
            **shape,
            peer=name,
            ours_over_peer_time=round(ours["ms_p50"] / peer["ms_p50"], 3),
            **extra,
        )


def check(run: Run, kernel: str, impl: str, dtype, err: float, **shape) -> None:
    run.rec(
        section="check",
        kernel=kernel,
        impl=impl,
        dtype=str(dtype),
        rel_err=err,
        ok=bool(err < TOL.get(dtype, TOL[BF16])),
        **shape,
    )


def section_correctness(run: Run, mamba) -> None:
    """Every Triton op at real shapes vs float64 oracles; outputs NaN-poisoned."""
    ops = triton_ops
    T_ssd = 2048 if not SMOKE else 96
    lens = [1000, 24, T_ssd - 1024] if not SMOKE else [40, 3, 53]
    for name, m in MODELS.items():
        H = m["H"]
        for dtype in (BF16, F32):
            args = mamba_inputs(T_ssd, H, dtype)
            init = torch.randn(len(lens), H, P, N, device=DEV)
            x, dt, A, B, C, D, z, bias = (t.double() for t in args)
            delta = F.softplus(dt + bias)
            ys, finals = [], []
            for s, (t0, t1) in enumerate(itertools.pairwise(cu_of(lens).tolist())):
                y, f = ref.ssd_recurrence(x[t0:t1], delta[t0:t1], A, B[t0:t1], C[t0:t1], D, z[t0:t1], init[s].double())
                ys.append(y)
                finals.append(f)
            y_ref, f_ref = torch.cat(ys), torch.stack(finals)
            for Q in (128, 256) if not SMOKE else (16, 32):
                # bf16: every autotune config of the output kernel alone (catches racy configs).
                kern = ssd_mod._chunk_output_kernel
                configs = kern.configs
                for cfg in configs if dtype == BF16 else []:
                    kern.configs, kern.cache = [cfg], {}
                    with poisoned_empty():
                        y, f = ssd_mod.ssd_chunk_scan(*args, cu_of(lens), init, chunk_size=Q, variant="sequential")
                    check(
                        run,
                        "ssd_chunk_scan",
                        "triton_sequential",
                        dtype,
                        max(rel(y, y_ref), rel(f, f_ref)),
                        model=name,
                        Q=Q,
                        T=T_ssd,
                        config=str(cfg),
                    )
                kern.configs, kern.cache = configs, {}
                for variant in ssd_mod.VARIANTS:  # each state-pass variant, autotuned output
                    with poisoned_empty():
                        y, f = ssd_mod.ssd_chunk_scan(*args, cu_of(lens), init, chunk_size=Q, variant=variant)
                    check(
                        run,
                        "ssd_chunk_scan",
                        f"triton_{variant}",
                        dtype,
                        max(rel(y, y_ref), rel(f, f_ref)),
                        model=name,
                        Q=Q,
                        T=T_ssd,
                        config="autotuned",
                    )
            with poisoned_empty():  # the default path: (variant, Q) picked at run time
                y, f = ops.ssd_chunk_scan(*args, cu_of(lens), init)
            check(run, "ssd_chunk_scan", "triton", dtype, max(rel(y, y_ref), rel(f, f_ref)), model=name, T=T_ssd)
            y, f = torch_ops.ssd_chunk_scan(*args, cu_of(lens), init, chunk_size=256)
            check(run, "ssd_chunk_scan", "torch", dtype, max(rel(y, y_ref), rel(f, f_ref)), model=name)
            if mamba is not None and dtype == BF16:  # single sequence, no initial state
                L0 = lens[0]
                y0, _ = ref.ssd_recurrence(x[:L0], delta[:L0], A, B[:L0], C[:L0], D, z[:L0])
                xs, dts, As, Bs, Cs, Ds, zs, bs = args
                call = mamba_ssd_call(mamba, xs[:L0], dts[:L0], As, Bs[:L0], Cs[:L0], Ds, zs[:L0], bs, [L0], 1, 256)
                check(run, "ssd_chunk_scan", "mamba_ssm", dtype, rel(call()[0][0], y0), model=name)

            Bsz = 64 if not SMOKE else 3
            for state_dtype in (F32, BF16):
                sargs = mamba_inputs(Bsz, H, dtype)
                state = torch.randn(Bsz, H, P, N, device=DEV).to(state_dtype)
                x, dt, A, B, C, D, z, bias = (t.double() for t in sargs)
                delta = F.softplus(dt + bias)
                outs = [
                    ref.ssd_recurrence(
                        x[b : b + 1],
                        delta[b : b + 1],
                        A,
                        B[b : b + 1],
                        C[b : b + 1],
                        D,
                        z[b : b + 1],
                        state[b].double(),
                    )
                    for b in range(Bsz)
                ]
                y_ref = torch.cat([o[0] for o in outs])
                s_ref = torch.stack([o[1] for o in outs])
                for impl, o in (("triton", ops), ("torch", torch_ops)):
                    st = state.clone()
                    with poisoned_empty():
                        y = o.ssd_state_update(st, *sargs[:6], sargs[6], sargs[7])
                    check(
                        run,
                        "ssd_state_update",
                        impl,
                        dtype if state_dtype == F32 else BF16,
                        max(rel(y, y_ref), rel(st, s_ref)),
                        model=name,
                        state_dtype=str(state_dtype),
                    )
                if mamba is not None and dtype == BF16:
                    st = state.clone()
                    y = mamba_ssu_call(mamba, st, *sargs)()
                    check(
                        run,
                        "ssd_state_update",
                        "mamba_ssm",
                        BF16,
                        max(rel(y, y_ref), rel(st, s_ref)),
                        model=name,
                        state_dtype=str(state_dtype),
                    )

            Hq, Hkv = m["Hq"], m["Hkv"]
            kv_lens = [1, 100, 2049, 3000] if not SMOKE else [1, 5, 30, 40]
            S, Lmax = len(kv_lens), max(kv_lens)
            q = torch.randn(S, Hq, HD, device=DEV).to(dtype)
            kc = torch.randn(S, Lmax, Hkv, HD, device=DEV).to(dtype)
            vc = torch.randn(S, Lmax, Hkv, HD, device=DEV).to(dtype)
            expect = torch.cat(
                [
                    ref.attention(
                        q[s : s + 1].double(),
                        kc[s, :L].double(),
                        vc[s, :L].double(),
                        HD**-0.5,
                        WINDOW,
                    )
                    for s, L in enumerate(kv_lens)
                ]
            )
            for impl, o in (("triton", ops), ("torch", torch_ops)):
                with poisoned_empty():
                    out = o.attention(
                        q,
                        kc,
                        vc,
                        cu_of([1] * S),
                        torch.tensor(kv_lens, device=DEV),
                        HD**-0.5,
                        WINDOW,
                    )
                check(run, "attention_decode", impl, dtype, rel(out, expect), model=name)

        for dtype in (BF16, F32):
            Cch = m["H"] * P
            clens = [1500, 2, 546] if not SMOKE else [20, 2, 9]
            x = torch.randn(sum(clens), Cch, device=DEV).to(dtype)
            w = torch.randn(Cch, K, device=DEV) * 0.5
            st0 = torch.randn(len(clens), Cch, K - 1, device=DEV).to(dtype)
            has = torch.tensor([True, False, True], device=DEV)
            cu = cu_of(clens).tolist()
            outs = [
                ref.causal_conv1d_silu(x[cu[s] : cu[s + 1]].double(), w.double(), st0[s].double() if has[s] else None)
                for s in range(len(clens))
            ]
            y_ref = torch.cat([o[0] for o in outs])
            s_ref = torch.stack([o[1] for o in outs])
            for impl, o in (("triton", ops), ("torch", torch_ops)):
                st = st0.clone()
                with poisoned_empty():
                    y = o.causal_conv1d(x, w, cu_of(clens), st, has)
                check(
                    run,
                    "causal_conv1d",
                    impl,
                    dtype,
                    max(rel(y, y_ref), rel(st, s_ref)),
                    model=name,
                )
                st = st0.clone()
                with poisoned_empty():
                    y = o.causal_conv1d_update(x[:3], st, w)
                ur = [ref.causal_conv1d_silu(x[b : b + 1].double(), w.double(), st0[b].double()) for b in range(3)]
                err = max(rel(y, torch.cat([u[0] for u in ur])), rel(st, torch.stack([u[1] for u in ur])))
                check(run, "causal_conv1d_update", impl, dtype, err, model=name)

            D_ = m["D"]
            xr = torch.randn(4096 if not SMOKE else 9, D_, device=DEV).to(dtype)
            res = torch.randn_like(xr) * 3
            w = 1 + 0.3 * torch.randn(D_, device=DEV)
            rr = xr.double() + res.double()
            Hq = m["Hq"]
            qh = (torch.randn(512 if not SMOKE else 5, Hq, HD, device=DEV) * 2).to(dtype)
            for impl, o in (("triton", ops), ("torch", torch_ops)):
                with poisoned_empty():
                    y, r = o.rms_norm(xr, w, 1e-6, res)
                    yh = o.head_rms_norm(qh, torch.ones(Hq, HD, device=DEV), 1e-6)
                    ys = o.silu_mul(xr)
                check(
                    run,
                    "rms_norm_residual",
                    impl,
                    dtype,
                    max(rel(y, ref.rms_norm(rr, w.double(), 1e-6)), rel(r, rr)),
                    model=name,
                )
                check(
                    run,
                    "head_rms_norm",
                    impl,
                    dtype,
                    rel(yh, ref.rms_norm(qh.double(), torch.ones(Hq, HD, device=DEV).double(), 1e-6)),
                    model=name,
                )
                half = D_ // 2
                check(
                    run,
                    "silu_mul",
                    impl,
                    dtype,
                    rel(ys, F.silu(xr[:, :half].double()) * xr[:, half:].double()),
                    model=name,
                )


def ssd_bytes_flops(T: int, H: int, S: int, Q: int = 256) -> tuple[float, float]:
    """Minimal HBM bytes (bf16 x, z, y, dt, B, C; fp32 final state) and useful causal FLOPs."""
    nbytes = 3 * T * H * P * 2 + 2 * T * N * 2 + T * H * 2 + S * H * P * N * 4
    flops = 4 * T * H * P * N + T * H * Q * P + 2 * T * Q * N
    return nbytes, flops


def section_ssd(run: Run, mamba) -> None:
    layouts = [
        ("B1", 2048, 1),
        ("B1", 8192, 1),
        ("B1", 32768, 1),
        ("B8", 8192, 8),
        ("varlen", 8192, 0),
    ]
    if SMOKE:
        layouts = [("B1", 64, 1), ("varlen", 64, 0)]
    for name, m in MODELS.items():
        H = m["H"]
        for layout, T, batch in layouts:
            if run.left() < 20:
                break
            if layout == "varlen":
                lens = [3000, 1000, 100, 4092] if not SMOKE else [30, 10, 4, 20]
            else:
                lens = [T // batch] * batch
            T = sum(lens)
            args = mamba_inputs(T, H, BF16)
            cu = cu_of(lens)
            init = torch.randn(len(lens), H, P, N, device=DEV) if layout == "varlen" else None
            shape = dict(model=name, layout=layout, T=T, S=len(lens))
            nbytes, flops = ssd_bytes_flops(T, H, len(lens))
            res = {}
            res["triton"] = perf(
                run,
                "ssd_chunk_scan",
                shape,
                "triton",
                lambda: triton_ops.ssd_chunk_scan(*args, cu, init),
                nbytes,
                flops,
                graph=True,
                choice=":".join(map(str, ssd_mod.auto_choice((*args, cu, init)))) if not SMOKE else None,
            )
            for v, Q in ssd_mod.AUTO_CHOICES if not SMOKE else [("sequential", 32), ("parallel", 32)]:
                perf(
                    run,
                    "ssd_chunk_scan",
                    shape,
                    f"triton_{v[:3]}_Q{Q}",
                    lambda v=v, Q=Q: ssd_mod.ssd_chunk_scan(*args, cu, init, chunk_size=Q, variant=v),
                    nbytes,
                    flops,
                    graph=True,
                )
            if T <= 8192:
                perf(
                    run,
                    "ssd_chunk_scan",
                    shape,
                    "torch",
                    lambda: torch_ops.ssd_chunk_scan(*args, cu, init, chunk_size=256),
                    nbytes,
                    flops,
                )
            if mamba is not None and layout != "varlen":  # varlen: ~50 s of extra mamba autotuning
                res["mamba"] = perf(
                    run,
                    "ssd_chunk_scan",
                    shape,
                    "mamba_ssm_Q256",
                    mamba_ssd_call(mamba, *args, lens, batch, 256),
                    nbytes,
                    flops,
                    graph=True,
                )
                ratio(run, "ssd_chunk_scan", shape, res["triton"], res["mamba"], "mamba_ssm")
            run.write_summary()


def quick(fn: Callable[[], object]) -> float:
    """Median ms of a short do_bench (exploration only)."""
    if SMOKE:
        return timeit(fn)[1]
    return float(triton.testing.do_bench(fn, warmup=10, rep=40))


def section_breakdown_ssd(run: Run) -> None:
    """Where the SSD time goes: each launch of each variant alone (do_bench medians, L2 flushed),
    the output kernel's autotune timings, and (``--explore``) extra output-kernel configs."""
    cases = [("1b", 8192), ("1b", 32768), ("8b", 8192)] if not SMOKE else [("tiny", 64)]
    for name, T in cases:
        H = MODELS[name]["H"]
        args = mamba_inputs(T, H, BF16)
        cu = cu_of([T])
        for Q in (128, 256) if not SMOKE else (32,):
            if run.left() < 30:
                return
            shape = dict(model=name, T=T, Q=Q)
            y_ref = ssd_mod.ssd_chunk_scan(*args, cu, None, chunk_size=Q, variant="sequential")[0]

            def rec(what: str, ms: float, err: float | None = None, **kw) -> None:
                run.rec(section="explore", kernel="ssd_chunk_scan", what=what, ms=ms, rel_to_default=err, **shape, **kw)

            try:
                ws = ssd_mod._prepare(*args, cu, None, Q, True)
                rec("cumsum", quick(lambda: ssd_mod._launch_cumsum(ws)))
                rec("state_pass_sequential", quick(lambda: ssd_mod._launch_sequential(ws)))
                rec("chunk_states", quick(lambda: ssd_mod._launch_chunk_states(ws)))
                rec("chunk_pass", quick(lambda: ssd_mod._launch_chunk_pass(ws)))
                kern = ssd_mod._chunk_output_kernel
                kern.cache = {}  # re-tune here, so configs_timings are this shape's
                ssd_mod._launch_output(ws)
                rec("output", quick(lambda: ssd_mod._launch_output(ws)), rel(ws.y, y_ref))
                for cfg, t in (getattr(kern, "configs_timings", None) or {}).items():
                    rec("output_autotune", float(t[0] if isinstance(t, (list, tuple)) else t), config=str(cfg))
                if EXPLORE and name == "1b" and T == 8192:  # extra output-kernel configs, each checked
                    saved = kern.configs
                    for m_, k_, p_, w_, st_ in EXTRA_OUT_CONFIGS:
                        cfg = triton.Config({"BLOCK_M": m_, "BLOCK_K": k_, "BLOCK_P": p_}, num_warps=w_, num_stages=st_)
                        kern.configs, kern.cache = [cfg], {}
                        try:
                            ws.y.fill_(float("nan"))
                            ssd_mod._launch_output(ws)
                            rec(
                                "output_config",
                                quick(lambda: ssd_mod._launch_output(ws)),
                                rel(ws.y, y_ref),
                                config=str(cfg),
                            )
                        except Exception as e:
                            rec("output_config", float("nan"), config=str(cfg), error=repr(e)[:300])
                    kern.configs, kern.cache = saved, {}
            except Exception as e:
                traceback.print_exc()
                run.rec(section="explore", kernel="ssd_chunk_scan", **shape, error=repr(e)[:500])
        run.write_summary()


# (BLOCK_M, BLOCK_K, BLOCK_P, warps, stages) tried beside the autotune list in the exploration.
EXTRA_OUT_CONFIGS = [
    (64, 64, 128, 4, 1),
    (128, 64, 128, 8, 1),
    (32, 32, 128, 4, 2),
    (64, 32, 64, 4, 1),
    (128, 32, 128, 8, 1),
]
if SMOKE:
    EXTRA_OUT_CONFIGS = [(32, 32, 32, 4, 1)]


def section_explore_ssu(run: Run) -> None:
    """State-update tile sweep: BLOCK_P x warps at a batch that streams well past L2."""
    sweep = [(bp, w) for bp in (8, 16, 32, 64, 128) for w in (1, 2, 4, 8)] if not SMOKE else [(8, 1), (16, 4)]
    for name in MODELS:
        H = MODELS[name]["H"]
        for Bsz, sdt in ((256, F32), (64, F32), (256, BF16)) if not SMOKE else ((4, F32),):
            if run.left() < 30:
                return
            args = mamba_inputs(Bsz, H, BF16)
            state = torch.randn(Bsz, H, P, N, device=DEV).to(sdt)
            nbytes = 2 * Bsz * H * P * N * state.element_size() + 3 * Bsz * H * P * 2
            for bp, w in sweep:
                if bp * N / (32 * w) < 4:  # fewer than 4 elements a thread: skip
                    continue
                try:
                    ms = quick(lambda: triton_ops.ssd_state_update(state, *args, block_p=bp, num_warps=w))
                    run.rec(
                        section="explore",
                        kernel="ssd_state_update",
                        model=name,
                        batch=Bsz,
                        state_dtype=str(sdt),
                        block_p=bp,
                        warps=w,
                        ms=ms,
                        GBps=round(nbytes / ms / 1e6, 1),
                    )
                except Exception as e:
                    run.rec(section="explore", kernel="ssd_state_update", block_p=bp, warps=w, error=repr(e)[:300])
        run.write_summary()


def section_ssu(run: Run, mamba) -> None:
    batches = [1, 8, 64, 256, 512] if not SMOKE else [1, 4]
    for name, m in MODELS.items():
        H = m["H"]
        for state_dtype in (F32, BF16):
            for Bsz in batches:
                if run.left() < 15:
                    return
                args = mamba_inputs(Bsz, H, BF16)
                state = torch.randn(Bsz, H, P, N, device=DEV).to(state_dtype)
                s = state.element_size()
                nbytes = 2 * Bsz * H * P * N * s + 3 * Bsz * H * P * 2 + 2 * Bsz * N * 2 + Bsz * H * 2
                shape = dict(model=name, batch=Bsz, state_dtype=str(state_dtype))
                ours = perf(
                    run,
                    "ssd_state_update",
                    shape,
                    "triton",
                    lambda: triton_ops.ssd_state_update(state, *args),
                    nbytes,
                    graph=True,
                )
                if Bsz in (1, 64, 512):
                    perf(
                        run,
                        "ssd_state_update",
                        shape,
                        "torch",
                        lambda: torch_ops.ssd_state_update(state, *args),
                        nbytes,
                    )
                if mamba is not None:
                    peer = perf(
                        run,
                        "ssd_state_update",
                        shape,
                        "mamba_ssm",
                        mamba_ssu_call(mamba, state, *args),
                        nbytes,
                        graph=True,
                    )
                    ratio(run, "ssd_state_update", shape, ours, peer, "mamba_ssm")
        run.write_summary()


def section_conv(run: Run) -> None:
    for name, m in MODELS.items():
        Cch = m["H"] * P
        w = torch.randn(Cch, K, device=DEV)
        cases = [[8192], [32768], [3000, 1000, 100, 4092]] if not SMOKE else [[64], [30, 3]]
        for lens in cases:
            if run.left() < 15:
                return
            T = sum(lens)
            x = torch.randn(T, Cch, device=DEV).to(BF16)
            st = torch.randn(len(lens), Cch, K - 1, device=DEV).to(BF16)
            has = torch.ones(len(lens), dtype=torch.bool, device=DEV)
            cu = cu_of(lens)
            shape = dict(model=name, T=T, S=len(lens), C=Cch)
            nbytes = 2 * T * Cch * 2
            for impl, o in (("triton", triton_ops), ("torch", torch_ops)):
                perf(
                    run,
                    "causal_conv1d",
                    shape,
                    impl,
                    lambda o=o: o.causal_conv1d(x, w, cu, st, has),
                    nbytes,
                )
        for Bsz in (1, 64, 512) if not SMOKE else (2,):
            x = torch.randn(Bsz, Cch, device=DEV).to(BF16)
            st = torch.randn(Bsz, Cch, K - 1, device=DEV).to(BF16)
            nbytes = Bsz * Cch * (2 * (K - 1) * 2 + 2 * 2)
            shape = dict(model=name, batch=Bsz, C=Cch)
            for impl, o in (("triton", triton_ops), ("torch", torch_ops)):
                perf(
                    run,
                    "causal_conv1d_update",
                    shape,
                    impl,
                    lambda o=o: o.causal_conv1d_update(x, st, w),
                    nbytes,
                    graph=impl == "triton",
                )
        run.write_summary()


def section_norms(run: Run) -> None:
    rows_list = [1, 512, 8192, 32768] if not SMOKE else [1, 9]
    for name, m in MODELS.items():
        D_ = m["D"]
        w = torch.ones(D_, device=DEV)
        for rows in rows_list:
            if run.left() < 10:
                return
            x = torch.randn(rows, D_, device=DEV).to(BF16)
            res = torch.randn_like(x)
            shape = dict(model=name, rows=rows, D=D_)
            for impl, o in (("triton", triton_ops), ("torch", torch_ops)):
                perf(
                    run,
                    "rms_norm_residual",
                    shape,
                    impl,
                    lambda o=o: o.rms_norm(x, w, 1e-6, res),
                    4 * rows * D_ * 2,
                    graph=rows <= 512 and impl == "triton",
                )
                if rows == rows_list[-2]:
                    perf(
                        run,
                        "rms_norm",
                        shape,
                        impl,
                        lambda o=o: o.rms_norm(x, w, 1e-6),
                        2 * rows * D_ * 2,
                    )
        T = 8192 if not SMOKE else 9
        for impl, o in (("triton", triton_ops), ("torch", torch_ops)):
            qh = torch.randn(T, m["Hq"], HD, device=DEV).to(BF16)
            wh = torch.ones(m["Hq"], HD, device=DEV)
            perf(
                run,
                "head_rms_norm",
                dict(model=name, T=T, H=m["Hq"]),
                impl,
                lambda o=o: o.head_rms_norm(qh, wh, 1e-6),
                2 * qh.numel() * 2,
            )
            bc = torch.randn(T, N, device=DEV).to(BF16)
            perf(
                run,
                "rms_norm_bc",
                dict(model=name, T=T, D=N),
                impl,
                lambda o=o: o.rms_norm(bc, torch.ones(N, device=DEV), 1e-6),
                2 * bc.numel() * 2,
            )
            for Ts in (64, T):
                g = torch.randn(Ts, 2 * m["F"], device=DEV).to(BF16)
                perf(
                    run,
                    "silu_mul",
                    dict(model=name, T=Ts, F=m["F"]),
                    impl,
                    lambda o=o, g=g: o.silu_mul(g),
                    3 * Ts * m["F"] * 2,
                )
        run.write_summary()


def section_attention(run: Run) -> None:
    decode = [(b, c) for c in (1024, 32768) for b in (1, 16, 64, 256)]
    prefill = [1024, 4096, 16384]
    if SMOKE:
        decode, prefill = [(2, 40)], [32]
    for name, m in MODELS.items():
        Hq, Hkv = m["Hq"], m["Hkv"]
        for Bsz, ctx in decode:
            if run.left() < 15:
                return
            q = torch.randn(Bsz, Hq, HD, device=DEV).to(BF16)
            kc = torch.randn(Bsz, ctx, Hkv, HD, device=DEV).to(BF16)
            vc = torch.randn_like(kc)
            lens = torch.full((Bsz,), ctx, device=DEV, dtype=torch.int32)
            cu = cu_of([1] * Bsz)
            seen = min(ctx, WINDOW + 1)
            nbytes = 2 * Bsz * seen * Hkv * HD * 2 + 2 * Bsz * Hq * HD * 2
            shape = dict(model=name, batch=Bsz, ctx=ctx, window=WINDOW)
            ours = perf(
                run,
                "attention_decode",
                shape,
                "triton",
                lambda: triton_ops.attention(q, kc, vc, cu, lens, HD**-0.5, WINDOW),
                nbytes,
                graph=True,
            )
            ks, vs = kc[:, ctx - seen :].transpose(1, 2), vc[:, ctx - seen :].transpose(1, 2)
            sdpa = perf(
                run,
                "attention_decode",
                shape,
                "sdpa_window_slice",
                lambda: F.scaled_dot_product_attention(q[:, :, None], ks, vs, scale=HD**-0.5, enable_gqa=Hq != Hkv),
                nbytes,
                graph=True,
            )
            ratio(run, "attention_decode", shape, ours, sdpa, "sdpa_window_slice")
            if ctx <= 8192:
                perf(
                    run,
                    "attention_decode",
                    shape,
                    "torch_path",
                    lambda: torch_ops.attention(q, kc, vc, cu, lens, HD**-0.5, WINDOW),
                    nbytes,
                )
        for T in prefill:
            for window in (None, WINDOW):
                if run.left() < 15:
                    return
                q = torch.randn(T, Hq, HD, device=DEV).to(BF16)
                kc = torch.randn(1, T, Hkv, HD, device=DEV).to(BF16)
                vc = torch.randn_like(kc)
                pairs = sum(min(i + 1, (window or T) + 1) for i in range(T))
                shape = dict(model=name, T=T, window=window)
                perf(
                    run,
                    "attention_prefill",
                    shape,
                    "triton_ops(sdpa)",
                    lambda: triton_ops.attention(
                        q, kc, vc, cu_of([T]), torch.tensor([T], device=DEV), HD**-0.5, window
                    ),
                    2 * T * (Hq + Hkv) * HD * 2,
                    4 * HD * Hq * pairs,
                )
        run.write_summary()


def run_sections(run: Run) -> None:
    torch.manual_seed(0)
    mamba = load_mamba()
    sections = [
        ("env", lambda: section_env(run)),
        ("correctness", lambda: section_correctness(run, mamba)),
        ("ssd", lambda: section_ssd(run, mamba)),
        ("ssu", lambda: section_ssu(run, mamba)),
        ("breakdown_ssd", lambda: section_breakdown_ssd(run)),
        *([("explore_ssu", lambda: section_explore_ssu(run))] if EXPLORE else []),
        ("conv", lambda: section_conv(run)),
        ("norms", lambda: section_norms(run)),
        ("attention", lambda: section_attention(run)),
    ]
    for name, fn in sections:
        if run.left() < 10:
            run.rec(section="skip", what=name, reason="budget")
            run.result.skip(f"section {name}")
            continue
        t = time.time()
        try:
            fn()
        except Exception as e:
            traceback.print_exc()
            run.rec(section="error", what=name, error=repr(e)[:1000])
        run.rec(section="done", what=name, seconds=round(time.time() - t, 1))
        run.write_summary()
    checks = [r for r in run.records if r.get("section") == "check"]
    bad = [r for r in checks if not r["ok"]]
    run.rec(section="final", checks=len(checks), failed_checks=len(bad), seconds=round(time.time() - run.t0, 1))
    run.write_summary()
    print_summary(run)


SHAPE_KEYS = ("model", "layout", "T", "S", "batch", "ctx", "rows", "state_dtype", "window")


def print_summary(run: Run) -> None:
    """A compact digest at the end of stdout (the full data is in the JSON files)."""
    print("=== SUMMARY", {k: v for k, v in run.env.items() if k != "nvidia_smi"})
    worst: dict[tuple, dict] = {}
    for r in run.records:
        if r.get("section") == "check":
            key = (r["kernel"], r["impl"], r["dtype"])
            if key not in worst or r["rel_err"] > worst[key]["rel_err"]:
                worst[key] = r
    for (kernel, impl, dtype), r in sorted(worst.items()):
        print(f"check {kernel:22s} {impl:10s} {dtype:15s} max_rel_err={r['rel_err']:.2e} ok={r['ok']}")
    for r in run.records:
        if r.get("section") == "ratio":
            shape = {k: v for k, v in r.items() if k not in ("section", "kernel", "peer", "t")}
            print(f"ratio {r['kernel']:18s} vs {r['peer']:18s} {shape}")
        elif r.get("section") == "perf" and "ms_p50" in r and r["impl"].startswith("triton"):
            print(
                f"perf {r['kernel']:18s} {r['impl']:12s} p50={r['ms_p50'] * 1e3:9.1f}us "
                f"GB/s={r.get('GBps')} frac_copy={r.get('frac_copy')} "
                f"graph_p50={r.get('graph_ms_p50', float('nan')) * 1e3:.1f}us "
                f"{ {k: r[k] for k in SHAPE_KEYS if k in r} }"
            )
        elif r.get("section") in ("error", "skip") or "error" in r:
            print("!!", r)
