"""Tokenizers of guide 003 made real: BPE (incremental pair counts; byte-level as in GPT-2 too), WordPiece
(likelihood-ratio training, BERT-compatible encoding and vocab.txt loading) and Unigram (EM + loss pruning +
Viterbi), with ids, special tokens, transformers-style batch calls, decode and atomic JSON save/load, in
fastarch's format or the ``tokenizers`` library's ``tokenizer.json``."""

from __future__ import annotations

from .batch import Encoding
from .bert_basic import BasicTokenizer, wordpiece_tokenize
from .bpe import BPETokenizer
from .hf_format import load_tokenizer_json, save_tokenizer_json, to_tokenizer_json
from .io import BaseTokenizer, TokenizerFileError, load_tokenizer
from .unigram import UnigramTokenizer
from .wordpiece import WordPieceTokenizer

__all__ = [
    "BPETokenizer",
    "BaseTokenizer",
    "BasicTokenizer",
    "Encoding",
    "TokenizerFileError",
    "UnigramTokenizer",
    "WordPieceTokenizer",
    "load_tokenizer",
    "load_tokenizer_json",
    "save_tokenizer_json",
    "to_tokenizer_json",
    "wordpiece_tokenize",
]
