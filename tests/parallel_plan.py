"""The suite on every core: how `python -m pytest -q` spreads tests over pytest-xdist workers.

pyproject's ``addopts`` run every invocation with ``-n auto --dist loadgroup --no-loadscope-reorder``
(``-n 0`` runs serially in one process, as before; see docs/development.md). Under ``loadgroup`` each
test is its own unit of work, except tests that share an expensive fixture, which go to one worker
together (one *group*), so that the fixture is built once per run and not once per worker:

- a fixture of scope ``module``, ``class`` or ``package``, or a ``session`` fixture defined in a test
  module (e.g. the two vLLM servers of tests/test_diagnose_server.py): the file's tests that use one are
  one group, named after the file (:func:`add_groups`);
- an explicit ``@pytest.mark.xdist_group("name")``: tests that must not run beside each other (say,
  two memory-heavy ones) or that share state some other way. A test that cannot run in parallel at
  all says why next to that mark.

Session fixtures of ``conftest.py`` (tiny models, the warm-start cache) are built once per worker; the
ones worth building once per *run* go through :func:`built_once`, an on-disk build under a file lock.

The scheduler hands out units in collection order, so each worker reorders its (identical) collection
longest unit first (:func:`longest_first`), by the per-test seconds in ``tests/durations.json``
(``python -m pytest -q --record-durations`` refreshes it): the long tests start at once, and the short
ones fill the gaps at the end, instead of one 100 s test starting last while the other worker idles.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

DURATIONS = Path(__file__).with_name("durations.json")
UNKNOWN_SLOW_S = 30.0  # a `slow` test that durations.json has not seen yet: assume it is long
UNKNOWN_S = 0.2  # any other test it does not list: most tests take well under a second
RECORDED_MIN_S = 0.5  # durations.json lists the tests that take longer; the rest count as UNKNOWN_S
GIB_PER_WORKER = 6  # peak memory of one worker: the bf16/fp32 vLLM servers (two engines) are the biggest
MAX_WORKERS = 4  # beyond four, worker start-up (torch, transformers: ~10 s each) outweighs the gain here
SHARED_SCOPES = ("module", "class", "package")


def auto_workers() -> int:
    """``-n auto``: one worker per usable core, at most :data:`MAX_WORKERS`, and no more than the
    memory holds at :data:`GIB_PER_WORKER` each (2 on the 2-core, 24 GiB CI box)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):  # no sysconf (not Linux/macOS): trust the core count
        memory_gib = GIB_PER_WORKER * cores
    return max(1, min(cores, MAX_WORKERS, int(memory_gib // GIB_PER_WORKER)))


def worker_count() -> int:
    """Workers of this run (1 when serial); set by xdist in each worker's environment."""
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def threads_per_worker() -> int:
    """torch/OpenMP threads for this process: the cores shared out among the workers (≤ 2, as before)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(2, cores // worker_count()))


def shared_fixture_groups(item) -> list[str]:
    """Names of the fixtures ``item`` shares with other tests at more than function scope and that
    would otherwise be built on every worker that runs one of them: module/class/package-scoped ones,
    and session-scoped ones defined in a test module (conftest's session fixtures are per worker)."""
    names = []
    info = getattr(item, "_fixtureinfo", None)
    for name in getattr(item, "fixturenames", ()):
        defs = info.name2fixturedefs.get(name) if info is not None else None
        if not defs:
            continue
        fixture = defs[-1]  # the one this test gets (the closest override)
        where = Path(getattr(fixture, "baseid", "") or "").name
        if fixture.scope in SHARED_SCOPES or (fixture.scope == "session" and where.startswith("test_")):
            names.append(name)
    return names


def add_groups(items, mark_factory) -> None:
    """Group the tests of a file that share a fixture (:func:`shared_fixture_groups`), one group per
    file (two such fixtures of one file may share tests), unless a test has an explicit ``xdist_group``."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None and shared_fixture_groups(item):
            item.add_marker(mark_factory(item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1]))


def strip_group(nodeid: str) -> str:
    """``path::test[param]@group`` → ``path::test[param]`` (xdist appends the group to the node id)."""
    return nodeid.rsplit("@", 1)[0] if nodeid.rfind("@") > nodeid.rfind("]") else nodeid


def load_durations(path: Path = DURATIONS) -> dict[str, float]:
    try:
        return {k: float(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError):
        return {}


def estimate(item, known: dict[str, float]) -> float:
    """Seconds ``item`` is expected to take: as recorded, else a guess from its ``slow`` mark."""
    if item.nodeid in known:
        return known[item.nodeid]
    return UNKNOWN_SLOW_S if item.get_closest_marker("slow") is not None else UNKNOWN_S


def unit_of(item) -> str:
    """The unit xdist's loadgroup schedules ``item`` in: its group, or the test alone."""
    marks = [m.args[0] if m.args else m.kwargs.get("name", "default") for m in item.iter_markers("xdist_group")]
    return "@" + "_".join(sorted(set(map(str, marks)))) if marks else item.nodeid


def longest_first(items, known: dict[str, float]) -> None:
    """Reorder ``items`` in place: units (groups, or single tests) by expected seconds, longest first,
    the tests of a group together and in their collected order; ties keep the collected order."""
    units: dict[str, list] = {}
    for item in items:
        units.setdefault(unit_of(item), []).append(item)
    weight = {u: sum(estimate(i, known) for i in members) for u, members in units.items()}
    order = sorted(units, key=lambda u: -weight[u])  # sorted() is stable: equal weights keep collection order
    items[:] = [item for u in order for item in units[u]]


def record(durations: dict[str, float], path: Path) -> None:
    """Merge this run's per-test seconds (setup + call + teardown) into ``path``: the tests that took
    at least :data:`RECORDED_MIN_S` (a test now quicker than that leaves the file)."""
    merged = {**load_durations(path), **{k: round(v, 1) for k, v in durations.items()}}
    kept = {k: v for k, v in sorted(merged.items()) if v >= RECORDED_MIN_S}
    path.write_text(json.dumps(kept, indent=0) + "\n")


def built_once(tmp_path_factory, name: str, build: Callable[[Path], object]) -> Path:
    """A directory built by ``build(directory)`` once per test run and shared by every xdist worker
    (serially: once per session). A file lock makes the other workers wait for the first one's build
    instead of repeating it; a build that raised leaves no directory behind, so the next caller retries."""
    from filelock import FileLock  # a dependency of torch

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's directory, above each worker's own popen-gwN
    target, done = root / f"built-once-{name}", root / f"built-once-{name}.done"  # the marker outside: the
    with FileLock(str(target) + ".lock"):                                         # directory is only the build's
        if not done.exists():
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir(parents=True)
            try:
                build(target)
            except BaseException:
                shutil.rmtree(target, ignore_errors=True)
                raise
            done.write_text("")
    return target
