"""Chat prompts and end-of-sequence ids, against transformers' own output.

The reference is ``tests/fixtures/families/{llama3,qwen2}/`` (made by
``tests/make_family_fixtures.py`` with transformers 5.24): ``chat.json`` holds two
conversations and transformers' rendered text; ``reference.npz`` its
``apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`` ids. The files are
placed beside a checkpoint as ``rlx-mpi convert`` places them (``<stem>.tokenizer.json`` ...).
No torch here.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tokenizers", reason="the 'text' extra (tokenizers) is not installed")
pytest.importorskip("jinja2", reason="the 'text' extra (jinja2) is not installed")

from rlx_mpi.errors import EXIT_BAD_INPUT, InputError  # noqa: E402
from rlx_mpi.io.prompts import read_prompts  # noqa: E402
from rlx_mpi.io.tokenizer import eos_ids_beside, load_tokenizer  # noqa: E402

FAMILIES = Path(__file__).parent / "fixtures" / "families"
LIMITS = dict(vocab_size=384, max_positions=256, max_new_tokens=8)
FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def beside(tmp_path, case, files=FILES, stem="model"):
    """The case's tokenizer files copied beside ``tmp_path/<stem>.h5`` as convert copies them."""
    for name in files:
        shutil.copyfile(FAMILIES / case / name, tmp_path / f"{stem}.{name}")
    return tmp_path / f"{stem}.h5"


def prompt_file(tmp_path, *conversations, name="chat.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps({"id": f"c{i}", "messages": m}) + "\n"
                            for i, m in enumerate(conversations)), encoding="utf-8")
    return path


def error_of(path, **kw) -> InputError:
    with pytest.raises(InputError) as e:
        read_prompts(path, **{**LIMITS, **kw})
    assert e.value.exit_code == EXIT_BAD_INPUT
    assert "\n" not in e.value.line()
    return e.value


# -- equal to transformers ------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["llama3", "qwen2"])  # a Llama-3-style and a ChatML template
def test_messages_render_and_tokenize_as_transformers_apply_chat_template(tmp_path, case):
    chat = json.loads((FAMILIES / case / "chat.json").read_text(encoding="utf-8"))
    ref = np.load(FAMILIES / case / "reference.npz", allow_pickle=False)
    tok = load_tokenizer(beside(tmp_path, case))
    prompts = read_prompts(prompt_file(tmp_path, *chat["messages"]), tokenizer=tok, **LIMITS)
    assert len(prompts) == 2
    for k, p in enumerate(prompts):
        assert p.text == chat["rendered"][k]
        assert list(p.tokens) == ref[f"chat_ids_{k}"].tolist()


def test_the_template_writes_the_bos_so_it_is_not_added_again(tmp_path):
    """Llama 3's tokenizer adds <|begin_of_text|> itself: encoding the rendered text as a plain
    "text" prompt would give two; the chat path gives transformers' one."""
    chat = json.loads((FAMILIES / "llama3" / "chat.json").read_text(encoding="utf-8"))
    tok = load_tokenizer(beside(tmp_path, "llama3"))
    _, ids = tok.chat(chat["messages"][0])
    assert ids[:2] != [0, 0] and ids.count(0) == 1
    assert tok.encode(chat["rendered"][0])[:2] == [0, 0]


def test_the_environment_is_transformers_not_jinja_defaults(tmp_path):
    """The ChatML fixture template is written with indented {% %} tags: only trim_blocks +
    lstrip_blocks render it as transformers does (a plain jinja2 Environment does not)."""
    import jinja2

    chat = json.loads((FAMILIES / "qwen2" / "chat.json").read_text(encoding="utf-8"))
    config = json.loads((FAMILIES / "qwen2" / "tokenizer_config.json").read_text(encoding="utf-8"))
    plain = jinja2.Environment().from_string(config["chat_template"]).render(
        messages=chat["messages"][0], add_generation_prompt=True)
    assert plain != chat["rendered"][0]
    tok = load_tokenizer(beside(tmp_path, "qwen2"))
    assert tok.chat_template.render(chat["messages"][0]) == chat["rendered"][0]


def _template(tmp_path, source, **config):
    """A checkpoint whose tokenizer_config.json carries ``source`` as its chat template."""
    shutil.copyfile(FAMILIES / "qwen2" / "tokenizer.json", tmp_path / "model.tokenizer.json")
    (tmp_path / "model.tokenizer_config.json").write_text(json.dumps({**config, "chat_template": source}))
    return load_tokenizer(tmp_path / "model.h5")


def test_template_globals_and_filters_are_transformers_own(tmp_path):
    """What utils/chat_template_utils.py provides: tojson without HTML escaping and with
    indent, raise_exception, strftime_now, dict, a namespace, loop controls, the generation
    tag, and the named special tokens as strings (also from the older {"content": ...} form)."""
    source = ("{{ messages[0]['content'] | tojson }}|{{ {'k': [1, 2]} | tojson(indent=1) }}|"
              "{{ bos_token }}{{ eos_token }}|{{ strftime_now('%Y') | length }}|"
              "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 1 %}{% break %}"
              "{% endif %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}|{{ dict(a=1)['a'] }}|"
              "{% generation %}gen{% endgeneration %}|{{ tools is none }}{{ documents is none }}|"
              "{{ add_generation_prompt }}")
    tok = _template(tmp_path, source, bos_token={"content": "<s>", "lstrip": False}, eos_token="</s>")
    text = tok.chat_template.render([{"role": "user", "content": "<a&b> é"}, {"role": "user", "content": "x"}])
    assert text == '"<a&b> é"|{\n "k": [\n  1,\n  2\n ]\n}|<s></s>|4|1|1|gen|TrueTrue|True'


def test_reasoning_is_passed_under_all_its_names_as_transformers_does(tmp_path):
    tok = _template(tmp_path, "{% for m in messages %}[{{ m.thinking }}/{{ m.reasoning_content }}]{% endfor %}")
    assert tok.chat_template.render([{"role": "assistant", "content": "a", "reasoning": "r"},
                                     {"role": "user", "content": "b"}]) == "[r/r][/]"


def test_chat_template_jinja_file_wins_and_named_template_lists_use_default(tmp_path):
    tok = _template(tmp_path, [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}])
    assert tok.chat_template.render([{"role": "user", "content": "x"}]) == "D"
    (tmp_path / "model.chat_template.jinja").write_text("J{{ messages | length }}")
    tok = load_tokenizer(tmp_path / "model.h5")
    assert tok.chat_template.render([{"role": "user", "content": "x"}]) == "J1"


# -- end-of-sequence ids --------------------------------------------------------------------------

def test_eos_ids_from_generation_config_list_in_its_order(tmp_path):
    assert eos_ids_beside(beside(tmp_path, "llama3", stem="a")) == (1, 2, 3)  # Llama 3.1's three
    assert eos_ids_beside(beside(tmp_path, "qwen2", stem="b")) == (2, 0)  # <|im_end|>, <|endoftext|>
    tok = load_tokenizer(tmp_path / "a.h5")
    assert tok.eos_token_ids == (1, 2, 3) and tok.eos_token_id == 1


def test_eos_id_int_and_fallback_to_the_tokenizer_config(tmp_path):
    ckpt = beside(tmp_path, "llama3", files=("tokenizer.json", "tokenizer_config.json"))
    assert eos_ids_beside(ckpt) == (3,)  # tokenizer_config eos_token "<|eot_id|>", an added token
    (tmp_path / "model.generation_config.json").write_text(json.dumps({"bos_token_id": 0}))
    assert eos_ids_beside(ckpt) == (3,)  # a generation config that names none
    (tmp_path / "model.generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert eos_ids_beside(ckpt) == (7,)
    (tmp_path / "model.generation_config.json").write_text(json.dumps({"eos_token_id": [5, 5, 9]}))
    assert eos_ids_beside(ckpt) == (5, 9)
    assert eos_ids_beside(tmp_path / "other.h5") == ()  # nothing beside it
    # an eos_token of the plain vocabulary (not an added token), read without `tokenizers`
    (tmp_path / "model.generation_config.json").unlink()
    (tmp_path / "model.tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "Ġand"}}))
    vocab = json.loads((tmp_path / "model.tokenizer.json").read_text())["model"]["vocab"]
    assert eos_ids_beside(ckpt) == (vocab["Ġand"],)


@pytest.mark.parametrize("value", ['"2"', "-1", "[1, true]", "2.0", "{}"])
def test_a_bad_eos_token_id_is_one_line_naming_the_file(tmp_path, value):
    (tmp_path / "m.generation_config.json").write_text('{"eos_token_id": ' + value + "}")
    with pytest.raises(InputError) as e:
        eos_ids_beside(tmp_path / "m.h5")
    assert e.value.where == str(tmp_path / "m.generation_config.json")
    assert "eos_token_id" in e.value.line() and "\n" not in e.value.line()


def test_a_broken_generation_config_is_one_line(tmp_path):
    (tmp_path / "m.generation_config.json").write_text("{not json")
    with pytest.raises(InputError, match="cannot read it as JSON"):
        eos_ids_beside(tmp_path / "m.h5")


# -- every mistake is one line naming FILE:LINE ---------------------------------------------------

USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("messages, words", [
    ("hi", ['"messages" is a string', '{"role": "user"']),
    ([], ['"messages" is an empty list']),
    ([1], ['"messages"[0] is a integer']),
    ([{"content": "x"}], ['"messages"[0] has no "role"']),
    ([{"role": 5, "content": "x"}], ['"messages"[0]["role"] is 5']),
    ([{"role": "user"}], ['"messages"[0] (user) has no "content"']),
    ([{"role": "user", "content": None}], ['"messages"[0] (user) has no "content"']),
])
def test_malformed_messages(tmp_path, messages, words):
    tok = load_tokenizer(beside(tmp_path, "qwen2"))
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "ok", "messages": USER}) + "\n"
                    + json.dumps({"id": "x", "messages": messages}) + "\n")
    err = error_of(path, tokenizer=tok)
    assert err.where == f"{path}:2"
    for w in words:
        assert w in err.line(), (w, err.line())


def test_messages_and_text_together_or_no_tokenizer(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "a", "text": "t", "messages": USER}) + "\n")
    assert 'both "text" and "messages"' in error_of(path).line()
    path.write_text(json.dumps({"id": "a", "messages": USER}) + "\n")
    err = error_of(path, tokenizer=None)
    assert err.where == f"{path}:1" and "no tokenizer" in err.line() and "tokenizer_config.json" in err.line()


def test_no_chat_template_says_which_file_and_what_to_do(tmp_path):
    shutil.copyfile(FAMILIES / "qwen2" / "tokenizer.json", tmp_path / "model.tokenizer.json")
    (tmp_path / "model.tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))  # a base model's
    tok = load_tokenizer(tmp_path / "model.h5")
    assert tok.chat_template is None
    err = error_of(prompt_file(tmp_path, USER), tokenizer=tok)
    assert err.where == f"{tmp_path / 'chat.jsonl'}:1"
    assert "no chat template" in err.line() and "instruct model" in err.line()
    # a tokens/text prompt file still works without one
    (tmp_path / "t.jsonl").write_text('{"id": "a", "text": "hi"}\n')
    assert read_prompts(tmp_path / "t.jsonl", tokenizer=tok, **LIMITS)[0].tokens


def test_the_template_refusing_the_roles_is_one_line(tmp_path):
    tok = load_tokenizer(beside(tmp_path, "llama3"))
    bad = [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]
    err = error_of(prompt_file(tmp_path, USER, bad), tokenizer=tok)
    assert err.where == f"{tmp_path / 'chat.jsonl'}:2"
    assert "refused these messages" in err.line() and "got tool" in err.line()


@pytest.mark.parametrize("source, words", [
    ("{% for m in messages %}", ["not valid Jinja", "template line 1"]),
    ("{{ messages[0].__class__.__mro__ }}", ["SecurityError"]),  # the sandbox
    ("{% set ns = namespace(_x=1) %}", ["SecurityError", "_x"]),
    ("{{ messages[0]['content'] + 1 }}", ["TypeError"]),
])
def test_template_errors_are_one_line(tmp_path, source, words):
    tok = _template(tmp_path, source)
    err = error_of(prompt_file(tmp_path, USER), tokenizer=tok)
    assert err.where == f"{tmp_path / 'chat.jsonl'}:1"
    for w in words:
        assert w in err.line(), (w, err.line())


def test_jinja2_missing_says_how_to_install(tmp_path, monkeypatch):
    tok = load_tokenizer(beside(tmp_path, "llama3"))
    monkeypatch.setitem(sys.modules, "jinja2", None)  # import now fails
    err = error_of(prompt_file(tmp_path, USER), tokenizer=tok)
    assert err.where == f"{tmp_path / 'chat.jsonl'}:1"
    assert "jinja2" in err.line() and "pip install 'rlx_mpi[text]'" in err.line()
