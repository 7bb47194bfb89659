"""Write the shipped arithmetic word problems in GSM8K's JSONL format (seeded, byte-for-byte reproducible).

Each line is ``{"question": …, "answer": …}``; the answer is a short worked solution with GSM8K's
calculator annotations (``<<48/2=24>>``) and ends in ``#### N``. Problems are one or two steps of
+, −, ×, ÷ over small templates; some results are negative (temperatures), some above a thousand
(written with a thousands separator inside the solution, as GSM8K's solutions often do; never after
``####``). Questions are unique; the eval file shares none with the training file.

    python scripts/make_arith_word_problems.py            # writes examples/data/arith_word_problems{,_eval}.jsonl
    python scripts/make_arith_word_problems.py --out-dir /tmp/x --train 400 --eval 100 --seed 0

tests/test_dataset.py checks that the defaults reproduce the committed files exactly.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ["Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kofi", "Lena",
         "Mateo", "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tara"]
ITEMS = ["apples", "stickers", "marbles", "pencils", "cookies", "books", "stamps", "shells", "cards", "beads"]
CONTAINERS = [("box", "boxes"), ("bag", "bags"), ("crate", "crates"), ("jar", "jars"), ("tray", "trays")]


def fmt(n: int) -> str:
    """A number as a solution writes it: thousands separated (``1,250``)."""
    return f"{n:,}"


def _buy(rng: random.Random) -> tuple[str, str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(3, 90), rng.randint(2, 60)
    q = f"{name} has {a} {item}. {name} buys {b} more. How many {item} does {name} have now?"
    return q, f"{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {item} now.", a + b


def _give(rng: random.Random) -> tuple[str, str, int]:
    name, friend, item = *rng.sample(NAMES, 2), rng.choice(ITEMS)
    a = rng.randint(20, 99)
    b = rng.randint(1, a - 1)
    q = f"{name} had {a} {item} and gave {b} of them to {friend}. How many {item} does {name} have left?"
    return q, f"{name} has {a} - {b} = <<{a}-{b}={a - b}>>{a - b} {item} left.", a - b


def _pack(rng: random.Random) -> tuple[str, str, int]:
    (one, many), item = rng.choice(CONTAINERS), rng.choice(ITEMS)
    a, b = rng.randint(12, 150), rng.randint(6, 40)
    q = f"A {one} holds {a} {item}. How many {item} are there in {b} {many}?"
    return q, f"There are {a} * {b} = <<{a}*{b}={a * b}>>{fmt(a * b)} {item} in {b} {many}.", a * b


def _share(rng: random.Random) -> tuple[str, str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    each, friends = rng.randint(2, 25), rng.randint(2, 9)
    total = each * friends
    q = f"{name} shares {total} {item} equally among {friends} friends. How many {item} does each friend get?"
    return q, f"Each friend gets {total} / {friends} = <<{total}/{friends}={each}>>{each} {item}.", each


def _temperature(rng: random.Random) -> tuple[str, str, int]:
    city = rng.choice(["Oslo", "Calgary", "Helsinki", "Harbin", "Denver", "Tromsø"])
    a, b = rng.randint(-8, 12), rng.randint(3, 25)
    q = (f"In {city} the temperature was {a} degrees at noon and fell by {b} degrees by midnight. "
         "What was the temperature at midnight, in degrees?")
    return q, f"At midnight it was {a} - {b} = <<{a}-{b}={a - b}>>{a - b} degrees.", a - b


def _wage(rng: random.Random) -> tuple[str, str, int]:
    name = rng.choice(NAMES)
    rate, hours = rng.randint(8, 45), rng.randint(5, 60)
    earned = rate * hours
    spent = rng.randint(10, earned - 1)
    q = (f"{name} earns ${rate} an hour and works {hours} hours this month, then spends ${spent} on rent and food. "
         f"How many dollars does {name} have left?")
    a = (f"{name} earns {rate} * {hours} = <<{rate}*{hours}={earned}>>{fmt(earned)} dollars.\n"
         f"After spending, {name} has {earned} - {spent} = <<{earned}-{spent}={earned - spent}>>"
         f"{fmt(earned - spent)} dollars left.")
    return q, a, earned - spent


def _pages(rng: random.Random) -> tuple[str, str, int]:
    name = rng.choice(NAMES)
    per_day, days, total_extra = rng.randint(5, 40), rng.randint(2, 14), rng.randint(1, 120)
    read = per_day * days
    book = read + total_extra
    q = (f"{name}'s book has {book} pages. {name} reads {per_day} pages a day for {days} days. "
         "How many pages are left to read?")
    a = (f"{name} reads {per_day} * {days} = <<{per_day}*{days}={read}>>{read} pages.\n"
         f"{book} - {read} = <<{book}-{read}={total_extra}>>{total_extra} pages are left.")
    return q, a, total_extra


TEMPLATES = [_buy, _give, _pack, _share, _temperature, _wage, _pages]


def generate(n: int, seed: int) -> list[dict[str, str]]:
    """``n`` distinct problems, templates in turn, deterministic in ``seed``."""
    rng = random.Random(seed)
    rows, seen = [], set()
    while len(rows) < n:
        question, solution, value = TEMPLATES[len(rows) % len(TEMPLATES)](rng)
        if question in seen:
            continue
        seen.add(question)
        rows.append({"question": question, "answer": f"{solution}\n#### {value}"})
    return rows


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> None:
    here = Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=here / "examples" / "data")
    parser.add_argument("--train", type=int, default=400)
    parser.add_argument("--eval", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows = generate(args.train + args.eval, args.seed)
    rng = random.Random(args.seed + 1)
    rng.shuffle(rows)  # templates mixed across the two files
    write_jsonl(args.out_dir / "arith_word_problems.jsonl", rows[: args.train])
    write_jsonl(args.out_dir / "arith_word_problems_eval.jsonl", rows[args.train:])
    print(f"wrote {args.train} + {args.eval} problems to {args.out_dir}")


if __name__ == "__main__":
    main()
