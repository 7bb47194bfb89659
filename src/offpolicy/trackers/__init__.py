"""Experiment trackers: ``log_to=[tensorboard, wandb, mlflow, trackio]`` (``metrics.jsonl`` is always written).

One small protocol (``Tracker``), one adapter module per tracker (``tensorboard.py``, ``wandb.py``,
``mlflow.py``, ``trackio.py``), each imported only when named, so a tracker that is not installed costs
nothing. Every tracker receives, under the names ``metrics.jsonl`` uses:

* the run's config, once (``log_config``);
* each step's finite scalars (``log_metrics``; a NaN, written as null to metrics.jsonl, is left out);
* tables of rows (``log_table``): the saved samples of a step (prompt, completion, reward, mean/max |log ρ|),
  diagnose's what-if table;
* PNG plots (``log_images``) and, for diagnose, a flat summary (``log_summary``).

Offline by default: W&B in ``WANDB_MODE=offline`` under ``<run>/wandb``, MLflow's SQLite store
``<run>/mlflow.db``, Trackio's SQLite store ``<run>/trackio`` (each unless its own environment variable says
otherwise: ``WANDB_MODE``, ``WANDB_DIR``, ``MLFLOW_TRACKING_URI``, ``TRACKIO_DIR``). Where each one wrote goes to
``<run>/trackers.json``.

No credential is written or printed: a tracking URI such as ``http://user:password@host`` (MLflow sends the
user information as HTTP basic auth) is kept as given for the tracker itself, but trackers.json, the run's
last line, the config the trackers store and every error line show it as ``http://***@host``; a query
parameter named like a secret (``?token=``, ``&sig=``) and the value of any environment variable named like
one (``*KEY*``, ``*TOKEN*``, ``*SECRET*``, ``*PASSWORD*``, ``*AUTH*``, ``*CREDENTIAL*``: ``WANDB_API_KEY``,
``HF_TOKEN``, ``MLFLOW_TRACKING_PASSWORD``, ...) become ``***`` too (``redact``).

A short password is still a password (issue #67: values under 8 characters had been left alone). The rule, by
length of the value:

* 8 characters or more, of any variable named as above: replaced wherever it appears, inside words too.
* 3 to 7 characters: replaced where it stands as a whole token (not inside a longer run of letters and digits:
  ``admin`` goes in ``user admin``, ``:admin@`` and ``'admin'``, not in ``administrator``), and only for a variable
  whose name holds a credential as a word of its own (``KEY``, ``APIKEY``, ``TOKEN``, ``SECRET``, ``PASSWORD``,
  ``PASSWD``, ``PASS``, ``PASSPHRASE``, ``CREDENTIAL(S)``: ``HF_TOKEN``, ``MLFLOW_TRACKING_PASSWORD``; not
  ``TOKENIZERS_PARALLELISM`` or ``MAX_NEW_TOKENS``, whose short values are counts and flags), and never a flag's
  word (``true``, ``false``, ``yes``, ``off``, ``none``, ``null``, ``auto``). Substring matching of a short value
  would turn ordinary text into ``***`` (``ail`` in every ``failed``); a whole token is where a printed secret
  stands, since a tool that repeats one puts it between delimiters (a URL's ``:`` and ``@``, quotes, spaces).
* 1 or 2 characters: never. Such a value (``1``, ``on``, ``42``) matches in nearly every line, and a secret that
  short protects nothing against guessing.

The same holds for a URL's password found in any variable (``http://user:pw@host``).

Failures never stop a run: a tracker that is missing or fails to start is one line before training
(``open_trackers``), and one that fails mid-run is reported once and left out from then on
(``Trackers``); ``metrics.jsonl`` and the other trackers go on.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import math
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console
from rich.text import Text

NAMES = ("tensorboard", "wandb", "mlflow", "trackio")
# the pip extra that installs each one (pyproject's optional-dependencies)
EXTRAS = {"tensorboard": "train", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}
SAMPLE_COLUMNS = ["step", "prompt", "completion", "answer", "reward", "advantage", "tokens", "finished",
                  "outside_support", "abs_log_ratio_mean", "abs_log_ratio_max"]


# the user information of a URL (``scheme://user:password@``, up to its last ``@`` before the path), a query
# parameter named like a secret, an environment variable named like one (its value is redacted wherever it shows)
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<info>[^/?#\s]*)@")
_SECRET_QUERY = re.compile(r"(?P<name>[?&;][^=&#\s]*(?:key|token|secret|passw(?:or)?d|credential|auth|sig)"
                           r"[^=&#\s]*=)[^&;#\s]+", re.IGNORECASE)
# not PWD (the working directory), not AUTHOR (git's GIT_AUTHOR_NAME)
_SECRET_ENV = re.compile(r"key|token|secret|passw(?:or)?d|credential|auth(?!or)", re.IGNORECASE)
# a short value is a secret only where the name holds one of these as a word ("_"-separated): HF_TOKEN, not
# TOKENIZERS_PARALLELISM or MAX_NEW_TOKENS
_SECRET_WORDS = frozenset({"KEY", "APIKEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "PASS", "PASSPHRASE",
                           "CREDENTIAL", "CREDENTIALS"})
_FLAG_WORDS = frozenset({"true", "false", "yes", "off", "none", "null", "auto"})
LONG_SECRET = 8  # a secret of this many characters or more is redacted wherever it appears, inside words too
MIN_SECRET = 3  # shorter values are never redacted: they match in nearly every line (the module's doc)


def _short_secret_name(name: str) -> bool:
    return not _SECRET_WORDS.isdisjoint(re.split(r"[^A-Z0-9]+", name.upper()))


def env_secrets(environ: dict[str, str] | None = None) -> list[str]:
    """The strings never to show: the values of secret-named environment variables (``os.environ`` by
    default) and the user information (and its password alone) of every URL a variable holds, longest first.
    A value under ``LONG_SECRET`` characters only where its variable's name holds a credential word and it is
    no flag's word; none under ``MIN_SECRET`` (the module's doc says why)."""
    found = set()
    for name, value in (os.environ if environ is None else environ).items():
        if len(value) >= LONG_SECRET and _SECRET_ENV.search(name):
            found.add(value)
        elif len(value) >= MIN_SECRET and _short_secret_name(name) and value.lower() not in _FLAG_WORDS:
            found.add(value)
        # up to the last @: a password typed with a raw / ? or # (a URL that then fails, and whose error
        # repeats it) is found too; a path holding an @ (no ":" before its first /) is not user information
        _, scheme, rest = value.strip().partition("://")
        info = rest.rpartition("@")[0]
        if scheme and info and (":" in info.split("/")[0] or "/" not in info):
            found.update(v for v in (info, info.partition(":")[2]) if len(v) >= MIN_SECRET)
    return sorted(found, key=len, reverse=True)


def _secret_pattern(secret: str) -> re.Pattern[str]:
    """A short secret as a whole token: not preceded (if it starts with a letter or digit) nor followed (if it
    ends with one) by a letter or digit. ``_`` separates, as in ``HF_TOKEN``."""
    before = r"(?<![^\W_])" if secret[0].isalnum() else ""
    after = r"(?![^\W_])" if secret[-1].isalnum() else ""
    return re.compile(before + re.escape(secret) + after)


def redact(text: str, secrets: list[str] | None = None) -> str:
    """``text`` without credentials: a URL's user information as ``***`` (``http://user:pw@host`` →
    ``http://***@host``), a secret-named query parameter's value (``?token=…``) as ``***``, and each of
    ``secrets`` (``env_secrets()`` by default) as ``***``: one of ``LONG_SECRET`` characters or more wherever it
    appears, a shorter one where it stands as a whole token, one under ``MIN_SECRET`` characters never."""
    for secret in env_secrets() if secrets is None else secrets:  # first: the patterns below could split one
        if len(secret) >= LONG_SECRET:
            text = text.replace(secret, "***")
        elif len(secret) >= MIN_SECRET and secret in text:
            text = _secret_pattern(secret).sub("***", text)
    text = _USERINFO.sub(lambda m: f"{m['scheme']}***@", text)
    return _SECRET_QUERY.sub(lambda m: f"{m['name']}***", text)


def redact_data(data: Any, secrets: list[str] | None = None) -> Any:
    """``data`` (dicts, lists, strings) with every string ``redact``-ed; other values as they are."""
    secrets = env_secrets() if secrets is None else secrets
    if isinstance(data, str):
        return redact(data, secrets)
    if isinstance(data, dict):
        return {k: redact_data(v, secrets) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [redact_data(v, secrets) for v in data]
    return data


@contextlib.contextmanager
def redacted_stdout() -> Iterator[None]:
    """What a tracker library prints inside (MLflow's "View run" link, Trackio's server URL) goes to stdout
    afterwards, ``redact``-ed."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            yield
    finally:
        if printed.getvalue():
            sys.stdout.write(redact(printed.getvalue()))


class Tracker(Protocol):
    """What ``RunLogger`` and ``diagnose`` hand each tracker. ``open(run_dir, name, config)`` (a module-level
    function of each adapter) starts it; every method may raise — ``Trackers`` catches it."""

    name: str
    where: dict[str, Any]  # where it wrote (trackers.json): directory, URI, project, run id

    def log_metrics(self, step: int, values: dict[str, float]) -> None: ...

    def log_table(self, key: str, step: int, columns: list[str], rows: list[list[Any]]) -> None: ...

    def log_images(self, step: int, images: dict[str, Path]) -> None: ...

    def log_summary(self, values: dict[str, float]) -> None: ...

    def close(self, failed: bool = False) -> None: ...


def finite_scalars(values: dict[str, Any]) -> dict[str, float]:
    """The numbers of ``values`` a tracker stores: ints and finite floats (bools as 0/1), nothing else."""
    out = {}
    for key, value in values.items():
        if isinstance(value, bool):
            value = float(value)
        if isinstance(value, (int, float)) and math.isfinite(value):
            out[key] = float(value)
    return out


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` → ``{"a.b": 1}`` (lists kept as their JSON text): for trackers whose config
    is flat (MLflow's params)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = json.dumps(value) if isinstance(value, (list, dict)) else value
    return out


def sample_rows(step: int, samples: list[dict[str, Any]]) -> list[list[Any]]:
    """``samples.jsonl`` records as table rows in ``SAMPLE_COLUMNS`` order."""
    return [[step if c == "step" else r.get(c) for c in SAMPLE_COLUMNS] for r in samples]


def parse_log_to(value: str | Sequence[str] | None) -> list[str]:
    """``"wandb,mlflow"`` or a list → checked names (duplicates dropped, order kept).

    Raises:
        ValueError: an unknown tracker name (the message lists the known ones).
    """
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    names = []
    for item in (str(i).strip().lower() for i in items):
        if not item or item == "none":
            continue
        if item not in NAMES:
            raise ValueError(f"log_to: unknown tracker {item!r}; known: {', '.join(NAMES)} (metrics.jsonl is always "
                             "written)")
        if item not in names:
            names.append(item)
    return names


class Trackers:
    """The open trackers, each call fanned out and guarded: a tracker that raises is reported once (one
    line naming it, what it was doing and the error) and left out for the rest of the run."""

    def __init__(self, trackers: list[Tracker], console: Console, run_dir: Path | None = None):
        self.trackers = trackers
        self.console = console
        # kept after close: the run's last line says where (never a credential: redact)
        self.where = {t.name: redact_data(t.where) for t in trackers}
        if run_dir is not None and trackers:
            (run_dir / "trackers.json").write_text(json.dumps(self.where, indent=1, default=str))

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def places(self) -> dict[str, str]:
        """Each tracker's store, as the console names it: its directory, log directory or tracking URI."""
        return {name: where.get("dir") or where.get("logdir") or where.get("tracking_uri")
                for name, where in self.where.items()}

    def _each(self, what: str, call: Callable[[Tracker], None]) -> None:
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as err:  # noqa: BLE001 - a tracker never stops the run
                self.trackers.remove(tracker)
                self.console.print(Text(f"log_to: {tracker.name} failed while {what} ({type(err).__name__}: "
                                        f"{_first_line(err)}); it is off for the rest of this run, metrics.jsonl "
                                        "and the other trackers go on", style="yellow"), soft_wrap=True)
                try:
                    tracker.close(failed=True)
                except Exception:  # noqa: BLE001 - already reported
                    pass

    def log_metrics(self, step: int, values: dict[str, Any]) -> None:
        scalars = finite_scalars(values)
        self._each(f"logging step {step}'s metrics", lambda t: t.log_metrics(step, scalars))

    def log_table(self, key: str, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        # a NaN cell (a preset that rejects every token has no weights) as null, as metrics.jsonl writes it:
        # the trackers would otherwise store it three ways (NaN, null, the string "NaN")
        rows = [[None if isinstance(v, float) and not math.isfinite(v) else v for v in row] for row in rows]
        self._each(f"logging the table {key!r}", lambda t: t.log_table(key, step, columns, rows))

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        self.log_table("samples", step, SAMPLE_COLUMNS, sample_rows(step, samples))

    def log_images(self, step: int, images: dict[str, Path]) -> None:
        self._each("logging the plots", lambda t: t.log_images(step, images))

    def log_summary(self, values: dict[str, Any]) -> None:
        scalars = finite_scalars(values)
        self._each("logging the summary", lambda t: t.log_summary(scalars))

    def close(self, failed: bool = False) -> None:
        self._each("closing", lambda t: t.close(failed=failed))
        self.trackers = []


def _first_line(err: BaseException) -> str:
    """The error's first line, as printed: without credentials (MLflow's errors repeat the tracking URI)."""
    text = str(err).strip()
    return redact(text.splitlines()[0]) if text else "no message"


def open_trackers(names: Sequence[str], run_dir: Path, name: str, config: dict[str, Any],
                  console: Console | None = None, start_step: int = 0) -> Trackers:
    """Start each named tracker into ``run_dir`` with ``config``. A tracker whose package is missing, or
    that fails to start, is one line on ``console`` — with the fix — and the run goes on without it."""
    console = console or Console()
    config = redact_data(config)  # a URL anywhere in the config, as trackers.json shows it
    opened = []
    for tracker_name in names:
        module = importlib.import_module(f"offpolicy.trackers.{tracker_name}")
        try:
            opened.append(module.open(run_dir, name, config, start_step=start_step))
        except ImportError as err:
            console.print(Text(f"log_to: {tracker_name} is not installed ({_first_line(err)}); this run goes on "
                               f"without it. Fix: pip install 'offpolicy[{EXTRAS[tracker_name]}]'", style="yellow"),
                          soft_wrap=True)
        except Exception as err:  # noqa: BLE001 - a tracker that cannot start never stops the run
            console.print(Text(f"log_to: {tracker_name} failed to start ({type(err).__name__}: {_first_line(err)}); "
                               "this run goes on without it", style="yellow"), soft_wrap=True)
    return Trackers(opened, console, run_dir)
