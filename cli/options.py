"""Options shared by several commands, as Annotated aliases (one definition each)."""

from __future__ import annotations

from typing import Annotated, Any

import typer
import yaml

from planner.errors import PlannerError

ModelArg = Annotated[str, typer.Argument(
    metavar="MODEL",
    help="A zoo flavor (see `planner models`), package.module:factory, hf:ConfigClass "
         "or a transformers config.json.")]
Batch = Annotated[int, typer.Option("--batch", "-b", help="Samples traced at once.")]
SeqLen = Annotated[int | None, typer.Option("--seq-len", "-s",
                                            help="Sequence length (default: the model's).")]
Dtype = Annotated[str, typer.Option("--dtype", help="Training dtype: bf16, fp16, fp32, tf32.")]
JsonOut = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON to stdout.")]
Force = Annotated[bool, typer.Option("--force", help="Overwrite existing output files.")]
Layers = Annotated[int | None, typer.Option("--layers", help="Number of blocks.",
                                            rich_help_panel="Model shape")]
Hidden = Annotated[int | None, typer.Option("--hidden", help="Hidden size.",
                                            rich_help_panel="Model shape")]
Heads = Annotated[int | None, typer.Option("--heads", help="Attention heads.",
                                           rich_help_panel="Model shape")]
KvHeads = Annotated[int | None, typer.Option("--kv-heads", help="Key/value heads (GQA).",
                                             rich_help_panel="Model shape")]
Ffn = Annotated[int | None, typer.Option("--ffn", help="MLP inner size.",
                                         rich_help_panel="Model shape")]
Vocab = Annotated[int | None, typer.Option("--vocab", help="Vocabulary size.",
                                           rich_help_panel="Model shape")]
Set = Annotated[list[str] | None, typer.Option(
    "--set", metavar="KEY=VALUE", rich_help_panel="Model shape",
    help="Any other shape option or factory keyword, e.g. --set experts=16 "
         "(repeatable).")]


# Constraints shared by `solve`, `what-if` and the session's `constrain`.
def _constraint(flag: str, help_text: str) -> typer.models.OptionInfo:
    return typer.Option(flag, help=help_text, rich_help_panel="Constraints")


Tp = Annotated[int | None, _constraint("--tp", "Tensor-parallel degree.")]
MaxTp = Annotated[int | None, _constraint("--max-tp", "Largest tensor-parallel degree.")]
Pp = Annotated[int | None, _constraint("--pp", "Pipeline stages per pipeline.")]
Dp = Annotated[int | None, _constraint("--dp", "Number of pipelines side by side.")]
MaxDp = Annotated[int | None, _constraint("--max-dp", "Most pipelines side by side.")]
MicroBatch = Annotated[int | None, _constraint("--micro-batch", "Micro-batch size.")]
Recompute = Annotated[str | None, _constraint(
    "--recompute", "none, selective or full (default: the solver picks per stage).")]
Zero = Annotated[int | None, _constraint("--zero", "ZeRO stage 0-3 (default: any).")]
Exclude = Annotated[list[str] | None, _constraint("--exclude",
                                                  "A node not to use (repeatable).")]
FirstStage = Annotated[str | None, _constraint(
    "--first-stage", "Device type every pipeline's first stage (the embedding's) runs on.")]
LastStage = Annotated[str | None, _constraint(
    "--last-stage", "Device type every pipeline's last stage (the head's) runs on.")]
Interleave = Annotated[int | None, _constraint(
    "--interleave", "Model chunks per device: interleaved 1F1B with that many, 1 for plain "
    "1F1B (default: the solver tries 1 to --max-interleave).")]
MaxInterleave = Annotated[int | None, _constraint(
    "--max-interleave", "Most model chunks per device the solver tries (default 1: plain "
    "1F1B; 2 or more searches interleaved 1F1B too, in a longer search).")]
ScheduleChoice = Annotated[str | None, _constraint(
    "--schedule", "1f1b, gpipe (plans of one pipeline class) or interleaved (with "
    "--interleave or --max-interleave); default: the solver tries 1F1B and GPipe, and "
    "interleaved 1F1B as --max-interleave allows.")]
Mixed = Annotated[bool, typer.Option("--mixed/--no-mixed", rich_help_panel="Constraints",
                                     help="Allow pipelines that mix device types.")]
TpPerClass = Annotated[bool, typer.Option(
    "--tp-per-class/--no-tp-per-class", rich_help_panel="Constraints",
    help="Let each pipeline class (pipelines alike) take its own tensor-parallel degree, "
    "e.g. tp 8 on small-memory GPUs beside tp 4 on large ones, and a two-type pipeline's "
    "stages on each type theirs (default: one degree per plan; the larger search takes "
    "longer on large clusters).")]
MixedShareTypes = Annotated[bool, typer.Option(
    "--mixed-share-types/--no-mixed-share-types", rich_help_panel="Constraints",
    help="Let two mixed pipeline classes share device types, e.g. A100 -> V100 beside "
    "A100 -> RTX 4090 (default: they use disjoint types, a cut for speed the solve output "
    "names; with it the search covers every pair and may take much longer).")]
TimeLimit = Annotated[float | None, typer.Option(
    "--time-limit", help="Seconds for the search (the fastest type alone gets at most a "
    "quarter, the whole cluster the rest); return the best plan found by then (the report "
    "says how far from optimal it may be; Ctrl-C does the same at any time). Baselines and "
    "predictions come after it.")]


def overrides(*, layers: int | None = None, hidden: int | None = None,
              heads: int | None = None, kv_heads: int | None = None, ffn: int | None = None,
              vocab: int | None = None, settings: list[str] | None = None) -> dict[str, Any]:
    """Shape overrides from the shape options and KEY=VALUE settings."""
    out: dict[str, Any] = {k: v for k, v in dict(layers=layers, hidden=hidden, heads=heads,
                                                 kv_heads=kv_heads, ffn=ffn,
                                                 vocab=vocab).items() if v is not None}
    for item in settings or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise PlannerError("bad-option", f"--set {item!r} must look like KEY=VALUE.")
        text = value.strip()
        if text.startswith("(") and text.endswith(")"):  # a tuple, as Python writes it
            text = f"[{text[1:-1]}]"
        parsed = yaml.safe_load(text) if text else ""
        name = key.strip().replace("-", "_")
        if name in out:
            raise PlannerError("bad-option", f"--set {item!r} sets {name}, which another option "
                               "sets too.", ["give each shape option once"])
        out[name] = tuple(parsed) if isinstance(parsed, list) else parsed
    return out
