"""The bootstrap char tokenizer: one token per character, exact round trips, HF loading."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from fastdraft.bootstrap.tokenizer import (
    DEFAULT_ALPHABET,
    SPECIAL_TOKENS,
    build_char_tokenizer,
    vocab_size_for,
)

TRICKY = [
    "7+3+9+4=7,0,9,3#3",
    " ",
    "\n",
    "  leading and trailing  ",
    "a\n\nb \n c",
    "a,b.c:d(e)?f-g*h",
    "0123456789" * 20,
    "",
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "nested" / "char"
    build_char_tokenizer(out, DEFAULT_ALPHABET)
    return out


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def test_writes_hf_files(tokenizer_dir: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tokenizer_dir / name).is_file()


def test_loads_as_fast_tokenizer_with_specials(tokenizer: PreTrainedTokenizerBase) -> None:
    assert tokenizer.is_fast
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2, 3]
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<pad>", 0)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<eos>", 1)
    assert (tokenizer.bos_token, tokenizer.bos_token_id) == ("<bos>", 2)
    assert (tokenizer.unk_token, tokenizer.unk_token_id) == ("<unk>", 3)
    assert len(tokenizer) == len(SPECIAL_TOKENS) + len(DEFAULT_ALPHABET)


@pytest.mark.parametrize("text", TRICKY)
def test_round_trip_one_token_per_char(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    ids = tokenizer.encode(text)
    assert len(ids) == len(text)
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    # No BOS/EOS is added, whatever add_special_tokens says.
    assert tokenizer(text, add_special_tokens=True)["input_ids"] == ids


def test_every_alphabet_char_has_its_own_id(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = [tokenizer.encode(ch) for ch in DEFAULT_ALPHABET]
    assert all(len(one) == 1 for one in ids)
    flat = [one[0] for one in ids]
    assert flat == list(range(len(SPECIAL_TOKENS), len(SPECIAL_TOKENS) + len(DEFAULT_ALPHABET)))
    assert max(flat) < vocab_size_for(DEFAULT_ALPHABET)


def test_unknown_chars_map_to_unk_one_each(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer.encode("1A~é2")
    assert ids == [tokenizer.encode("1")[0], 3, 3, 3, tokenizer.encode("2")[0]]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "12"
    assert tokenizer.decode(ids) == "1<unk><unk><unk>2"


def test_special_token_text_encodes_to_special_id(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer.encode("3<eos>")
    assert ids[1:] == [tokenizer.eos_token_id]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "3"


def test_batch_padding_uses_pad_id(tokenizer: PreTrainedTokenizerBase) -> None:
    batch = tokenizer(["12", "3"], padding=True)
    assert 0 in batch["input_ids"][0] + batch["input_ids"][1]
    assert sorted(map(sum, batch["attention_mask"])) == [1, 2]


def test_custom_alphabet(tmp_path: Path) -> None:
    build_char_tokenizer(tmp_path, "ab \n")
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert tok.encode("ab \nba") == [4, 5, 6, 7, 5, 4]
    assert tok.encode("c") == [3]


def test_vocab_size_rounds_up_to_16() -> None:
    assert vocab_size_for("a") == 16
    assert vocab_size_for("abcdefghijkl") == 16  # 4 specials + 12 chars
    assert vocab_size_for("abcdefghijklm") == 32
    assert vocab_size_for(DEFAULT_ALPHABET) % 16 == 0
    assert vocab_size_for(DEFAULT_ALPHABET) >= len(SPECIAL_TOKENS) + len(DEFAULT_ALPHABET)


def test_default_alphabet_has_space_and_newline() -> None:
    assert " " in DEFAULT_ALPHABET and "\n" in DEFAULT_ALPHABET
    assert len(set(DEFAULT_ALPHABET)) == len(DEFAULT_ALPHABET)


@pytest.mark.parametrize(
    ("alphabet", "message"), [("", "empty"), ("abca", "repeats"), ("a<eos>", "special token")]
)
def test_bad_alphabet_rejected(tmp_path: Path, alphabet: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_char_tokenizer(tmp_path, alphabet)
