"""tests/parallel_plan.py: the plan that spreads the suite over xdist workers — tests that share an
expensive fixture stay together, the longest units start first, a shared build happens once — and the
warm start that two runs beside each other train once (issue #35)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import parallel_plan as plan

HERE = Path(__file__).resolve().parent
# the inner pytest runs load pytest-xdist (where they use it) and no other installed plugin: the plan's groups are
# pytest's and xdist's business, and each interpreter would otherwise import every plugin installed here (hydra's,
# jaxtyping's, hypothesis', …: ~2 s of CPU a process, three processes in the two-worker run)
ONLY_XDIST = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}


class FakeItem:
    """What the plan reads of a pytest item: its node id and its marks."""

    def __init__(self, nodeid: str, group: str | None = None, slow: bool = False):
        self.nodeid = nodeid
        self.marks = ([pytest.mark.xdist_group(group).mark] if group else []) + ([pytest.mark.slow.mark] if slow else [])

    def iter_markers(self, name):
        return (m for m in self.marks if m.name == name)

    def get_closest_marker(self, name):
        return next(self.iter_markers(name), None)


def test_longest_units_first_a_group_together_ties_in_collected_order():
    items = [FakeItem("t.py::short_a"), FakeItem("t.py::g1", group="g"), FakeItem("t.py::long"),
             FakeItem("t.py::short_b"), FakeItem("u.py::g2", group="g"), FakeItem("u.py::new_slow", slow=True),
             FakeItem("u.py::new")]
    known = {"t.py::long": 50.0, "t.py::g1": 20.0, "u.py::g2": 20.0, "t.py::short_a": 1.0, "t.py::short_b": 1.0}
    plan.longest_first(items, known)
    # the group (40 s) after the 50 s test, its tests together in collected order; an unseen slow test is
    # assumed long (30 s), an unseen plain one short (0.2 s); equal weights keep the collected order
    assert [i.nodeid for i in items] == ["t.py::long", "t.py::g1", "u.py::g2", "u.py::new_slow", "t.py::short_a",
                                         "t.py::short_b", "u.py::new"]


def test_group_suffix_is_stripped_but_not_inside_a_parameter():
    assert plan.strip_group("tests/a.py::t[x]@vllm") == "tests/a.py::t[x]"
    assert plan.strip_group("tests/a.py::t[user@host]") == "tests/a.py::t[user@host]"
    assert plan.strip_group("tests/a.py::t") == "tests/a.py::t"


def test_recorded_durations_merge_and_drop_the_short_tests(tmp_path):
    path = tmp_path / "durations.json"
    path.write_text(json.dumps({"a::old": 3.0, "a::kept": 2.0}))
    plan.record({"a::old": 0.1, "a::new": 7.04, "a::tiny": 0.2}, path)
    assert plan.load_durations(path) == {"a::kept": 2.0, "a::new": 7.0}  # a::old now takes 0.1 s: it leaves
    assert plan.load_durations(tmp_path / "missing.json") == {}


def test_worker_count_follows_cores_and_memory(monkeypatch):
    pages = {"SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(plan.os, "sysconf", lambda name: pages.get(name, 0))
    for gib, cores, want in ((24, 2, 2), (24, 16, 4), (12, 16, 2), (4, 16, 1)):
        monkeypatch.setattr(plan.os, "sched_getaffinity", lambda pid, c=cores: set(range(c)), raising=False)
        pages["SC_PHYS_PAGES"] = gib * 2**30 // 4096
        assert plan.auto_workers() == want, (gib, cores)


def test_a_shared_build_runs_once_for_every_worker(tmp_path, monkeypatch):
    """Two workers asking at once: the second waits for the first's build and gets the same directory;
    a build that raised leaves nothing, so the next caller builds again."""
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    factories = [SimpleNamespace(getbasetemp=lambda w=w: (tmp_path / f"popen-gw{w}").resolve()) for w in (0, 1)]
    calls, got = [], []

    def build(directory: Path) -> None:
        calls.append(directory)
        time.sleep(0.3)  # long enough for the other thread to arrive while this one builds
        (directory / "model.bin").write_text("weights")

    threads = [threading.Thread(target=lambda f=f: got.append(plan.built_once(f, "tiny", build))) for f in factories]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and got[0] == got[1] == tmp_path / "built-once-tiny"
    assert [p.name for p in got[0].iterdir()] == ["model.bin"]  # nothing of the plan's inside the build

    def broken(directory: Path) -> None:
        (directory / "half").write_text("")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        plan.built_once(factories[0], "other", broken)
    assert not (tmp_path / "built-once-other").exists()
    assert (plan.built_once(factories[1], "other", build) / "model.bin").exists()


def test_tests_sharing_a_module_or_test_module_session_fixture_are_one_group(tmp_path):
    """A real pytest collection: a module-scoped fixture and a session fixture defined in a test module
    group their file's tests; a conftest session fixture (built per worker) and an explicit group don't."""
    (tmp_path / "conftest.py").write_text(
        "import pytest, sys\n"
        f"sys.path.insert(0, {str(HERE)!r})\n"
        "import parallel_plan\n"
        "@pytest.fixture(scope='session')\n"
        "def per_worker(): return 1\n"
        "@pytest.hookimpl(tryfirst=True)\n"
        "def pytest_collection_modifyitems(items):\n"
        "    parallel_plan.add_groups(items, pytest.mark.xdist_group)\n"
        "    for item in items:\n"
        "        m = item.get_closest_marker('xdist_group')\n"
        "        print('GROUP', item.name, m.args[0] if m else None)\n")
    (tmp_path / "test_a.py").write_text(
        "import pytest\n"
        "@pytest.fixture(scope='module')\n"
        "def engine(): return 1\n"
        "@pytest.fixture(scope='session')\n"
        "def servers(): return 1\n"
        "def test_engine(engine): pass\n"
        "def test_servers(servers): pass\n"
        "def test_plain(per_worker): pass\n"
        "@pytest.mark.xdist_group('memory')\n"
        "def test_explicit(engine): pass\n")
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-s", "-p", "no:cacheprovider",
                          str(tmp_path)], capture_output=True, text=True, cwd=tmp_path, timeout=120, env=ONLY_XDIST)
    groups = dict(line.split()[1:] for line in out.stdout.splitlines() if line.startswith("GROUP"))
    assert groups == {"test_engine": "test_a.py", "test_servers": "test_a.py", "test_plain": "None",
                      "test_explicit": "memory"}, out.stdout + out.stderr


def test_a_group_runs_on_one_worker_in_a_real_two_worker_run(tmp_path):
    """The plan's groups only work if pytest-xdist's loadgroup sees them: it appends ``@group`` to each
    grouped test's node id and schedules by that suffix. pytest 9.2 moved the node id to ``Node._id`` while
    xdist 3.8 still writes ``_nodeid``: the suffix vanished, every group was ignored, and a module fixture
    (a Ray cluster, two vLLM servers) was built on both workers. A real two-worker run over a file whose
    module fixture is shared by six tests: every one of them carries the suffix, runs on one worker, and
    the fixture is built once."""
    (tmp_path / "conftest.py").write_text(
        "import pytest, sys\n"
        f"sys.path.insert(0, {str(HERE)!r})\n"
        "import parallel_plan\n"
        "@pytest.hookimpl(tryfirst=True)\n"
        "def pytest_collection_modifyitems(items):\n"
        "    parallel_plan.add_groups(items, pytest.mark.xdist_group)\n")
    (tmp_path / "test_a.py").write_text(
        "import os, time, pytest\n"
        "LOG = os.path.join(os.path.dirname(__file__), 'log.txt')\n"
        "def note(text):\n"
        "    with open(LOG, 'a') as f: f.write(text + '\\n')\n"
        "@pytest.fixture(scope='module')\n"
        "def engine():\n"
        "    note('built ' + os.environ['PYTEST_XDIST_WORKER'])\n"
        "    return 1\n"
        "@pytest.mark.parametrize('i', range(6))\n"
        "def test_shared(engine, i, request):\n"
        "    time.sleep(0.05)\n"
        "    note('ran ' + os.environ['PYTEST_XDIST_WORKER'] + ' ' + request.node.nodeid)\n"
        "@pytest.mark.parametrize('i', range(6))\n"
        "def test_alone(i):\n"
        "    time.sleep(0.05)\n")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "xdist", "-n", "2",
                          "--dist", "loadgroup", str(tmp_path)], capture_output=True, text=True, cwd=tmp_path,
                         timeout=120, env=ONLY_XDIST)
    assert out.returncode == 0, out.stdout + out.stderr
    log = (tmp_path / "log.txt").read_text().splitlines()
    built = [line for line in log if line.startswith("built")]
    ran = [line.split() for line in log if line.startswith("ran")]
    assert len(ran) == 6 and all(nodeid.endswith("@test_a.py") for _, _, nodeid in ran), log
    assert len({worker for _, worker, _ in ran}) == 1 and len(built) == 1, log


def test_two_runs_beside_each_other_train_the_warm_start_once(tmp_path, monkeypatch):
    """Two `offpolicy train` runs (or two test workers) needing the same warm start: the second waits for
    the first and reuses its model instead of training it again (~15-60 s each)."""
    from offpolicy.policy import warmstart
    from offpolicy.train.config import TrainConfig

    monkeypatch.setenv("OFFPOLICY_CACHE", str(tmp_path))
    trained = []

    def fake_warm_start(cfg, target, progress):
        trained.append(target)
        time.sleep(0.3)
        target.mkdir()
        (target / "warmstart.json").write_text("{}")
        return target

    monkeypatch.setattr(warmstart, "_warm_start", fake_warm_start)
    cfg = TrainConfig()
    paths = []
    threads = [threading.Thread(target=lambda: paths.append(warmstart.default_model(cfg))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(trained) == 1 and paths[0] == paths[1] == trained[0]
    assert [p.name for p in (tmp_path / "warmstart").iterdir() if not p.name.startswith(".")] == [trained[0].name]
