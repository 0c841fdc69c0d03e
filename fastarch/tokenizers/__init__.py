"""Tokenizers of guide 003 made real: BPE (incremental pair counts), WordPiece (likelihood-ratio training,
BERT-compatible encoding and vocab.txt loading) and Unigram (EM + loss pruning + Viterbi), with ids,
special tokens, decode and atomic JSON save/load."""

from __future__ import annotations

from .bert_basic import BasicTokenizer, wordpiece_tokenize
from .bpe import BPETokenizer
from .io import BaseTokenizer, TokenizerFileError, load_tokenizer
from .unigram import UnigramTokenizer
from .wordpiece import WordPieceTokenizer

__all__ = [
    "BPETokenizer",
    "BaseTokenizer",
    "BasicTokenizer",
    "TokenizerFileError",
    "UnigramTokenizer",
    "WordPieceTokenizer",
    "load_tokenizer",
    "wordpiece_tokenize",
]
