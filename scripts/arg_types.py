"""argparse ``type=`` callables shared by the scripts: each checks a number before anything starts, so a bad
value is an argparse usage error naming the flag, not a failure minutes into a run."""
from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def int_at_least(low: int, why: str = "") -> Callable[[str], int]:
    """An integer >= ``low``; ``why`` is appended to the bound in the error (e.g. ``" (a number of seeds)"``)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}{why}, got {value}")
        return value

    return parse


def number_above(low: float = 0.0, *, allow_low: bool = False, allow_inf: bool = False,
                 hint: str = "") -> Callable[[str], float]:
    """A finite number > ``low`` (>= ``low`` with ``allow_low``; +inf as well with ``allow_inf``). NaN and -inf are
    always refused. ``hint`` is appended to the error message."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        finite = math.isfinite(value) or (allow_inf and value == math.inf)
        if not finite or value < low or (value == low and not allow_low):
            what = "a number" if allow_inf else "a finite number"
            raise argparse.ArgumentTypeError(
                f"must be {what} {'>=' if allow_low else '>'} {low:g}, got {text!r}{hint}")
        return value

    return parse
