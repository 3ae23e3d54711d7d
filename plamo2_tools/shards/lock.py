"""The output lock, where the shard format's readers and writers have always imported it from.
It lives in the foundation (`plamo2_tools/output_lock.py`) since single-file outputs lock too."""

from ..output_lock import LOCK_NAME, Holder, OutputLock, ensure_not_being_written

__all__ = ["LOCK_NAME", "Holder", "OutputLock", "ensure_not_being_written"]
