"""Prompt files: every mistake is one InputError naming FILE:LINE; text prompts via tokenizers."""

from __future__ import annotations

import json
import pickle

import pytest

from rlx_mpi.errors import EXIT_BAD_INPUT, InputError
from rlx_mpi.io.prompts import Prompt, read_prompts
from rlx_mpi.io.tokenizer import load_tokenizer

LIMITS = dict(vocab_size=100, max_positions=32, max_new_tokens=8)


def write(tmp_path, text: str | bytes, name="p.jsonl"):
    path = tmp_path / name
    path.write_bytes(text.encode("utf-8") if isinstance(text, str) else text)
    return path


def error_of(path, **kw) -> InputError:
    with pytest.raises(InputError) as e:
        read_prompts(path, **{**LIMITS, **kw})
    assert e.value.exit_code == EXIT_BAD_INPUT
    assert "\n" not in e.value.line()  # one line, always
    return e.value


def test_reads_ids_tokens_in_order_skipping_blank_lines(tmp_path):
    path = write(tmp_path, '{"id": "a", "tokens": [1, 2, 3]}\n\n  \n{"id": 7, "tokens": [99]}\r\n')
    prompts = read_prompts(path, **LIMITS)
    assert prompts == [Prompt(0, "a", (1, 2, 3), None), Prompt(1, "7", (99,), None)]


def test_utf8_bom_is_accepted(tmp_path):
    path = write(tmp_path, b'\xef\xbb\xbf{"id": "a", "tokens": [5]}\n')
    assert read_prompts(path, **LIMITS)[0].tokens == (5,)


@pytest.mark.parametrize("lines, line, words", [
    (['{"id": "a", "tokens": [1]}', '{"id": "a", "tokens": [2]}'], 2, ["'a'", "line 1", "unique"]),
    (['{"id": 1, "tokens": [1]}', '{"id": "1", "tokens": [2]}'], 2, ["'1'", "already used"]),
    (['{"id": "a", "tokens": [1, 100]}'], 1, ["token 100", "position 1", "[0, 100)"]),
    (['{"id": "a", "tokens": [-1]}'], 1, ["token -1"]),
    (['{"id": "a", "tokens": [1, 2.0]}'], 1, ['"tokens"[1] is 2.0', "integer"]),
    (['{"id": "a", "tokens": [true]}'], 1, ['"tokens"[0] is true', "boolean"]),
    (['{"id": "a", "tokens": []}'], 1, ["no tokens"]),
    (['{"id": "a", "tokens": "1 2"}'], 1, ['"tokens" is a string']),
    (['{"id": "a", "tokens": ' + json.dumps(list(range(25))) + '}'], 1,
     ["25 tokens", "max_new_tokens 8", "needs 33", "has 32", "--max-new-tokens"]),
    (['{"tokens": [1]}'], 1, ['no "id"']),
    (['{"id": 1.5, "tokens": [1]}'], 1, ['"id" is 1.5', "string or an integer"]),
    (['{"id": "", "tokens": [1]}'], 1, ["empty"]),
    (['{"id": "a"}'], 1, ['no "tokens", "text" or "messages"']),
    (['{"id": "a", "tokens": [1], "text": "hi"}'], 1, ['both "tokens" and "text"']),
    (['{"id": "a", "tokens": [1], "prompt": 3}'], 1, ["unknown key 'prompt'"]),
    (['{"id": "a", "id": "b", "tokens": [1]}'], 1, ["key 'id' appears twice"]),
    (['{"id": "a", "tokens": [NaN]}'], 1, ["NaN"]),
    (['{"id": "a", "tokens": [1]', ''], 1, ["not valid JSON"]),
    (['["a", 1]'], 1, ["a JSON list, not an object"]),
    (['{"id": "a", "tokens": [1]}', '', 'garbage'], 3, ["not valid JSON", "garbage"]),
    (['{"id": "a", "text": "hello"}'], 1, ["no tokenizer", "tokenizer.json", "rlx-mpi convert"]),
])
def test_each_mistake_is_one_line_naming_file_and_line(tmp_path, lines, line, words):
    path = write(tmp_path, "\n".join(lines) + "\n")
    err = error_of(path)
    assert err.where == f"{path}:{line}"
    for word in words:
        assert word in err.line(), (word, err.line())


def test_empty_file_and_blank_file_have_no_prompts(tmp_path):
    for text in ("", "\n\n  \n", "\ufeff"):
        err = error_of(write(tmp_path, text))
        assert "no prompts" in err.line() and '"tokens"' in err.line()


@pytest.mark.parametrize("data, what", [
    (pickle.dumps([{"id": "a", "tokens": [1]}]), "pickle"),
    (b"\x93NUMPY\x01\x00v\x00{'descr': '<i8'}", "numpy"),
    (b"\x89HDF\r\n\x1a\n\x00\x00", "HDF5"),
    (b'{"id": "a", "tokens": [1]}\n{"id": "b",\x00\x00}\n', "binary"),
])
def test_binary_files_are_refused_with_a_clear_line(tmp_path, data, what):
    err = error_of(write(tmp_path, data))
    assert what in err.line()
    if what == "binary":
        assert err.where.endswith(":2")


def test_invalid_utf8_names_its_line(tmp_path):
    err = error_of(write(tmp_path, b'{"id": "a", "tokens": [1]}\n{"id": "\xff", "tokens": [1]}\n'))
    assert err.where.endswith(":2") and "0xff" in err.line() and "UTF-8" in err.line()


def test_size_bound_directory_and_missing_file(tmp_path):
    path = write(tmp_path, '{"id": "a", "tokens": [1]}\n' * 10)
    assert "more than the 100 allowed" in error_of(path, max_bytes=100).line()
    assert "is a directory" in error_of(tmp_path).line()
    assert "not found" in error_of(tmp_path / "nope.jsonl").line()


def test_limits_are_exact(tmp_path):
    # 24 prompt tokens + 8 new = 32 positions: fits exactly
    path = write(tmp_path, json.dumps({"id": "a", "tokens": list(range(24))}) + "\n")
    assert len(read_prompts(path, **LIMITS)[0].tokens) == 24
    path = write(tmp_path, '{"id": "a", "tokens": [99]}\n')
    assert "outside [0, 99)" in error_of(path, vocab_size=99).line()


# -- tokenizer -------------------------------------------------------------------------------------

def _word_level(folder, name="tokenizer.json"):
    """A tiny WordLevel tokenizer.json, made here (no hub): ids 0-2 special, then words."""
    tokenizers = pytest.importorskip("tokenizers", reason="the optional 'tokenizers' package "
                                     "(extra 'text') is not installed")
    from tokenizers import models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "the": 3, "capital": 4, "of": 5, "france": 6, "is": 7}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(folder / name))
    return vocab


def test_text_prompts_with_a_tokenizer_beside_the_checkpoint(tmp_path):
    _word_level(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    tok = load_tokenizer(tmp_path / "model.h5")
    assert tok is not None and tok.eos_token_id == 2 and tok.eos_token_ids == (2,)
    assert tok.encode("the capital of france is") == [3, 4, 5, 6, 7]
    assert tok.decode([3, 4, 2]) == "the capital"  # the special </s> is dropped
    path = write(tmp_path, '{"id": "q", "text": "the capital of france is"}\n{"id": "r", "tokens": [3]}\n')
    prompts = read_prompts(path, tokenizer=tok, **LIMITS)
    assert prompts[0] == Prompt(0, "q", (3, 4, 5, 6, 7), "the capital of france is")
    assert prompts[1].text is None
    err = error_of(path, tokenizer=tok, vocab_size=5)  # the tokenizer's ids must fit the model
    assert err.where.endswith(":1") and "encodes to token 5" in err.line()


def test_stem_tokenizer_wins_and_generation_config_gives_eos(tmp_path):
    _word_level(tmp_path, "model.tokenizer.json")
    (tmp_path / "tokenizer.json").write_text("not json at all")  # another model's, broken
    (tmp_path / "model.generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    tok = load_tokenizer(tmp_path / "model.h5")
    assert tok.path.name == "model.tokenizer.json" and tok.eos_token_ids == (7, 2)
    with pytest.raises(InputError, match="not a tokenizers file"):
        load_tokenizer(tmp_path / "other.h5")


def test_no_tokenizer_is_none_and_a_missing_package_says_how_to_install(tmp_path, monkeypatch):
    assert load_tokenizer(tmp_path / "model.h5") is None
    assert load_tokenizer(tmp_path) is None
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(__import__("sys").modules, "tokenizers", None)  # import now fails
    with pytest.raises(InputError) as e:
        load_tokenizer(tmp_path / "model.h5")
    assert "pip install 'rlx_mpi[text]'" in e.value.line()
