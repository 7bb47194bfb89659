"""TRL 1.16's GRPOTrainer at two data-parallel ranks (gloo, DDP) equals one rank, with offpolicy's loss.

tests/trl_two_ranks.py trains ``OffpolicyGRPOTrainer`` (the example's trainer) for two optimizer
steps at two ranks and at one on the same global batch (4 prompts × 2 generations per step, rank
0's completions 1–2 tokens, rank 1's 4–6), for every ``loss_type`` the adapter supports, with rank
1's tokens all rejected by a ratio veto, and with a data-chosen weight cap (``{rule: quantile}``),
which the adapter fixes over the whole optimizer step (``_step_config``: all its micro-batches on
every rank; before it, the cap was chosen per rank and the two worlds ended 5·10⁻² apart), also
with two accumulated micro-batches per rank. Weights to rounding and TRL's logged metrics
(``offpolicy/*`` all-reduced by the adapter, ``loss``, ``grad_norm``, ``reward``) must match.

TRL's ``bnpo`` divides by each rank's own token count (``Σ ℓm / Σ m`` per process, then DDP's
mean): at unequal counts two ranks are not one batch — for TRL's own loss too. The test shows it
with the preset that reproduces TRL's correction (``trl:sequence_mask``) against TRL's own loss
with its own IS correction (the example's ``TRLImportanceSampling``): the same weights at one rank,
and the same two-rank-minus-one-rank difference. That bnpo run is the check that the comparison
fails when the denominator is per rank.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("trl", reason="TRL not installed (install.sh installs trl==1.16.0; pip install offpolicy[trl])")

import torch  # noqa: E402

import offpolicy as op  # noqa: E402
from hf_fixtures import HOST_SHAPE, char_model  # noqa: E402
from offpolicy.integrations.trl import SUPPORTED_LOSS_TYPES  # noqa: E402

pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parent
VETO = op.LossConfig(clip_low=0.2, clip_high=0.2, correction=op.CorrectionConfig(
    anchor="old", reject=[{"stat": "ratio", "level": "any_token", "low": 0.1, "high": 10.0}], denominator="fixed"))
QUANTILE = op.LossConfig(clip_low=0.2, clip_high=0.2, correction=op.CorrectionConfig(
    anchor="old", weight={"level": "token", "mode": "truncate", "high": {"rule": "quantile", "q": 0.75}},
    denominator="fixed"))
RANK1_PROMPTS = ["cde", "def", "ghi", "hij"]  # slots 3–4 of each step: rank 1's at two ranks
LOGGED = ("loss", "grad_norm", "reward")


def _runs() -> list[dict]:
    runs = [{"name": lt, "trainer": "offpolicy", "config": "recommended", "loss_type": lt}
            for lt in SUPPORTED_LOSS_TYPES]
    runs += [{"name": "rank1_all_rejected", "trainer": "offpolicy", "config": VETO, "loss_type": "dapo",
              "spike": RANK1_PROMPTS},
             {"name": "quantile_cap", "trainer": "offpolicy", "config": QUANTILE, "loss_type": "dapo"},
             # two micro-batches per rank (4 at one rank), shuffled by TRL: the step's cap over all of them
             {"name": "quantile_cap_accum2", "trainer": "offpolicy", "config": QUANTILE, "loss_type": "dapo",
              "accum": 2},
             {"name": "trl_is_bnpo", "trainer": "trl_is", "config": None, "loss_type": "bnpo"},
             {"name": "preset_bnpo", "trainer": "offpolicy", "config": "trl:sequence_mask", "loss_type": "bnpo"}]
    return runs


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    d = tmp_path_factory.mktemp("trl_two_ranks")
    state = {k: v.detach().clone() for k, v in char_model(**HOST_SHAPE).state_dict().items()}
    torch.save({"state": state, "shape": HOST_SHAPE, "runs": _runs(), "lr": 0.5}, d / "in.pt")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(TESTS), str(TESTS.parent / "src"), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]])}
    proc = subprocess.run([sys.executable, str(TESTS / "trl_two_ranks.py"), str(d / "in.pt"), str(d / "out.pt")],
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return state, torch.load(d / "out.pt", weights_only=False)


def _distance(a: dict, b: dict) -> float:
    return sum(float((a[k] - b[k]).pow(2).sum()) for k in a) ** 0.5


def _logged(row: dict) -> dict[str, float]:
    return {k: v for k, v in row.items() if k.startswith("offpolicy/") or k in LOGGED}


def test_trl_grpo_two_ranks_equal_one(worlds) -> None:
    state, out = worlds
    two, one = out[2], out[1]
    for name in [r["name"] for r in _runs()]:
        a0, a1, b = two[0][name], two[1][name], one[0][name]
        moved = _distance(b["state"], state)
        assert moved > 1e-2, name
        assert _distance(a0["state"], a1["state"]) == 0.0, name  # DDP: one model on both ranks
        gap = _distance(a0["state"], b["state"])
        print(f"TRL {name}: moved {moved:.4f}, two ranks vs one {gap:.2e}")
        if "bnpo" in name:
            assert gap > 1e-3 * moved, (name, gap, moved)  # TRL's per-rank normaliser: not one batch
            continue
        assert gap < 1e-5 * moved, (name, gap, moved)
        assert len(a0["logs"]) == len(b["logs"]) == 2
        if name.endswith("accum2"):
            continue  # TRL logs the mean of its micro-batches' values, and shuffles rows into micro-batches
        for step, (x, y) in enumerate(zip(a0["logs"], b["logs"])):
            x, y = _logged(x), _logged(y)
            assert x.keys() == y.keys() and "offpolicy/kl_k3" in y, name
            for k in y:
                assert x[k] == pytest.approx(y[k], rel=2e-5, abs=1e-6), (name, step, k)


def test_bnpo_two_ranks_differ_from_one_as_trls_own_loss_does(worlds) -> None:
    _, out = worlds
    two, one = out[2][0], out[1][0]
    ours, trls = "preset_bnpo", "trl_is_bnpo"
    assert two[trls]["trainer"] == "TRLImportanceSampling" and two[ours]["trainer"] == "OffpolicyGRPOTrainer"
    # the preset reproduces TRL's loss with its IS correction: the same weights at one rank and at two
    assert _distance(one[ours]["state"], one[trls]["state"]) < 1e-5 * _distance(one[ours]["state"], worlds[0])
    assert _distance(two[ours]["state"], two[trls]["state"]) < 1e-5 * _distance(two[ours]["state"], worlds[0])
    # and so the same two-rank difference, which is not zero
    diff_ours = {k: two[ours]["state"][k] - one[ours]["state"][k] for k in one[ours]["state"]}
    diff_trl = {k: two[trls]["state"][k] - one[trls]["state"][k] for k in one[trls]["state"]}
    size = _distance(diff_trl, {k: torch.zeros_like(v) for k, v in diff_trl.items()})
    assert size > 1e-3
    assert _distance(diff_ours, diff_trl) < 1e-3 * size


def test_a_rank_whose_tokens_are_all_rejected(worlds) -> None:
    _, out = worlds
    for row in out[2][0]["rank1_all_rejected"]["logs"]:
        # the adapter all-reduces offpolicy's metrics: rank 1's tokens are the rejected share of the step
        assert 0.5 < row["offpolicy/masked_fraction"] < 1.0
