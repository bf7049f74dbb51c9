import os
import sys

import pytest
from hypothesis import settings

# Property tests draw the same examples on every run, so that a run's verdict is the code's
# and not the draw's (CI included); HYPOTHESIS_PROFILE=explore draws new ones each run.
settings.register_profile("reproducible", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "reproducible"))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture(autouse=True)
def _trace_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    """Every test (and the commands it runs) caches traces in a fresh folder of its own,
    never in the user's cache, and with the cache on whatever the environment says."""
    monkeypatch.setenv("PLANNER_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    monkeypatch.delenv("PLANNER_NO_CACHE", raising=False)


@pytest.fixture(autouse=True)
def _reservations_ledger(tmp_path_factory: pytest.TempPathFactory,
                         monkeypatch: pytest.MonkeyPatch):
    """Every test its own (absent) reservations ledger, never the user's: `solve` and
    `schedule` plan around the devices the user's reserved."""
    monkeypatch.setenv("PLANNER_LEDGER",
                       str(tmp_path_factory.mktemp("ledger") / "ledger.sqlite"))
