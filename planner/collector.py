"""Pause the garbage collector's automatic passes through the allocation-heavy phases.

Tracing a model and solving create objects by the hundred thousand and free them by
reference counting, leaving almost no cycles (tests check the solve leaves none). The
collector does not know that: every so often it runs a full pass over every object
alive, torch's and the traced graph's included. On Llama-3 70B such passes took 0.7 s
of a 1.6 s trace and 0.3-0.4 s of most solves. Inside `paused()` none run; automatic
collection resumes after, as it was.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No automatic garbage collection inside (nested uses are no-ops)."""
    if not gc.isenabled():  # (paused already, by an outer phase or the caller)
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
