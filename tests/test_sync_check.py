"""Sync verification (issue #56, item 7): a weight sync that changed nothing is an error, on the hf engine and
through ``offpolicy train``; the engine's KL to the initial policy, hand-checked on the tiny model."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import FAST
from hf_fixtures import char_model_dir
from offpolicy.measure import sync_check
from offpolicy.engines import Rollouts, SamplingConfig
from offpolicy.engines.hf import HFEngine
from offpolicy.policy.batch import to_batch
from offpolicy.policy.score import Scorer, load_policy
from offpolicy.tasks.tokenizer import build_char_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return char_model_dir(tmp_path_factory.mktemp("tiny"), hidden_size=32, num_layers=1, seed=3)


def trainer_weights(path, shift: float = 0.0) -> list[tuple[str, torch.Tensor]]:
    model = load_policy(path, torch.device("cpu"))
    return [(n, t.detach() + shift) for n, t in model.state_dict().items()]


class Unsynced(HFEngine):
    """An engine whose sync reads every tensor and loads none (an adapter that never reaches the model)."""

    def sync_weights(self, named_tensors) -> None:
        for _ in named_tensors:
            pass


def test_probe_names_pick_the_largest_tensors_once():
    shared = torch.zeros(10, 4)
    named = {"b.norm": torch.ones(4), "a.embed": shared, "z.head": shared, "c.mlp": torch.zeros(6, 4),
             "d.ids": torch.zeros(100, dtype=torch.long), "e.proj": torch.zeros(5, 4)}
    # the tied embedding once (under its first name), integers never
    assert sync_check.probe_names(named, k=3) == ["a.embed", "c.mlp", "e.proj"]
    assert sync_check.fingerprint(torch.tensor([3.0, -4.0])) == (-1.0, 7.0, 25.0)
    # a large tensor: 8 runs of 2,048 entries, the first and the last included; bf16 as the engine stores it
    big = torch.zeros(100_000)
    base = sync_check.fingerprint(big)
    for i, seen in ((0, True), (99_999, True), (50_000, False)):  # 50,000 lies between two runs
        moved = big.clone()
        moved[i] = 1.0
        assert (sync_check.fingerprint(moved) != base) is seen
    tiny_step = torch.full((4,), 1.0)
    assert sync_check.fingerprint(tiny_step + 1e-4, torch.bfloat16) == sync_check.fingerprint(tiny_step, torch.bfloat16)


def test_a_sync_that_changed_nothing_is_an_error(tiny):
    tok = build_char_tokenizer()
    engine = HFEngine(str(tiny), tok, "bf16")
    assert sync_check.verified_sync(engine, trainer_weights(tiny))  # the first sync: a baseline, no verdict
    before = engine.weight_fingerprint()
    assert sync_check.verified_sync(engine, trainer_weights(tiny, 0.01))  # new weights reach the engine
    assert engine.weight_fingerprint() != before
    sync_check.verified_sync(engine, trainer_weights(tiny, 0.01))  # the same weights again (lr 0): no error
    # an update below bf16's resolution changes nothing the engine stores: compared in its dtype, no error
    sync_check.verified_sync(engine, trainer_weights(tiny, 0.01 + 1e-9))

    broken = Unsynced(str(tiny), tok, "bf16")
    sync_check.verified_sync(broken, trainer_weights(tiny))
    with pytest.raises(sync_check.SyncError, match="the weight sync changed nothing — the trainer sent new values"):
        sync_check.verified_sync(broken, trainer_weights(tiny, 0.01))


def test_an_engine_that_cannot_read_its_weights_is_synced_unchecked():
    class Plain:
        name = "plain"
        got = None

        def sync_weights(self, named):
            self.got = list(named)

    engine = Plain()
    assert not sync_check.verified_sync(engine, [("w", torch.ones(2))])
    assert [n for n, _ in engine.got] == ["w"]


def test_engine_kl_to_initial_by_hand(tiny):
    """On tokens whose log μ is π_0's own, KL(μ ‖ π_0)'s k3 is exactly 0; with log μ = log π_0 − 0.1 on every
    token, r = e^0.1 and the k3 is e^0.1 − 1 − 0.1 on each."""
    model = load_policy(tiny, torch.device("cpu")).eval()
    scorer = Scorer(model, SamplingConfig(max_tokens=4), torch.device("cpu"))
    prompts, responses = [[1, 5, 6], [1, 7]], [[8, 9, 10], [11, 12]]
    probe = to_batch(Rollouts(prompts, responses, [[-1.0] * 3, [-1.0] * 2], [True, True], version=0), 0)
    pi0 = scorer.score(probe).logprobs.float()
    own = to_batch(Rollouts(prompts, responses, [pi0[0, :3].tolist(), pi0[1, :2].tolist()], [True, True], 0), 0)
    initial = sync_check.InitialPolicy(tiny, scorer)
    rows = torch.arange(2)
    assert initial.values(own, rows)["sync/engine_kl_to_initial"] == 0.0
    shifted = to_batch(Rollouts(prompts, responses, [(pi0[0, :3] - 0.1).tolist(), (pi0[1, :2] - 0.1).tolist()],
                                [True, True], 0), 0)
    values = initial.values(shifted, rows, trainer=pi0)
    assert values["sync/engine_kl_to_initial"] == pytest.approx(torch.tensor(0.1).exp().item() - 1.1, rel=1e-4)
    assert values["sync/trainer_kl_to_initial"] == 0.0  # the trainer is still π_0


@pytest.mark.slow
def test_train_stops_on_a_sync_that_changed_nothing(offpolicy_cache, tmp_path, monkeypatch):
    """``offpolicy train`` on an engine whose syncs load nothing: the first sync after an update is an
    EngineError naming the cause, where before the run went on sampling from the initial weights."""
    from cli_inprocess import offpolicy

    monkeypatch.setattr(HFEngine, "sync_weights", Unsynced.sync_weights)
    result = offpolicy("train", *FAST, "steps=2", "lr=1e-3", f"out_dir={tmp_path / 'run'}", "--no-progress",
                       env={**os.environ, "OFFPOLICY_CACHE": str(offpolicy_cache)})
    assert result.returncode != 0
    assert "the weight sync changed nothing" in result.stderr, result.stderr[-2000:]
