"""After `planner profile --model M --quick`, the calibrated cost model predicts the
model's layers and local all-reduces within 20% of fresh measurements."""

import pytest

from cost_models.profile.calibration import calibrate, check


@pytest.fixture(scope="module")
def checks():
    cluster = calibrate("gpt-tiny", quick=True)
    return check("gpt-tiny", cluster, quick=True)


def test_layer_times_within_20_percent(checks):
    layers, _ = checks
    assert layers
    for c in layers:
        assert abs(c.error) <= 0.20, c


def test_all_reduce_within_20_percent(checks):
    _, comm = checks
    # tiny messages are dominated by gloo's scheduling noise on a shared 2-core machine;
    # the claim is for the sizes that carry gradients
    big = [c for c in comm if int(c.what.split()[1]) >= 256 * 1024]
    assert big
    for c in big:
        assert abs(c.error) <= 0.20, c
