"""The calibration logic, fed made-up measurements: a profile calibrates the cost model
(`calibrated_cluster`, as `planner profile merge` does), which then reproduces the
measurements it was calibrated on, and `compare` catches measurements it does not.

Nothing here times anything, so nothing depends on the machine's load: the measured
calibrate-and-check comparison on this machine (which drifts by up to ±25% from one
minute to the next on a shared VM) is a benchmark, `python benchmarks/cost_model.py`
("cost model" in benchmarks/RESULTS.md)."""

import pytest

from cost_models import catalog
from cost_models.profile.calibration import BIG_MESSAGE, Check, Checks, calibrated_cluster, compare
from cost_models.profile.comm import OPERATIONS, summarize
from cost_models.profile.schema import KIND, SCHEMA_VERSION
from planner.models import model_spec
from planner.trace import trace_model
from planner.types import ClusterSpec, LinkSpec, NodeSpec

MODEL = "gpt-tiny"
SEQ = 64
SIZES = tuple(2**i for i in range(10, 27, 4))  # 1 KiB .. 64 MiB
ALPHA, BETA = 2e-4, 1.5e9  # the made-up link: seconds = ALPHA + bytes / BETA


def _layers(slower: float = 1.0) -> dict:
    """gpt-tiny's layer timings as a profile holds them: layer i takes (i + 1) ms
    forward per sample plus 0.5 ms, backward twice that, all `slower` times."""
    traced = trace_model(model_spec(MODEL), seq_len=SEQ, dtype="fp32").layers
    timings = [{"layer": layer.name, "signature": layer.signature, "micro_batch": mb,
                "fwd": slower * (0.5 + (i + 1) * mb) * 1e-3,
                "bwd": slower * 2 * (0.5 + (i + 1) * mb) * 1e-3}
               for mb in (1, 2) for i, layer in enumerate(traced)]
    steps = [{"micro_batch": mb, "seconds": sum(t["fwd"] + t["bwd"] for t in timings
                                                if t["micro_batch"] == mb)} for mb in (1, 2)]
    return {"model": MODEL, "seq_len": SEQ, "dtype": "fp32", "timings": timings,
            "steps": steps}


def _comm(slower: float = 1.0) -> dict:
    """Two gloo processes whose every operation takes ALPHA + bytes / BETA seconds."""
    seconds = {op: [[size, slower * (ALPHA + size / BETA)] for size in SIZES]
               for op in OPERATIONS}
    return summarize(seconds, backend="gloo", world=2, device="cpu")


def _profile() -> dict:
    return {"schema_version": SCHEMA_VERSION, "kind": KIND, "host": "box",
            "timestamp": "2026-12-01T00:00:00+00:00",
            "software": {"python": "3.11", "torch": "2.5", "cuda": None, "planner": "0.1",
                         "platform": "linux"},
            "mode": "quick", "load_average": [0.0, 0.0, 0.0],
            "devices": [{"index": 0, "kind": "cpu", "name": "test cpu",
                         "memory_bytes": 8 * 2**30, "threads": 2, "cores": 2,
                         "matmul": {"fp32": {"best_flops": 1e11, "sweep": []}},
                         "memory_bandwidth": {"best": 1e10, "sweep": []},
                         "layers": _layers()}],
            "communication": _comm()}


@pytest.fixture(scope="module")
def cluster() -> ClusterSpec:
    return calibrated_cluster(_profile())


def test_the_calibrated_model_reproduces_the_measurements_it_was_calibrated_on(cluster):
    checks = compare(MODEL, cluster, _layers(), _comm())
    assert [c.what for c in checks.layers] == [f"{MODEL} layers, micro-batch {mb}"
                                               for mb in (1, 2)]
    assert [c.nbytes for c in checks.all_reduce] == list(SIZES)
    for c in checks.layers + checks.all_reduce:
        assert c.predicted == pytest.approx(c.measured, rel=1e-9), c
    assert checks.close(tolerance=1e-6)


def test_a_machine_that_changed_is_caught(cluster):
    """Measured again 1.5x slower: every check is off by -1/3, and the claim fails."""
    checks = compare(MODEL, cluster, _layers(slower=1.5), _comm(slower=1.5))
    for c in checks.layers + checks.all_reduce:
        assert c.error == pytest.approx(-1 / 3), c
    assert not checks.close(tolerance=0.3) and checks.close(tolerance=0.34)
    layers_only = compare(MODEL, cluster, _layers(slower=1.5), _comm())
    assert not layers_only.close(tolerance=0.3)
    comm_only = compare(MODEL, cluster, _layers(), _comm(slower=1.5))
    assert not comm_only.close(tolerance=0.3)


def test_an_uncalibrated_model_is_caught():
    """The catalog's CPU and its default link, the measurements ignored, miss them."""
    node = NodeSpec(name="box", device=catalog.device("cpu"), devices=2,
                    intra_link=LinkSpec(name="catalog", bandwidth=50e9, latency=1e-6))
    guess = ClusterSpec(name="guess", nodes=(node,), network=node.intra_link)
    checks = compare(MODEL, guess, _layers(), _comm())
    assert all(abs(c.error) > 0.5 for c in checks.layers + checks.all_reduce)
    assert not checks.close(tolerance=0.35)


def test_the_claim_covers_the_layers_and_the_big_all_reduces_only():
    def off(error: float, nbytes: float = 0.0) -> Check:
        return Check("x", predicted=1 + error, measured=1.0, nbytes=nbytes)

    small_off = Checks([off(0.1)], [off(0.9, BIG_MESSAGE / 4), off(-0.1, BIG_MESSAGE)])
    assert small_off.close(tolerance=0.2)  # a small message's scheduler ticks don't count
    assert not Checks([off(0.1)], [off(0.3, BIG_MESSAGE)]).close(tolerance=0.2)
    assert not Checks([off(0.1)], [off(0.0, BIG_MESSAGE / 4)]).close(tolerance=0.2)
    assert not Checks([], [off(0.0, BIG_MESSAGE)]).close(tolerance=0.2)
