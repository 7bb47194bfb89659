"""Rewards of task=dataset on hand-written cases (GSM8K references, boxed LaTeX, negatives, thousands
separators, no number at all), properties over generated numbers, and a user's own function."""

from __future__ import annotations

import math
import sys
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from offpolicy.tasks.rewards import (boxed_reward, checked_value, exact_reward, gsm8k_answer, import_reward,
                                     last_boxed, last_number, normalize_latex, number_reward, resolve_reward)

GSM8K = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
         "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")


@pytest.mark.parametrize("completion, reference, expected", [
    ("She sold 72 clips.", GSM8K, 1.0),                       # GSM8K reference: the number after ####
    ("48 + 24 = 72", GSM8K, 1.0),                             # the *last* number counts, not the first
    ("72 clips, or maybe 71", GSM8K, 0.0),                    # ... even when an earlier one was right
    ("The answer is 72.", GSM8K, 1.0),                        # a sentence's full stop is not a decimal point
    ("It fell to -27 degrees.", "#### -27", 1.0),             # negative numbers
    ("It fell to 27 degrees.", "#### -27", 0.0),              # sign matters
    ("−5", "#### -5", 1.0),                                   # the Unicode minus sign
    ("In total 1,234 apples", "#### 1234", 1.0),              # thousands separators
    ("1,234,567", "#### 1234567", 1.0),
    ("That is 1,2", "#### 2", 1.0),                           # "1,2" is a list (1 then 2), not 12
    ("0.50", "#### 1/2", 1.0),                                # decimals and fractions compare as rationals
    ("3/4 of the cake", "#### 0.75", 1.0),
    ("12.5 km", "#### 12.5", 1.0),
    ("12.50", "#### 12.5", 1.0),
    ("12.51", "#### 12.5", 0.0),
    ("I do not know.", GSM8K, 0.0),                           # no number at all: 0
    ("", GSM8K, 0.0),
    ("x/0", "#### 0", 1.0),                                   # "/0" has no digits before it: just 0
    ("72", "seventy-two", 0.0),                               # a reference without a number never matches
    ("72", "the total is 72", 1.0),                           # no ####: the reference's last number
])
def test_number(completion, reference, expected):
    assert number_reward(completion, reference) == expected


def test_number_parsing_details():
    assert last_number("a 1/0 b") is None  # no value (division by zero), never an exception
    assert last_number("-1,234.50") == Fraction(-246_900, 200)  # −1234.5 = −2469/2
    assert last_number("v2 and 3") == 3  # digits inside a word are not a number
    assert gsm8k_answer("work\n#### 1,000 ") == "1,000" and gsm8k_answer("42") == "42"


@pytest.mark.parametrize("completion, reference, expected", [
    (r"So the answer is $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}", 1.0),
    (r"\boxed{\frac{1}{2}}", "#### 0.5", 1.0),                # numbers compare as numbers: 1/2 = 0.5
    (r"\boxed{\frac12}", r"\boxed{\dfrac{1}{2}}", 1.0),       # \frac12 and \dfrac{1}{2}
    (r"\boxed{-\frac{3}{4}}", "-0.75", 1.0),
    (r"\boxed{\frac{3}{4}}", "0.7", 0.0),
    (r"\boxed{1{,}000}", "#### 1000", 1.0),                   # LaTeX's {,} thousands separator
    (r"\boxed{90^\circ}", "90", 1.0),
    (r"\boxed{50\%}", "50", 1.0),
    (r"\boxed{\text{(B)}}", "(B)", 1.0),
    (r"\boxed{x^2 + 1}", "x^2+1", 1.0),                       # whitespace never matters
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}", 1.0),  # nested braces, \sqrt3
    (r"\boxed{\left(1, 2\right)}", "(1,2)", 1.0),
    (r"first \boxed{3} then \boxed{4}", "4", 1.0),            # the last box counts
    (r"first \boxed{4} then \boxed{3}", "4", 0.0),
    ("the answer is 1/2", "1/2", 0.0),                        # no box: 0
    (r"\boxed{1/2", "1/2", 0.0),                              # an unclosed box is no box
    (r"\boxed{}", "", 0.0),                                   # an empty box never matches
])
def test_boxed(completion, reference, expected):
    assert boxed_reward(completion, reference) == expected


def test_boxed_helpers():
    assert last_boxed(r"a \boxed{\frac{a}{b}} b") == r"\frac{a}{b}"
    assert last_boxed(r"\fbox{7}") == "7" and last_boxed("none") is None
    assert normalize_latex(r"\dfrac{x+1}{2}") == "(x+1)/2"  # compound operands keep their parentheses
    assert normalize_latex(r"$\frac{1}{2}$.") == "1/2" and normalize_latex(r"\$5") == "5"


@pytest.mark.parametrize("completion, reference, expected", [
    (" 72 ", GSM8K, 1.0),       # exact: stripped completion vs the reference's final answer
    ("72.", GSM8K, 0.0),        # exact means exact
    ("Paris", "Paris", 1.0),
    ("paris", "Paris", 0.0),
])
def test_exact(completion, reference, expected):
    assert exact_reward(completion, reference) == expected


@given(st.integers(-10**9, 10**9))
def test_number_reads_any_integer_as_written(n):
    """A GSM8K-style reference ``#### n`` matches a completion that writes n with or without thousands
    separators, and never n + 1."""
    reference = f"work\n#### {n}"
    assert number_reward(f"so the total is {n:,} items.", reference) == 1.0
    assert number_reward(f"so the total is {n}", reference) == 1.0
    assert number_reward(f"so the total is {n + 1:,}", reference) == 0.0


@given(st.integers(-999, 999), st.sampled_from([1, 2, 4, 5, 8, 10, 20, 25]))
def test_boxed_fraction_equals_its_decimal(p, q):
    """\\boxed{\\frac{p}{q}} equals the terminating decimal p/q (q's prime factors are 2 and 5)."""
    decimal = f"{p / q:.6f}".rstrip("0").rstrip(".")
    sign = "-" if p < 0 else ""
    assert boxed_reward(rf"\boxed{{{sign}\frac{{{abs(p)}}}{{{q}}}}}", f"#### {decimal}") == 1.0
    assert number_reward(f"it is {p}/{q}", f"#### {decimal}") == 1.0


# ------------------------------------------------------------------------- a user's own function
def test_user_function_is_imported_and_checked(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def score(completion, reference):\n    return float(completion.strip() == reference.strip())\n"
        "def word(completion, reference):\n    return 'yes'\n"
        "NOT_A_FUNCTION = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = resolve_reward("my_rewards:score")
    assert fn("a ", "a") == 1.0 and fn("a", "b") == 0.0
    assert resolve_reward("number") is number_reward
    with pytest.raises(ValueError, match=r"cannot import module 'no_such_mod' \(ModuleNotFoundError"):
        import_reward("no_such_mod:score")
    with pytest.raises(ValueError, match="module 'my_rewards' has no attribute 'missing'"):
        import_reward("my_rewards:missing")
    with pytest.raises(ValueError, match="my_rewards.NOT_A_FUNCTION is a int, not a function"):
        import_reward("my_rewards:NOT_A_FUNCTION")
    with pytest.raises(ValueError, match="expected exact, number, boxed or package.module:function"):
        import_reward("numbr")
    sys.modules.pop("my_rewards", None)


@pytest.mark.parametrize("value, expected", [(1, 1.0), (0.25, 0.25), (True, 1.0), (False, 0.0)])
def test_checked_value_accepts_numbers(value, expected):
    assert checked_value("f", value) == expected


def test_checked_value_refuses_non_numbers():
    import torch

    assert checked_value("f", torch.tensor(0.5)) == 0.5  # a one-element tensor is a number
    with pytest.raises(ValueError, match="reward='f' returned str 'yes'; it must return a number"):
        checked_value("f", "yes")
    with pytest.raises(ValueError, match="returned NoneType None"):
        checked_value("f", None)
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError, match="rewards must be finite"):
            checked_value("f", bad)


@pytest.mark.parametrize("text", ["1.0", "0", b"1", " 1 "])
def test_a_reward_returned_as_text_is_refused(text):
    """Issue #32 item 8: docs/gpu-and-real-data.md says a reward function must return a number (a bool
    counts); ``float("1.0")`` used to let text through."""
    with pytest.raises(ValueError, match=r"must return a number .*not text"):
        checked_value("my_rewards:score", text)


def test_numpy_scalars_and_bools_are_numbers():
    import numpy as np

    assert checked_value("f", np.float32(0.5)) == 0.5 and checked_value("f", np.int64(1)) == 1.0
    assert checked_value("f", np.bool_(True)) == 1.0 and checked_value("f", True) == 1.0
