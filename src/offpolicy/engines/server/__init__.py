"""Rollouts from an inference server a user already runs, one module a job:

* ``transport``: where the server is (``ServerConfig``), its API key, one JSON exchange with retries and redirects
  decided here (``request_json``), the model it serves;
* ``completions``: the OpenAI-compatible ``/v1/completions`` protocol, and the checks every endpoint's answer
  passes (one choice, the prompt scored, the ids and the text they decode to);
* ``masks``: vLLM's ``/inference/v1/generate`` and SGLang's ``/generate``, which return each token's sampling mask;
* ``head``: each token's k most likely ids with their log μ (``--head-logprobs``);
* ``concurrency``: the requests in flight at once, on a bounded pool of threads;
* ``sample``: ``generate``, one response per prompt through the above, and what the report says about the server.

This package's own name re-exports what the rest of offpolicy and its tests use.
"""

from __future__ import annotations

from offpolicy.engines.server.completions import completion_body, parse_completion
from offpolicy.engines.server.head import OUTSIDE_SUPPORT, head_asked, read_head
from offpolicy.engines.server.masks import SGLANG_HEAD, read_sglang_meta, sglang_generate_body, vllm_generate_body
from offpolicy.engines.server.sample import generate
from offpolicy.engines.server.transport import ServerConfig, ServerError, api_key_from_env, request_json, served_model

__all__ = ["OUTSIDE_SUPPORT", "SGLANG_HEAD", "ServerConfig", "ServerError", "api_key_from_env", "completion_body",
           "generate", "head_asked", "parse_completion", "read_head", "read_sglang_meta", "request_json",
           "served_model", "sglang_generate_body", "vllm_generate_body"]
