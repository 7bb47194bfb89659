"""The per-token mismatch viewer: one self-contained HTML page (inline CSS and JS, no network) that shows
each sampled sequence with its tokens coloured by log ρ = log π − log μ.

Hovering a token shows π, μ, ρ, the trainer's entropy there and what every preset of the what-if table
does to it (rejects it, or weights it by w); sequences are sorted worst first (max |log ρ|), a preset filter
keeps the sequences that preset rejects tokens of, and the what-if table and the plots (PNG, inlined as
base64) sit above. ``diagnose`` writes ``report.html`` next to ``report.json``; ``offpolicy view RUN_DIR``
writes one for a training run's ``samples.jsonl`` (each step's samples, worst first; a cut-off run's
partial last line is skipped).

Untrusted text (prompts, completions, tokens) never becomes markup: the data is one JSON blob in a
``<script type="application/json">`` block with ``<``, ``>``, ``&`` and U+2028/9 escaped as ``\\uXXXX``
(so neither ``</script>`` nor ``<!--`` can close or comment it out), and the page's script inserts every
string with ``textContent``. Rendering is one pass over the data into a DocumentFragment with one event
listener per page (event delegation), which stays usable at 512 sequences × 256 tokens.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import math
from pathlib import Path
from typing import Any

import torch

import offpolicy as op
from offpolicy.core import presets
WORST_PER_STEP = 16  # a run's view: at most this many samples per step, the worst first


def _round(values: list[float]) -> list[float | None]:
    """Floats for the page: 7 significant digits (float32's precision), null where not finite."""
    return [float(f"{v:.7g}") if math.isfinite(v) else None for v in values]


def row_lengths(mask: torch.Tensor) -> list[int]:
    """Each row's response length ``[B, T]`` → ``[B]``: up to its last valid token (a token without a ratio
    inside it, outside the trainer's top-k/top-p support, is a hole in the mask and stays in the row)."""
    cols = torch.arange(1, mask.shape[-1] + 1, device=mask.device)
    return (mask.bool() * cols).amax(-1).tolist() if mask.numel() else [0] * len(mask)


def token_verdicts(trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor,
                   names: list[str] | None = None, lengths: list[int] | None = None) -> list[dict[str, Any]]:
    """What each preset's ``correct`` does to every token of this batch (π_old = π_θ = ``trainer``, A = 0, as
    the what-if table runs it), ``[B, T]`` inputs. Presets that give identical weights and masks share one
    group: ``{"presets": [...], "w": per row the weight of each of its tokens (0 where rejected or without a
    ratio), "rej": per row the positions it rejects}`` over each row's first ``lengths[i]`` columns
    (``row_lengths``). A batch without a single ratio (samples saved before samples.jsonl kept log-probs, or
    a step whose rows all lie outside the trainer's top-k/top-p support), which ``correct`` refuses, is one
    group of every preset that weighs and rejects nothing: the page still shows it."""
    groups: dict[tuple[bytes, bytes], dict[str, Any]] = {}
    lengths = row_lengths(mask) if lengths is None else lengths
    if not mask.bool().any():
        return [{"presets": list(names or presets.names()), "w": [[0.0] * n for n in lengths],
                 "rej": [[] for _ in lengths]}]
    adv = torch.zeros_like(mask)
    for name in names or presets.names():
        out = op.correct(trainer, rollout, mask, presets.correction(name), logprobs=trainer, advantages=adv)
        kept = out.mask.bool()
        weights = torch.where(kept, out.weights, 0.0)
        key = (weights.numpy().tobytes(), kept.numpy().tobytes())
        if key not in groups:
            rejected = mask.bool() & ~kept
            groups[key] = {"presets": [], "w": [_round(weights[i, :n].tolist()) for i, n in enumerate(lengths)],
                           "rej": [rejected[i, :n].nonzero().flatten().tolist() for i, n in enumerate(lengths)]}
        groups[key]["presets"].append(name)
    return list(groups.values())


def sequences(trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor,
              token_text: list[list[str]] | None, entropy: torch.Tensor | None,
              prompts: list[str] | None = None) -> list[dict[str, Any]]:
    """Each row's response tokens (text, log π, log μ, entropy: ``[B, T]`` inputs, a row's tokens its first
    ``row_lengths`` columns; log π null at a token without a ratio) and its prompt, as ``report.json`` keeps
    them for the viewer."""
    out = []
    for i, n in enumerate(row_lengths(mask)):
        valid = mask[i, :n].bool().tolist()
        out.append({"prompt": prompts[i] if prompts is not None else None,
                    "tokens": list(token_text[i][:n]) if token_text is not None else None,
                    "log_pi": [v if ok else None for v, ok in zip(_round(trainer[i, :n].tolist()), valid)],
                    "log_mu": _round(rollout[i, :n].tolist()),
                    "entropy": _round(entropy[i, :n].tolist()) if entropy is not None else None})
    return out


def _png(path: Path) -> dict[str, str]:
    return {"name": path.stem, "src": "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()}


def _worst(seq: dict[str, Any]) -> float:
    """max |log ρ| over the tokens with both log-probs (the sort key, worst first)."""
    values = [abs(p - m) for p, m in zip(seq["log_pi"], seq["log_mu"]) if p is not None and m is not None]
    return max(values, default=0.0)


def diagnose_view(report: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """The page's data for one diagnose setting (``report`` as written to report.json, plots under
    ``out_dir``)."""
    seqs = [{"i": i, **s, "worst": _worst(s)} for i, s in enumerate(report.get("sequences") or [])]
    stats = [[k, v] for k, v in report.get("summary", {}).items() if "@" not in k]
    plots = [_png(Path(p)) for p in report.get("plots", []) if Path(p).is_file()]
    return {"name": report["setting"].get("name", "diagnose"), "kind": "diagnose", "stats": stats,
            "what_if": report.get("what_if"), "plots": plots, "groups": report.get("token_verdicts") or [],
            "seqs": seqs, "presets": [r["preset"] for r in report.get("what_if", [])]}


def read_samples(path: Path) -> tuple[list[dict[str, Any]], int]:
    """``samples.jsonl``'s records and the number of lines that could not be read (a cut-off run's last
    line, written half)."""
    records, bad = [], 0
    if not path.is_file():
        return records, bad
    for line in path.read_text(errors="replace").split("\n"):  # not splitlines(): U+2028 in a completion is no break
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            bad += 1
    return records, bad


def run_view(run_dir: Path) -> tuple[dict[str, Any], list[str]]:
    """The page's data for a training run: each step's saved samples with their per-token log π_old and
    log μ (``samples.jsonl``), worst first, what each preset would do to them (``token_verdicts`` over the
    step's saved rows), the run's plot and its last metrics. Returns the view and notes for the user.

    Raises:
        FileNotFoundError: ``run_dir`` has no samples.jsonl.
    """
    path = run_dir / "samples.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: no samples.jsonl; is it an offpolicy train run directory? "
                                "(diagnose writes its own report.html)")
    records, bad = read_samples(path)
    notes = [f"{bad} line(s) of samples.jsonl could not be read (a run cut off mid-write); left out"] if bad else []
    per_token = [r for r in records if r.get("log_pi") is not None and r.get("log_mu") is not None]
    if len(per_token) < len(records):
        notes.append(f"{len(records) - len(per_token)} sample(s) hold no per-token log-probs (written before "
                     "samples.jsonl kept them): shown without tokens")
    steps = sorted({r["step"] for r in records})
    seqs, groups_by_step = [], []
    for step in steps:
        rows = sorted((r for r in records if r["step"] == step), key=lambda r: -(r.get("abs_log_ratio_max") or 0))
        rows = rows[:WORST_PER_STEP]
        for r in rows:
            seq = {"i": len(seqs), "step": step, "prompt": r.get("prompt"), "completion": r.get("completion"),
                   "reward": r.get("reward"), "tokens": r.get("token_text"), "log_pi": r.get("log_pi") or [],
                   "log_mu": r.get("log_mu") or [], "entropy": None}
            seq["worst"] = _worst(seq)
            seqs.append(seq)
        groups_by_step.append(_step_verdicts(seqs[len(seqs) - len(rows):]))
    groups = _merge_steps(groups_by_step)
    metrics, _ = read_samples(run_dir / "metrics.jsonl")
    last = metrics[-1] if metrics else {}
    keys = ["step", "reward", "offpolicy/kl_k3", "offpolicy/masked_fraction", "offpolicy/ess", "eval/accuracy"]
    stats = [[k, last[k]] for k in keys if last.get(k) is not None]
    plots = [_png(run_dir / "training.png")] if (run_dir / "training.png").is_file() else []
    return {"name": run_dir.name, "kind": "run", "stats": stats, "what_if": None, "plots": plots, "groups": groups,
            "seqs": seqs, "presets": presets.names()}, notes


def _step_verdicts(seqs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``token_verdicts`` over one step's saved rows (padded into ``[k, T]``; a null log-prob, a token outside
    the trainer's support, is left out of the mask as the loss leaves it out)."""
    width = max((len(s["log_pi"]) for s in seqs), default=0)
    trainer, rollout, mask = (torch.zeros(len(seqs), width) for _ in range(3))
    for i, s in enumerate(seqs):
        for t, (p, m) in enumerate(zip(s["log_pi"], s["log_mu"])):
            if p is not None and m is not None:
                trainer[i, t], rollout[i, t], mask[i, t] = p, m, 1.0
    return token_verdicts(trainer, rollout, mask, lengths=[len(s["log_pi"]) for s in seqs])


def _merge_steps(per_step: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One group per preset over the whole run (steps group presets differently): its rows' weights and
    rejections, step after step."""
    merged: dict[str, dict[str, Any]] = {}
    for groups in per_step:
        for g in groups:
            for name in g["presets"]:
                entry = merged.setdefault(name, {"presets": [name], "w": [], "rej": []})
                entry["w"] += g["w"]
                entry["rej"] += g["rej"]
    # presets with identical verdicts over the whole run share one group again (a smaller page)
    out: dict[str, dict[str, Any]] = {}
    for name, g in merged.items():
        key = json.dumps([g["w"], g["rej"]])
        if key in out:
            out[key]["presets"].append(name)
        else:
            out[key] = g
    return list(out.values())


def _finite(data: Any) -> Any:
    """``data`` with every NaN or ±inf float as null (JSON has no such numbers; the page shows "–")."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: _finite(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_finite(v) for v in data]
    return data


def safe_json(data: Any) -> str:
    """``data`` as JSON that is safe inside a ``<script>`` element: ``<``, ``>``, ``&`` and the JS line
    separators U+2028/U+2029 escaped (``</script>``, ``<!--`` cannot appear)."""
    text = json.dumps(_finite(data), ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    for raw, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"),
                         ("\u2029", "\\u2029")):
        text = text.replace(raw, escaped)
    return text


def write_html(path: Path, views: list[dict[str, Any]], title: str) -> Path:
    """Write the page for ``views`` (``diagnose_view`` / ``run_view`` data) to ``path``."""
    template = Path(__file__).with_name("viewer.html").read_text(encoding="utf-8")
    # the Content-Security-Policy allows only the page's own script, by its hash: no other script, no inline
    # event handler (onerror=…) and no javascript: URL can run, whatever the data holds
    script = template[template.rindex("<script>") + len("<script>"):template.rindex("</script>")]
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    page = template.replace("__SCRIPT_HASH__", f"'sha256-{digest}'").replace("__TITLE__", html.escape(title))
    page = page.replace("__DATA__", safe_json({"title": title, "views": views}))
    path.write_text(page, encoding="utf-8")
    return path
