"""The trainer on its device (issue #21): device resolution and its errors, exact micro-batching by
tokens, bf16 autocast over fp32 master weights, gradient checkpointing, no host read in the loss
path, the per-step throughput and memory numbers, checkpoints that load on any device, Triton
launches under their tensors' device, a broken vLLM import reported (issue #33). CUDA-only checks skip
without CUDA (they run on the device machine when one is lent), with both engines where vLLM imports.
vLLM's sleep / wake around the weight sync, checked against vLLM's API without a GPU: test_vllm_api.py."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml

import offpolicy as op
from conftest import FAST
from hf_fixtures import TRAINER_SHAPE, char_model
from offpolicy.core.config import ConfigError
from offpolicy.engines import Rollouts, SamplingConfig
from offpolicy.core.kept_set import KeptIds
from offpolicy.core.metrics import Metrics
from offpolicy.policy import score
from offpolicy.policy.batch import to_batch
from offpolicy.policy.score import Scorer
from offpolicy.tasks.tokenizer import build_char_tokenizer
from offpolicy.train import update
from offpolicy.train.config import load_train_config, resolve_device, resolve_trainer_dtype
from offpolicy.engines.vllm import vllm_available
from offpolicy.train.loop import throughput, train

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (runs on the device machine when lent)")
SAMPLING = SamplingConfig(max_tokens=8)


def tiny_setup(dtype=torch.float64, seed=0):
    """A tiny Qwen2 and a hand-made batch of 6 rows with different prompt and response lengths."""
    tok = build_char_tokenizer()
    model = char_model(**TRAINER_SHAPE, seed=seed).to(dtype)
    g = torch.Generator().manual_seed(seed)
    prompts = [[1, *torch.randint(5, 40, (n,), generator=g).tolist()] for n in (3, 6, 2, 5, 4, 7)]
    responses = [torch.randint(5, 40, (n,), generator=g).tolist() for n in (5, 1, 8, 3, 6, 2)]
    # μ = a perturbed copy's log-probs: a real mismatch for the correction to act on
    logprobs = [(-2.0 - torch.rand(len(r), generator=g, dtype=torch.float64)).tolist() for r in responses]
    rollouts = Rollouts(prompts, responses, logprobs, [True] * 6, version=0)
    batch = to_batch(rollouts, tok.pad_token_id)
    batch.rollout_logprobs = batch.rollout_logprobs.to(dtype)
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2, 0.3, 0.9], dtype=dtype).unsqueeze(-1).expand_as(batch.mask).contiguous()
    return model, batch, adv


def grads_after_step(model, batch, adv, loss_cfg, budget, old=None, trainer_dtype="fp32", steps=(range(6),)):
    """The gradient the ``optimizer_step`` calls apply (one per entry of ``steps``, each on those rows, into
    one Metrics as the loop does): SGD with lr 1 and no clipping moves each weight by −Σ∇; weights restored."""
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    metrics = Metrics()

    def old_of(rows, mb, logprobs):
        return logprobs.detach() if old is None else old[rows, : mb.mask.shape[1]]

    for rows in steps:
        update.optimizer_step(Scorer(model, SAMPLING, torch.device("cpu"), trainer_dtype, budget), opt, batch,
                              torch.tensor(list(rows)), adv, old_of=old_of, loss_cfg=loss_cfg, max_grad_norm=1e12,
                              metrics=metrics)
    grads = [b - p.detach() for b, p in zip(before, model.parameters())]
    with torch.no_grad():
        for p, b in zip(model.parameters(), before):
            p.copy_(b)
    return grads, metrics.to_dict()


ROW_NOISE = (0.0003, 0.3, 0.02, 0.8, 0.0005, 0.1)  # rows from near-on-policy to far: every preset keeps some


def near_setup():
    """``tiny_setup`` with μ = π_θ + N(0, σ_b²) per token of row b (σ in ``ROW_NOISE``) and π_old = π_θ +
    N(0, (σ_b/3)²): every preset's band keeps some rows and most bands cut something (a correction that
    rejects everything would compare zeros)."""
    model, batch, adv = tiny_setup()
    g = torch.Generator().manual_seed(100)
    with torch.no_grad():
        lp = Scorer(model, SAMPLING, torch.device("cpu"), "fp32", None).score(batch).logprobs
    mask = batch.mask.bool()
    zero = torch.zeros((), dtype=lp.dtype)
    sigma = torch.tensor(ROW_NOISE, dtype=lp.dtype).unsqueeze(1)
    batch.rollout_logprobs = torch.where(mask, (lp + sigma * torch.randn(lp.shape, generator=g, dtype=lp.dtype))
                                         .clamp(max=-1e-3), zero)
    old = torch.where(mask, (lp + sigma / 3 * torch.randn(lp.shape, generator=g, dtype=lp.dtype)).clamp(max=-1e-3),
                      zero)
    return model, batch, adv, old


def assert_same_step(whole, split, tol=1e-10):
    """Two (gradients, metrics) of one step: equal to ``tol`` (relative to the value, absolute below 1)."""
    (g_whole, m_whole), (g_split, m_split) = whole, split
    scale = max(g.abs().max().item() for g in g_whole)
    for a, b in zip(g_whole, g_split):
        assert (a - b).abs().max().item() <= tol * max(scale, 1e-30)
    assert m_split.keys() == m_whole.keys()
    for key, value in m_whole.items():
        other = m_split[key]
        assert (math.isnan(value) and math.isnan(other)) or abs(value - other) <= tol * max(1.0, abs(value)), \
            (key, value, other)


# data-chosen bounds (issue #12, #14) and weight.normalize, beside every preset
STEP_LEVEL = {
    "quantile_weight": {"anchor": "old", "weight": {"level": "token", "mode": "truncate",
                                                    "high": {"rule": "quantile", "q": 0.7}}},
    "ess_weight": {"anchor": "old", "weight": {"level": "sequence", "mode": "truncate",
                                               "high": {"rule": "ess", "target": 0.999}}},
    "quantile_rule": {"anchor": "old", "reject": [{"stat": "ratio", "level": "geometric",
                                                   "low": {"rule": "quantile", "q": 0.2}}]},
    "m2_then_quantile": {"anchor": "old", "reject_mode": "sequential",
                         "reject": [{"stat": "m2", "high": 0.02}, {"stat": "ratio", "level": "token",
                                                                    "high": {"rule": "quantile", "q": 0.9}}]},
    "normalize_token": {"anchor": "old", "weight": {"level": "token", "mode": "truncate", "high": 1.5,
                                                    "normalize": True}},
    "normalize_sequence": {"anchor": "current", "weight": {"level": "geometric", "mode": "truncate",
                                                           "normalize": True}},
}


def step_config_of(name):
    if name in STEP_LEVEL:
        kind = "reinforce" if STEP_LEVEL[name]["anchor"] == "current" else "ppo"
        return op.LossConfig(kind=kind, correction=STEP_LEVEL[name])
    cfg = op.LossConfig.from_preset(name)
    # seq-mean-token-sum-norm divides by max_len: the config load asks for it with micro_batch_tokens
    return cfg.model_copy(update={"max_len": 8}) if cfg.agg == "seq-mean-token-sum-norm" else cfg


@pytest.mark.parametrize("name", [*op.presets.names(), *STEP_LEVEL])
def test_a_split_step_equals_the_whole_step(name):
    """Issue #32: for every preset, the data-chosen bounds and weight.normalize, one optimizer step split into
    micro-batches of ≤ 20 tokens gives the unsplit step's gradient, loss, grad norm and every metric to 1e-10
    (float64 model): the step's thresholds and mean weight are fixed over the whole step, per-row reductions
    run over the step's response width, sums accumulate in float64."""
    model, batch, adv, old = near_setup()
    cfg = step_config_of(name)
    # π_old from its own forward, and π_old = sg(π_θ) (the loop's skipped forward) for anchor old
    for anchor_old in (old, None) if cfg.correction is not None and cfg.correction.anchor == "old" else (old,):
        whole = grads_after_step(model, batch, adv, cfg, None, anchor_old)
        split = grads_after_step(model, batch, adv, cfg, 20, anchor_old)
        assert any(g.abs().max() > 1e-6 for g in whole[0]), "no gradient: the comparison would be vacuous"
        assert_same_step(whole, split)


def test_data_chosen_bounds_are_not_per_micro_batch():
    """Guard against a vacuous comparison above: a per-micro-batch bound (the library's per-call default,
    what the trainer did before issue #32) gives another step."""
    model, batch, adv, old = near_setup()
    cfg = op.LossConfig.from_preset("areal:m2po")
    whole = grads_after_step(model, batch, adv, cfg, None, old)
    per_call = Metrics()
    for g, _ in score.micro_batches(batch, torch.arange(6), 20):
        mb = score.trim(batch.select(g))
        lp = Scorer(model, SAMPLING, torch.device("cpu"), "fp32").forward(mb).logprobs
        per_call.update(op.policy_loss(lp, old[g, : mb.mask.shape[1]], adv[g, : mb.mask.shape[1]], mb.mask,
                                       mb.rollout_logprobs, cfg)[1])
    assert per_call["masked_fraction"] != pytest.approx(whole[1]["offpolicy/masked_fraction"], abs=1e-3)


def test_optimizer_steps_of_any_split_log_one_loss():
    """Issue #32 items 4–5: two optimizer steps (mini-batches) into one Metrics, one step split into
    micro-batches and the other not: no reducer clash ('loss' was a per-call mean unsplit and a sum of
    global-count parts split), and ``offpolicy/loss`` is the mean of the two steps' full-batch losses —
    the same as without micro-batches (it was their sum, twice the loss)."""
    model, batch, adv, old = near_setup()
    cfg = op.LossConfig.from_preset("recommended")
    steps = ([0, 1], [2, 3, 4, 5])  # rows 1, 0: 2·9 ≤ 20 tokens, one micro-batch; rows 2–5 need three
    assert len(score.micro_batches(batch, torch.tensor(steps[0]), 20)) == 1
    assert len(score.micro_batches(batch, torch.tensor(steps[1]), 20)) == 3
    whole = grads_after_step(model, batch, adv, cfg, None, old, steps=steps)
    split = grads_after_step(model, batch, adv, cfg, 20, old, steps=steps)
    assert_same_step(whole, split)
    # the same two steps, each into its own Metrics: the logged loss is the mean of theirs
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    each = []
    for rows in steps:
        m = Metrics()
        update.optimizer_step(Scorer(model, SAMPLING, torch.device("cpu")), opt, batch, torch.tensor(rows), adv,
                              old_of=lambda r, mb, lp: old[r, : mb.mask.shape[1]], loss_cfg=cfg, max_grad_norm=1e12,
                              metrics=m)
        each.append(m["loss"])
    assert whole[1]["offpolicy/loss"] == pytest.approx((each[0] + each[1]) / 2, rel=1e-12)
    assert abs(each[0] - each[1]) > 1e-3  # two different losses: a sum would not pass for the mean


# ---------------------------------------------------------------------- device and dtype
def test_device_cuda_without_cuda_is_refused_before_anything_is_written(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: the error is for machines without it")
    cfg = load_train_config(None, [*FAST, "steps=1", f"out_dir={tmp_path / 'run'}", "trainer.device=cuda"])
    with pytest.raises(ConfigError, match=r"trainer.device=cuda: CUDA is not available.*Fix: trainer.device=cpu"):
        train(cfg, progress=False)
    assert not (tmp_path / "run").exists()
    assert resolve_device(load_train_config(None, ["trainer.device=auto"])) == torch.device("cpu")
    assert resolve_trainer_dtype(load_train_config(None, []), torch.device("cpu"))[0] == "fp32"
    with pytest.raises(Exception, match="device"):
        load_train_config(None, ["trainer.device=gpu"])  # not auto | cpu | cuda | cuda:N


def test_diagnose_device_cuda_without_cuda_is_one_clear_line(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: the error is for machines without it")
    from offpolicy.cli import main

    assert main(["diagnose", "--trainer-device", "cuda", "--engine", "hf", "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("offpolicy diagnose: error: trainer.device=cuda: CUDA is not available") and "\n" not in err
    assert not (tmp_path / "d").exists()


def test_seq_sum_norm_micro_batches_need_max_len():
    with pytest.raises(Exception, match=r"loss.max_len=10"):
        load_train_config(None, ["trainer.micro_batch_tokens=64", "loss.agg=seq-mean-token-sum-norm"])
    load_train_config(None, ["trainer.micro_batch_tokens=64", "loss.agg=seq-mean-token-sum-norm", "loss.max_len=10"])


# ---------------------------------------------------------------------- micro-batches
def test_micro_batches_by_padded_tokens():
    _, batch, _ = tiny_setup()
    lengths = batch.attention_mask.sum(1).tolist()
    assert lengths == [9, 8, 11, 9, 11, 10]  # prompt (bos + n) + response: 4+5, 7+1, 3+8, 6+3, 5+6, 8+2
    groups = [part.rows for part in score.micro_batches(batch, torch.arange(6), 20)]
    # shortest first: 8 (row 1), 9 (row 0), 9 (row 3), 10, 11, 11 → [1, 0] costs 2·9 = 18 ≤ 20, adding row 3
    # costs 3·9 = 27 > 20; [3, 5] costs 2·10 = 20; [2, 4] costs 2·11 = 22 > 20, so 2 and 4 go alone
    assert [g.tolist() for g in groups] == [[1, 0], [3, 5], [2], [4]]
    assert [p.rows.tolist() for p in score.micro_batches(batch, torch.arange(6), None)] == [list(range(6))]
    assert [p.rows.tolist() for p in score.micro_batches(batch, torch.arange(6), 5)] == [[1], [0], [3], [5], [2], [4]]
    mb = score.trim(batch.select(torch.tensor([1, 0])))
    assert mb.input_ids.shape == (2, 9) and mb.mask.shape == (2, 5)  # longest row 9, longest response 5


def test_micro_batch_losses_add_up_to_the_whole_loss():
    model, batch, adv = tiny_setup()
    loss_cfg = op.LossConfig.from_preset("recommended")
    cpu = torch.device("cpu")
    with torch.no_grad():
        whole_mb = score.trim(batch)
        lp = Scorer(model, SAMPLING, cpu, "fp32").forward(whole_mb).logprobs
        whole, _ = op.policy_loss(lp, lp, adv[:, : lp.shape[1]], whole_mb.mask, whole_mb.rollout_logprobs,
                                  loss_cfg)
        groups = [part.rows for part in score.micro_batches(batch, torch.arange(6), 20)]
        mbs = [score.trim(batch.select(g)) for g in groups]
        lps = [Scorer(model, SAMPLING, cpu, "fp32").forward(mb).logprobs for mb in mbs]
        advs = [adv[g][:, : mb.mask.shape[1]] for g, mb in zip(groups, mbs)]
        parts = [{"mask": mb.mask, "rollout_logprobs": mb.rollout_logprobs, "old_logprobs": x, "logprobs": x,
                  "advantages": a} for mb, x, a in zip(mbs, lps, advs)]
        cfg = update.step_config(loss_cfg, parts)
        total = sum(op.policy_loss(x, x, a, mb.mask, mb.rollout_logprobs, cfg)[0] for mb, x, a in zip(mbs, lps, advs))
    assert len(groups) == 4 and cfg.global_tokens == whole_mb.mask.sum().item()  # no rejection: all 25 tokens
    # the rungs take ratios in fp32 (the project's rule), so the sums agree to fp32's rounding (~1e-7)
    assert total.item() == pytest.approx(whole.item(), rel=1e-6)
    naive = sum(op.policy_loss(x, x, a, mb.mask, mb.rollout_logprobs, loss_cfg)[0] for mb, x, a in zip(mbs, lps, advs))
    assert naive.item() != pytest.approx(whole.item(), rel=1e-2)  # each micro-batch's own count would not


# ---------------------------------------------------------------------- precision, checkpointing
def test_gradient_checkpointing_gives_the_same_gradient():
    model, batch, adv = tiny_setup()
    plain, _ = grads_after_step(model, batch, adv, op.LossConfig(), None)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    checkpointed, _ = grads_after_step(model, batch, adv, op.LossConfig(), None)
    for a, b in zip(plain, checkpointed):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13)


def test_bf16_is_autocast_compute_over_fp32_master_weights():
    model, batch, adv = tiny_setup(dtype=torch.float32)
    cpu = torch.device("cpu")
    mb = score.trim(batch)
    with torch.no_grad():
        fp32 = Scorer(model, SAMPLING, cpu, "fp32").forward(mb).logprobs
        bf16 = Scorer(model, SAMPLING, cpu, "bf16").forward(mb).logprobs
    assert bf16.dtype == torch.float32  # log-probs (and every ratio after them) stay fp32
    gap = ((bf16 - fp32).abs() * mb.mask).max().item()
    assert 1e-5 < gap < 0.2  # bf16 compute really ran (8-bit mantissa: ~1e-2 on these logits), close to fp32
    grads, _ = grads_after_step(model, batch, adv, op.LossConfig(), None, trainer_dtype="bf16")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(g.dtype == torch.float32 for g in grads) and any(g.abs().max() > 0 for g in grads)


# ---------------------------------------------------------------------- host reads
@pytest.mark.parametrize("replay", [False, True], ids=["own_set", "kept_set_replayed"])
def test_the_loss_path_reads_nothing_on_the_host(monkeypatch, replay):
    """On a GPU every host read of a device value is a synchronisation. On the CPU we check the
    same thing structurally: forward, loss, backward and update never turn a tensor into a Python
    value nor take a ``nonzero`` (a data-dependent shape: a host wait on CUDA). The forward is checked
    from the micro-batch the trainer moves to the device (``score.to_device``, which works out the
    counted positions on the host) — issue #44: the head's ``nonzero`` of the device mask went unseen
    while this test began after the forward. ``kept_set_replayed``: under top-k with the engine's kept
    sets (issue #46) the head made each chunk's sets dense with two host reads per chunk, forward and
    backward; their bounds now come from the host too (``Batch.counted``)."""
    model, batch, adv = tiny_setup(dtype=torch.float32)
    sampling = SAMPLING
    if replay:  # the engine's top-5 sets of a noisy copy of the logits, each holding its sampled token
        sampling = SamplingConfig(max_tokens=8, top_k=5)
        vocab = model.get_output_embeddings().weight.shape[0]
        noisy = torch.rand((*batch.mask.shape, vocab), generator=torch.Generator().manual_seed(5))
        keep = torch.zeros_like(noisy, dtype=torch.bool).scatter(-1, noisy.topk(5, dim=-1).indices, True)
        batch.kept = KeptIds.from_mask(keep.scatter(-1, batch.response_ids.unsqueeze(-1), True))
    cpu = torch.device("cpu")
    mb = score.to_device(score.trim(batch), cpu)
    a = adv[:, : mb.mask.shape[1]].float()
    mb.rollout_logprobs = mb.rollout_logprobs.float()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    metrics = Metrics()

    names = ("item", "tolist", "__bool__", "__float__", "__int__", "numpy", "nonzero")
    originals = {name: getattr(torch.Tensor, name) for name in names}
    torch_nonzero = torch.nonzero
    depth: list = []

    def refuse(self, *args, **kwargs):
        raise AssertionError("host read of a tensor in the loss path")

    def allowed(fn):
        """``fn`` may read the host: the CPU rungs of the loss validate there (free on a CPU; the triton
        rung a CUDA batch takes does not, see test_cuda_loss_path_does_not_synchronise), and AdamW reads
        its step counter, a CPU tensor on every device. Checked here: the trainer's code around them."""
        def call(*args, **kwargs):
            depth.append(fn)  # an allowed call inside another (check_head runs the decoder) stays allowed
            for name, original in originals.items():
                monkeypatch.setattr(torch.Tensor, name, original)
            monkeypatch.setattr(torch, "nonzero", torch_nonzero)
            try:
                return fn(*args, **kwargs)
            finally:
                depth.pop()
                if not depth:
                    for name in names:
                        monkeypatch.setattr(torch.Tensor, name, refuse)
                    monkeypatch.setattr(torch, "nonzero", refuse)
        return call

    from offpolicy.policy import head

    monkeypatch.setattr(op, "policy_loss", allowed(op.policy_loss))
    monkeypatch.setattr(opt, "step", allowed(opt.step))
    monkeypatch.setattr(head, "check_head", allowed(head.check_head))  # once per model, on its first forward
    # the decoder is transformers' code: its SDPA mask builder reads the padding mask on the host
    # (masking_utils._ignore_causal_mask_sdpa); checked here is ours around it
    monkeypatch.setattr(head, "decoder_hidden", allowed(head.decoder_hidden))
    monkeypatch.setattr(torch, "nonzero", refuse)
    for name in names:
        monkeypatch.setattr(torch.Tensor, name, refuse)
    logprobs = Scorer(model, sampling, cpu, "fp32").forward(mb, metrics).logprobs
    update.accumulate(logprobs, logprobs.detach(), a, mb, op.LossConfig.from_preset("recommended"), metrics)
    update.apply(model, opt, 1.0, metrics)
    monkeypatch.undo()
    values = metrics.to_dict()  # the one copy per step
    assert values["offpolicy/grad_norm"] > 0 and values["offpolicy/kl_k3"] >= 0
    assert values.get("offpolicy/kept_set_replayed", 0.0) == float(replay)


def test_throughput_numbers_per_step():
    values = {"step_seconds": 2.0, "time/generate": 0.5, "time/wait": 0.1, "time/train": 1.2}
    sync = throughput(values, 100.0, torch.device("cpu"), overlapped=False)
    # 100 tokens / 2 s = 50 tok/s; generate 0.5 / 2 = 0.25; train 1.2 / 2 = 0.6; no GPU memory on CPU
    assert {k: v for k, v in sync.items() if k.startswith("time/")} == {
        "time/tokens_per_s": 50.0, "time/generate_share": 0.25, "time/train_share": 0.6}
    assert throughput(values, 100.0, torch.device("cpu"), overlapped=True)["time/generate_share"] == 0.05  # 0.1 / 2
    # a CPU has a memory figure too (issue #30 item 7): this process's resident memory, never a NaN
    memory = {k: v for k, v in sync.items() if k.startswith("memory/")}
    assert memory.keys() == {"memory/rss_gib", "memory/peak_rss_gib"}
    assert 0.01 < memory["memory/rss_gib"] <= memory["memory/peak_rss_gib"] < 1024


def test_gpu_peak_leaves_out_the_engine_share(monkeypatch):
    """vLLM allocates through a torch memory pool and sleep only unmaps its pages, so the allocator's peak
    counts the sleeping engine (issue #33 item 5): the trainer's peak and the engine's share are reported
    apart. 10 GiB peak with the engine's 4 GiB in it → the trainer's 6 GiB, the engine's 4 GiB."""
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 10 * 2**30)
    values = {"step_seconds": 1.0, "time/generate": 0.5, "time/wait": 0.0}
    out = throughput(values, 10.0, torch.device("cuda"), overlapped=False, engine_bytes=4 * 2**30)
    assert out["memory/peak_gib"] == 6.0 and out["memory/engine_gib"] == 4.0


def test_peak_resident_memory_is_per_step():
    import mmap

    from offpolicy.train.memory import memory_metrics, reset_memory_peaks

    try:
        open("/proc/self/clear_refs", "w").close()
    except OSError:
        pytest.skip("no writable /proc/self/clear_refs (not Linux): the peak is the run's, not the step's")
    cpu = torch.device("cpu")
    reset_memory_peaks(cpu)
    # 64 MiB mapped, touched page by page, then unmapped: straight from the OS, since a malloc'd block may reuse
    # pages an earlier test left resident in the heap (under xdist a worker has run other tests before this)
    block = mmap.mmap(-1, 64 * 2**20)
    for offset in range(0, len(block), mmap.PAGESIZE):
        block[offset] = 1
    block.close()
    during = memory_metrics(cpu)
    assert during["memory/peak_rss_gib"] - during["memory/rss_gib"] > 48 / 1024  # the block is in this step's peak
    reset_memory_peaks(cpu)
    after = memory_metrics(cpu)
    assert after["memory/peak_rss_gib"] - after["memory/rss_gib"] < 16 / 1024  # and not in the next step's


# ---------------------------------------------------------------------- checkpoints, Triton launches, vLLM import
def test_a_checkpoint_saved_on_a_gpu_resumes_on_the_cpu(tmp_path, monkeypatch):
    """torch.save records each tensor's device; ``load_trainer_state`` maps them to the CPU (the optimizer
    then moves its state to the parameters' device). Here the file says cuda:1, as a run there writes it:
    without map_location torch.load would need that GPU (issue #33 item 2)."""
    from offpolicy.train.checkpoint import load_trainer_state

    monkeypatch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:1")
    state = {"optimizer": {"state": {0: {"exp_avg": torch.full((3,), 0.5)}}}, "step": 4}
    torch.save(state, tmp_path / "trainer_state.pt")
    monkeypatch.undo()
    state = load_trainer_state(tmp_path)
    assert state["step"] == 4 and state["optimizer"]["state"][0]["exp_avg"].device == torch.device("cpu")
    assert state["optimizer"]["state"][0]["exp_avg"].tolist() == [0.5, 0.5, 0.5]


def test_triton_launches_run_under_their_tensors_device(monkeypatch):
    """Triton launches on the current CUDA device: every launch is entered under a guard of the batch's
    device (issue #33 item 1), and the guard makes that device current (torch.cuda.device)."""
    pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")
    from conftest import random_batch
    from offpolicy.core.kernels import triton as tk

    if not (torch.cuda.is_available() or tk._interpreted()):
        pytest.skip("no GPU and TRITON_INTERPRET unset: the triton rung does not run")
    entered = []

    class Guard:  # stands in for torch.cuda.device: records the device made current
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(self.device)

        def __exit__(self, *exc):
            entered.append(None)

    monkeypatch.setattr(torch.cuda, "device", Guard)
    with tk.on_device(torch.device("cuda", 1)):
        pass
    assert entered == [torch.device("cuda", 1), None]
    monkeypatch.undo()

    guarded, launches = [], []
    real_guard = tk.on_device

    def spy_guard(device):
        guarded.append(device)
        return real_guard(device)

    class Kernel:  # records whether the guard was entered (and not left) when the kernel launched
        def __init__(self, kernel):
            self.kernel = kernel

        def run(self, *args, **kwargs):  # the rung launches with kernel.run(..., grid=...): no proxy per call
            launches.append(len(guarded))
            return self.kernel.run(*args, **kwargs)

    monkeypatch.setattr(tk, "on_device", spy_guard)
    for name in ("_row_stats", "_tokens", "_finish"):
        monkeypatch.setattr(tk, name, Kernel(getattr(tk, name)))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    b = {k: v.to(device) for k, v in random_batch(0).items()}
    cfg = op.LossConfig.from_preset("verl:decoupled_seq_is")  # a sequence weight: all three kernels launch
    loss, _ = tk.policy_loss(b["logprobs"], b["old"], b["adv"], b["mask"], b["rollout"], cfg, reduce=True)
    assert torch.isfinite(loss)
    assert guarded == [b["mask"].device] and launches == [1, 1, 1]


def test_a_broken_vllm_import_is_reported(monkeypatch):
    """`import vllm` failing (a missing package, or a CUDA build next to the wrong torch) is never swallowed
    into "install vllm": the error is in the message (issue #33 item 7)."""
    import sys

    from offpolicy.engines import make_engine

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm → ImportError: import of vllm halted
    with pytest.raises(RuntimeError, match=r"`import vllm` failed: \w*Error: import of vllm halted"):
        make_engine("vllm", "unused", None, "fp32")


@pytest.mark.slow
@pytest.mark.parametrize("setting", [["minibatches=1", "preset=recommended", "trainer.gradient_checkpointing=true"],
                                     # issue #32: a reducer clash at step 0, and a loss logged twice over
                                     ["minibatches=8", "preset=areal:m2po"],
                                     ["minibatches=1", "ppo_epochs=2", "preset=verl:bypass_pg_is"]])
def test_micro_batched_run_matches_the_plain_run(offpolicy_cache, tmp_path, setting):
    """Same samples, same first update: micro-batching (and checkpointing) change memory, not the step —
    with mini-batches of which some split and some do not, PPO epochs, a data-chosen bound (M2PO) and a
    preset whose loss is not PPO's. The run's config.yaml holds the loss that ran."""
    def first(name, *extra):
        cfg = load_train_config(None, [*FAST, "steps=1", *setting, f"out_dir={tmp_path / name}", "trainer.device=cpu",
                                       *extra])
        train(cfg, progress=False)
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return json.loads(lines[0]), yaml.safe_load((tmp_path / name / "config.yaml").read_text()), cfg

    plain, config, cfg = first("plain")
    split, _, _ = first("split", "trainer.micro_batch_tokens=24")
    assert config["train"]["trainer"]["device"] == "cpu" and config["resolved"]["trainer_dtype"] == "fp32"
    assert config["resolved"]["loss"] == config["train"]["loss"] == cfg.loss_config().model_dump(mode="json")
    if "preset=recommended" in setting:  # the README's clip, not PPO's ε = 0.2
        assert (config["resolved"]["loss"]["clip_low"], config["resolved"]["loss"]["clip_high"]) == (0.4, 0.4)
    assert split.keys() == plain.keys()
    for key, value in plain.items():
        # fp32 model: the split forward rounds differently (~1e-7); a per-call bound or a doubled loss is ≥ 1e-2 off
        # (memory/*: the process's memory, which differs between runs as timings do)
        if not key.startswith(("time/", "generate/", "memory/")) and key != "step_seconds" and value is not None:
            assert split[key] == pytest.approx(value, rel=1e-4, abs=1e-6, nan_ok=True), key
    assert "memory/peak_gib" not in plain and plain["time/tokens_per_s"] > 0 and plain["generate/tokens_per_s"] > 0
    assert 0 < plain["memory/rss_gib"] <= plain["memory/peak_rss_gib"]  # a CPU run's memory figure
    assert 0 < plain["time/generate_share"] < 1 and 0 < plain["time/train_share"] < 1


# ---------------------------------------------------------------------- CUDA (device machine)
@CUDA
@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.skipif(
    not vllm_available(), reason="vLLM is not importable here (pip install vllm)"))])
def test_cuda_run(engine, offpolicy_cache, tmp_path, monkeypatch):
    """Two steps on the GPU. With vllm (colocated, sleep mode): generate → sleep(1) → train → wake the
    weights → reload through the worker → wake the KV cache, and the engine's memory reported apart."""
    from offpolicy.core.kernels import get

    triton = get("triton")
    calls = []
    real = triton.policy_loss

    def spy(*args, **kwargs):
        calls.append(args[0].device.type)
        return real(*args, **kwargs)

    monkeypatch.setattr(triton, "policy_loss", spy)
    cfg = load_train_config(None, [*FAST, "steps=2", f"out_dir={tmp_path / 'run'}", "trainer.device=cuda", f"engine={engine}"])
    result = train(cfg, progress=False)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert calls and set(calls) == {"cuda"}  # the loss took the triton rung
    assert all(r["memory/peak_gib"] > 0 and r["memory/engine_gib"] > 0 and r["memory/rss_gib"] > 0 for r in rows)
    assert "device: cuda" in (result.run_dir / "config.yaml").read_text()
    # the engine's weights were reloaded after every step (a broken sync leaves the engine's μ on old weights)
    assert all(0 <= r["offpolicy/kl_k3"] < 1e-2 for r in rows)


@CUDA
def test_cuda_loss_path_does_not_synchronise():
    model, batch, adv = tiny_setup(dtype=torch.float32)
    device = torch.device("cuda")
    model.to(device)
    mb = score.trim(batch)
    mb.rollout_logprobs = mb.rollout_logprobs.float()
    mb = score.to_device(mb, device)
    a = adv[:, : mb.mask.shape[1]].float().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = op.LossConfig.from_preset("recommended")
    logprobs = Scorer(model, SAMPLING, device, "bf16").forward(mb).logprobs
    update.accumulate(logprobs, logprobs.detach(), a, mb, cfg, Metrics())  # warm-up: kernels compiled, state made
    update.apply(model, opt, 1.0, Metrics())
    logprobs = Scorer(model, SAMPLING, device, "bf16").forward(mb).logprobs
    metrics = Metrics()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        update.accumulate(logprobs, logprobs.detach(), a, mb, cfg, metrics)
        update.apply(model, opt, 1.0, metrics)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert metrics.to_dict()["offpolicy/grad_norm"] > 0
