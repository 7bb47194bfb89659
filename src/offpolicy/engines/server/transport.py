"""The HTTP side of a server's rollouts: where the server is (``ServerConfig``), its API key, one JSON exchange
(``request_json``) and the model it serves (``served_model``).

Requests share one httpx client (``client``), each with a timeout and retries with exponential backoff on
connection errors, timeouts, HTTP 429 and 5xx (never on another 4xx: a refusal is reported as it came, status and
body; never on a TLS failure: a certificate the client does not trust is no server that is down). The API key
never leaves the origin of ``--engine-url``: httpx follows no redirect here (``follow_redirects=False``);
``follow`` follows a GET's redirect within the origin and refuses one to another scheme, host or port (where httpx
would drop the key but still send the request), and the key and a URL's credentials are never echoed.
"""

from __future__ import annotations

import json
import ssl
import threading
import time
import urllib.parse
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from offpolicy.core.errors import ConfigError

# the path each protocol posts to: /v1/completions (None), vLLM's and SGLang's endpoints that return sampling masks
ENDPOINTS = {None: "/v1/completions", "vllm": "/inference/v1/generate", "sglang": "/generate"}
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


def one_line(text: str, limit: int = BODY_CHARS) -> str:
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
            text = one_line(response.content.decode("utf-8", "replace"))
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
        shown = one_line(raw.decode("utf-8", "replace"))
        raise ServerError(f"{method} {url}: the answer is not JSON: {shown}") from None
    if not isinstance(answer, dict):
        raise ServerError(f"{method} {url}: expected a JSON object, got {one_line(json.dumps(answer))}")
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
