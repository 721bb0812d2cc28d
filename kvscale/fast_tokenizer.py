"""A tokenizer on the ``tokenizers`` library and jinja2 alone, for directories where it is provably
what transformers would load.

Importing transformers costs ~2 CPU-seconds per process; every process that tokenizes (the
server's front end, its engine core, every router) would pay it. ``FastTokenizer.from_directory``
returns None unless the directory is one that transformers 5 loads as a plain ``tokenizers``
tokenizer with nothing added or changed (``tokenizer.json`` used as is, one chat template string,
no tokenization-space clean-up); ``kvscale.model_files.load_tokenizer`` then falls back to
transformers. Chat templates render as transformers' ``apply_chat_template`` does: a sandboxed
jinja2 environment with its globals and filters, the named special tokens as variables.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer

from kvscale.token_pieces import PieceCache, byte_lengths, cuts_safely

GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"
# tokenizer_config.json keys that change nothing transformers does with tokenizer.json (or are
# checked below); any other key means transformers may behave differently: fall back to it.
_INERT_KEYS = {"backend", "is_local", "local_files_only", "model_max_length", "name_or_path", "tokenizer_class",
               "chat_template", "clean_up_tokenization_spaces", "split_special_tokens", "extra_special_tokens",
               "added_tokens_decoder", "padding_side", "truncation_side", "model_input_names",
               *SPECIAL_TOKEN_NAMES}
# transformers patches the pre-tokenizer of tokenizers above this size (Mistral's regex).
_MAX_PLAIN_VOCAB = 100_000


def _token_text(value: Any) -> str | None:
    """A special token's string as tokenizer_config.json stores it (a string or an AddedToken dict)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _chat_template(directory: Path, config: dict) -> str | None:
    """The one template string transformers would use, or None when it would not be one string.

    As transformers resolves it: ``chat_template.jinja`` (and any ``additional_chat_templates/``)
    before the config's ``chat_template``; more than one template makes a dict."""
    extra = directory / TEMPLATE_DIR
    if extra.is_dir() and any(extra.glob("*.jinja")):
        return None
    file = directory / TEMPLATE_FILE
    if file.is_file():
        return file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    return template if isinstance(template, str) else None


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """JSON without jinja's HTML escaping, non-ASCII kept (transformers' filter)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _DictGlobal:
    """``dict(...)`` and ``dict.fromkeys(...)`` in a template, without the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace that refuses underscore-prefixed names."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's signature, so namespace(self=...) works
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace cannot hold underscore-prefixed attribute {name!r}")


def compile_chat_template(template: str) -> jinja2.Template:
    """The template in the environment transformers renders chat templates in (less its
    ``{% generation %}`` tag: a template using it does not compile here)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictGlobal()
    env.globals["namespace"] = _Namespace
    return env.from_string(template)


def _plain(value: Any) -> Any:
    """A copy made of plain JSON types, as transformers hands the template (a fresh copy, so the
    caller's messages are never touched)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    raise TypeError(f"chat template inputs must be JSON-like, got {type(value).__name__}")


# apply_chat_template options of transformers' that are not template variables.
_TRANSFORMERS_ONLY = {"chat_template", "continue_final_message", "sanitize_control_tokens", "padding", "truncation",
                      "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                      "tokenizer_kwargs"}
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(message: dict) -> dict:
    """A message's reasoning under every name templates read it by (as transformers fills them)."""
    reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


class FastTokenizer:
    """What kvscale uses of a transformers tokenizer, on ``tokenizers.Tokenizer`` directly."""

    def __init__(self, directory: Path, backend: Tokenizer, config: dict, chat_template: str,
                 special_tokens: dict[str, str], prefix_specials: list[int] | None = None) -> None:
        """``prefix_specials``: what token_pieces.cuts_safely found in tokenizer.json (None: long
        texts are encoded whole)."""
        self.name_or_path = str(directory)
        self._directory = directory
        self._tokenizer = backend
        # A batch call, as transformers makes it: unlike encode it releases the GIL, so a long
        # prompt tokenized in a worker thread leaves the event loop running (the router's hashing).
        # Its fast form skips the character offsets, which nothing here reads (tokenizers 0.21
        # and later have it; older ones take the plain batch call).
        self._batch = getattr(backend, "encode_batch_fast", backend.encode_batch)
        self.pieces = None
        if prefix_specials is not None:
            added = {token_id: token.content for token_id, token in backend.get_added_tokens_decoder().items()}
            lengths = byte_lengths(backend.get_vocab(with_added_tokens=True), added)
            self.pieces = PieceCache(self._encode_pieces, prefix_specials, lengths)
        self._config = config
        self.chat_template = chat_template
        self._compiled = compile_chat_template(chat_template)
        self.special_tokens_map = special_tokens
        for name in SPECIAL_TOKEN_NAMES:
            token = special_tokens.get(name)
            setattr(self, name, token)
            setattr(self, f"{name}_id", None if token is None else backend.token_to_id(token))

    @classmethod
    def from_directory(cls, directory: str | Path) -> FastTokenizer | None:
        """The directory's tokenizer, or None where transformers might load something else."""
        directory = Path(directory)
        try:
            config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
            source = (directory / "tokenizer.json").read_text(encoding="utf-8")
            data = json.loads(source)
        except (OSError, ValueError):
            return None
        if not isinstance(config, dict) or not isinstance(data, dict):
            return None
        if set(config) - _INERT_KEYS or config.get("tokenizer_class") not in GENERIC_CLASSES:
            return None
        if config.get("backend", "tokenizers") != "tokenizers" or config.get("clean_up_tokenization_spaces"):
            return None
        if config.get("split_special_tokens") or config.get("extra_special_tokens"):
            return None
        if data.get("truncation") is not None or data.get("padding") is not None or data.get("post_processor") is None:
            return None
        added = {token.get("id"): token for token in data.get("added_tokens") or []}
        for index, token in (config.get("added_tokens_decoder") or {}).items():
            known = added.get(int(index))
            if not isinstance(token, dict) or known is None or any(
                    known.get(key) != value for key, value in token.items() if key != "__type"):
                return None
        special: dict[str, str] = {}
        for name in SPECIAL_TOKEN_NAMES:
            if config.get(name) is None:
                continue
            text = _token_text(config[name])
            # A named token tokenizer.json lacks would be added by transformers: not ours to mimic.
            if text is None or not any(t.get("content") == text and t.get("special") for t in added.values()):
                return None
            special[name] = text
        template = _chat_template(directory, config)
        if template is None:
            return None
        try:
            # The file's own text: ``data`` is only read above, and serialising it again cost
            # about as much as parsing it, in every process that loads a tokenizer.
            backend = Tokenizer.from_str(source)
            if backend.get_vocab_size(with_added_tokens=True) > _MAX_PLAIN_VOCAB:
                return None
            return cls(directory, backend, config, template, special, cuts_safely(data))
        except Exception:  # a template needing transformers' extensions ({% generation %}), a bad file
            return None

    # --- encoding -----------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._ids(text, add_special_tokens)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = self._ids(text, add_special_tokens)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def _ids(self, text: str, add_special_tokens: bool) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a string, got {type(text).__name__}")
        if self.pieces is not None and (ids := self.pieces.ids(text, add_special_tokens)) is not None:
            return ids
        return self._batch([text], add_special_tokens=add_special_tokens)[0].ids

    def _encode_pieces(self, texts: list[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self._batch(texts, add_special_tokens=False)]

    def decode(self, ids: int | list[int], skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode([ids] if isinstance(ids, int) else list(ids),
                                      skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self._tokenizer.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: list[str]) -> list[int | None]:
        return [self._tokenizer.token_to_id(t) for t in tokens]

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def backend_tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        return dict(sorted(self._tokenizer.get_added_tokens_decoder().items()))

    # --- chat ---------------------------------------------------------------------------------

    def apply_chat_template(self, conversation: list[dict], tools: list[dict] | None = None,
                            documents: list[dict] | None = None, add_generation_prompt: bool = False,
                            tokenize: bool = True, **kwargs: Any) -> str:
        """The conversation rendered by the chat template as text (``tokenize=False``: kvscale
        encodes the text itself); ``kwargs`` reach the template as variables, as in transformers."""
        unsupported = sorted(set(kwargs) & _TRANSFORMERS_ONLY)
        if tokenize or unsupported:
            raise NotImplementedError(f"FastTokenizer renders text only (tokenize=False), without {unsupported}")
        if not conversation:
            raise ValueError("cannot apply the chat template to an empty conversation")
        if tools is not None and not all(isinstance(tool, dict) for tool in tools):
            raise ValueError("tools must be JSON schemas (dicts)")
        if documents is not None and not all(isinstance(document, dict) for document in documents):
            raise TypeError("documents must be a list of dicts with 'title' and 'text' keys")
        messages = []
        for message in conversation:
            if not isinstance(message, Mapping):
                raise TypeError(f"chat messages must be dicts, got {message!r}")
            # transformers drops null fields: templates handle a missing key, not a None
            messages.append(_alias_reasoning(_plain({k: v for k, v in message.items() if v is not None})))
        variables = _plain({**self.special_tokens_map, **kwargs})
        text = self._compiled.render(messages=messages, tools=_plain(tools), documents=_plain(documents),
                                     add_generation_prompt=add_generation_prompt, **variables)
        return text

    # --- files --------------------------------------------------------------------------------

    def save_pretrained(self, directory: str | Path) -> tuple[str, ...]:
        """Copy the files this tokenizer was loaded from (they load back as the same tokenizer)."""
        target = Path(directory)
        target.mkdir(parents=True, exist_ok=True)
        written = []
        for name in ("tokenizer.json", "tokenizer_config.json", TEMPLATE_FILE):
            source = self._directory / name
            if source.is_file() and source.resolve() != (target / name).resolve():
                shutil.copyfile(source, target / name)
            if (target / name).is_file():
                written.append(str(target / name))
        return tuple(written)

    def __repr__(self) -> str:
        return f"FastTokenizer({self.name_or_path!r}, vocab={len(self)})"
