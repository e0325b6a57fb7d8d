"""Character-level HF tokenizer for the bootstrapped tiny policy.

No machine here downloads tokenizers from a hub, so the tiny CPU recipe writes its own: one token
per character, so that a small model learns synthetic tasks digit by digit and lengths in
characters equal lengths in tokens. The directory it writes loads with
``transformers.AutoTokenizer.from_pretrained`` as a fast tokenizer, like any real checkpoint.

Unknown characters (not in the alphabet) encode to ``<unk>`` (id 3), one ``<unk>`` per
character; decoding drops them when ``skip_special_tokens=True`` and writes ``<unk>`` otherwise,
so round trips are exact only for text made of alphabet characters. As with any HF tokenizer,
the literal strings ``<pad>``, ``<eos>``, ``<bos>`` and ``<unk>`` in input text encode to the
special token ids.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from tokenizers import Tokenizer, decoders
from tokenizers.models import BPE

from fastdraft.errors import FastdraftError

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
BOS_TOKEN = "<bos>"
UNK_TOKEN = "<unk>"
#: Special tokens in id order: <pad>=0, <eos>=1, <bos>=2, <unk>=3.
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, EOS_TOKEN, BOS_TOKEN, UNK_TOKEN)

#: Digits and arithmetic symbols for the synthetic tasks (data/tasks), plus lowercase letters and
#: a little punctuation so that prompts may carry short words; space and newline included.
DEFAULT_ALPHABET: str = string.digits + "+-*=,.#:()?" + string.ascii_lowercase + " \n"

_VOCAB_MULTIPLE = 16


def _check_alphabet(alphabet: str) -> None:
    if not alphabet:
        raise FastdraftError("alphabet is empty: pass the characters the tokenizer must know")
    seen: set[str] = set()
    duplicates = sorted({ch for ch in alphabet if ch in seen or seen.add(ch)})
    if duplicates:
        raise FastdraftError(f"alphabet repeats characters {duplicates!r}: list each character "
                             "once")
    clashes = [tok for tok in SPECIAL_TOKENS if tok in alphabet]
    if clashes:
        raise FastdraftError(f"alphabet contains special token text {clashes!r}: remove it")


def vocab_size_for(alphabet: str) -> int:
    """Model vocabulary size for ``alphabet``: specials + characters, rounded up to 16.

    The model's embedding may be larger than the tokenizer (the extra rows are never produced);
    a multiple of 16 keeps matmul shapes friendly on GPUs.
    """
    _check_alphabet(alphabet)
    num_tokens = len(SPECIAL_TOKENS) + len(alphabet)
    return -(-num_tokens // _VOCAB_MULTIPLE) * _VOCAB_MULTIPLE


def _build_tokenizer(alphabet: str) -> Tokenizer:
    """A BPE model with no merges: every character is its own token, unknowns become <unk>.

    No normalizer and no pre-tokenizer, so spaces and newlines are ordinary characters; the
    ``Fuse`` decoder concatenates tokens (the default decoder would insert spaces).
    """
    vocab = {tok: idx for idx, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + idx for idx, ch in enumerate(alphabet)})
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN, fuse_unk=False))
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.decoder = decoders.Fuse()
    return tokenizer


def build_char_tokenizer(out_dir: str | Path, alphabet: str = DEFAULT_ALPHABET) -> None:
    """Write a character-level HF tokenizer directory to ``out_dir`` (created if missing).

    Files: ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``. Encoding
    adds no BOS/EOS (the RL engine appends EOS itself where it needs one).
    """
    _check_alphabet(alphabet)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _build_tokenizer(alphabet).save(str(out / "tokenizer.json"))
    special_map = {
        "pad_token": PAD_TOKEN,
        "eos_token": EOS_TOKEN,
        "bos_token": BOS_TOKEN,
        "unk_token": UNK_TOKEN,
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_map,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
