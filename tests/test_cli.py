"""The CLI as a user types it: `offpolicy presets`, `offpolicy presets NAME`, and its errors."""

from __future__ import annotations

import re

import pytest
import yaml

import offpolicy as op
from cli_inprocess import offpolicy


def test_console_script_is_installed():
    """The `offpolicy` command is declared and resolves to the CLI (checked through the package
    metadata, not PATH, which may lack the venv's bin)."""
    from importlib.metadata import entry_points

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "offpolicy"]
    assert script.value == "offpolicy.cli:main" and script.load() is __import__("offpolicy.cli").cli.main


def test_presets_lists_every_preset():
    result = offpolicy("presets", process=True)
    assert result.returncode == 0, result.stderr
    for name in op.presets.names():
        assert name in result.stdout


def test_presets_name_shows_the_config_as_yaml():
    result = offpolicy("presets", "openrlhf:seq-mask-tis")
    assert result.returncode == 0, result.stderr
    assert "unclamped" in result.stdout
    body = yaml.safe_load(result.stdout[result.stdout.index("correction:"):])
    assert op.CorrectionConfig.from_dict(body["correction"]) == op.CorrectionConfig.from_preset("openrlhf:seq-mask-tis")
    assert body["loss"]["kind"] == "ppo"


def test_unknown_preset_is_one_clear_line():
    result = offpolicy("presets", "verl:nope")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "offpolicy presets: error: unknown preset 'verl:nope'. List them with `offpolicy presets`."
    ]


@pytest.mark.parametrize("args", [[], ["frobnicate"]])
def test_usage_errors(args):
    result = offpolicy(*args)
    assert result.returncode == 2
    assert "usage: offpolicy" in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--engine", "hf", "--vllm-max-num-seqs", "8"],
     "engine.vllm.* options (diagnose: --vllm-*) are read with the vllm engine only (the engine is hf). Fix: "
     "engine=vllm (diagnose: --engine vllm), or drop them"),
    (["--engine-url", "http://127.0.0.1:1", "--no-vllm-enforce-eager"],
     "--no-vllm-enforce-eager configures the in-process vLLM engine; a server batches as it was started"),
], ids=["hf-engine", "server"])
def test_diagnose_vllm_flags_without_the_vllm_engine_are_refused(args, message):
    """train refuses vllm.* without engine=vllm; diagnose's --vllm-* flags likewise, before any model loads
    (the model directory does not exist), never silently ignored."""
    result = offpolicy("diagnose", "--model", "/nonexistent/model", *args)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"offpolicy diagnose: error: {message}" + (
        " (pass the option to the server instead)" if "server" in message else "")]


# `offpolicy diagnose`'s flags on 65ba3dd, before they were generated from DiagnoseConfig (issue #57 item 4):
# flag → (dest, default, type, choices, action) as that commit's hand-written parser declared them; the flags of
# the sections train shares (issue #68) are given only when typed (default SUPPRESS: an unset field stays unset),
# their defaults are the sections' — one default each — and three moved: --device, --logit-noise,
# --micro-batch-tokens are --trainer-device, --engine-logit-noise, --trainer-micro-batch-tokens
S = "==SUPPRESS=="
DIAGNOSE_FLAGS_65BA3DD = {
    "--model": ("model", "default", None, None, "store"),
    "--engine": ("engine", S, None, ["auto", "vllm", "hf"], "store"),  # auto: one default with train's
    "--engine-dtype": ("engine_dtype", S, None, ["auto", "bf16", "fp16", "fp32"], "store"),
    "--trainer-dtype": ("trainer_dtype", S, None, ["auto", "fp32", "bf16"], "store"),
    "--trainer-device": ("trainer_device", S, None, None, "store"),
    "--prompts": ("prompts", None, None, None, "store"),
    "--task": ("task", "reverse", None, ["reverse", "addition", "walk"], "store"),
    "--data": ("data", None, None, None, "store"),
    "--batch": ("batch", None, None, None, "store"),
    "--prompt-field": ("prompt_field", "question", None, None, "store"),
    "--system-prompt": ("system_prompt", None, None, None, "store"),
    "--chat-template": ("chat_template", "auto", None, ["auto", "none"], "store"),
    "--max-prompt-tokens": ("max_prompt_tokens", 512, int, None, "store"),
    "--n": ("n", 512, int, None, "store"),
    "--max-tokens": ("max_tokens", S, int, None, "store"),
    "--temperature": ("temperature", S, float, None, "store"),
    "--top-p": ("top_p", S, float, None, "store"),
    "--top-k": ("top_k", S, int, None, "store"),
    "--engine-logit-noise": ("engine_logit_noise", S, float, None, "store"),
    "--trainer-micro-batch-tokens": ("trainer_micro_batch_tokens", S, int, None, "store"),
    "--vllm-max-num-batched-tokens": ("vllm_max_num_batched_tokens", S, int, None, "store"),
    "--vllm-max-num-seqs": ("vllm_max_num_seqs", S, int, None, "store"),
    "--vllm-enable-chunked-prefill": ("vllm_enable_chunked_prefill", S, None, None, "boolean"),
    "--no-vllm-enable-chunked-prefill": ("vllm_enable_chunked_prefill", S, None, None, "boolean"),
    "--vllm-enforce-eager": ("vllm_enforce_eager", S, None, None, "boolean"),
    "--no-vllm-enforce-eager": ("vllm_enforce_eager", S, None, None, "boolean"),
    "--compare": ("compare", None, None, None, "store"),
    "--seed": ("seed", 0, int, None, "store"),
    "--out": ("out", "diagnose", None, None, "store"),
    "--fail-above": ("fail_above", None, None, None, "append"),
    "--fail-below": ("fail_below", None, None, None, "append"),
    "--engine-url": ("engine_url", None, None, None, "store"),
    "--api-key-env": ("api_key_env", None, None, None, "store"),
    "--served-model-name": ("served_model_name", None, None, None, "store"),
    "--concurrency": ("concurrency", 8, int, None, "store"),
    "--request-timeout": ("request_timeout", 300.0, float, None, "store"),
    "--retries": ("retries", 3, int, None, "store"),
    "--no-cache-salt": ("no_cache_salt", False, None, None, "store_true"),
    "--log-to": ("log_to", None, None, None, "store"),
}
# the section defaults the 65ba3dd flags had (issue #68: engine auto, as train; its dtype auto = bf16 in diagnose;
# max_tokens unset = 64 in diagnose; micro-batch tokens unset = 2,048 in diagnose)
SECTION_DEFAULTS = {"engine": "auto", "engine_dtype": "auto", "trainer_dtype": "auto", "trainer_device": "auto",
                    "max_tokens": None, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "engine_logit_noise": 0.0,
                    "trainer_micro_batch_tokens": None, "vllm_max_num_batched_tokens": None, "vllm_max_num_seqs": None,
                    "vllm_enable_chunked_prefill": None, "vllm_enforce_eager": None}
MOVED = {"--device": "--trainer-device", "--logit-noise": "--engine-logit-noise",
         "--micro-batch-tokens": "--trainer-micro-batch-tokens"}
ACTIONS = {"_StoreAction": "store", "_AppendAction": "append", "_StoreTrueAction": "store_true",
           "BooleanOptionalAction": "boolean"}


def _diagnose_parser():
    from offpolicy.cli import build_parser

    return build_parser()._subparsers._group_actions[0].choices["diagnose"]


def test_diagnose_help_lists_the_flags_of_65ba3dd_and_each_new_config_field():
    """Issue #57 item 4: the flags are generated from DiagnoseConfig. ``diagnose --help``, as typed, lists
    exactly 65ba3dd's options (with -h) plus one flag per field added since (another issue's new option is
    a new field, and a new flag without a line here)."""
    from offpolicy.measure.diagnose_config import SECTION_FLAGS, SECTIONS, DiagnoseConfig

    old_fields = {dest for dest, *_ in DIAGNOSE_FLAGS_65BA3DD.values()}
    fields = [f for f in DiagnoseConfig.model_fields if f not in {p.split(".")[0] for p in SECTIONS}]
    new = {"--" + f.replace("_", "-") for f in [*fields, *SECTION_FLAGS] if f not in old_fields}
    new |= {"--no-" + flag[2:] for flag in new
            if type(_diagnose_parser()._option_string_actions[flag]).__name__ == "BooleanOptionalAction"}
    expected = {"-h", "--help", *DIAGNOSE_FLAGS_65BA3DD, *new}
    assert set(_diagnose_parser()._option_string_actions) - set(MOVED) == expected
    result = offpolicy("diagnose", "--help", process=True)  # python -m offpolicy, a fresh process
    assert result.returncode == 0, result.stderr
    listed = set(re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", result.stdout.split("options:", 1)[1]))
    assert expected <= listed, sorted(expected - listed)
    # nothing but flags of the parser's (a mention in a help text names a real flag too)
    assert listed <= expected, sorted(listed - expected)


def test_diagnose_flags_keep_65ba3dd_types_choices_and_defaults():
    """Each old flag parses as before: the same destination, type, choices and kind of action, and the
    default of 65ba3dd's parser, which is now DiagnoseConfig's (the only copy of each default)."""
    from offpolicy.measure.diagnose_config import SECTION_FLAGS, DiagnoseConfig

    actions = _diagnose_parser()._option_string_actions
    for flag, (dest, default, kind, choices, action) in DIAGNOSE_FLAGS_65BA3DD.items():
        got = actions[flag]
        assert (got.dest, got.default, got.type, got.choices, ACTIONS[type(got).__name__]) == \
            (dest, default, kind, choices, action), flag
        if dest in SECTION_FLAGS:  # a section's flag: the section's field holds the one default
            assert SECTION_FLAGS[dest][2].default == SECTION_DEFAULTS[dest], flag
        else:
            assert DiagnoseConfig.model_fields[dest].default == default, flag


@pytest.mark.parametrize("old, new", list(MOVED.items()))
def test_diagnose_moved_flags_are_refused_with_their_new_name(old, new):
    """No silent alias (issue #68): a flag that moved into a section is one line naming its new flag."""
    result = offpolicy("diagnose", "--model", "/nonexistent/model", old, "1")
    assert result.returncode == 2
    assert f"{old} has moved: it is {new} now" in result.stderr.strip().splitlines()[-1]


def test_diagnose_generated_flags_parse_as_typed():
    """A command line through the generated parser: types converted, repeatable flags collected, switches
    set, the prompt sources exclusive as before."""
    from offpolicy.cli import build_parser
    from offpolicy.measure.diagnose_config import DiagnoseConfig

    args = vars(build_parser().parse_args(
        ["diagnose", "--top-p", "0.9", "--top-k", "5", "--n", "8", "--fail-above", "kl_k3=1e-3", "--fail-above",
         "ess=0.5", "--no-vllm-enforce-eager", "--trainer-micro-batch-tokens", "64", "--task", "walk"]))
    config = DiagnoseConfig(**{k: v for k, v in args.items() if k not in ("func", "command")})
    assert (config.sampling.top_p, config.sampling.top_k, config.n, config.trainer.micro_batch_tokens, config.task) \
        == (0.9, 5, 8, 64, "walk")
    assert config.fail_above == ["kl_k3=1e-3", "ess=0.5"] and config.engine.vllm.enforce_eager is False
    assert config.sampling.truncates and not DiagnoseConfig().sampling.truncates
    # a section's flag not typed leaves its field unset: the command's own default applies (2,048 tokens here)
    assert "micro_batch_tokens" not in DiagnoseConfig(**{k: v for k, v in vars(build_parser().parse_args(
        ["diagnose"])).items() if k not in ("func", "command")}).trainer.model_fields_set
    assert build_parser().parse_args(["diagnose", "--no-cache-salt"]).no_cache_salt is True
    result = offpolicy("diagnose", "--prompts", "p.jsonl", "--task", "walk")
    assert result.returncode == 2 and "not allowed with argument --prompts" in result.stderr
    result = offpolicy("diagnose", "--n", "many")
    assert result.returncode == 2 and "--n: invalid int value: 'many'" in result.stderr


def test_diagnose_flag_errors_echo_a_sampling_value_and_nothing_else():
    """A sampling value's refusal names the flag and the value (the rule is sampling.RULES'); no other refusal
    repeats its value — a server URL's password or a key must never be printed."""
    from offpolicy.measure.diagnose_config import DiagnoseConfig

    with pytest.raises(op.ConfigError) as err:
        DiagnoseConfig(top_p=2.0)
    assert str(err.value).startswith("--top-p 2: expected in (0, 1]")
    with pytest.raises(op.ConfigError) as err:
        DiagnoseConfig(engine_url="http://alice:s3cretpw@127.0.0.1:8000")
    assert "s3cretpw" not in str(err.value) and "alice" not in str(err.value)
