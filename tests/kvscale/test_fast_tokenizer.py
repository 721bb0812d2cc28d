"""kvscale/fast_tokenizer.py: where ``load_tokenizer`` takes it, it tokenizes, decodes and renders
chat templates exactly as transformers does (routing hashes the ids both sides make); anywhere
else transformers loads the tokenizer, as before."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest

from kvscale import model_files
from kvscale.fast_tokenizer import FastTokenizer
from kvscale.tokenization import (
    chat_prompt_token_ids,
    completion_prompt_token_ids,
    render_chat_prompt,
)

CORPUS = [
    "", "Hello, world!", "The quick brown fox jumps over the lazy dog.", " leading space", "trailing space ",
    "  two spaces\tand a tab\n\nnewlines\r\n", "     \n\n\n    ", "Ünïcödé — 漢字 カタカナ 한국어 🙂👍🏽 🇫🇷",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "a<|im_end|>b<|endoftext|>c <|im_start|> d",
    "<|im_start|", "def f(x: int) -> int:\n    return x ** 2  # square\n\nprint({'a': [1, 2]})\n",
    "SELECT * FROM t WHERE a >= 3 AND b <> 'x';", "1234567890 3.14159 -42 1e-9", "\u200b\u00a0zero-width", "🙂" * 20,
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city, ünïcode",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}},
                                               "required": ["city"]}}}]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Ünïcödé 🙂 <|im_end|> in text"}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": None, "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
     {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21}"},
     {"role": "assistant", "content": "It is 21 °C."}, {"role": "user", "content": "  and tomorrow?\n"}],
    [{"role": "developer", "content": ""}, {"role": "user", "content": [{"type": "text", "text": "parts "},
                                                                         {"type": "text", "text": "joined"}]}],
]
# Exercises what transformers' template environment adds: namespace, dict, loop controls, tojson
# (indent, no HTML escaping, non-ASCII kept), raise_exception, the special tokens, tools, kwargs.
CUSTOM_TEMPLATE = """{%- set ns = namespace(n=0) -%}
{%- for m in messages -%}
  {%- if m.role == 'bad' %}{{ raise_exception('bad role') }}{% endif -%}
  {%- if m.role == 'skip' %}{% continue %}{% endif -%}
  {%- set ns.n = ns.n + 1 %}
{{ bos_token }}{{ m.role }} {{ m.content | default('(none)') }}{% if m.reasoning_content %} [{{ m.reasoning_content }}]{% endif %}{{ eos_token }}
{% endfor %}
{%- if tools %}{{ tools | tojson }}
{{ tools | tojson(indent=2) }}{% endif %}
{{ dict(a='<b>&', n=ns.n) | tojson }} {{ extra | default('') }} {{ documents | tojson }}
{%- if add_generation_prompt %}{{ bos_token }}assistant
{% endif %}"""


def _transformers_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def bundled_dir() -> Path:
    return model_files.resolve_model_path(None)


@pytest.fixture(scope="module")
def directories(bundled_dir, tmp_path_factory) -> dict[str, Path]:
    """The bundled model's directory, the tokenizer path the router resolves, one written by
    transformers' save_pretrained, and one with the generic fast class and the template inline."""
    saved = tmp_path_factory.mktemp("saved")
    _transformers_tokenizer(bundled_dir).save_pretrained(str(saved))
    inline = tmp_path_factory.mktemp("inline")
    shutil.copy(saved / "tokenizer.json", inline / "tokenizer.json")
    config = json.loads((saved / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=(saved / "chat_template.jinja").read_text(),
                  clean_up_tokenization_spaces=False)
    (inline / "tokenizer_config.json").write_text(json.dumps(config))
    return {"bundled": bundled_dir, "router": model_files.resolve_tokenizer_path(None), "saved": saved,
            "inline": inline}


@pytest.fixture(scope="module", params=["bundled", "router", "saved", "inline"])
def pair(request, directories):
    path = directories[request.param]
    fast = model_files.load_tokenizer(path)
    assert isinstance(fast, FastTokenizer)
    return fast, _transformers_tokenizer(path)


def test_encode_and_decode_equal_transformers(pair) -> None:
    fast, reference = pair
    for text in CORPUS:
        for special in (True, False):
            ids = reference.encode(text, add_special_tokens=special)
            assert fast.encode(text, add_special_tokens=special) == ids, text
            assert fast(text, add_special_tokens=special)["input_ids"] == reference(
                text, add_special_tokens=special)["input_ids"]
        assert completion_prompt_token_ids(fast, text) == completion_prompt_token_ids(reference, text)
        ids = reference.encode(text)
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    every = list(range(len(reference)))
    assert fast.decode(every) == reference.decode(every)
    assert [fast.decode(i) for i in every[:300]] == [reference.decode(i) for i in every[:300]]
    assert fast.decode(every, skip_special_tokens=True) == reference.decode(every, skip_special_tokens=True)


def test_vocabulary_special_tokens_and_backend_equal_transformers(pair) -> None:
    fast, reference = pair
    assert fast.eos_token_id == reference.eos_token_id is not None
    assert (fast.bos_token_id, fast.pad_token_id, fast.unk_token_id) == (
        reference.bos_token_id, reference.pad_token_id, reference.unk_token_id)
    assert len(fast) == len(reference)
    assert fast.chat_template == reference.chat_template
    assert fast.backend_tokenizer.to_str() == reference.backend_tokenizer.to_str()
    assert {i: (t.content, t.special, t.normalized, t.rstrip) for i, t in fast.added_tokens_decoder.items()} == {
        i: (t.content, t.special, t.normalized, t.rstrip) for i, t in reference.added_tokens_decoder.items()}


@pytest.mark.parametrize("tool_format", ["hermes", "llama3_json"])
def test_chat_prompts_equal_transformers(pair, tool_format) -> None:
    fast, reference = pair
    for conversation in CONVERSATIONS:
        for tools in (None, TOOLS):
            assert render_chat_prompt(fast, conversation, tools, tool_format) == render_chat_prompt(
                reference, conversation, tools, tool_format)
            assert chat_prompt_token_ids(fast, conversation, tools, tool_format) == chat_prompt_token_ids(
                reference, conversation, tools, tool_format)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    for generation_prompt in (True, False):
        assert fast.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False) == (
            reference.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False))


def test_a_template_using_what_transformers_adds_renders_alike(directories, tmp_path) -> None:
    path = tmp_path / "custom"
    shutil.copytree(directories["saved"], path)
    (path / "chat_template.jinja").write_text(CUSTOM_TEMPLATE)
    fast, reference = model_files.load_tokenizer(path), _transformers_tokenizer(path)
    assert isinstance(fast, FastTokenizer)
    messages = [{"role": "system", "content": "<b>&"}, {"role": "skip", "content": "x"},
                {"role": "user", "content": None, "name": "n"},
                {"role": "assistant", "content": "é 漢", "reasoning": "thought"}]
    documents = [{"title": "Doc", "text": "ünï <tag>"}]
    for tools in (None, TOOLS):
        for kwargs in ({}, {"extra": "kw", "bos_token": "[BOS]"}):
            rendered = fast.apply_chat_template(messages, tools=tools, documents=documents, tokenize=False,
                                                add_generation_prompt=True, **kwargs)
            assert rendered == reference.apply_chat_template(messages, tools=tools, documents=documents,
                                                             tokenize=False, add_generation_prompt=True, **kwargs)
    assert messages[2]["content"] is None and "reasoning_content" not in messages[3]  # the caller's, untouched
    for tokenizer in (fast, reference):
        with pytest.raises(jinja2.TemplateError, match="bad role"):
            tokenizer.apply_chat_template([{"role": "bad", "content": "x"}], tokenize=False)
    for index, template in enumerate(["{% set ns = namespace(_private=1) %}x",
                                      "{% set ns = namespace(a=1) %}{% set ns._b = 2 %}x"]):
        bad = path.with_name(f"bad{index}")
        shutil.copytree(path, bad)
        (bad / "chat_template.jinja").write_text(template)
        for tokenizer in (model_files.load_tokenizer(bad), _transformers_tokenizer(bad)):
            with pytest.raises(jinja2.exceptions.SecurityError):
                tokenizer.apply_chat_template(messages, tokenize=False)


def _edited(source: Path, target: Path, config: dict | None = None, template: str | None = None) -> Path:
    shutil.copytree(source, target)
    if config is not None:
        merged = json.loads((target / "tokenizer_config.json").read_text())
        merged.update(config)
        (target / "tokenizer_config.json").write_text(json.dumps(merged))
    if template is not None:
        (target / "chat_template.jinja").write_text(template)
    return target


@pytest.mark.parametrize("change", [
    {"config": {"tokenizer_class": "Qwen2Tokenizer"}},
    {"config": {"tokenizer_class": "GPT2Tokenizer"}},
    {"config": {"clean_up_tokenization_spaces": True}},
    {"config": {"add_bos_token": True}},
    {"template": "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"},
    {"template": "{% for m in messages %}{{ m.content }"},
])
def test_anything_else_falls_back_to_transformers(directories, tmp_path, change) -> None:
    path = _edited(directories["saved"], tmp_path / "edited", **change)
    assert FastTokenizer.from_directory(path) is None
    loaded = model_files.load_tokenizer(path)
    assert not isinstance(loaded, FastTokenizer)
    assert type(loaded).__module__.startswith("transformers")


def test_no_template_or_several_templates_fall_back(directories, tmp_path) -> None:
    none = _edited(directories["saved"], tmp_path / "none")
    (none / "chat_template.jinja").unlink()
    several = _edited(directories["saved"], tmp_path / "several")
    (several / "additional_chat_templates").mkdir()
    (several / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages }}")
    assert FastTokenizer.from_directory(none) is None and FastTokenizer.from_directory(several) is None


def test_save_pretrained_copies_a_directory_that_loads_alike(directories, tmp_path) -> None:
    fast = model_files.load_tokenizer(directories["bundled"])
    fast.save_pretrained(tmp_path / "copy")
    again = model_files.load_tokenizer(tmp_path / "copy")
    assert isinstance(again, FastTokenizer)
    assert again.encode(CORPUS[8]) == fast.encode(CORPUS[8]) and again.chat_template == fast.chat_template
    assert _transformers_tokenizer(tmp_path / "copy").encode(CORPUS[7]) == fast.encode(CORPUS[7])


def test_loading_the_bundled_tokenizer_never_imports_transformers() -> None:
    probe = ("import kvscale.model_files as m; m.load_tokenizer(m.resolve_model_path(None)); import sys; "
             "assert 'transformers' not in sys.modules, 'transformers imported'")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
