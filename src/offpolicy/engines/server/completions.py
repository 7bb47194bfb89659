"""The OpenAI-compatible ``/v1/completions`` protocol, and the checks every endpoint's answer passes.

One request per prompt (``completion_body``): the prompt goes as **token ids** (rendered with the model's chat
template), so the server never re-tokenises it, and ``add_special_tokens: false`` so it adds no BOS; **every
sampling field is sent explicitly** (temperature, top_p, top_k, min_p, the three penalties, min_tokens, a
per-request seed), so no server default changes μ; ``logprobs: 1`` asks for log μ of each sampled token,
``return_token_ids`` (vLLM 0.32, recent SGLang) and ``return_tokens_as_token_ids`` (vLLM) for the sampled ids; with
a head (``SamplingConfig.head_logprobs`` = k) ``logprobs: k`` asks for each token's k most likely ids as well.

Alignment is checked on every response, never assumed (``parse_completion``; for every endpoint,
``checked_response``): the prompt ids the server reports it scored must equal those sent (or, where it reports
none, its prompt-token count must); the sampled ids must come back as ids, agree between the two fields that carry
them, and decode here to the text the server returned (else the server's tokenizer is not ``--model``'s). An
answer holds exactly one choice (``one_choice``: ``n`` is 1 in every request). A failure is a ``ServerError``
naming the cause.

A correct server's text may differ from the plain decode of its ids in three ways, each accepted
(``expected_texts``): a response cut by ``max_tokens`` inside a multi-byte character ends short of the tokens that
hold the incomplete character (an incremental detokenizer — vLLM's, SGLang's — holds them back until the character
completes, which never happens); the stop token that ended a finished response is left out of the text (vLLM
never detokenizes it, while ``skip_special_tokens: false`` keeps every other special token); and the decode runs on
after the prompt (vLLM primes its ``DecodeStream`` with the prompt ids), which keeps a first word's leading space
that a SentencePiece decoder strips at the start of a text.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from typing import Any

from offpolicy.engines.base import SamplingConfig
from offpolicy.engines.server.head import HEAD_FIELDS, read_head
from offpolicy.engines.server.transport import ServerError, one_line

TOKEN_ID = re.compile(r"token_id:(\d+)")


def ints(value) -> bool:
    """A list of integers (``bool`` excluded: JSON's true is no token id)."""
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def one_choice(answer: dict[str, Any], where: str) -> dict[str, Any]:
    """The one choice of an answer that carries ``choices`` (``/v1/completions``, vLLM's ``/inference/v1/generate``):
    every request asks ``n: 1``, so a list of one dict, else the server answered another request than the one sent.

    Raises:
        ServerError: ``choices`` is absent, not a list of one dict.
    """
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise ServerError(f"{where}: expected one choice, got {one_line(json.dumps(choices))[:120]}")
    return choices[0]


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
    choice = one_choice(answer, where)
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
        raise ServerError(f"{where}: token_ids is not a list of integers: {one_line(json.dumps(direct))[:120]}")
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
                              f"{one_line(json.dumps(entry))[:80]}")
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
