"""Data-parallel runs of a host's real training step on the CPU: the same global batch at one rank
and at two gloo ranks, in processes forked from one parent that has already imported the host.

Used by the host worker scripts (tests/skyrl_cpu_worker.py, tests/openrlhf_cpu_worker.py,
tests/verl_actor_step.py, tests/trl_two_ranks.py) and their tests (tests/test_two_ranks_*.py).

Why fork: importing a host (SkyRL, verl, OpenRLHF, TRL + transformers) costs 10–20 s of CPU per
process; a parent imports it once and forks one process per rank (``torchrun`` or ``mp.spawn``
would import it again in every rank). Each child creates its own gloo process group (a fresh
file rendezvous per world), so the two-rank world and the one-rank world are independent process
groups, as two launches of the host would be. The parent starts no thread-pool work before the
fork (``torch.set_num_threads(1)``); the children never return to the parent's code.

What the batches look like (``global_batches``): rows of *unequal* response lengths, ordered so
that rank 0's half holds fewer valid tokens than rank 1's; ``spike_rows`` lowers log μ on every
token of the given rows, so a ratio veto rejects every token of the rank that holds them.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROWS = 8  # global rows per optimizer step: 4 per rank at two ranks
PROMPT, RESPONSE = 3, 6
# valid response tokens per row: rank 0 (rows 0–3) 2+3+1+4 = 10, rank 1 (rows 4–7) 6+5+6+4 = 21
LENGTHS = (2, 3, 1, 4, 6, 5, 6, 4)


def shard(batch: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """Rank ``rank``'s contiguous 1/world of every ``[B, ...]`` tensor (how the hosts' dispatch
    splits a batch over data-parallel ranks: verl's ``chunk``, SkyRL's ``MeshDispatch``)."""
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == ROWS:
            n = ROWS // world
            out[k] = v[rank * n:(rank + 1) * n].clone()
        else:
            out[k] = v
    return out


def global_batches(model: torch.nn.Module, logprobs: Callable[[torch.nn.Module, dict], torch.Tensor], n_steps: int = 2,
                   seed: int = 0, spike_rows: tuple[int, ...] = (), vocab: tuple[int, int] = (3, 40)
                   ) -> list[dict[str, torch.Tensor]]:
    """``n_steps`` global batches of ROWS rows: sequences (prompt + response, right-padded), the
    response ``action_mask`` of LENGTHS, π_old from ``model``'s current weights (stale from step 2
    on), μ = π_old + N(0, 0.3²) (a sampler that differs from the trainer; ``spike_rows``: every
    token of those rows 3 nats lower), and one advantage per row (GRPO-like, ± values)."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n_steps):
        seq = torch.randint(vocab[0], vocab[1], (ROWS, PROMPT + RESPONSE), generator=g)
        action = torch.zeros(ROWS, RESPONSE)
        for i, n in enumerate(LENGTHS):
            action[i, :n] = 1
        attn = torch.cat([torch.ones(ROWS, PROMPT), action], 1).long()
        b = {"sequences": seq, "attention_mask": attn, "action_mask": action}
        with torch.no_grad():
            old = logprobs(model, b)
        mu = (old + 0.3 * torch.randn(old.shape, generator=g)).clamp(max=-1e-3)
        for r in spike_rows:
            mu[r] -= 3.0
        adv = (torch.randn(ROWS, 1, generator=g).expand(ROWS, RESPONSE) * action).contiguous()
        batches.append({**b, "old": old * action, "mu": mu * action, "adv": adv})
    return batches


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world: int, init: str, port: int, fn: Callable, args: tuple, out: str) -> None:
    try:
        torch.set_num_threads(1)
        for key, value in {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                           "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
            os.environ[key] = value
        torch.distributed.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        torch.save(result, out)
    except BaseException:  # noqa: BLE001 - the parent reports it
        Path(out + ".err").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def run_worlds(fn: Callable, args: tuple, worlds: tuple[int, ...] = (2, 1), timeout: float = 500) -> dict[int, list]:
    """``fn(rank, world, *args)`` on every rank of each world in ``worlds`` (all started at once, each
    world its own gloo group); returns ``{world: [result of rank 0, ...]}``. A failing rank's
    traceback is raised here; a hang past ``timeout`` kills the children."""
    ctx = mp.get_context("fork")
    tmp = tempfile.mkdtemp(prefix="two_ranks_")
    procs = []
    for world in worlds:
        init, port = os.path.join(tmp, f"init{world}"), _free_port()
        for rank in range(world):
            out = os.path.join(tmp, f"w{world}r{rank}.pt")
            p = ctx.Process(target=_child, args=(rank, world, init, port, fn, args, out))
            p.start()
            procs.append((world, rank, out, p))
    for _, _, _, p in procs:
        p.join(timeout)
    errors = []
    for world, rank, out, p in procs:
        if p.is_alive():
            p.kill()
            errors.append(f"world {world} rank {rank}: still running after {timeout} s (killed)")
        elif p.exitcode != 0:
            err = Path(out + ".err")
            errors.append(f"world {world} rank {rank}: exit {p.exitcode}\n" + (err.read_text() if err.exists() else ""))
    if errors:
        raise RuntimeError("\n".join(errors))
    results: dict[int, list] = {}
    for world, rank, out, _ in procs:
        results.setdefault(world, []).append(torch.load(out, weights_only=False))
    return results
