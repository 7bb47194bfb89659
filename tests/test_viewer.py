"""The per-token viewer (report.html of ``diagnose``, ``offpolicy view RUN_DIR``) in a real browser: the
distribution's Chromium driven by Playwright (``executable_path=/usr/bin/chromium``; .ci/run installs it).

The page's tokens are report.json's (count and text), a hovered token's tooltip holds report.json's π, μ,
ρ, entropy and each preset's verdict, the preset filter hides exactly the sequences that preset rejects no
token of, the console stays clean, a completion full of markup and script is shown as text and runs
nothing, and a cut-off run still gets its page."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from offpolicy.measure import viewer
CHROMIUM = os.environ.get("OFFPOLICY_CHROMIUM", "/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
EVIL = ('<script>window.__pwned = 1</script></div></span><img src=x onerror="window.__pwned = 2">'
        '<a href="javascript:window.__pwned = 3">click</a></script><script>window.__pwned = 4</script><!-- '
        '\u2028 & &amp; "quotes"')


def _chromium() -> str:
    if not (Path(CHROMIUM).is_file() and os.access(CHROMIUM, os.X_OK)):
        why = f"no Chromium at {CHROMIUM} (apt-get install chromium; .ci/run installs it)"
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the browser tests: {why}")
        pytest.skip(why)
    return CHROMIUM


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    try:
        from playwright import sync_api
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("CI must run the browser tests: playwright is not installed (install.sh installs it)")
        pytest.skip("playwright is not installed (install.sh installs it)")
    executable = _chromium()
    with sync_api.sync_playwright() as p:
        # a new, empty profile: Playwright's own temporary --user-data-dir, removed on close
        b = p.chromium.launch(executable_path=executable, args=FLAGS, headless=True)
        yield b
        b.close()


class Page:
    """A loaded page and every console error or uncaught exception it raised."""

    def __init__(self, browser, path: Path, width: int = 1200, height: int = 900):
        self.errors: list[str] = []
        self.page = browser.new_page(viewport={"width": width, "height": height})
        self.page.on("console", lambda m: self.errors.append(f"console.{m.type}: {m.text}")
                     if m.type in ("error", "warning") else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        self.page.goto(path.resolve().as_uri())
        self.page.wait_for_selector("body[data-ready='1']", timeout=60_000)

    def rendered(self) -> dict[int, list[str]]:
        """Sequence index → the text of each of its token spans, as the page shows them."""
        got = self.page.evaluate("""() => Array.from(document.querySelectorAll('#seqs .seq')).map(
            d => [Number(d.dataset.s), Array.from(d.querySelectorAll('.tok')).map(s => s.textContent)])""")
        return dict((k, v) for k, v in got)

    def visible(self) -> set[int]:
        return set(self.page.evaluate("""() => Array.from(document.querySelectorAll('#seqs .seq'))
            .filter(d => !d.classList.contains('hidden') && d.offsetParent !== null).map(d => Number(d.dataset.s))"""))

    def close(self) -> None:
        self.page.close()


@pytest.fixture(scope="module")
def diagnosed(tmp_path_factory) -> Path:
    """``offpolicy diagnose`` on a tiny model (a noisy bf16 engine against the fp32 trainer): report.json and
    report.html."""
    from cli_inprocess import run_cli
    from hf_fixtures import char_model_dir

    model = char_model_dir(tmp_path_factory.mktemp("tiny"), hidden_size=64, num_layers=2, seed=2)
    out = tmp_path_factory.mktemp("diag")
    # logit noise on the engine: a mismatch some presets reject part of (a tiny model's bf16 one is too small)
    result = run_cli("diagnose", "--model", str(model), "--engine", "hf", "--n", "24", "--max-tokens", "12",
                     "--engine-logit-noise", "0.3", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "report.html").is_file() and "report.html" in result.stdout
    return out


@pytest.mark.slow
def test_report_page_shows_report_json_tokens_tooltips_and_filter(browser, diagnosed):
    report = json.loads((diagnosed / "report.json").read_text())
    seqs = report["sequences"]
    page = Page(browser, diagnosed / "report.html")
    try:
        # every sequence, every token, the report's text, in its order
        rendered = page.rendered()
        assert rendered == {k: s["tokens"] for k, s in enumerate(seqs)}
        assert sum(map(len, rendered.values())) == sum(len(s["log_mu"]) for s in seqs) > len(seqs)
        # worst first: the first sequence shown has the largest max |log ρ|
        worst = max(range(len(seqs)), key=lambda k: max(abs(p - m) for p, m in zip(seqs[k]["log_pi"],
                                                                                    seqs[k]["log_mu"])))
        assert page.page.evaluate("() => Number(document.querySelector('#seqs .seq').dataset.s)") == worst

        # hover the batch's worst token: the tooltip holds the report's numbers (7 significant digits)
        k = worst
        t = max(range(len(seqs[k]["log_mu"])), key=lambda i: abs(seqs[k]["log_pi"][i] - seqs[k]["log_mu"][i]))
        page.page.hover(f"#seqs .seq[data-s='{k}'] .tok[data-t='{t}']")
        page.page.wait_for_selector("#tip [data-field='rho']", state="visible")
        field = lambda name: page.page.text_content(f"#tip [data-field='{name}']")  # noqa: E731
        lp, lm, ent = seqs[k]["log_pi"][t], seqs[k]["log_mu"][t], seqs[k]["entropy"][t]
        for name, want in (("pi", math.exp(lp)), ("mu", math.exp(lm)), ("rho", math.exp(lp - lm)),
                           ("log_rho", lp - lm), ("entropy", ent)):
            assert float(field(name)) == pytest.approx(want, rel=1e-6), name
        assert json.loads(field("token").split("  (#")[0]) == seqs[k]["tokens"][t]
        # each preset's verdict on this token: "rejects" or its weight, as report.json's token_verdicts
        lines = page.page.evaluate("""() => Array.from(document.querySelectorAll('#tip [data-verdict]')).map(
            r => [r.dataset.verdict, r.lastChild.textContent.split(', ')])""")
        shown = {p: verdict for verdict, names in lines for p in names}
        assert set(shown) == {r["preset"] for r in report["what_if"]}
        for group in report["token_verdicts"]:
            for p in group["presets"]:
                if t in group["rej"][k]:
                    assert shown[p] == "rejects", p
                else:
                    assert float(shown[p].removeprefix("w = ")) == pytest.approx(group["w"][k][t], rel=1e-6), p

        # the preset filter: exactly the sequences the preset rejects a token of, then all again
        partial = [g for g in report["token_verdicts"] if 0 < sum(bool(r) for r in g["rej"]) < len(seqs)]
        assert partial, "no preset rejects some but not all of this batch's sequences: pick another --seed"
        group = partial[0]
        page.page.select_option("#preset", group["presets"][0])
        assert page.visible() == {i for i, r in enumerate(group["rej"]) if r}
        outlined = page.page.evaluate("""() => Array.from(document.querySelectorAll('#seqs .tok.rej')).map(
            s => [Number(s.closest('.seq').dataset.s), Number(s.dataset.t)])""")
        assert sorted(map(tuple, outlined)) == sorted((i, t) for i, r in enumerate(group["rej"]) for t in r)
        page.page.select_option("#preset", "")
        assert page.visible() == set(range(len(seqs)))
        # the what-if table and the plots are on the page
        assert page.page.locator("#whatif tr").count() == len(report["what_if"]) + 1
        assert page.page.locator("#plots img").count() == len(report["plots"])
        assert page.errors == []
    finally:
        page.close()


def evil_run(run_dir: Path) -> Path:
    """A run directory whose samples hold markup and script everywhere, cut off mid-line (a run killed while
    writing samples.jsonl)."""
    run_dir.mkdir(parents=True)
    rows = []
    for step in range(2):
        for j in range(3):
            tokens = ["<script>", "window.__pwned=5", "</script>", "</div>", "javascript:alert(1)", EVIL]
            lp = [-0.5 * (i + 1) for i in range(len(tokens))]
            lm = [v + 0.05 * (j + 1) * (-1) ** i for i, v in enumerate(lp)]
            lp[1] = None  # a token outside the trainer's support: no ratio
            rows.append({"step": step, "prompt": f"{EVIL} prompt {j}", "completion": f"{EVIL} completion {j}",
                         "answer": "x", "reward": float(j), "advantage": 0.0, "tokens": len(tokens),
                         "outside_support": 1, "finished": True, "abs_log_ratio_mean": 0.1 * j,
                         "abs_log_ratio_max": 0.05 * (j + 1), "token_text": tokens, "log_pi": lp, "log_mu": lm})
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    (run_dir / "samples.jsonl").write_text(text + text.splitlines()[0][:57])  # the cut-off last line
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward": 0.5}) + "\n")
    return run_dir


def test_markup_and_script_in_samples_are_text_and_nothing_runs(browser, tmp_path):
    from cli_inprocess import run_cli

    run_dir = evil_run(tmp_path / "run")
    result = run_cli("view", str(run_dir))
    assert result.returncode == 0, result.stderr
    assert "1 line(s) of samples.jsonl could not be read" in result.stdout  # the cut-off line, said and skipped
    page_file = run_dir / "report.html"
    source = page_file.read_text()
    assert "<script>window" not in source and "</script><script>" not in source and "<!-- " not in source
    page = Page(browser, page_file)
    try:
        assert page.page.evaluate("() => window.__pwned") is None
        rendered = page.rendered()
        assert len(rendered) == 6 and all(v[-1] == EVIL and v[0] == "<script>" for v in rendered.values())
        completions = page.page.evaluate(
            "() => Array.from(document.querySelectorAll('.completion')).map(e => e.textContent)")
        assert sorted(completions) == sorted(f"{EVIL} completion {j}" for j in range(3) for _ in range(2))
        # nothing became an element: two scripts (data, code) and no image, link or iframe outside the plots
        assert page.page.evaluate("() => document.scripts.length") == 2
        assert page.page.evaluate(
            "() => document.querySelectorAll('#seqs img, #seqs a, #seqs script, iframe').length") == 0
        # hover everything (a tooltip insertion is the other way in), click the "link" token
        page.page.hover(".seq .tok[data-t='5']")
        assert json.loads(page.page.text_content("#tip [data-field='token']").split("  (#")[0]) == EVIL
        page.page.click(".seq .tok[data-t='4']")
        page.page.hover(".seq .tok[data-t='1']")  # no ratio: said so, not NaN
        assert "outside the trainer" in page.page.text_content("#tip [data-field='pi']")
        assert page.page.evaluate("() => window.__pwned") is None
        # a run: step by step, each step's worst first
        order = page.page.evaluate("""() => Array.from(document.querySelectorAll('#seqs .step, #seqs .seq'))
            .map(e => e.classList.contains('step') ? e.textContent
                                                   : e.querySelector('.meta').textContent.match(/reward (\\S+)/)[1])""")
        assert order == ["step 0", "2.000", "1.000", "0.000", "step 1", "2.000", "1.000", "0.000"]
        assert page.errors == []
    finally:
        page.close()


@pytest.mark.slow
def test_page_stays_usable_at_512_sequences_of_256_tokens(browser, tmp_path):
    """512 × 256 tokens: every token rendered, hover and filter answer (no timing is asserted)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    trainer = -torch.rand(512, 256, generator=gen)
    rollout = (trainer + 0.05 * torch.randn(512, 256, generator=gen)).clamp(max=-1e-6)
    mask = torch.ones(512, 256)
    texts = [[f"t{i % 97}" for i in range(256)] for _ in range(512)]
    seqs = viewer.sequences(trainer, rollout, mask, texts, torch.rand(512, 256, generator=gen))
    groups = viewer.token_verdicts(trainer, rollout, mask, ["verl:decoupled_geo_rs"])
    view = {"name": "stress", "kind": "diagnose", "stats": [], "what_if": None, "plots": [], "groups": groups,
            "presets": ["verl:decoupled_geo_rs"],
            "seqs": [{"i": i, **s, "worst": viewer._worst(s)} for i, s in enumerate(seqs)]}
    path = viewer.write_html(tmp_path / "big.html", [view], "stress")
    page = Page(browser, path)
    try:
        assert page.page.evaluate("() => document.querySelectorAll('#seqs .tok').length") == 512 * 256
        page.page.hover("#seqs .seq:nth-child(3) .tok:nth-child(100)")
        assert page.page.is_visible("#tip [data-field='rho']")
        page.page.select_option("#preset", "verl:decoupled_geo_rs")
        rejected = next(g for g in groups if "verl:decoupled_geo_rs" in g["presets"])["rej"]
        assert page.visible() == {i for i, r in enumerate(rejected) if r}
        assert page.errors == []
    finally:
        page.close()


def test_safe_json_cannot_close_the_script_block():
    text = viewer.safe_json({"a": "</script><!-- <script>alert(1)</script> & \u2028"})
    assert "<" not in text and ">" not in text and "&" not in text and "\u2028" not in text
    assert json.loads(text) == {"a": "</script><!-- <script>alert(1)</script> & \u2028"}


def test_view_refuses_a_directory_without_samples(tmp_path):
    from cli_inprocess import run_cli

    result = run_cli("view", str(tmp_path))
    assert result.returncode == 2 and "no samples.jsonl" in result.stderr


def test_view_shows_a_run_whose_steps_have_no_log_ratio(tmp_path):
    """Issue #55 item 4: a step whose saved samples hold no log-ratio at all — samples.jsonl written before it
    kept per-token log-probs (a run resumed across the upgrade), or a step whose one saved sample lies wholly
    outside the trainer's top-k/top-p support — still gets its page, beside a step that has ratios; each
    preset's verdicts stay aligned with the sequences (one row each), and the step with ratios gets the
    verdicts ``token_verdicts`` gives it alone."""
    import torch

    from cli_inprocess import run_cli

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    old = [{"step": 0, "prompt": f"old {j}", "completion": "c", "answer": "a", "reward": 0.0, "advantage": 0.0,
            "tokens": 3, "finished": True, "abs_log_ratio_mean": 0.01, "abs_log_ratio_max": 0.02 * j}
           for j in range(2)]
    outside = {"step": 1, "prompt": "outside", "completion": "xy", "reward": 1.0, "token_text": ["x", "y"],
               "log_pi": [None, None], "log_mu": [-0.7, -1.2], "abs_log_ratio_max": None}
    lp, lm = [-0.1, -2.0, None, -0.5], [-0.2, -0.4, -3.0, -0.5]
    normal = {"step": 2, "prompt": "normal", "completion": "abcd", "reward": 0.5, "token_text": list("abcd"),
              "log_pi": lp, "log_mu": lm, "abs_log_ratio_max": 1.6}
    (run_dir / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*old, outside, normal]))
    result = run_cli("view", str(run_dir))
    assert result.returncode == 0, result.stderr
    said = " ".join(result.stdout.split())  # rich wraps a line at the terminal's width (a long tmp path)
    assert (run_dir / "report.html").is_file() and "4 samples over 3 steps" in said
    assert "2 sample(s) hold no per-token log-probs" in said
    view, _ = viewer.run_view(run_dir)
    assert [(s["step"], s["prompt"]) for s in view["seqs"]] == [(0, "old 1"), (0, "old 0"), (1, "outside"),
                                                                (2, "normal")]
    groups = view["groups"]
    assert sorted(p for g in groups for p in g["presets"]) == sorted(view["presets"])
    mask = torch.tensor([[float(p is not None) for p in lp]])
    alone = viewer.token_verdicts(torch.tensor([[p or 0.0 for p in lp]]), torch.tensor([lm]), mask, lengths=[4])
    alone_of = {p: g for g in alone for p in g["presets"]}
    for g in groups:
        assert len(g["w"]) == len(g["rej"]) == 4  # one row per sequence shown
        assert g["w"][:3] == [[], [], [0.0, 0.0]] and g["rej"][:3] == [[], [], []]  # nothing to weigh or reject
        for p in g["presets"]:
            assert (g["w"][3], g["rej"][3]) == (alone_of[p]["w"][0], alone_of[p]["rej"][0]), p


def test_legend_shows_the_colour_scale_the_tokens_use(browser, tmp_path):
    """Suspicion of issue #55, found by hand in Chromium: the legend drew a linear bar from −1 to +1 while the
    tokens are coloured by |log ρ| on a log scale from 1e-4 (white) to 1 (full colour), so a token at
    log ρ = 0.006 looked strongly red beside a legend that put it near white. The legend's swatches, one a
    decade from 1e-4 to 1 each side, have exactly the colour of a token at that log ρ; 0.006 falls between
    the 0.001 and 0.01 swatches; below 1e-4 is white."""
    import re

    import torch

    ratios = [1.0, 0.1, 0.01, 0.001, 1e-4, -1.0, -0.1, -0.01, -0.001, -1e-4, 0.006, 5e-5, 0.0]
    # log π − log μ exactly each ratio on the page (one side 0): no rounding across the 1e-4 edge
    trainer = torch.tensor([[min(r, 0.0) for r in ratios]], dtype=torch.float64)
    rollout = torch.tensor([[min(-r, 0.0) for r in ratios]], dtype=torch.float64)
    mask = torch.ones_like(rollout)
    seqs = viewer.sequences(trainer, rollout, mask, [[f"t{i}" for i in range(len(ratios))]], None)
    view = {"name": "legend", "kind": "diagnose", "stats": [], "what_if": None, "plots": [], "groups": [],
            "presets": [], "seqs": [{"i": 0, **seqs[0], "worst": 1.0}]}
    page = Page(browser, viewer.write_html(tmp_path / "legend.html", [view], "legend"))
    try:
        def rgba(text: str) -> tuple[float, ...]:
            values = [float(v) for v in re.findall(r"[\d.]+", text)]
            return tuple(values) if len(values) == 4 else (*values, 1.0 if text.startswith("rgb(") else 0.0)

        legend = {float(lr): rgba(c) for lr, c in page.page.evaluate("""() => Array.from(
            document.querySelectorAll('#legend [data-lr]')).map(
                s => [s.dataset.lr, getComputedStyle(s).backgroundColor])""")}
        tokens = [rgba(c) for c in page.page.evaluate("""() => Array.from(document.querySelectorAll('#seqs .tok'))
            .map(s => getComputedStyle(s).backgroundColor)""")]
        token = dict(zip(ratios, tokens))
        assert sorted(legend) == sorted(ratios[:10] + [0.0])  # a decade a swatch, 1e-4 to 1 each side, and 0
        for lr in ratios[:10]:
            assert legend[lr] == pytest.approx(token[lr], abs=1e-3), lr
        assert legend[1.0][:3] == (220, 40, 40) and legend[-1.0][:3] == (40, 90, 220)  # red π > μ, blue π < μ
        alphas = [legend[v][3] for v in (1e-4, 0.001, 0.01, 0.1, 1.0)]
        assert alphas == sorted(alphas) and alphas[-1] > 0.9 and alphas[0] < 0.1
        assert legend[0.001][3] < token[0.006][3] < legend[0.01][3]  # the token, where the legend puts it
        assert token[5e-5][3] == 0 and legend[0.0][3] == 0  # below 1e-4: no colour (white)
        # no gradient left that claims another scale
        assert not page.page.evaluate("""() => Array.from(document.querySelectorAll('.legend, .legend *')).some(
            e => getComputedStyle(e).backgroundImage.includes('gradient'))""")
        assert page.errors == []
    finally:
        page.close()
