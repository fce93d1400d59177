"""Tokenizer (HF `tokenizers`), chat template (jinja2) and incremental detokenizer.

Reads tokenizer.json and tokenizer_config.json from the model folder; transformers is
not needed on the serving path.
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer


def _token_text(value) -> str | None:
    if isinstance(value, dict):     # {"content": "<s>", ...} in older configs
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, folder: str | Path):
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"model folder {folder} has no tokenizer.json")
        self._tok = HFTokenizer.from_file(str(path))
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template = cfg.get("chat_template")
        tmpl_file = folder / "chat_template.jinja"
        if template is None and tmpl_file.is_file():
            template = tmpl_file.read_text()
        if isinstance(template, list):      # [{"name": "default", "template": ...}]
            template = next((t["template"] for t in template if t.get("name") == "default"),
                            template[0]["template"] if template else None)
        self.chat_template: str | None = template
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.eos_token_id = (self._tok.token_to_id(self.eos_token)
                             if self.eos_token else None)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._compiled = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True
                            ) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template (tokenizer_config.json has no "
                             "chat_template); use generate() with a plain prompt")
        if self._compiled is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])

            def raise_exception(message):
                raise ValueError(f"chat template: {message}")

            env.globals["raise_exception"] = raise_exception
            self._compiled = env.from_string(self.chat_template)
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content'")
        return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "",
                                     eos_token=self.eos_token or "")


class IncrementalDetokenizer:
    """Decodes a growing token list in O(1) per token: decode a small window and emit
    the text beyond what was already emitted, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly decoded text (maybe empty)."""
        self.ids.extend(token_ids)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += new
            return new
        return ""

    def flush(self) -> str:
        """At the end, emit whatever was held back (even an incomplete character)."""
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        new = full[len(prefix):] if len(full) > len(prefix) else ""
        self.read_offset = len(self.ids)
        self.text += new
        return new

    def cut_at_stop(self, new_text: str, stops: list[str] | tuple[str, ...]) -> str | None:
        """The earliest stop string in the text, searched from just before `new_text` (the
        text the last add/flush returned: a stop may straddle old and new text). Cuts
        `self.text` before it and returns it; None when no stop is found."""
        if not stops or not new_text:
            return None
        longest = max(len(s) for s in stops)
        start = max(0, len(self.text) - len(new_text) - longest + 1)
        best = None
        for s in stops:
            pos = self.text.find(s, start)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is None:
            return None
        self.text = self.text[:best[0]]
        return best[1]


def load_tokenizer(model_dir: str):
    """The model folder's tokenizer, or None without tokenizer.json."""
    if not (Path(model_dir) / "tokenizer.json").is_file():
        return None
    return Tokenizer(model_dir)
