"""The README and docs/*.md as written: the commands they show run as typed, as far as can be
checked without running them. Static and fast — nothing is trained, sampled or installed.

* every ``offpolicy ...`` command in a shell block parses with the CLI's own parser; its
  ``key=value`` overrides (and YAML config) load through ``load_train_config``; a preset it names
  exists; options quoted inline exist on their subcommand;
* ``pip install "offpolicy[extra]"  # pkg==v`` names an extra of pyproject.toml that pins pkg==v;
* ``python benchmarks/x.py --flag`` names a script that exists and defines each flag;
* every preset name quoted in code (``verl:decoupled_seq_is``) is a preset;
* every repository path quoted (``examples/…yaml``, ``tests/…py``, ``docs/…png``) exists;
* every relative link and image resolves inside the repository, anchors included (GitHub's slugs);
* Python blocks compile, and the ``op.*`` / ``offpolicy.*`` names they use exist (read from the
  source, so a host framework need not be installed);
* the ``ConfigError:`` examples are, verbatim, the messages the code raises.
"""

from __future__ import annotations

import ast
import re
import shlex
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

import offpolicy as op
from offpolicy.core import presets
from offpolicy.cli import build_parser
from offpolicy.core.config import ConfigError, CorrectionConfig, LossConfig
from offpolicy.train.config import HELP_SECTIONS, load_train_config

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
SRC = ROOT / "src"

_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
_INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")
_PRESET = re.compile(r"(?<![\w-])(?:verl|trl|skyrl|openrlhf|slime|areal|nemorl|roll|prime-rl):[A-Za-z0-9_.\-]*[A-Za-z0-9_]")
_PATH = re.compile(r"(?<![\w/.\-])((?:examples|benchmarks|tests|docs|src)/[\w./\-]*\.(?:py|yaml|yml|json|png|md|sh))\b")


def _text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def _blocks(page: Path, langs: tuple[str, ...]) -> list[str]:
    return [body for lang, body in _FENCE.findall(_text(page)) if lang in langs]


def _prose(page: Path) -> str:
    """The page without its fenced blocks (inline code spans are read from this)."""
    return _FENCE.sub("", _text(page))


def _commands(page: Path) -> list[list[str]]:
    """Shell commands of the page's bash blocks: continuation lines joined, comments dropped,
    ``a && b`` split, leading ``VAR=value`` assignments removed."""
    out = []
    for body in _blocks(page, ("bash", "sh", "shell")):
        for line in body.replace("\\\n", " ").splitlines():
            tokens = shlex.split(line, comments=True)
            while tokens:
                cmd = tokens[: tokens.index("&&")] if "&&" in tokens else tokens
                tokens = tokens[len(cmd) + 1:]
                while cmd and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", cmd[0]):
                    cmd = cmd[1:]
                if cmd:
                    out.append(cmd)
    return out


def _all(kind) -> list[tuple[str, object]]:
    return [(p.relative_to(ROOT).as_posix(), item) for p in PAGES for item in kind(p)]


def _ids(items) -> list[str]:
    return [f"{page}:{' '.join(item) if isinstance(item, list) else item}"[:80] for page, item in items]


OFFPOLICY_COMMANDS = [(p, c) for p, c in _all(_commands) if c[0] == "offpolicy"]


def test_the_readme_shows_the_commands_it_promises():
    # the checks below must not pass vacuously: the README's own commands are found
    readme = [c for p, c in OFFPOLICY_COMMANDS if p == "README.md"]
    assert {c[1] for c in readme} >= {"train", "diagnose", "presets"}, readme
    assert any(c[:2] == ["bash", "install.sh"] for c in _commands(README))


@pytest.mark.parametrize(("page", "cmd"), OFFPOLICY_COMMANDS, ids=_ids(OFFPOLICY_COMMANDS))
def test_offpolicy_command_parses_and_its_config_loads(page, cmd):
    try:
        args = build_parser().parse_args(cmd[1:])
    except SystemExit as err:  # argparse prints the reason to stderr
        pytest.fail(f"{page}: `{' '.join(cmd)}` is rejected by the CLI's parser (exit {err.code})")
    if args.command == "presets" and args.name is not None:
        presets.get(args.name)
    if args.command == "train" and args.help:
        assert args.help in HELP_SECTIONS, f"{page}: `{' '.join(cmd)}`: train has no help section {args.help!r}"
    if args.command == "train":
        items = list(args.items)
        path = None
        if items and "=" not in items[0]:
            path = ROOT / items.pop(0)
            assert path.is_file(), f"{page}: `{' '.join(cmd)}` names {path.relative_to(ROOT)}, which does not exist"
        # steps overridden: loading validates every key and value, nothing is run
        cfg = load_train_config(path, [*items, "steps=1"])
        if cfg.preset is not None and cfg.preset != "none":
            presets.get(cfg.preset)


def _inline_offpolicy(page: Path) -> list[str]:
    # "offpolicy diagnose: FAIL …" quotes a line the program prints, not a command
    return [s for s in _INLINE.findall(_prose(page)) if s.startswith("offpolicy ") and not s.split()[1].endswith(":")]


INLINE_COMMANDS = _all(_inline_offpolicy)


@pytest.mark.parametrize(("page", "span"), INLINE_COMMANDS, ids=_ids(INLINE_COMMANDS))
def test_inline_offpolicy_mentions_name_real_options(page, span):
    tokens = shlex.split(span)
    subparsers = build_parser()._subparsers._group_actions[0].choices
    assert tokens[1] in subparsers, f"{page}: `{span}`: no subcommand {tokens[1]!r}"
    options = subparsers[tokens[1]]._option_string_actions
    for before, tok in zip(tokens[1:], tokens[2:]):
        if tok.startswith("--"):
            assert tok.split("=")[0] in options, f"{page}: `{span}`: {tokens[1]} has no option {tok}"
        elif tokens[1] == "train" and before in ("-h", "--help"):
            assert tok in HELP_SECTIONS or tok == "SECTION", f"{page}: `{span}`: train has no help section {tok!r}"
        elif tokens[1] == "train" and "=" in tok:
            load_train_config(None, [tok, "steps=1"])


def test_pip_extras_exist_with_the_pins_the_readme_states():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    checked = 0
    for body in _blocks(README, ("bash",)):
        for line in body.splitlines():
            m = re.match(r'pip install "offpolicy\[([\w-]+)\]"\s*#\s*(\S+==\S+)', line)
            if m:
                extra, pin = m.groups()
                assert extra in extras, f"README: pip extra {extra!r} is not in pyproject.toml"
                assert pin in extras[extra], f"README says {extra} pins {pin}; pyproject.toml: {extras[extra]}"
                checked += 1
    assert checked == 4  # trl, verl, openrlhf, skyrl


def test_install_sh_takes_the_options_the_docs_name():
    script = (ROOT / "install.sh").read_text()
    for page in PAGES:
        for opt in re.findall(r"install\.sh (--[\w-]+)", _text(page)):
            assert f'" {opt} "' in script, f"{page.name}: install.sh has no option {opt}"


SCRIPT_COMMANDS = [(p, c) for p, c in _all(_commands)
                   if c[0] in ("python", "python3") and len(c) > 1 and c[1].endswith(".py")]


@pytest.mark.parametrize(("page", "cmd"), SCRIPT_COMMANDS, ids=_ids(SCRIPT_COMMANDS))
def test_script_exists_and_defines_its_flags(page, cmd):
    script = ROOT / cmd[1]
    assert script.is_file(), f"{page}: `{' '.join(cmd)}`: no file {cmd[1]}"
    source = script.read_text()
    for flag in (t.split("=")[0] for t in cmd[2:] if t.startswith("--")):
        assert f'"{flag}"' in source, f"{page}: `{' '.join(cmd)}`: {cmd[1]} defines no {flag}"


def _code(page: Path) -> str:
    return "\n".join([*(b for _, b in _FENCE.findall(_text(page))), *_INLINE.findall(_prose(page))])


PRESET_NAMES = sorted({(p, name) for p, name in _all(lambda page: _PRESET.findall(_code(page)))})


@pytest.mark.parametrize(("page", "name"), PRESET_NAMES, ids=_ids(PRESET_NAMES))
def test_quoted_preset_exists(page, name):
    assert name in presets.names(), f"{page}: {name!r} is not a preset (offpolicy presets lists them)"


REPO_PATHS = sorted(set(_all(lambda page: _PATH.findall(_text(page)))))


@pytest.mark.parametrize(("page", "path"), REPO_PATHS, ids=_ids(REPO_PATHS))
def test_quoted_repository_path_exists(page, path):
    assert (ROOT / path).exists(), f"{page}: {path} does not exist"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (letters of any script,
    digits, '_' and '-' stay), spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> Iterator[str]:
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+)$", _FENCE.sub("", _text(page)), re.M):
        base = _slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        yield base if n == 0 else f"{base}-{n}"


LINKS = [(p, target) for p, target in _all(lambda page: _LINK.findall(_prose(page)))
         if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize(("page", "target"), LINKS, ids=_ids(LINKS))
def test_link_resolves(page, target):
    path, _, anchor = target.partition("#")
    source = ROOT / page
    dest = (source.parent / path).resolve() if path else source
    assert dest.is_relative_to(ROOT), f"{page}: link {target} leaves the repository (it breaks on GitHub)"
    assert dest.exists(), f"{page}: link {target} points to nothing"
    if anchor:
        assert dest.suffix == ".md", f"{page}: anchor in a link to a non-markdown file: {target}"
        assert anchor in set(_anchors(dest)), f"{page}: {dest.name} has no heading with anchor #{anchor}"


def test_the_docs_map_lists_every_docs_page():
    linked = {Path(t).name for _, t in LINKS if t.startswith("docs/") and t.endswith(".md")}
    on_disk = {p.name for p in PAGES[1:]}
    assert on_disk <= linked, f"docs pages the README does not link: {sorted(on_disk - linked)}"


PYTHON_BLOCKS = _all(lambda page: _blocks(page, ("python",)))


def _defines(module: str, name: str) -> bool:
    """Whether module ``offpolicy.…`` (a file or a package under src/) binds ``name`` at top level."""
    base = SRC.joinpath(*module.split("."))
    file = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    if (base / f"{name}.py").is_file() or (base / name).is_dir():
        return True  # a submodule
    tree = ast.parse(file.read_text())
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((a.asname or a.name) == name for a in node.names):
                return True
    return False


@pytest.mark.parametrize(("page", "code"), PYTHON_BLOCKS, ids=_ids([(p, c.splitlines()[0]) for p, c in PYTHON_BLOCKS]))
def test_python_block_compiles_and_names_what_exists(page, code):
    tree = ast.parse(code)  # SyntaxError fails the test with the line
    aliases: dict[str, str] = {}  # local name -> offpolicy module it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("offpolicy"):
            for a in node.names:
                assert _defines(node.module, a.name), f"{page}: `from {node.module} import {a.name}`: no such name"
                if (SRC.joinpath(*node.module.split("."), f"{a.name}.py")).is_file():
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "offpolicy":
                    aliases[a.asname or a.name] = "offpolicy"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            module = aliases[node.value.id]
            if module == "offpolicy":
                assert hasattr(op, node.attr), f"{page}: offpolicy has no public name {node.attr!r}"
            else:
                assert _defines(module, node.attr), f"{page}: {module} has no {node.attr!r}"


def test_inline_op_names_are_public():
    for page in PAGES:
        for name in re.findall(r"(?<![\w.])op\.(\w+)", _code(page)):
            assert hasattr(op, name), f"{page.name}: `op.{name}` is not a public name of offpolicy"


# The config each README error example comes from; the README must show exactly these messages.
_ERROR_INPUTS = [
    (LossConfig, {"correction": {"weight": {"level": "token", "mode": "truncate", "hgh": 2.0}}}),
    (CorrectionConfig, {"reject": [{"stat": "k2", "level": "token", "low": 0.1, "high": 1.0}]}),
]


def test_error_examples_are_the_messages_the_code_raises():
    shown = [line for body in _blocks(README, ("text",)) for line in body.splitlines()
             if line.startswith("ConfigError: ")]
    raised = []
    for cls, data in _ERROR_INPUTS:
        with pytest.raises(ConfigError) as err:
            cls(**data)
        raised.append(f"ConfigError: {err.value}")
    assert shown == raised


def test_readme_stays_a_front_door():
    # issue #24: the README is ≤ ~250 lines; depth goes to docs/ (room left for a few more lines)
    lines = len(_text(README).splitlines())
    assert lines <= 300, f"README.md has {lines} lines; move the depth into docs/*.md"


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_code_fences_are_balanced(page):
    # an unclosed ``` swallows the rest of the page, and every check above with it
    fences = [line for line in _text(page).splitlines() if line.startswith("```")]
    assert len(fences) % 2 == 0, f"{page.name}: {len(fences)} ``` lines — one is not closed"
