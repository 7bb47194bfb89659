"""TRL 1.16.0 KL: TRL's own _compute_loss vs the adapter (TRL's KL) vs offpolicy's k3 (the pre-#27 mapping)."""
import os, sys, tempfile, torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))  # test batch + builder
import test_host_defaults as t
from trl import GRPOTrainer
import offpolicy as op
from offpolicy.tasks.model import build_tiny_qwen2
from offpolicy.tasks.tokenizer import build_char_tokenizer
tok = build_char_tokenizer(); torch.manual_seed(0)
m = build_tiny_qwen2(tok, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=64)
d = tempfile.mkdtemp(); m.save_pretrained(d)
env = {"tokenizer": tok, "model_path": d, "out": tempfile.mkdtemp()}
def gnorm(g): return torch.sqrt(sum((x**2).sum() for x in g)).item()
for bias in (True, False):
    tr = t._trl_trainer(env, op.LossConfig(), beta=0.04, use_bias_correction_kl=bias)
    x = t._batch(tr)
    trl_l, trl_g = t._loss_and_grads(tr, GRPOTrainer._compute_loss, x)
    new_l, new_g = t._loss_and_grads(tr, type(tr)._compute_loss, x)
    old = t._trl_trainer(env, op.LossConfig(kl_coef=0.04, kl_kind="k3"), beta=0.04, use_bias_correction_kl=bias)
    old_l, old_g = t._loss_and_grads(old, type(old)._compute_loss, x)
    diff = lambda g: gnorm([a - b for a, b in zip(g, trl_g)]) / gnorm(trl_g)
    print(f"use_bias_correction_kl={bias}: loss TRL {trl_l.item():.6f} | adapter {new_l.item():.6f} (grad rel. diff {diff(new_g):.1e}) | offpolicy k3 (pre-#27) {old_l.item():.6f} (grad rel. diff {diff(old_g):.3f})")
