"""The scripts' shared argparse types (scripts/arg_types.py): bounds, NaN/inf, and the message argparse shows."""
import argparse
import math

import pytest

from scripts.arg_types import int_at_least, number_above


def test_int_at_least_takes_the_bound_and_refuses_below_it_and_non_integers():
    parse = int_at_least(1, " (a number of seeds)")
    assert parse("1") == 1 and parse("12") == 12
    with pytest.raises(argparse.ArgumentTypeError, match=r"^must be an integer >= 1 \(a number of seeds\), got 0$"):
        parse("0")
    for bad in ("1.5", "two", "", "nan"):
        with pytest.raises(argparse.ArgumentTypeError, match="is not an integer"):
            parse(bad)


@pytest.mark.parametrize("kwargs, good, bad", [
    ({}, ["1e-9", "3"], ["0", "-1", "nan", "inf", "-inf"]),
    ({"allow_low": True}, ["0", "3"], ["-0.5", "nan", "inf"]),
    ({"allow_inf": True}, ["inf", "2.5"], ["0", "nan", "-inf"]),
    ({"low": 2.0, "allow_low": True}, ["2", "2.5"], ["1.999", "nan"]),
])
def test_number_above_bounds(kwargs, good, bad):
    parse = number_above(**kwargs)
    for text in good:
        assert parse(text) == float(text)
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)


def test_number_above_message_carries_the_hint_and_the_text_as_given():
    with pytest.raises(argparse.ArgumentTypeError) as exc:
        number_above(hint=" (leave it out for no limit)")("nan")
    assert str(exc.value) == "must be a finite number > 0, got 'nan' (leave it out for no limit)"
    assert math.isinf(number_above(allow_inf=True)("+inf"))
