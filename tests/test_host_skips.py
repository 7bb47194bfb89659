"""A host framework that cannot be imported makes its tests skip with the reason, never a collection error."""

from __future__ import annotations

import pytest

from conftest import require_host


def test_a_missing_host_submodule_is_a_skip_that_names_it_and_the_error():
    with pytest.raises(pytest.skip.Exception) as info:
        require_host("json", "offpolicy_no_such_host.losses", why="Host 9.9 is not importable")
    message = str(info.value)
    assert "Host 9.9 is not importable" in message
    assert "offpolicy_no_such_host.losses" in message and "ModuleNotFoundError" in message


def test_a_host_import_that_raises_something_else_is_a_skip_too(tmp_path, monkeypatch):
    (tmp_path / "offpolicy_broken_host.py").write_text("raise RuntimeError('needs a GPU driver')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(pytest.skip.Exception, match="RuntimeError: needs a GPU driver"):
        require_host("offpolicy_broken_host", why="broken")


def test_importable_modules_are_returned_in_order():
    json, math = require_host("json", "math", why="stdlib")
    assert json.dumps([1]) == "[1]" and math.sqrt(4.0) == 2.0
    assert require_host("json", why="stdlib").__name__ == "json"
