"""Training data: every step's global batch, of which each pipeline takes its slice.

Pipelines take consecutive slices of the global batch in plan order (pipeline 0
samples [0, share_0), pipeline 1 the next share_1, ...), so the union is exactly
the batch a single process would train on.

Synthetic (default): the model's own example inputs (random token ids and
next-token targets for language models, random images and labels for vision),
drawn on the CPU from a generator seeded by (seed, step); every rank that needs
data makes the same batch without communicating.

A user hook `package.module:function` supplies real data. It is called as

    function(step: int, start: int, stop: int, *, seq_len: int | None, seed: int)
        -> (inputs, targets)

and must return samples [start, stop) of step `step`'s global batch: `inputs` a
tensor or tuple of tensors (the model's positional inputs) and `targets` what the
model's loss takes, each with stop - start rows (integers in any integer dtype: numpy
tokenizers' int32 ids are widened to the int64 embeddings and cross-entropy take). It
must be deterministic in its
arguments: the first and last stage of a pipeline call it separately (for the
inputs and the targets), and a resumed run calls it again for the same steps. Each
rank calls it twice for its first batch and stops with an error naming the hook
where the two differ.

Variable-length samples (`samples`): a hook may instead return `inputs` and `targets`
as lists (not tuples), one 1-D tensor of token ids and one of targets per sample, of
any lengths up to the plan's sequence length (a sample's targets as long as its ids);
or, without a hook, a data profile (`planner data-profile`, the runtime's `--lengths`)
gives synthetic samples of random tokens whose lengths are drawn from it (seeded by
(seed, step); cut to the plan's sequence length). Every rank then takes the whole step's
samples and packs them (`planner.runtime.packed`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from planner.errors import PlannerError
from planner.models import LoadedModel
from planner.models.user import _import_target

if TYPE_CHECKING:
    from planner.data.profile import DataProfile

Hook = Callable[..., tuple[Any, Any]]

# The target the zoo and transformers losses skip: F.cross_entropy's default ignore_index,
# which they all keep (padding, prompt tokens).
IGNORED_TARGET = -100


def load_hook(target: str) -> Hook:
    try:
        return _import_target(target)
    except PlannerError as exc:
        raise PlannerError("bad-data", exc.message.replace("model factory", "data hook")
                           .replace("Model factory", "Data hook"), exc.remedies) from None


def _rows(tree: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _is_integer(tensor: torch.Tensor) -> bool:
    """Whether `tensor` holds integers that can name a class (not floats, complex or bools)."""
    return not (tensor.dtype.is_floating_point or tensor.dtype.is_complex
                or tensor.dtype == torch.bool)


def _identical(first: Any, second: Any) -> bool:
    """Whether two batches hold the same tensors (NaN equal to NaN) in the same structure."""
    leaves, spec = torch.utils._pytree.tree_flatten(first)
    others, other_spec = torch.utils._pytree.tree_flatten(second)
    if spec != other_spec:
        return False
    for a, b in zip(leaves, others, strict=True):
        if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
            return False
        if not isinstance(a, torch.Tensor):
            if a != b:
                return False
        elif a.shape != b.shape or a.dtype != b.dtype or not torch.equal(
                torch.nan_to_num(a) if a.is_floating_point() else a,
                torch.nan_to_num(b) if b.is_floating_point() else b):
            return False
    return True


def _take(tree: Any, start: int, stop: int) -> Any:
    return torch.utils._pytree.tree_map(
        lambda t: t[start:stop] if isinstance(t, torch.Tensor) else t, tree)


class Batches:
    """Slices of each step's global batch (see the module docstring)."""

    def __init__(self, loaded: LoadedModel, *, global_batch: int, seed: int,
                 hook: str | None = None, vocab: Mapping[int, int] | None = None,
                 classes: int | None = None, lengths: DataProfile | None = None) -> None:
        self.loaded, self.global_batch, self.seed = loaded, global_batch, seed
        self.lengths = lengths  # synthetic variable-length samples' distribution
        self.vocab = dict(vocab or {})  # input -> rows of the embedding it indexes
        self.classes = classes  # classes the loss takes integer targets from (or None)
        self.hook = load_hook(hook) if hook else None
        self.hook_name = hook
        self._cache: tuple[int, Any, Any] | None = None
        self._example: tuple | None = None  # the model's own inputs, one sample on meta
        self._repeated = False  # whether the hook was called twice with the same arguments

    def _synthetic(self, step: int) -> tuple[tuple, Any]:
        if self._cache is not None and self._cache[0] == step:
            return self._cache[1], self._cache[2]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed * 1_000_003 + step)
            args, kwargs, targets = self.loaded.example(self.global_batch, "cpu")
        if kwargs:
            raise PlannerError("unsupported-model", "The model's example inputs include "
                               "keyword arguments; the runtime passes positional inputs only.",
                               ["pass a data hook with --data"])
        self._cache = (step, tuple(args), targets)
        return tuple(args), targets

    def get(self, step: int, start: int, stop: int) -> tuple[tuple, Any]:
        """(inputs, targets) of samples [start, stop) of step `step` (CPU tensors)."""
        if self.hook is None:
            args, targets = self._synthetic(step)
            return _take(args, start, stop), _take(targets, start, stop)
        made = self._call(step, start, stop)
        if not self._repeated:
            self._repeated = True
            if not _identical(made, self._call(step, start, stop)):
                raise PlannerError(
                    "bad-data", f"Data hook {self.hook_name!r} returned different samples "
                    f"when called twice with the same arguments (step {step}, samples "
                    f"{start}-{stop}): the pipelines' first and last stages call it "
                    "separately for the inputs and the targets, and a resumed run calls it "
                    "again, so they would train on samples that do not match.",
                    ["make it a function of (step, start, stop, seq_len, seed) alone: seed "
                     "any random generator from seed and step, and read files by index "
                     "rather than from a shared stream"])
        if not isinstance(made, tuple) or len(made) != 2:
            raise PlannerError("bad-data", f"Data hook {self.hook_name!r} must return "
                               f"(inputs, targets); it returned {type(made).__name__}.")
        inputs, targets = made
        inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        for tensor in _rows((inputs, targets)):
            if tensor.dim() == 0 or tensor.shape[0] != stop - start:
                raise PlannerError(
                    "bad-data", f"Data hook {self.hook_name!r} returned a tensor of shape "
                    f"{tuple(tensor.shape)} for samples {start}-{stop} of step {step}; every "
                    f"tensor needs {stop - start} rows.")
        self._check_like(inputs, targets, stop - start)
        return self._integers_like(inputs, targets)

    def variable(self) -> bool:
        """Whether the samples vary in length (`samples`): a data profile gives their
        lengths, or the hook returns lists (asked once, for one sample of step 0)."""
        if self.lengths is not None:
            return True
        if self.hook is None:
            return False
        made = self._call(0, 0, 1)
        return isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], list)

    def samples(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every sample of step `step` as (token ids, targets), 1-D int64 CPU tensors of
        its own length (see the module docstring)."""
        if self.hook is None:
            return self._synthetic_samples(step)
        made = self._call(step, 0, self.global_batch)
        if not self._repeated:
            self._repeated = True
            if not _identical(made, self._call(step, 0, self.global_batch)):
                self._bad(f"different samples when called twice with the same arguments "
                          f"(step {step}, samples 0-{self.global_batch})",
                          ["make it a function of (step, start, stop, seq_len, seed) alone"])
        if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], list)
                and isinstance(made[1], list)):
            self._bad("other than two lists (token ids and targets, a tensor per sample) for "
                      "variable-length samples", ["return ([ids, ...], [targets, ...])"])
        inputs, targets = made
        if len(inputs) != self.global_batch or len(targets) != self.global_batch:
            self._bad(f"{len(inputs)} inputs and {len(targets)} targets for step {step}; "
                      f"a step has {self.global_batch} samples")
        out = []
        for i, (ids, wanted) in enumerate(zip(inputs, targets, strict=True)):
            out.append(self._sample(step, i, ids, wanted))
        return out

    def _synthetic_samples(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        from planner.data.profile import draw_lengths

        if self.lengths is None or not self.vocab:
            raise PlannerError("bad-data", "Synthetic variable-length samples need a data "
                               "profile (--lengths) and a model that takes token ids.",
                               ["pass a data hook that returns samples with --data"])
        lengths = draw_lengths(self.lengths, self.global_batch,
                               random.Random(self.seed * 1_000_003 + step))
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        size = self.vocab.get(0, min(self.vocab.values()))
        out = []
        for length in lengths:
            ids = torch.randint(0, size, (min(length, self.loaded.seq_len or length) + 1,),
                                generator=generator)
            out.append((ids[:-1], ids[1:]))
        return out

    def _sample(self, step: int, index: int, ids: Any, wanted: Any
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """One variable-length sample, checked: 1-D integer tensors of one length, 1 to
        the sequence length, ids in the vocabulary and targets among the classes."""
        where = f"sample {index} of step {step}"
        for what, tensor in (("token ids", ids), ("targets", wanted)):
            if not isinstance(tensor, torch.Tensor) or tensor.dim() != 1 or not _is_integer(
                    tensor):
                self._bad(f"{what} of {where} as "
                          f"{getattr(tensor, 'shape', type(tensor).__name__)}, not a 1-D "
                          "integer tensor")
        limit = self.loaded.seq_len
        if len(ids) != len(wanted) or not 1 <= len(ids) <= (limit or len(ids)):
            self._bad(f"{where} with {len(ids)} token ids and {len(wanted)} targets; each "
                      f"sample needs as many of both, 1 to {limit} (the plan's sequence "
                      "length)", ["cut long samples to the sequence length"])
        size = self.vocab.get(0)
        if size is not None:
            low, high = (int(v) for v in torch.aminmax(ids))
            if low < 0 or high >= size:
                self._bad(f"{where} with token id {high if high >= size else low}, outside "
                          f"the model's vocabulary of {size:,}")
        if self.classes is not None:
            self._check_classes(wanted, self.classes)
        return ids.to(torch.int64), wanted.to(torch.int64)

    def _call(self, step: int, start: int, stop: int) -> Any:
        try:
            return self.hook(step, start, stop, seq_len=self.loaded.seq_len, seed=self.seed)
        except Exception as exc:
            raise PlannerError("bad-data", f"Data hook {self.hook_name!r} raised "
                               f"{type(exc).__name__}: {exc} (step {step}, samples "
                               f"{start}-{stop}).", ["run the hook by hand with those "
                                                     "arguments"]) from exc

    def _check_like(self, inputs: tuple, targets: Any, rows: int) -> None:
        """An error naming the hook where its batch differs from the model's own example
        inputs in count, type, integer-or-float dtype or the shape past the rows, or holds
        token ids outside the embedding an input indexes (`vocab`) or integer targets
        outside the loss's classes (`classes`): they failed deep in the model or the loss,
        in a traceback on every rank."""
        if self._example is None:  # (one sample on meta: only dtypes and shapes count)
            self._example = self.loaded.example(1, "meta")
        args, _, wanted = self._example
        pairs = [(f"input {i}", got, want) for i, (got, want) in
                 enumerate(zip(inputs, args, strict=False))]
        if len(inputs) != len(args):
            self._bad(f"{len(inputs)} input(s) where the model takes {len(args)}")
        if isinstance(wanted, torch.Tensor):
            pairs.append(("the targets", targets, wanted))
        for what, got, want in pairs:
            if not isinstance(got, torch.Tensor):
                self._bad(f"{what} as {type(got).__name__}, not a tensor")
            if got.dtype.is_floating_point != want.dtype.is_floating_point:
                self._bad(f"{what} as {got.dtype} where the model takes {want.dtype}")
            if got.shape[1:] != want.shape[1:]:
                self._bad(f"{what} of shape {tuple(got.shape)} where the model takes "
                          f"{(rows, *want.shape[1:])} (rows first)")
        for i, size in self.vocab.items():
            if i < len(inputs) and inputs[i].numel():
                low, high = (int(v) for v in torch.aminmax(inputs[i]))
                if low < 0 or high >= size:
                    self._bad(f"input {i} with token id {high if high >= size else low}, "
                              f"outside the model's vocabulary of {size:,} (ids 0-{size - 1:,}"
                              ")", ["encode the text with the model's own tokenizer",
                                    "or solve for a model with a vocabulary that large"])
        if self.classes is not None and isinstance(targets, torch.Tensor):
            self._check_classes(targets, self.classes)

    def _integers_like(self, inputs: tuple, targets: Any) -> tuple[tuple, Any]:
        """The (checked) batch with its integer tensors in the integer dtypes of the
        model's own inputs and targets (`_check_like`'s pairs), where every value fits:
        embeddings and cross-entropy take int64 only."""
        args, _, wanted = self._example

        def like(got: Any, want: Any, what: str) -> Any:
            if not (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)
                    and _is_integer(got) and _is_integer(want) and got.dtype != want.dtype):
                return got
            span = torch.iinfo(want.dtype)
            if got.numel() and (int(got.min()) < span.min or int(got.max()) > span.max):
                self._bad(f"{what} as {got.dtype} with values the model's {want.dtype} "
                          "cannot hold")
            return got.to(want.dtype)

        cast = tuple(like(got, want, f"input {i}") for i, (got, want) in
                     enumerate(zip(inputs, args, strict=True)))
        return cast, like(targets, wanted, "the targets")

    def _check_classes(self, targets: torch.Tensor, classes: int) -> None:
        """Integer targets must be a class of the loss (0 to classes - 1) or the index it
        ignores; float targets (soft labels, regression) are the loss's own business."""
        if not _is_integer(targets):
            return
        counted = targets[targets != IGNORED_TARGET]
        if not counted.numel():
            return
        low, high = (int(v) for v in torch.aminmax(counted))
        if low < 0 or high >= classes:
            self._bad(f"target {high if high >= classes else low}, outside "
                      f"the {classes:,} classes of the model's output (0-{classes - 1:,}, or "
                      f"{IGNORED_TARGET} for a position the loss skips)",
                      [f"make the targets class indices below {classes:,} (for a language "
                       "model: the next token ids, from the model's own tokenizer)",
                       f"mark positions the loss should skip with {IGNORED_TARGET}"])

    def _bad(self, problem: str, remedies: list[str] | None = None) -> None:
        raise PlannerError("bad-data", f"Data hook {self.hook_name!r} returned {problem}.",
                           remedies or ["make it return what the model's own inputs look like "
                                        "(the synthetic data: run without --data)"])
