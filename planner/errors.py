"""The one exception type library code raises for bad input or impossible requests.

The CLI turns a `PlannerError` into a short message and a non-zero exit code;
library users catch it and read `kind`, `message` and `remedies`.
"""

from __future__ import annotations

from collections.abc import Sequence


class PlannerError(Exception):
    """An error a user can act on.

    kind:     a short machine-readable category ("unknown-model", "bad-value",
              "trace-failed", "infeasible", ...).
    message:  one paragraph naming the field, device or stage at fault.
    remedies: things to try, printed as a numbered list.
    """

    def __init__(self, kind: str, message: str, remedies: Sequence[str] = ()) -> None:
        self.kind = kind
        self.message = message
        self.remedies = tuple(remedies)
        super().__init__(self.render())

    def render(self) -> str:
        if not self.remedies:
            return self.message
        fixes = "  ".join(f"{i}) {r}" for i, r in enumerate(self.remedies, 1))
        return f"{self.message}\nTry: {fixes}"

    def report(self) -> str:
        """The error as the processes without the CLI's console print it on stderr: the
        paragraph, then the remedies numbered a line each."""
        lines = [f"error: {self.message}"]
        lines += [f"  {i}) {remedy}" for i, remedy in enumerate(self.remedies, 1)]
        return "\n".join(lines)


class Infeasible(PlannerError):
    """No plan exists (kind "infeasible"), and why, for callers that explain it:
    `constraints`, the options as given that rule every plan out (empty if none do),
    and `memory`, whether device memory does (with those constraints, where both)."""

    def __init__(self, message: str, remedies: Sequence[str] = (), *,
                 constraints: Sequence[str] = (), memory: bool = False) -> None:
        super().__init__("infeasible", message, remedies)
        self.constraints = tuple(constraints)
        self.memory = memory


def closest(name: str, candidates: Sequence[str], n: int = 3) -> list[str]:
    """The candidates closest to `name`, for "did you mean" messages."""
    import difflib

    lowered = {c.lower(): c for c in candidates}
    hits = difflib.get_close_matches(name.lower(), list(lowered), n=n, cutoff=0.4)
    extends = [c for c in candidates if c.lower().startswith(name.lower())]  # A100 -> A100-40G
    prefix = [c for c in candidates if c.lower().startswith(name.lower()[:3])]
    out: list[str] = []
    for c in [*extends, *(lowered[h] for h in hits), *prefix]:
        if c not in out and len(out) < n:
            out.append(c)
    return out


def unknown_name_error(kind: str, what: str, name: str, candidates: Sequence[str],
                       listing_command: str) -> PlannerError:
    """A PlannerError for a name that is not in a registry, with suggestions."""
    near = closest(name, candidates)
    hint = f" Did you mean {', '.join(repr(c) for c in near)}?" if near else ""
    return PlannerError(
        kind,
        f"Unknown {what} {name!r}.{hint}",
        [f"run `{listing_command}` to list every {what}"],
    )
