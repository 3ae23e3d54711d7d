"""What the Triton kernels were asked to compile and tune, counted where it happens, so a server can
show (and a test can assert) that a warm process meets no prompt shape it has not prepared for.

Three counts:

* `compiles`: Triton's own cache misses (`knobs.runtime.jit_cache_hook`, a real compile: GPU only);
* `tunings`: the SSD scan's (variant, chunk) choices timed (`ssd.auto_choice`: a new shape bucket on
  a GPU, timed once per machine and then read from the tuning cache);
* `specializations`: distinct launch keys by Triton's own rules, computed at our launches by a
  proxy around every kernel (`enable`): each constexpr's value, each tensor's dtype and 16-byte
  alignment, each integer's class (1, a multiple of 16, other; an autotuning key's exact value),
  and the launch options; plus the SSD choice's shape bucket.  What Triton compiles is a function
  of these, so a key never seen is a compile (or a tuning) waiting to happen on a GPU.  It runs on
  the CPU too (Triton's interpreter, TRITON_INTERPRET=1), which is how the tests check a warm
  server (tests/serve/test_warm_shapes.py).  The proxies cost a few microseconds per launch, so
  they are on only when asked (`enable()`, or PLAMO2_WATCH_KERNELS=1 before the kernels load).

`listeners` are called with the key of every new specialization (the server counts them in
/metrics).
"""

from __future__ import annotations

import inspect
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

WATCH_ENV = "PLAMO2_WATCH_KERNELS"
Key = tuple[Any, ...]

_lock = threading.Lock()
seen: set[Key] = set()
listeners: list[Callable[[Key], None]] = []
counts = {"compiles": 0, "tunings": 0, "specializations": 0}
_enabled = False


def note(kernel: str, key: Key) -> None:
    """Record one launch's specialization; new ones are counted and told to the listeners."""
    full = (kernel, *key)
    with _lock:
        if full in seen:
            return
        seen.add(full)
        counts["specializations"] += 1
    for listener in list(listeners):
        listener(full)


def tuned() -> None:
    with _lock:
        counts["tunings"] += 1


def snapshot() -> frozenset[Key]:
    with _lock:
        return frozenset(seen)


def int_class(v: int) -> int:
    """Triton's specialization of an integer argument: 1, 16 (a multiple of 16) or 0 (other)."""
    return 1 if v == 1 else 16 if v % 16 == 0 else 0


def _arg_class(v: Any) -> Any:
    if hasattr(v, "data_ptr") and hasattr(v, "dtype"):
        return ("t", str(v.dtype), v.data_ptr() % 16 == 0)
    if isinstance(v, bool):
        return ("b", v)
    if isinstance(v, int):
        return ("i", int_class(v))
    if isinstance(v, float):
        return ("f",)
    if v is None:
        return ("n",)
    return ("o", type(v).__name__)


def _function(kernel: Any) -> Callable[..., Any]:
    fn = kernel
    while not inspect.isfunction(fn):
        fn = fn.fn
    return fn


class Watched:
    """A Triton kernel (JITFunction, Autotuner or the interpreter's function) whose launches are
    noted before they run; everything else is the kernel's own."""

    def __init__(self, kernel: Any, name: str) -> None:
        self.kernel, self.name = kernel, name
        fn = _function(kernel)
        self.signature = inspect.signature(fn)
        self.constexprs = {n for n, p in self.signature.parameters.items() if "constexpr" in str(p.annotation)}
        self.exact = set(getattr(kernel, "keys", ()) or ())  # an autotuner times every new value of these

    def key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Key:
        names = list(self.signature.parameters)
        bound = dict(zip(names, args, strict=False))
        options = {}
        for k, v in kwargs.items():
            (bound if k in self.signature.parameters else options)[k] = v
        out: list[Any] = []
        for n in names:
            if n not in bound:
                continue
            v = bound[n]
            if n in self.constexprs:
                out.append((n, "c", v))
            elif n in self.exact:
                out.append((n, "k", v))
            else:
                out.append((n, *_arg_class(v)))
        return (*out, *sorted(options.items()))

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        launch = self.kernel[grid]

        def run(*args: Any, **kwargs: Any) -> Any:
            note(self.name, self.key(args, kwargs))
            return launch(*args, **kwargs)

        return run

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kernel, name)


def _is_kernel(value: Any) -> bool:
    from triton.runtime import KernelInterface

    return isinstance(value, KernelInterface) and not isinstance(value, Watched)


def watch_module(module: ModuleType) -> int:
    """Wrap the module's launched Triton kernels (module globals named `*_kernel*`, looked up at every
    launch) in `Watched`; the `@triton.jit` helpers they call stay as they are (a kernel calls them by
    their global name, which must stay a Triton function)."""
    n = 0
    for attr, value in list(vars(module).items()):
        if "_kernel" in attr and _is_kernel(value):
            setattr(module, attr, Watched(value, f"{module.__name__.rsplit('.', 1)[-1]}.{attr}"))
            n += 1
    return n


KERNEL_MODULES = ("attention", "conv1d", "fused", "gemv", "norm", "ssd", "state_update", "swiglu")


def enable() -> None:
    """Watch every kernel of the Triton backend (idempotent)."""
    global _enabled
    import importlib

    with _lock:
        if _enabled:
            return
        _enabled = True
    for name in KERNEL_MODULES:
        watch_module(importlib.import_module(f"plamo2_tools.kernels.{name}"))


def install() -> None:
    """Count Triton's real compiles (its cache-miss hook; a no-op where it has none), and watch the
    kernels when PLAMO2_WATCH_KERNELS=1.  Called when the Triton backend is chosen."""
    try:
        from triton import knobs
    except ImportError:  # Triton before 3.4: no hook to count with
        knobs = None
    if knobs is not None and getattr(knobs.runtime, "jit_cache_hook", "absent") is None:
        knobs.runtime.jit_cache_hook = _cache_miss
    if os.environ.get(WATCH_ENV) == "1":
        enable()


def _cache_miss(*args: Any, **kwargs: Any) -> bool:
    with _lock:
        counts["compiles"] += 1
    return False  # compile as usual


@contextmanager
def listening(fn: Callable[[Key], None]) -> Iterator[None]:
    listeners.append(fn)
    try:
        yield
    finally:
        listeners.remove(fn)
