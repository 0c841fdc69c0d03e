"""Sequence builders: BERT, GPT, encoder-decoder and guide-003 transformers, CLIP, multi-modal and recurrent
models, in standard sizes (``bert_base`` 109,482,240 and ``gpt2_small`` 124,439,808 parameters, as the
published checkpoints) and small ones for tests and demos. Keyword arguments override the defaults."""

from __future__ import annotations

from ..nn.bert import BERT, BERTModel, BERTTransformer
from ..nn.clip import CLIP
from ..nn.gpt import GPTModel, GPTTransformer
from ..nn.multimodal import MultiModalTransformer
from ..nn.recurrent import GRU, LSTM, VanillaRNN
from ..nn.transformer import Transformer, TransformerLM
from .registry import register_configs

__all__: list[str] = []

_TINY_RNN = dict(input_size=8, hidden_size=16, output_size=4, num_layers=2)

globals().update(register_configs({
    "bert_base": (BERT, "BERT-Base (uncased vocabulary 30522, 12 x 768, 12 heads, pooler): 109,482,240 parameters.",
                  dict(vocab_size=30522, hidden_size=768, num_heads=12, num_layers=12, intermediate_size=3072,
                       max_position_embeddings=512, type_vocab_size=2)),
    "bert_tiny": (BERT, "2 layers x 32, 4 heads, vocabulary 128, dropout 0.",
                  dict(vocab_size=128, hidden_size=32, num_heads=4, num_layers=2, intermediate_size=64,
                       max_position_embeddings=64, dropout=0.0)),
    "bert_pretraining_tiny": (BERTModel, "Guide 001's BERTModel (MLM + NSP heads), tiny.",
                              dict(vocab_size=128, embed_dim=32, num_heads=4, num_layers=2, ff_dim=64, max_len=64,
                                   dropout=0.0)),
    "bert_transformer_tiny": (BERTTransformer, "Guide 000's BERTTransformer, tiny.",
                              dict(vocab_size=128, d_model=32, n_heads=4, num_layers=2, d_ff=64, max_len=64,
                                   dropout=0.0)),
    "gpt2_small": (GPTModel, "GPT-2 small (50257 vocabulary, 12 x 768, 12 heads, 1024 positions, tied head): 124,439,808 parameters.",
                   dict(vocab_size=50257, embed_dim=768, num_heads=12, num_layers=12, ff_dim=3072, max_len=1024)),
    "gpt_tiny": (GPTModel, "Guide 001's GPTModel: vocabulary 256, 2 x 64, 4 heads, 128 positions, dropout 0.",
                 dict(vocab_size=256, embed_dim=64, num_heads=4, num_layers=2, ff_dim=256, max_len=128, dropout=0.0)),
    "gpt_transformer_tiny": (GPTTransformer, "Guide 000's GPTTransformer: vocabulary 256, 2 x 64, 4 heads, 128 positions, dropout 0.",
                             dict(vocab_size=256, d_model=64, n_heads=4, num_layers=2, d_ff=256, max_len=128,
                                  dropout=0.0)),
    "gpt_bench": (GPTTransformer, "The benchmark GPT: guide 000 layout, d_model 512, 8 layers, 8 heads, 1024 positions.",
                  dict(vocab_size=8192, d_model=512, n_heads=8, num_layers=8, d_ff=2048, max_len=1024, dropout=0.0)),
    "transformer_tiny": (Transformer, "Guide 000's encoder-decoder Transformer, tiny.",
                         dict(src_vocab_size=64, tgt_vocab_size=64, d_model=32, n_heads=4, num_encoder_layers=2,
                              num_decoder_layers=2, d_ff=64, max_len=128, dropout=0.0)),
    "transformer003_tiny": (TransformerLM, "Guide 003's language model (decoder mode, rotary by default), tiny.",
                            dict(vocab_size=64, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_len=128, dropout=0.0,
                                 mode="decoder", pos_encoding="rotary")),
    "clip_tiny": (CLIP, "CLIP with 32px images (patch 8), 16-token text, width 32, 1 layer per tower.",
                  dict(embed_dim=32, vision_depth=1, text_depth=1, vision_heads=4, text_heads=4, vocab_size=64,
                       img_size=32, patch_size=8, context_length=16)),
    "multimodal_tiny": (MultiModalTransformer, "Guide 000's multi-modal transformer, tiny.",
                        dict(vision_dim=24, text_vocab=64, d_model=32, n_heads=4, num_layers=1, num_classes=5)),
    "lstm_tiny": (LSTM, "2-layer LSTM, 8 -> 16 -> 4.", _TINY_RNN),
    "gru_tiny": (GRU, "2-layer GRU, 8 -> 16 -> 4.", _TINY_RNN),
    "rnn_tiny": (VanillaRNN, "2-layer Elman RNN, 8 -> 16 -> 4.", _TINY_RNN),
}))
