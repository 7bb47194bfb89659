"""Rollouts from an inference server a user already runs: its OpenAI-compatible ``/v1/completions``.

``offpolicy diagnose --engine-url URL`` measures the engine users deploy (``vllm serve``,
``trl vllm-serve``, SGLang) rather than one offpolicy starts. One request per prompt:

* the prompt goes as **token ids** (rendered here with the model's chat template), so the server
  never re-tokenises it; ``add_special_tokens: false`` so it adds no BOS;
* **every sampling field is sent explicitly** (temperature, top_p, top_k, min_p, the three
  penalties, min_tokens, a per-request seed): a vLLM server started with ``--generation-config
  auto`` (its default) fills only the fields a request leaves out from the model's
  ``generation_config.json``, so none of its values can change μ behind the report's back;
* ``logprobs: 1`` asks for log μ of each sampled token; ``return_token_ids`` (vLLM 0.32,
  recent SGLang) and ``return_tokens_as_token_ids`` (vLLM) ask for the sampled token ids;
* ``cache_salt`` (vLLM; ``--no-cache-salt`` leaves it out for a server that refuses the field):
  one fresh salt per diagnose run, so no request is served from prefix-cache KV computed before
  the run — by weights the server held earlier, if a trainer updated them without resetting its
  cache (NeMo-RL #4018, SkyRL #1836). The run's own requests share it, so a prompt's prefix is
  still prefilled once.

Alignment is checked on every response, never assumed (``parse_completion``): the prompt ids the
server reports it scored must equal those sent (or, where it reports none, its prompt-token count
must); the sampled ids must come back as ids, agree between the two fields that carry them, and
decode here to the text the server returned (else the server's tokenizer is not ``--model``'s).
A failure is a ``ServerError`` naming the cause; nothing is written before all responses are in.

Requests run concurrently on a bounded thread pool, each with a timeout and retries with
exponential backoff on connection errors, timeouts, HTTP 429 and 5xx (never on another 4xx: a
refusal is reported as it came, status and body). The standard library only: no HTTP dependency.
"""

from __future__ import annotations

import http.client
import json
import math
import re
import secrets
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import queue
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from offpolicy.engines.base import Rollouts, SamplingConfig
from offpolicy.errors import ConfigError

# the sampling fields vLLM (ModelConfig.get_diff_sampling_param) takes from generation_config.json
# for a request that leaves them unset
GENERATION_CONFIG_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                            "frequency_penalty", "max_new_tokens")
TOKEN_ID = re.compile(r"token_id:(\d+)")
BODY_CHARS = 300  # a server's error body, as much as one line holds


class ServerError(ConfigError):
    """The server refused, could not be reached, or answered outside the contract (no token ids, a
    rewritten prompt, no log-probs). One line with the cause and the fix; the CLI exits 2."""


class ServerConfig(BaseModel):
    """Where the server is and how to talk to it (``offpolicy diagnose --engine-url ...``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(description="base URL of the OpenAI-compatible API, e.g. http://127.0.0.1:8000 (a trailing /v1 "
                     "is accepted)")
    api_key: str | None = Field(None, description="sent as 'Authorization: Bearer KEY'; read from --api-key-env")
    served_model: str | None = Field(None, description="the model name for requests; None = the one /v1/models lists")
    concurrency: int = Field(8, ge=1, description="requests in flight at once")
    timeout: float = Field(300.0, gt=0, description="seconds one request may take (a long generation included)")
    retries: int = Field(3, ge=0, description="retries after a connection error, timeout, HTTP 429 or 5xx")
    backoff: float = Field(1.0, ge=0, description="seconds before the first retry; doubled at each next one")
    cache_salt: bool = Field(True, description="send one fresh vLLM cache_salt per run: no request reuses "
                             "prefix-cache KV computed before the run (by older weights)")

    @field_validator("url")
    @classmethod
    def url_is_http(cls, url: str) -> str:
        """Normalise to ``scheme://host[:port][/prefix]`` without the ``/v1`` and trailing slashes."""
        parts = urllib.parse.urlsplit(url.strip())
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"--engine-url {url!r}: expected http(s)://HOST:PORT, e.g. http://127.0.0.1:8000")
        path = parts.path.rstrip("/")
        path = path[: -len("/v1")] if path.endswith("/v1") else path
        return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def api_key_from_env(variable: str | None, environ: dict[str, str]) -> str | None:
    """The key held by environment variable ``variable`` (``--api-key-env``); None when not asked.

    Raises:
        ConfigError: the variable is unset or empty (a key never goes on the command line, where
            ``ps`` and shell histories show it).
    """
    if variable is None:
        return None
    key = environ.get(variable, "")
    if not key:
        raise ConfigError(f"--api-key-env {variable}: the environment variable {variable} is unset or empty; "
                          f"export {variable}=<the server's --api-key>")
    return key


def _one_line(text: str, limit: int = BODY_CHARS) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit] + " …"


def _hint(status: int, path: str) -> str:
    if status in (401, 403):
        return " (the server wants an API key: --api-key-env VAR, with VAR holding the key it was started with)"
    if status == 404:
        return f" (does it serve the OpenAI-compatible API at {path}? vllm serve and trl vllm-serve do)"
    return ""


def request_json(config: ServerConfig, path: str, body: dict[str, Any] | None = None,
                 stop: threading.Event | None = None) -> dict[str, Any]:
    """One JSON exchange (GET without ``body``, POST with it), retried on a connection error, a
    timeout, HTTP 429 or 5xx after ``backoff · 2^k`` seconds (or the server's Retry-After), at most
    ``retries`` times; ``stop`` set (another request failed) ends the retries early.

    Raises:
        ServerError: another HTTP status (with its body), retries exhausted (with the last cause),
            or an answer that is not a JSON object.
    """
    url = config.url + path
    method = "GET" if body is None else "POST"
    headers = {"Accept": "application/json"}
    if body is not None:
        headers["Content-Type"] = "application/json"
    if config.api_key:
        headers["Authorization"] = f"Bearer {config.api_key}"
    data = None if body is None else json.dumps(body).encode()
    last = ""
    for attempt in range(config.retries + 1):
        wait_s = config.backoff * 2 ** attempt
        try:
            request = urllib.request.Request(url, data=data, headers=headers, method=method)
            with urllib.request.urlopen(request, timeout=config.timeout) as response:
                raw = response.read()
            break
        except urllib.error.HTTPError as err:
            text = _one_line(err.read().decode("utf-8", "replace"))
            if err.code != 429 and err.code < 500:  # a refusal: asking again gets the same answer
                raise ServerError(f"{method} {url} answered HTTP {err.code} {err.reason}: {text or '(empty body)'}"
                                  f"{_hint(err.code, path)}") from None
            last = f"HTTP {err.code} {err.reason}: {text or '(empty body)'}"
            retry_after = err.headers.get("Retry-After", "") if err.headers else ""
            if retry_after.strip().isdigit():
                wait_s = min(float(retry_after), 60.0)
        except (TimeoutError, urllib.error.URLError, ConnectionError, http.client.HTTPException, OSError) as err:
            reason = getattr(err, "reason", err)
            last = (f"timed out after {config.timeout:g} s" if isinstance(reason, TimeoutError)
                    else f"{type(reason).__name__}: {reason}")
        if attempt == config.retries or (stop is not None and stop.is_set()):
            raise ServerError(f"{method} {url}: no answer after {attempt + 1} attempt(s); last: {last} "
                              f"(is the server up? --request-timeout, --retries)")
        if stop is not None:
            if stop.wait(wait_s):
                raise ServerError(f"{method} {url}: abandoned after another request failed; last: {last}")
        else:
            time.sleep(wait_s)
    try:
        answer = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        shown = _one_line(raw.decode("utf-8", "replace"))
        raise ServerError(f"{method} {url}: the answer is not JSON: {shown}") from None
    if not isinstance(answer, dict):
        raise ServerError(f"{method} {url}: expected a JSON object, got {_one_line(json.dumps(answer))}")
    return answer


def served_model(config: ServerConfig) -> dict[str, Any]:
    """The model card (``id``; vLLM adds ``root``, the path it loaded, and ``max_model_len``) that
    requests name: ``--served-model-name`` when given, else the only model ``/v1/models`` lists.

    Raises:
        ServerError: the server is unreachable, lists no model, several without a choice, or not
            the one asked for.
    """
    answer = request_json(config, "/v1/models")
    cards = [c for c in answer.get("data") or [] if isinstance(c, dict) and isinstance(c.get("id"), str)]
    names = [c["id"] for c in cards]
    if config.served_model is not None:
        if config.served_model not in names:
            raise ServerError(f"--served-model-name {config.served_model!r}: {config.url}/v1/models lists "
                              f"{', '.join(map(repr, names)) or 'no model'}")
        return cards[names.index(config.served_model)]
    if len(cards) != 1:
        listed = ", ".join(map(repr, names)) or "none"
        raise ServerError(f"{config.url}/v1/models lists {len(cards)} models ({listed}): pick one with "
                          "--served-model-name NAME")
    return cards[0]


def run_cache_salt() -> str:
    """A salt no earlier run used: 128 random bits (vLLM allows ≤ 128 characters, no '/' or '@')."""
    return f"offpolicy-diagnose-{secrets.token_hex(16)}"


def completion_body(model: str, prompt_ids: list[int], sampling: SamplingConfig, seed: int,
                    salt: str | None = None) -> dict[str, Any]:
    """The ``/v1/completions`` request for one prompt: token ids in, every sampling field explicit
    (neutral penalties, ``min_p`` 0, no stop strings, ``min_tokens`` 0), the sampled tokens'
    log-probs and ids out; ``salt``: vLLM's ``cache_salt`` (module doc)."""
    return {**({"cache_salt": salt} if salt is not None else {}),
        "model": model, "prompt": list(prompt_ids), "n": 1, "stream": False, "echo": False,
        "max_tokens": sampling.max_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p,
        "top_k": sampling.top_k, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
        "frequency_penalty": 0.0, "min_tokens": 0, "ignore_eos": False, "stop": [], "seed": seed,
        # logprobs=1, not 0: a server that reads 0 as "off" would answer without them
        "logprobs": 1, "return_tokens_as_token_ids": True, "return_token_ids": True,
        "add_special_tokens": False, "skip_special_tokens": False,
    }


def _show(tokenizer, ids: list[int]) -> str:
    return repr(tokenizer.decode(ids, skip_special_tokens=False)) if ids else "nothing"


def prompt_change(sent: list[int], scored: list[int], tokenizer) -> str:
    """Why the prompt the server scored is not the one sent, in words."""
    if len(scored) > len(sent) and scored[len(scored) - len(sent):] == sent:
        extra = scored[: len(scored) - len(sent)]
        bos = " (the BOS)" if tokenizer.bos_token_id in extra else ""
        return (f"the server put {_show(tokenizer, extra)}{bos} in front of the prompt: it tokenised or templated "
                "the prompt itself instead of using the ids sent")
    if len(scored) < len(sent) and sent[len(sent) - len(scored):] == scored:
        return f"the server dropped the first {len(sent) - len(scored)} prompt token(s) (truncate_prompt_tokens?)"
    at = next((k for k, (a, b) in enumerate(zip(sent, scored)) if a != b), min(len(sent), len(scored)))
    return (f"the server scored another prompt ({len(scored)} tokens, sent {len(sent)}; first difference at token "
            f"{at}: sent {_show(tokenizer, sent[at:at + 4])}, scored {_show(tokenizer, scored[at:at + 4])}): "
            "another chat template or tokenizer on the server")


def _strip_replacement(text: str) -> str:
    # an incremental detokenizer holds back a split UTF-8 character (U+FFFD here, absent there)
    return text.replace("\ufffd", "")


def parse_completion(answer: dict[str, Any], index: int, sent: list[int], tokenizer) -> dict[str, Any]:
    """Token ids, log μ and alignment evidence of one ``/v1/completions`` answer.

    Returns ``{"ids", "logprobs", "finished", "prompt", "text"}`` with ``prompt`` one of ``"ids"``
    (the server reported the ids it scored: equal), ``"count"`` (only its prompt-token count:
    equal), ``"none"``; ``text`` ``"checked"`` or ``"none"`` (no text returned).

    Raises:
        ServerError: no choice, no log-probs, no token ids, ids that disagree with each other or
            with the returned text, a non-finite or positive log-prob, or a changed prompt.
    """
    where = f"response {index}"
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise ServerError(f"{where}: expected one choice, got {_one_line(json.dumps(choices))[:120]}")
    choice = choices[0]
    lp = choice.get("logprobs")
    if not isinstance(lp, dict) or not isinstance(lp.get("token_logprobs"), list):
        raise ServerError(f"{where}: the server returned no log-probs (asked with logprobs=1); offpolicy needs log μ "
                          "of each sampled token")
    values = lp["token_logprobs"]
    direct = choice.get("token_ids")
    tokens = lp.get("tokens")
    from_tokens = None
    if isinstance(tokens, list) and tokens and all(isinstance(t, str) and TOKEN_ID.fullmatch(t) for t in tokens):
        from_tokens = [int(TOKEN_ID.fullmatch(t).group(1)) for t in tokens]
    elif isinstance(tokens, list) and not tokens and not values:
        from_tokens = []
    if direct is None and from_tokens is None:
        raise ServerError(f"{where}: the server cannot return the sampled token ids (it ignored return_token_ids "
                          "and return_tokens_as_token_ids); re-tokenising its text is not exact. vLLM returns them, "
                          "SGLang does where it knows return_token_ids")
    if direct is not None and (not isinstance(direct, list) or not all(isinstance(t, int) for t in direct)):
        raise ServerError(f"{where}: token_ids is not a list of integers: {_one_line(json.dumps(direct))[:120]}")
    if direct is not None and from_tokens is not None and direct != from_tokens:
        raise ServerError(f"{where}: the server's token_ids {direct[:8]}… and its logprobs tokens {from_tokens[:8]}… "
                          "disagree")
    ids = direct if direct is not None else from_tokens
    if len(values) != len(ids):
        raise ServerError(f"{where}: {len(values)} log-probs for {len(ids)} sampled tokens")
    for t, v in enumerate(values):
        if not isinstance(v, (int, float)) or not math.isfinite(v) or v > 1e-4:
            raise ServerError(f"{where}, token {t}: log-prob {v!r} is not a finite log-probability ≤ 0 (a vLLM "
                              "--logprobs-mode *_logits returns logits: start it with --logprobs-mode "
                              "processed_logprobs)")
    scored = choice.get("prompt_token_ids")
    if scored is not None:
        if list(scored) != list(sent):
            raise ServerError(f"{where}: {prompt_change(list(sent), list(scored), tokenizer)}")
        prompt = "ids"
    else:
        count = (answer.get("usage") or {}).get("prompt_tokens")
        if isinstance(count, int) and count != len(sent):
            raise ServerError(f"{where}: the server counts {count} prompt tokens, {len(sent)} were sent: it changed "
                              "the prompt (an added BOS, its own chat template?)")
        prompt = "count" if isinstance(count, int) else "none"
    text = choice.get("text")
    checked = "none"
    if isinstance(text, str):
        server = _strip_replacement(text)
        local = {_strip_replacement(tokenizer.decode(ids, skip_special_tokens=skip)) for skip in (False, True)}
        if server not in local:
            raise ServerError(f"{where}: the returned token ids decode here to "
                              f"{_one_line(repr(tokenizer.decode(ids, skip_special_tokens=False)), 80)}, the server's "
                              f"text is {_one_line(repr(text), 80)}: the server's tokenizer is not --model's")
        checked = "checked"
    return {"ids": list(ids), "logprobs": [float(v) for v in values], "finished": choice.get("finish_reason") == "stop",
            "prompt": prompt, "text": checked}


PROMPT_CHECK = {"ids": "verified: the server reported the prompt token ids it scored, equal to those sent",
                "count": "partly verified: the server reports no prompt ids (return_token_ids), only its prompt-token "
                         "count, equal to the ids sent",
                "none": "not verified: the server reports neither the prompt ids it scored nor their count"}
TEXT_CHECK = {"checked": "verified: the sampled ids decode here to the text the server returned",
              "none": "not verified: the server returned no text"}


def generation_config_note(model_path: Path | None, sent: dict[str, Any]) -> str | None:
    """Which sampling defaults the model's ``generation_config.json`` holds, and that the request
    overrides them (a vLLM server with ``--generation-config auto`` applies them to unset fields)."""
    path = None if model_path is None else Path(model_path) / "generation_config.json"
    if path is None or not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    defaults = {k: config[k] for k in GENERATION_CONFIG_FIELDS if config.get(k) is not None}
    if not defaults:
        return None
    shown = ", ".join(f"{k}={v}" for k, v in defaults.items())
    sending = ", ".join(f"{k}={sent[k]}" for k in GENERATION_CONFIG_FIELDS if k in sent)
    return (f"the model's generation_config.json sets {shown}: a vLLM server started with --generation-config auto "
            f"(its default) applies them to any field a request leaves out; every request here sets {sending} "
            "explicitly, so μ is the stated distribution")


def bounded(job, count: int, workers: int):
    """Run ``job(i, stop)`` for i < ``count`` on at most ``workers`` threads; yield each i as it ends.
    The first exception stops the rest (``stop`` is set: queued jobs never start, retries give up) and
    is raised here. Daemon threads: a request still in flight (up to its timeout) never holds up the
    exit after an error or Ctrl-C, as ``ThreadPoolExecutor``'s joined workers would."""
    stop = threading.Event()
    todo = iter(range(count))
    lock = threading.Lock()
    ended: queue.Queue[tuple[int, BaseException | None]] = queue.Queue()

    def worker() -> None:
        while not stop.is_set():
            with lock:
                i = next(todo, None)
            if i is None:
                return
            try:
                job(i, stop)
                ended.put((i, None))
            except BaseException as err:  # noqa: BLE001 - handed to the caller's thread, raised there
                stop.set()
                ended.put((i, err))

    for _ in range(min(workers, count)):
        threading.Thread(target=worker, daemon=True, name="offpolicy-server").start()
    try:
        for _ in range(count):
            i, err = ended.get()
            if err is not None:
                raise err
            yield i
    finally:
        stop.set()


def generate(config: ServerConfig, tokenizer, prompts: list[list[int]], sampling: SamplingConfig, seed: int = 0,
             model_path: Path | None = None, console=None) -> tuple[Rollouts, dict[str, Any]]:
    """Sample one response per prompt from the server; returns the rollouts and what the report
    says about the server (URL, model, the request's fields, alignment evidence, notes, seconds).
    Request ``i`` carries seed ``seed · 1000003 + i`` (the vllm engine's per-request seeds).

    Raises:
        ServerError: see ``request_json``, ``served_model``, ``parse_completion``.
    """
    card = served_model(config)
    name = card["id"]
    salt = run_cache_salt() if config.cache_salt else None
    bodies = [completion_body(name, p, sampling, seed * 1_000_003 + i, salt) for i, p in enumerate(prompts)]
    results: list[dict[str, Any] | None] = [None] * len(prompts)

    def one(i: int, stop: threading.Event) -> None:
        answer = request_json(config, "/v1/completions", bodies[i], stop)
        results[i] = parse_completion(answer, i, prompts[i], tokenizer)

    start = time.perf_counter()
    progress = None
    if console is not None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        progress = Progress(TextColumn("server {task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=console, transient=True)
    try:
        if progress is not None:
            progress.start()
            task = progress.add_task(name, total=len(prompts))
        for _ in bounded(one, len(prompts), config.concurrency):
            if progress is not None:
                progress.advance(task)
    finally:
        if progress is not None:
            progress.stop()
    seconds = time.perf_counter() - start
    rows = [r for r in results if r is not None]
    rollouts = Rollouts(prompt_ids=[list(p) for p in prompts], response_ids=[r["ids"] for r in rows],
                        logprobs=[r["logprobs"] for r in rows], finished=[r["finished"] for r in rows], version=0)
    rollouts.validate("server")
    sent = {k: v for k, v in bodies[0].items() if k not in ("prompt", "seed", "cache_salt")}
    notes = []
    note = generation_config_note(model_path, sent)
    if note:
        notes.append(note)
    short = sum(1 for r in rows if not r["finished"] and len(r["ids"]) < sampling.max_tokens)
    if short:
        notes.append(f"{short} response(s) ended before --max-tokens {sampling.max_tokens} without a stop token: the "
                     "server capped max_tokens (its max_model_len or --override-generation-config max_new_tokens); "
                     "the tokens it sampled are measured as they are")
    levels = {r["prompt"] for r in rows}  # the report states the weakest evidence any response gave
    prompt_level = "none" if "none" in levels else "count" if "count" in levels else "ids"
    text_level = "none" if any(r["text"] == "none" for r in rows) else "checked"
    info = {
        "url": config.url, "served_model": name, "server_model_root": card.get("root"),
        "server_max_model_len": card.get("max_model_len"), "request": sent,
        "seeds": f"request i: seed·1000003 + i (seed {seed})", "requests": len(prompts),
        "concurrency": config.concurrency, "seconds": seconds,
        "prefix_cache": ("cache_salt: one fresh salt for this run's requests (no KV computed before the run is "
                         "reused)" if salt else "no cache_salt sent (--no-cache-salt): the server may reuse "
                         "prefix-cache KV computed before the run"),
        "alignment": {"prompt_ids": PROMPT_CHECK[prompt_level],
                      "response_ids": "verified: returned as ids (return_token_ids / return_tokens_as_token_ids)",
                      "text": TEXT_CHECK[text_level]},
        "notes": notes,
    }
    return rollouts, info
