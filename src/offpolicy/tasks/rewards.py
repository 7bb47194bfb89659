"""Verifiable rewards for ``task: dataset``: ``exact``, ``number``, ``boxed`` or a user's function.

Every reward maps ``(completion, reference)`` to a float; the built-ins return 1.0 or 0.0.

* ``exact``   — ``completion.strip() == reference.strip()``, with a GSM8K reference (``… #### 72``)
  reduced to its final answer first.
* ``number``  — the *last* number in the completion equals the reference's number (after GSM8K's
  ``####`` when present, else the reference's last number). Numbers may be negative, carry
  thousands separators (``1,234``), decimals (``0.50``) or be a fraction (``3/4``); they are compared
  exactly as rationals (``0.5 == 1/2 == 0.50``). A completion without a number scores 0.
* ``boxed``   — the content of the last ``\\boxed{…}`` (braces balanced) equals the reference's (its
  own last ``\\boxed{}`` if it has one, else its GSM8K answer, else the whole reference) after light
  LaTeX normalisation (``normalize_latex``); two contents that both read as numbers compare as
  numbers. No ``\\boxed{}`` in the completion scores 0.
* ``package.module:function`` — ``function(completion, reference)`` imported at config time; it must
  return a finite real number (``bool`` counts: True = 1.0; text such as ``"1.0"`` is refused).
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable
from fractions import Fraction

BUILTIN = ("exact", "number", "boxed")
RewardFn = Callable[[str, str], float]

# a number: optional sign, digits with optional thousands groups, optional decimals, optional /denominator;
# or a bare decimal (.5). Thousands groups need exactly three digits, so "1,2" is two numbers, not 12.
_NUMBER = re.compile(r"(?<![\w.])[-−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?|[-−]?\.\d+")
_USER_SPEC = re.compile(r"^[A-Za-z_][\w]*(?:\.[A-Za-z_][\w]*)*:[A-Za-z_]\w*$")


def gsm8k_answer(reference: str) -> str:
    """The final answer of a GSM8K-style reference: the text after the last ``####`` (else all of it)."""
    _, sep, tail = reference.rpartition("####")
    return (tail if sep else reference).strip()


def parse_number(text: str) -> Fraction | None:
    """``text`` (one number as ``_NUMBER`` matches it) as an exact rational; None if it is not one.

    ``"-1,234.50"`` → −2469/2; ``"3/4"`` → 3/4; ``"1/0"`` → None (no value, never an exception).
    """
    text = text.strip().replace("−", "-").replace(",", "").replace(" ", "")
    try:
        if "/" in text:
            num, den = text.split("/", 1)
            return Fraction(num) / Fraction(den) if Fraction(den) != 0 else None
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def last_number(text: str) -> Fraction | None:
    """The last number written in ``text`` (see ``_NUMBER``), or None when there is none."""
    for match in reversed(_NUMBER.findall(text)):
        value = parse_number(match)
        if value is not None:
            return value
    return None


def reference_number(reference: str) -> Fraction | None:
    """The number a reference asks for: GSM8K's ``#### N`` when present, else its last number."""
    return last_number(gsm8k_answer(reference))


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{…}`` (or ``\\fbox{…}``) in ``text``, braces balanced; None if none
    (an unclosed box counts as none)."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def _frac_to_slash(text: str) -> str:
    """``\\frac{a}{b}`` / ``\\frac12`` → ``(a)/(b)`` style ``a/b`` (simple operands only keep no parens)."""
    group = r"\{((?:[^{}]|\{[^{}]*\})*)\}"  # braces nested one level: \frac{\sqrt{3}}{2}
    pattern = re.compile(rf"\\frac\s*(?:{group}|(\w))\s*(?:{group}|(\w))")
    while True:
        new = pattern.sub(lambda m: _wrap(m.group(1) or m.group(2)) + "/" + _wrap(m.group(3) or m.group(4)), text)
        if new == text:
            return new
        text = new


def _wrap(operand: str) -> str:
    return operand if re.fullmatch(r"[-\w.]+", operand) else f"({operand})"


def normalize_latex(text: str) -> str:
    """Light LaTeX normalisation for comparing final answers (not a CAS):

    drop ``$`` and ``\\$``, ``\\left``/``\\right``, spacing commands (``\\,`` ``\\!`` ``\\;`` ``\\quad``), ``^\\circ``,
    ``\\%``/``%``, ``\\text{…}``/``\\mathrm{…}`` wrappers (their content stays), a trailing period and all
    whitespace; ``\\dfrac``/``\\tfrac`` → ``\\frac`` → ``a/b``; ``{,}`` → ``,``; ``\\sqrt3`` → ``\\sqrt{3}``;
    ``0.50`` and ``1/2`` stay as written (the caller compares numbers as numbers).
    """
    text = text.replace("\\$", "").replace("$", "").strip()  # math delimiters and escaped dollar signs
    text = re.sub(r"\\(?:text|textbf|mathrm|mathbf|mbox)\s*\{([^{}]*)\}", r"\1", text)
    text = re.sub(r"\\left|\\right|\\[,!;: ]|\\quad|\\qquad|\^\s*\{?\\circ\}?|\\%|%|\\displaystyle", "", text)
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("{,}", ",")
    text = re.sub(r"\\sqrt\s*(\w)", r"\\sqrt{\1}", text)
    text = _frac_to_slash(text)
    text = re.sub(r"\s+", "", text).rstrip(".")
    if text.startswith("{") and text.endswith("}") and last_boxed("\\boxed" + text) == text[1:-1]:
        text = text[1:-1]  # one redundant outer pair of braces
    return text


def _as_number(text: str) -> Fraction | None:
    """``text`` as a number when all of it is one number (``"1,000"``, ``"-3/4"``, ``"(1)/(2)"``)."""
    bare = text.replace("(", "").replace(")", "") if re.fullmatch(r"\(?[-−]?[\d.,]+\)?/\(?[\d.,]+\)?", text) else text
    return parse_number(bare) if _NUMBER.fullmatch(bare) else None


def exact_reward(completion: str, reference: str) -> float:
    return 1.0 if completion.strip() == gsm8k_answer(reference) else 0.0


def number_reward(completion: str, reference: str) -> float:
    got, want = last_number(completion), reference_number(reference)
    return 1.0 if got is not None and want is not None and got == want else 0.0


def boxed_reward(completion: str, reference: str) -> float:
    got = last_boxed(completion)
    if got is None:
        return 0.0
    boxed_ref = last_boxed(reference)
    want = normalize_latex(boxed_ref if boxed_ref is not None else gsm8k_answer(reference))
    got = normalize_latex(got)
    a, b = _as_number(got), _as_number(want)
    if a is not None and b is not None:
        return 1.0 if a == b else 0.0
    return 1.0 if got == want and got != "" else 0.0


BUILTIN_FNS: dict[str, RewardFn] = {"exact": exact_reward, "number": number_reward, "boxed": boxed_reward}


def import_reward(spec: str) -> RewardFn:
    """The function ``package.module:function`` names, imported now.

    Raises:
        ValueError: malformed spec, module not importable, no such attribute, or not callable.
    """
    if not _USER_SPEC.match(spec):
        raise ValueError(f"reward={spec!r}: expected exact, number, boxed or package.module:function "
                         "(e.g. my_rewards:score)")
    module_name, fn_name = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 — any import failure is the user's to fix, named here
        raise ValueError(f"reward={spec!r}: cannot import module {module_name!r} ({type(err).__name__}: {err}). "
                         "Fix: put it on PYTHONPATH (or install it), or use reward=exact|number|boxed") from None
    fn = getattr(module, fn_name, None)
    if fn is None:
        raise ValueError(f"reward={spec!r}: module {module_name!r} has no attribute {fn_name!r}")
    if not callable(fn):
        raise ValueError(f"reward={spec!r}: {module_name}.{fn_name} is a {type(fn).__name__}, not a function")
    return fn


def resolve_reward(spec: str) -> RewardFn:
    """The reward function for ``spec``: a built-in name, or a user's function (imported now)."""
    return BUILTIN_FNS[spec] if spec in BUILTIN_FNS else import_reward(spec)


def checked_value(spec: str, value: object) -> float:
    """A reward function's return value as a finite float: a number (int, float, numpy scalar, a
    one-element tensor) or a ``bool`` (True = 1.0, as documented). Text is refused even when it
    reads as a number (``"1.0"``): a function returning strings has a bug (a comparison's operands,
    a parsed answer returned instead of its score) that ``float()`` would hide.

    Raises:
        ValueError: not a real number (a string, None, a tensor of several values …) or not finite —
        a non-finite reward would poison every advantage of its group.
    """
    if isinstance(value, bool):
        return float(value)
    try:
        if isinstance(value, (str, bytes, bytearray)):
            raise TypeError
        number = float(value)  # ints, floats, numpy scalars, one-element tensors
    except (TypeError, ValueError):
        raise ValueError(f"reward={spec!r} returned {type(value).__name__} {value!r:.60}; it must return a number "
                         "(e.g. 1.0 for correct, 0.0 otherwise), not text") from None
    if not math.isfinite(number):
        raise ValueError(f"reward={spec!r} returned {number}; rewards must be finite")
    return number
