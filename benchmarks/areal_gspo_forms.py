"""max |∂loss/∂log π_θ| difference: offpolicy's GSPO-token vs AReaL's sequence form (ppo_actor_loss_fn,
importance_sampling_level sequence), and offpolicy's gspo_form sequence vs AReaL, on 200 random batches
(6 × 8, per-token advantages, ~20 % padding, rejection_sampling at its defaults: token mask ρ ≤ 5).
Needs AReaL 1.0.4 (install.sh). Run: ``PYTHONPATH=src python benchmarks/areal_gspo_forms.py``."""
import torch

import offpolicy as op
from offpolicy.integrations import areal
import areal.api.cli_args as C
import areal.utils.functional.functional as F

worst = {"token": 0.0, "sequence": 0.0}
for seed in range(200):
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 8
    prox = -torch.rand(B, T, generator=g) * 3 - 1
    mu = (prox + torch.randn(B, T, generator=g) * 0.3).clamp(max=-1e-3)
    theta = prox + torch.randn(B, T, generator=g) * 0.1
    adv = torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    mask[:, 0] = True
    setting = dict(importance_sampling_level="sequence", use_decoupled_loss=True, rejection_sampling=dict(upper=5.0))
    th = theta.clone().requires_grad_(True)
    loss, _ = F.ppo_actor_loss_fn(logprobs=th, proximal_logprobs=prox, old_logprobs=mu, advantages=adv, eps_clip=0.2,
                                  loss_mask=mask.clone(), rejection_sampling=C.RejectionSamplingConfig(upper=5.0),
                                  importance_sampling_level="sequence")
    loss.backward()
    want = th.grad
    cfg = areal.loss_config(**setting)
    for form in ("token", "sequence"):
        c = cfg.model_copy(update={"gspo_form": form})
        th = theta.clone().requires_grad_(True)
        l, _ = op.policy_loss(th, prox, adv, mask.float(), mu, c)
        l.backward()
        worst[form] = max(worst[form], float((th.grad - want).abs().max()))
print({k: f"{v:.3g}" for k, v in worst.items()})
