"""The package's rooms and what each may import (docs/development.md, "Layout"): every import reaches down a
floor or stays on its own, never up (the engines import nothing of ``policy/``); the trained model's room
(``offpolicy.policy``) and ``diagnose`` import nothing from ``train/``, and the head and the batch import
each other in one direction only; no import circle — type-only imports and imports inside functions count."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "offpolicy"


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, modules: set[str] = frozenset()) -> set[str]:
    """Every module ``path`` names in an import, at any depth (functions, ``if TYPE_CHECKING:``). ``from a
    import b`` names ``a.b`` — and ``a`` itself only where ``b`` is not one of ``modules`` (the package's
    own: ``from offpolicy.core import ops`` imports ``offpolicy.core.ops``, not the package's facade)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            subs = {f"{node.module}.{a.name}" for a in node.names}
            names |= subs if subs & set(modules) else subs | {node.module}
    return names


BELOW_TRAIN = [*sorted((SRC / "policy").glob("*.py")), *sorted((SRC / "tasks").glob("*.py")),
               *sorted((SRC / "engines").rglob("*.py")), *sorted((SRC / "speed").glob("*.py")),
               *sorted((SRC / "measure").glob("*.py")), *sorted((SRC / "core").rglob("*.py"))]


@pytest.mark.parametrize("path", BELOW_TRAIN, ids=lambda p: str(p.relative_to(SRC)))
def test_nothing_below_train_imports_from_train(path):
    """On f7091b3 diagnose reached train/update.py, train/loop.py, train/warmstart.py and train/config.py."""
    reached = sorted(n for n in imported(path) if n == "offpolicy.train" or n.startswith("offpolicy.train."))
    assert not reached, f"{path.relative_to(SRC)} imports {reached}"


def test_the_batch_does_not_import_the_head():
    """One direction: the head reads a Batch; the batch module re-exported the head (a circle, type-only on
    the head's side, on f7091b3)."""
    assert not {n for n in imported(SRC / "policy" / "batch.py") if n.startswith("offpolicy.policy.head")}


def graph() -> dict[str, set[str]]:
    """Module → the package's modules it imports (at any depth; ``imported``)."""
    paths = {module_name(p): p for p in SRC.rglob("*.py")}
    return {name: {m for m in imported(path, set(paths)) if m in paths} - {name} for name, path in paths.items()}


def test_diagnose_reaches_no_train_module():
    """Whatever ``offpolicy.measure.diagnose`` and its config import, and what those import in turn (the package's
    facade ``offpolicy`` included), none is a module of ``train/``."""
    edges, seen, todo = graph(), set(), ["offpolicy.measure.diagnose", "offpolicy.measure.diagnose_config"]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(edges.get(name, ()))
    assert not sorted(m for m in seen if m.startswith("offpolicy.train"))


def test_no_import_circle():
    """No module of the package reaches itself through imports — at module level, in a function or under
    ``TYPE_CHECKING``. On f7091b3: ``train/batch.py`` → ``train/head.py`` → ``train/batch.py``."""
    import graphlib

    try:
        tuple(graphlib.TopologicalSorter(graph()).static_order())
    except graphlib.CycleError as err:
        pytest.fail(f"an import circle: {' → '.join(err.args[1])}")


# docs/development.md's table of rooms, bottom up: a module may import its own floor and the floors below
FLOORS = {
    0: {"core.errors", "core.metrics", "core.ops", "core.kl", "core.proximal", "core.kept_set", "trackers",
        "measure.provenance"},
    1: {"core.config", "core.sampling", "core.preset_data", "core.presets", "core.thresholds", "speed"},
    2: {"core.correction", "core.centering", "core.kernels", "core.losses", "core.step", "core.sequence_weight",
        "core", "measure", ""},  # "": the package's facade, offpolicy/__init__.py; core, measure: their __init__
    3: {"engines", "tasks", "integrations", "measure.viewer"},
    4: {"policy"},
    5: {"train", "measure.diagnose", "measure.diagnose_config", "measure.sync_check", "measure.self_check",
        "measure.engine_checks"},
    6: {"cli", "__main__"},
}
FOLDERS = ("core", "measure")  # folders whose modules are rooms of their own (a room is a folder elsewhere)


def room(module: str) -> str:
    """``offpolicy.engines.hf`` → ``engines``; ``offpolicy.core.ops`` → ``core.ops`` (the core's and the measuring
    folder's modules are rooms each); ``offpolicy`` → "" (the facade)."""
    parts = module.split(".")
    if len(parts) > 2 and parts[1] in FOLDERS:
        return f"{parts[1]}.{parts[2]}"
    return parts[1] if len(parts) > 1 else ""


def folder(module: str) -> str:
    """The top-level folder (or file) a module lives in: ``offpolicy.core.kernels.triton`` → ``core``; ``offpolicy``
    → "" (the facade, a file of the package's top)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_loop_between_folders_and_files():
    """Collapse each top-level folder (and each top-level file) into one node: no loop. On 78b0e05
    ``kernels/reference.py`` imported ``centering.py``, which imported ``kernels/common.py`` — a loop between the
    folder and the file that no module-level circle showed (issue #68)."""
    import graphlib

    edges: dict[str, set[str]] = {}
    for a, targets in graph().items():
        edges.setdefault(folder(a), set()).update(folder(b) for b in targets if folder(b) != folder(a))
    try:
        tuple(graphlib.TopologicalSorter(edges).static_order())
    except graphlib.CycleError as err:
        pytest.fail(f"a loop between folders and files: {' → '.join(err.args[1])}")


def floor(module: str) -> int:
    return next(level for level, rooms in FLOORS.items() if room(module) in rooms)


def test_every_module_has_a_floor():
    """A new room is placed in the table (and in docs/development.md) before it can import anything."""
    unplaced = sorted(m for m in graph() if not any(room(m) in rooms for rooms in FLOORS.values()))
    assert not unplaced, f"modules in no room of FLOORS: {unplaced}"


def test_no_import_reaches_up_a_floor():
    """On 65ba3dd: ``engines/hf.py`` imported ``policy/cpu_linear.py`` (floor 3 → 4); the oneDNN linear now
    lives in the ground-floor ``speed/`` room, which both use."""
    upward = sorted(f"{a} → {b}" for a, targets in graph().items() for b in targets if floor(b) > floor(a))
    assert not upward, f"imports from a lower floor up: {upward}"


def test_the_engines_import_nothing_of_the_policy_room():
    reached = sorted(f"{a} → {b}" for a, targets in graph().items() if room(a) == "engines"
                     for b in targets if room(b) == "policy")
    assert not reached


# engines/server/, one module a job (its __init__'s doc), bottom up: a module imports only those before it; the
# package's __init__ re-exports, and no module of it imports the package's own name (the facade) back
SERVER_JOBS = ("transport", "head", "completions", "masks", "concurrency", "sample", "")


def test_the_server_jobs_import_down_only():
    """On 891fd15 ``engines/server.py`` was one 1,179-line module doing six jobs (issue #68 item 4); split, the
    transport knows no protocol, the head no endpoint, and ``/v1/completions`` no sampling mask."""
    package = "offpolicy.engines.server"
    on_disk = {module_name(p).removeprefix(package).lstrip(".") for p in (SRC / "engines" / "server").glob("*.py")}
    assert on_disk == set(SERVER_JOBS), f"engines/server/ holds {sorted(on_disk)}: place each module in SERVER_JOBS"
    order = {job: rank for rank, job in enumerate(SERVER_JOBS)}
    upward = []
    for a, targets in graph().items():
        if a == package or a.startswith(package + "."):
            job = a.removeprefix(package).lstrip(".")
            upward += [f"{a} → {b}" for b in targets if (b == package or b.startswith(package + "."))
                       and order[b.removeprefix(package).lstrip(".")] >= order[job]]
    assert not upward, f"imports up or across the server's jobs: {upward}"

