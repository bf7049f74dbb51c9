"""Cost-model accuracy on this machine: profile, then predict and measure afresh.

    python benchmarks/cost_model.py        # writes the "cost model" section

`planner profile --model gpt2-small --quick` calibrates the cost model (measured
matmul rate, memory bandwidth, per-layer timings, gloo all-reduce). The cost
model then predicts the forward+backward time of the model's layers (summed, per
micro-batch size) and 2-process all-reduces, which are measured again. Target:
within 20%. For contrast, the same layers priced by the roofline alone (measured
matmul rate and bandwidth, no layer timings) and by the catalog's CPU figures.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from results import write_section

from cost_models import catalog
from cost_models.compute import roofline_time
from cost_models.profile.calibration import calibrate, check
from planner.models import load_model, model_spec
from planner.trace import trace_loaded

MODEL = "gpt2-small"


def main() -> None:
    cluster = calibrate(MODEL, quick=True)
    layer_checks, comm_checks = check(MODEL, cluster, quick=True)
    device = cluster.nodes[0].device
    seq = next(t.seq_len for t in device.measured.layer_times)
    layers = trace_loaded(load_model(model_spec(MODEL), seq_len=seq), batch=1,
                          dtype="fp32").layers
    no_timings = dataclasses.replace(device, measured=dataclasses.replace(
        device.measured, layer_times=()))
    rows = []
    for c in layer_checks:
        mb = int(c.what.rsplit(" ", 1)[1])
        roof = sum(roofline_time(layer, no_timings, tp=1, micro_batch=mb, dtype="fp32").total
                   for layer in layers)
        cat = sum(roofline_time(layer, catalog.device("cpu"), tp=1, micro_batch=mb,
                                dtype="fp32").total for layer in layers)
        rows.append(f"| {c.what} | {c.predicted * 1e3:.1f} ms | {c.measured * 1e3:.1f} ms | "
                    f"{c.error:+.1%} | {(roof - c.measured) / c.measured:+.1%} | "
                    f"{(cat - c.measured) / c.measured:+.1%} |")
    comm_rows = [f"| {c.what} | {c.predicted * 1e3:.3f} ms | {c.measured * 1e3:.3f} ms | "
                 f"{c.error:+.1%} |" for c in comm_checks]
    for row in rows + comm_rows:
        print(row)
    load = os.getloadavg()[0]
    body = (f"Model {MODEL} (seq {seq}, fp32) on this CPU; load average {load:.2f} when "
            "measured.\n\n| layers | predicted (calibrated) | measured again | error | "
            "roofline, measured rates only | roofline, catalog CPU |\n|---|---|---|---|---|"
            "---|\n" + "\n".join(rows) +
            "\n\n| gloo all-reduce, 2 processes | predicted | measured again | error |\n"
            "|---|---|---|---|\n" + "\n".join(comm_rows) +
            "\n\nThe calibrated prediction uses the profile's per-layer timings (fitted "
            "linearly in micro-batch size) and the all-reduce link fitted from the profile's "
            "sweep; the roofline columns show what the model predicts without layer timings.")
    write_section("cost model", "python benchmarks/cost_model.py", body)


if __name__ == "__main__":
    main()
