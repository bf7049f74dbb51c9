"""`planner data-profile`: what the training data's sample lengths look like
(`planner.data.profile`); `planner partition`: the data set split over a plan's
pipelines by capacity, class-balanced (`planner.data.shards`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape

from cli import options as opt
from cli.tables import output_console
from planner.units import fmt_seconds

if TYPE_CHECKING:
    from planner.data.profile import DataProfile
    from planner.types import ClusterSpec, ModelGraph, Plan

console = output_console()
err_console = Console(emoji=False, stderr=True)
BAR = 40  # characters of the histogram's longest bar


def data_profile(
    source: Annotated[str, typer.Argument(
        help="A JSONL file of samples (a number of tokens a line, or objects with tokens, "
        "image_tokens, label), or a data hook package.module:function.",
        metavar="SAMPLES")],
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="Write the profile (JSON) here, for `planner partition`, "
        "the runtime's --lengths and the benchmark.")] = None,
    steps: Annotated[int, typer.Option(
        "--steps", help="Steps of samples to draw from a data hook.")] = 10,
    global_batch: Annotated[int | None, typer.Option(
        "--global-batch", "-B", help="Samples per step, for a data hook.")] = None,
    seq_len: opt.SeqLen = None,
    seed: Annotated[int, typer.Option("--seed", help="The seed a data hook gets.")] = 0,
    json_out: opt.JsonOut = False,
    force: opt.Force = False,
) -> None:
    """Summarize the sample lengths (tokens per sample) of a data set.

    Prints the count, mean, quantiles, the tail (the longest samples' share of all
    tokens) and a histogram on geometric bins. A multimodal sample's image tokens count
    in its length (the model sees them as part of its sequence).

    Examples:
      planner data-profile samples.jsonl -o profile.json
      planner data-profile mydata.loader:batch -B 64 --steps 20 --seq-len 2048
    """
    from planner.data.profile import hook_samples, profile_json, read_samples, summarize
    from planner.errors import PlannerError
    from planner.files import check_writable, write_atomic

    if output is not None:
        check_writable(output, force=force)
    is_hook = ":" in source and not Path(source).exists()
    if is_hook:
        if global_batch is None:
            raise PlannerError("bad-option", f"Give --global-batch (-B) to profile data hook "
                               f"{source!r}: it is called for --steps steps of that many "
                               "samples.")
        samples = hook_samples(source, steps=steps, global_batch=global_batch,
                               seq_len=seq_len, seed=seed)
    else:
        samples = read_samples(Path(source))
    profile = summarize(samples, source)
    if output is not None:
        write_atomic(output, profile_json(profile), force=force)
    if json_out:
        sys.stdout.write(profile_json(profile))
        return
    _render(profile)
    if output is not None:
        console.print(f"wrote {escape(str(output))}")


def _render(profile: DataProfile) -> None:
    console.print(f"[bold]{escape(profile.source)}[/]: {profile.count:,} samples, "
                  f"{profile.total_tokens:,} tokens")
    quantiles = "  ".join(f"p{int(q * 100) if q < 0.99 else q * 100:g} "
                          f"{profile.quantile(q):,.0f}" for q in (0.5, 0.9, 0.99))
    console.print(f"length: mean {profile.mean:,.1f}, std {profile.std:,.1f}, min "
                  f"{profile.min:,}, max {profile.max:,};  {quantiles}")
    console.print(f"tail: the longest 1% of samples hold {profile.top_share:.1%} of the "
                  f"tokens; mean squared length {profile.mean_square / profile.mean ** 2:.2f}x "
                  "the squared mean (attention's quadratic term)")
    if profile.image_samples:
        console.print(f"images: {profile.image_samples:,} samples with image tokens, "
                      f"{profile.image_tokens:,} image tokens "
                      f"({profile.image_tokens / profile.total_tokens:.1%} of all)")
    if profile.labels:
        shown = ", ".join(f"{escape(k)} {v:,}" for k, v in list(profile.labels.items())[:12])
        more = len(profile.labels) - 12
        console.print(f"labels: {len(profile.labels)} classes: {shown}"
                      + (f", ... {more} more" if more > 0 else ""))
    counts = profile.histogram.counts
    edges = profile.histogram.edges
    widest = max(counts)
    label_width = len(f"{edges[-2]:,}-{edges[-1] - 1:,}")
    for i, count in enumerate(counts):
        span = f"{edges[i]:,}-{edges[i + 1] - 1:,}"
        bar = "#" * round(BAR * count / widest) if widest else ""
        console.print(f"  {span:>{label_width}} {bar} {count:,}", highlight=False)


def partition(
    source: Annotated[Path, typer.Argument(
        help="A JSONL file of samples (as data-profile reads it); a sample's index is its "
        "line among the samples, from 0.", metavar="SAMPLES")],
    out: Annotated[Path, typer.Option(
        "--out", help="Folder for partition.json and one index file per pipeline.")],
    plan: Annotated[Path | None, typer.Option(
        "--plan", help="Shares from this plan: each pipeline's samples per step.")] = None,
    shares: Annotated[str | None, typer.Option(
        "--shares", help="Or the shares given: samples per step of each pipeline, e.g. "
        "24,8.")] = None,
    tolerance: Annotated[float, typer.Option(
        "--tolerance", help="The most a class's share in a shard may differ from its share "
        "of the data set (0.02: two percentage points).")] = 0.02,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the shuffles.")] = 0,
    json_out: opt.JsonOut = False,
    force: opt.Force = False,
) -> None:
    """Split a data set over a plan's pipelines: shards proportional to their capacity,
    each class in every shard in its share of the data set.

    Writes partition.json and pipeline-<p>.txt (one sample index a line) into --out; a
    data hook reads them with planner.data.shards.read_partition(folder).indices(step,
    start, stop). Reports each shard's size and class spread, and Pearson's chi-squared
    test of shard against class.

    Examples:
      planner partition samples.jsonl --plan plan.json --out parts/
      planner partition samples.jsonl --shares 24,8 --tolerance 0.01 --out parts/
    """
    from planner.data.profile import read_samples
    from planner.data.shards import make_partition, partition_files, partition_json
    from planner.errors import PlannerError
    from planner.files import check_writable, write_atomic

    if (plan is None) == (shares is None):
        raise PlannerError("bad-option", "Give the pipelines' shares with --plan PLAN or "
                           "--shares N,N,... (one of them).")
    if plan is not None:
        from planner.planfile import read_plan

        per_step = [p.batch_share for p in read_plan(plan).pipelines]
    else:
        try:
            per_step = [int(part) for part in shares.split(",")]
        except ValueError:
            raise PlannerError("bad-option", f"--shares takes whole numbers separated by "
                               f"commas, e.g. 24,8 (got {shares!r}).") from None
    if out.exists() and not out.is_dir():
        raise PlannerError("bad-path", f"--out {str(out)!r} is a file; give a folder.")
    if not out.parent.is_dir():
        raise PlannerError("bad-path", f"Folder {str(out.parent)!r} does not exist.",
                           ["create it first", "choose another --out"])
    samples = read_samples(source)
    made = make_partition([s.label for s in samples], per_step, tolerance=tolerance,
                          seed=seed, source=str(source))
    files = partition_files(made)
    if out.is_dir():  # (nothing there is overwritten without --force)
        for name in files:
            check_writable(out / name, force=force)
    else:
        out.mkdir()
    for name, text in files.items():
        write_atomic(out / name, text, force=force)
    if json_out:
        sys.stdout.write(partition_json(made))
        return
    console.print(f"[bold]{escape(str(source))}[/]: {made.count:,} samples, "
                  f"{len(made.classes)} class(es), over {len(made.shards)} pipelines")
    for shard in made.shards:
        exact = made.count * shard.share / sum(s.share for s in made.shards)
        console.print(f"  pipeline {shard.pipeline}: {shard.share} a step -> {shard.size:,} "
                      f"samples (exactly {exact:,.2f}) in {escape(shard.file)}",
                      highlight=False)
    console.print(f"largest class-share gap {made.deviation:.2%} (tolerance "
                  f"{made.tolerance:.2%}); chi-squared {made.chi_squared:.3g} on "
                  f"{made.degrees} degrees of freedom, p = {made.p_value:.3f}")
    console.print(f"wrote {escape(str(out))}/")


def for_data(plans: list[Plan], graph: ModelGraph, cluster: ClusterSpec,
             profile: DataProfile, source: str) -> list[Plan]:
    """`planner solve --data-profile`: the plans ranked by their expected step on the
    profile's lengths (`planner.data.choose`), the ranking shown on stderr."""
    from cost_models.model import AnalyticalCostModel
    from planner.data.choose import DRAWS, rank_for_data

    ranked = rank_for_data(plans, graph.layers, AnalyticalCostModel(cluster), profile)
    err_console.print(f"On the data ({escape(source)}: mean length {profile.mean:,.0f}, "
                      f"p99 {profile.quantile(0.99):,.0f}; {DRAWS} steps drawn, packed "
                      "balanced), the solver's best plans:", soft_wrap=True)
    for rank, candidate in enumerate(ranked, 1):
        order = plans.index(candidate.plan) + 1
        err_console.print(
            f"  {rank}. solver's #{order}: expected step {fmt_seconds(candidate.expected)} "
            f"(slowest {fmt_seconds(candidate.slowest)}, idle {candidate.idle:.0%}; at mean "
            f"length {fmt_seconds(candidate.mean_step)}; all samples full length "
            f"{fmt_seconds(candidate.plan.prediction.step_time)})", highlight=False,
            soft_wrap=True)
    return [candidate.plan for candidate in ranked]


def register(app: typer.Typer) -> None:
    app.command("data-profile")(data_profile)
    app.command("partition")(partition)
