"""The reference side of the host end-to-end tests (tests/test_e2e_{openrlhf,skyrl}.py): the same
tiny Qwen2, the same batches and the same SGD steps, with ``op.policy_loss`` called directly and no
host code at all. A host's trained weights must equal these.
"""

from __future__ import annotations

import torch

import offpolicy as op
from hf_fixtures import char_model
from offpolicy.tasks.tokenizer import build_char_tokenizer

MODEL = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64,
         "max_positions": 32}
LR = 0.5
MAX_NORM = 1.0  # both hosts clip the global grad norm at 1.0 by default (--actor.max_norm; SkyRL's max_grad_norm)


def response_logprobs(model: torch.nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    """log π of the response tokens, [B, A], the way both hosts' actor wrappers compute it
    (OpenRLHF ``Actor.forward``, SkyRL ``HFModelWrapper.forward``): position ids from the attention
    mask, fp32 logits, token t+1's log-prob read at position t, the last A columns, × the mask."""
    am = b["attention_mask"]
    pos = am.long().cumsum(-1) - 1
    pos.masked_fill_(am == 0, 1)
    logits = model(b["sequences"], attention_mask=am, position_ids=pos).logits.float()
    lp = logits.log_softmax(-1).gather(-1, b["sequences"].roll(-1, 1).unsqueeze(-1)).squeeze(-1)[:, :-1]
    mask = b["action_mask"]
    return lp[:, -mask.shape[1]:] * mask.float()


def make_setup(seed: int = 0, n_steps: int = 2, b_: int = 4, p_: int = 3, a_: int = 5
               ) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Initial weights and ``n_steps`` batches. π_old comes from the initial weights for every batch
    (so from step 2 on π_θ ≠ π_old); μ = π_old + N(0, 0.3²) per token, a sampler that really
    differs from the trainer; one row's last two response tokens are masked out."""
    tok = build_char_tokenizer()
    model = char_model(**MODEL)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n_steps):
        seq = torch.randint(3, len(tok), (b_, p_ + a_), generator=g)
        attn = torch.ones(b_, p_ + a_, dtype=torch.long)
        action = torch.ones(b_, a_)
        action[1, -2:] = 0  # row 1: its last two response tokens carry no loss
        b = {"sequences": seq, "attention_mask": attn, "action_mask": action}
        with torch.no_grad():
            old = response_logprobs(model, b)
        mu = (old + 0.3 * torch.randn(old.shape, generator=g)).clamp(max=-1e-3) * action  # log-probs are ≤ 0
        adv = (torch.randn(b_, 1, generator=g).expand(b_, a_) * action).contiguous()
        batches.append({**b, "old": old, "mu": mu, "adv": adv})
    return state, batches


def reference_steps(state: dict[str, torch.Tensor], batches: list[dict[str, torch.Tensor]],
                    cfg: op.LossConfig) -> dict[str, torch.Tensor]:
    """One SGD step per batch on ``op.policy_loss(..., cfg)`` (token-mean over the batch), the grad
    norm clipped at MAX_NORM; the final weights."""
    model = char_model(**MODEL)
    model.load_state_dict(state)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for b in batches:
        logp = response_logprobs(model, b)
        loss, _ = op.policy_loss(logp, b["old"], b["adv"], b["action_mask"], b["mu"], cfg)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """‖a − b‖₂ over all parameters."""
    return sum(float((a[k].float() - b[k].float()).pow(2).sum()) for k in a) ** 0.5


def assert_host_steps_equal_policy_loss(host: str, state: dict[str, torch.Tensor],
                                        batches: list[dict[str, torch.Tensor]], out: dict, cfg: op.LossConfig,
                                        plain: op.LossConfig) -> None:
    """The host's trained weights ``out["state"]`` after its steps on ``batches`` from ``state``: those of
    ``reference_steps`` under ``cfg`` to float noise (relative to how far the steps moved the weights),
    and not those of an uncorrected ``plain`` step on the same batches (the correction is what ran)."""
    ref = reference_steps(state, batches, cfg)
    moved = distance(ref, state)
    assert moved > 1e-2  # the two steps move the weights
    print(f"{host}: weights moved {moved:.4f}, host vs op.policy_loss {distance(out['state'], ref):.2e}")
    assert distance(out["state"], ref) < 1e-4 * moved, (distance(out["state"], ref), moved)
    assert distance(out["state"], reference_steps(state, batches, plain)) > 1e-2 * moved


def statuses(out: dict) -> list[dict]:
    """The host's status (its logged metrics) of each of the two steps."""
    assert len(out["status"]) == 2
    return out["status"]
