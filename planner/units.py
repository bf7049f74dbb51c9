"""Human units at the file/CLI boundary: parse "100Gbps", "25 GB/s", "80GiB", "5us";
format SI values back for people. Inside the planner everything is SI (bytes,
seconds, bytes/s, FLOP/s).

Case is read where it cannot change the meaning, and only there:

- Prefixes of sizes, rates and FLOP/s are read in any case (`100gbps`, `80giB`,
  `312 tflops`): nothing here is measured in milli- or pico-units, so `m` and `p`
  can only mean mega and peta. Durations keep theirs (`ms` is milliseconds).
- Bits or bytes per second: the letter B decides where it stands alone, `B/s`
  bytes and `b/s` bits (`/s` in any case), so `25GB/s` and `25Gb/s` stay apart.
  `Bps` (a capital B, then lower case) is bytes: that mixed spelling exists to
  say so; `bps` in any other case (`gbps`, `GBPS`) is bits, as networks are
  rated. Spelled out, `bit/s` and `bits/s` are bits in any case (`25GBIT/s`).
"""

from __future__ import annotations

import math
import re

from planner.errors import PlannerError

_NUMBER = r"(?P<num>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
_PREFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_BINARY = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9, "min": 60.0}

_ANY_PREFIX = r"(?P<prefix>(?i:[kmgtp]i?)?)"  # decimal or binary, any case (see above)
_BYTES_RE = re.compile(rf"^\s*{_NUMBER}\s*{_ANY_PREFIX}(?P<unit>B|bytes?)?\s*$")
_RATE_RE = re.compile(  # (with a sign: "-100Gbps" is refused as not positive, not unread)
    rf"^\s*(?P<sign>-?){_NUMBER}\s*{_ANY_PREFIX}(?P<unit>(?i:bits?/s|bps|b/s))\s*$")
_TIME_RE = re.compile(rf"^\s*{_NUMBER}\s*(?P<unit>s|ms|us|µs|ns|min)?\s*$")
_FLOPS_RE = re.compile(rf"^\s*{_NUMBER}\s*(?P<prefix>(?i:[kmgtp])?)(?i:flop/s|flops)?\s*$")


def _bad(what: str, text: object, examples: str, field: str | None,
         guess: str | None = None) -> PlannerError:
    where = f" (for {field})" if field else ""
    advice = (f"did you mean {guess!r}? Write it" if guess else "write it") + f" like {examples}."
    return PlannerError("bad-unit", f"Cannot read {text!r} as {what}{where}; {advice}")


def _finite(value: float, text: object, what: str) -> None:
    """An error for NaN or an infinite value (`.nan`, `.inf` or 1e400 in a file)."""
    if not math.isfinite(value):
        raise PlannerError("bad-value", f"{what} must be a finite number (got {text}).")


def _scale(prefix: str) -> float:
    """The factor of a prefix as written in any case: 'g' and 'G' 1e9, 'gi' 2**30."""
    canonical = prefix[:1].upper() + prefix[1:].lower()
    return _BINARY.get(canonical) or _PREFIX[canonical]


def _in_bits(unit: str) -> bool:
    """Whether a rate unit counts bits (else bytes), by the rule above."""
    if unit.lower().startswith("bit"):
        return True
    if unit.lower() == "bps":
        return unit != "Bps"
    return unit.startswith("b")  # b/s, B/s


def parse_bytes(text: str | float | int, field: str | None = None) -> float:
    """'80GiB' -> 85899345920.0; '40 GB' -> 4e10; plain numbers are bytes."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        m = _BYTES_RE.match(str(text))
        if not m:
            raise _bad("a size", text, "'80GiB', '40 GB' or '512MiB'", field)
        value = float(m["num"]) * _scale(m["prefix"])
    _finite(value, text, field or "size")
    if value < 0:
        raise PlannerError("bad-value", f"{field or 'size'} must not be negative (got {text}).")
    return value


def parse_bandwidth(text: str | float | int, field: str | None = None) -> float:
    """'100Gbps' -> 1.25e10 bytes/s; '25 GB/s' -> 2.5e10; plain numbers are bytes/s."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        m = _RATE_RE.match(str(text))
        if not m:
            per_second = f"{str(text).strip()}/s"  # "25 Gbit", "40GB": an amount, not a rate
            raise _bad("a bandwidth", text, "'100Gbps', '25 GB/s' or '600GB/s'", field,
                       per_second if _RATE_RE.match(per_second) else None)
        bits = _in_bits(m["unit"])
        value = (-1.0 if m["sign"] else 1.0) * float(m["num"]) * _scale(m["prefix"]) / (
            8.0 if bits else 1.0)
    _finite(value, text, field or "bandwidth")
    if value <= 0:
        raise PlannerError("bad-value", f"{field or 'bandwidth'} must be positive (got {text}).")
    return value


def parse_duration(text: str | float | int, field: str | None = None) -> float:
    """'5us' -> 5e-6 s; plain numbers are seconds."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        m = _TIME_RE.match(str(text))
        if not m:
            raise _bad("a duration", text, "'5us', '1.5ms' or '0.002s'", field)
        scale = _TIME[m["unit"] or "s"]
        # divide by 1e6 rather than multiply by 1e-6: "5us" is exactly 5e-06
        value = float(m["num"]) / round(1 / scale) if scale < 1 else float(m["num"]) * scale
    _finite(value, text, field or "duration")
    if value < 0:
        raise PlannerError("bad-value", f"{field or 'duration'} must not be negative (got {text}).")
    return value


def parse_flops(text: str | float | int, field: str | None = None) -> float:
    """'312 TFLOPS' -> 3.12e14 FLOP/s; plain numbers are FLOP/s."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        m = _FLOPS_RE.match(str(text))
        if not m:
            raise _bad("a compute rate", text, "'312 TFLOPS' or '19.5TFLOP/s'", field)
        value = float(m["num"]) * _scale(m["prefix"])
    _finite(value, text, field or "compute rate")
    if value <= 0:
        raise PlannerError("bad-value", f"{field or 'compute rate'} must be positive "
                           f"(got {text}).")
    return value


def _si(value: float, unit: str, base: float = 1000.0, prefixes: str = " kMGTPE") -> str:
    for i, p in enumerate(prefixes):
        if abs(value) < base ** (i + 1) or i == len(prefixes) - 1:
            scaled = value / base**i
            prefix = p.strip()
            return f"{scaled:.3g} {prefix}{unit}"
    return f"{value:g} {unit}"


def fmt_bytes(n: float) -> str:
    """Binary prefixes: 1.5 GiB."""
    for unit, scale in (("TiB", 2.0**40), ("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_flops(n: float) -> str:
    return _si(n, "FLOP")


def fmt_rate(n: float) -> str:
    return _si(n, "B/s")


def fmt_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    if abs(s) < 1e-9:  # float noise (sums that cancel), not a duration
        return "0 µs"
    return f"{s * 1e6:.3g} µs"


def fmt_count(n: float) -> str:
    """Parameter counts: 70.6B, 355M."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"
