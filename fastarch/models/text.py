"""Sequence builders: BERT, GPT, encoder-decoder and guide-003 transformers, CLIP, multi-modal and recurrent
models, in standard sizes (``bert_base`` 109,482,240 and ``gpt2_small`` 124,439,808 parameters, as the
published checkpoints) and small ones for tests and demos. Keyword arguments override the defaults."""

from __future__ import annotations

from typing import Any

from ..nn.bert import BERT, BERTModel, BERTTransformer
from ..nn.clip import CLIP
from ..nn.gpt import GPTModel, GPTTransformer
from ..nn.multimodal import MultiModalTransformer
from ..nn.recurrent import GRU, LSTM, VanillaRNN
from ..nn.transformer import Transformer, Transformer003
from .registry import register_model

__all__: list[str] = []


def _cfg(defaults: dict[str, Any], kw: dict[str, Any]) -> dict[str, Any]:
    out = dict(defaults)
    out.update(kw)
    return out


@register_model
def bert_base(**kw: Any) -> BERT:
    """BERT-Base (uncased vocabulary 30522, 12 x 768, 12 heads, pooler): 109,482,240 parameters."""
    return BERT(**_cfg(dict(vocab_size=30522, hidden_size=768, num_heads=12, num_layers=12, intermediate_size=3072,
                            max_position_embeddings=512, type_vocab_size=2), kw))


@register_model
def bert_tiny(**kw: Any) -> BERT:
    """2 layers x 32, 4 heads, vocabulary 128, dropout 0."""
    return BERT(**_cfg(dict(vocab_size=128, hidden_size=32, num_heads=4, num_layers=2, intermediate_size=64,
                            max_position_embeddings=64, dropout=0.0), kw))


@register_model
def bert_pretraining_tiny(**kw: Any) -> BERTModel:
    """Guide 001's BERTModel (MLM + NSP heads), tiny."""
    return BERTModel(**_cfg(dict(vocab_size=128, embed_dim=32, num_heads=4, num_layers=2, ff_dim=64, max_len=64,
                                 dropout=0.0), kw))


@register_model
def bert_transformer_tiny(**kw: Any) -> BERTTransformer:
    """Guide 000's BERTTransformer, tiny."""
    return BERTTransformer(**_cfg(dict(vocab_size=128, d_model=32, n_heads=4, num_layers=2, d_ff=64, max_len=64,
                                       dropout=0.0), kw))


@register_model
def gpt2_small(**kw: Any) -> GPTModel:
    """GPT-2 small (50257 vocabulary, 12 x 768, 12 heads, 1024 positions, tied head): 124,439,808 parameters."""
    return GPTModel(**_cfg(dict(vocab_size=50257, embed_dim=768, num_heads=12, num_layers=12, ff_dim=3072,
                                max_len=1024), kw))


@register_model
def gpt_tiny(**kw: Any) -> GPTModel:
    """Guide 001's GPTModel: vocabulary 256, 2 x 64, 4 heads, 128 positions, dropout 0 (deterministic)."""
    return GPTModel(**_cfg(dict(vocab_size=256, embed_dim=64, num_heads=4, num_layers=2, ff_dim=256, max_len=128,
                                dropout=0.0), kw))


@register_model
def gpt_transformer_tiny(**kw: Any) -> GPTTransformer:
    """Guide 000's GPTTransformer: vocabulary 256, 2 x 64, 4 heads, 128 positions, dropout 0."""
    return GPTTransformer(**_cfg(dict(vocab_size=256, d_model=64, n_heads=4, num_layers=2, d_ff=256, max_len=128,
                                      dropout=0.0), kw))


@register_model
def gpt_bench(**kw: Any) -> GPTTransformer:
    """The benchmark GPT: guide 000 layout, d_model 512, 8 layers, 8 heads, 1024 positions."""
    return GPTTransformer(**_cfg(dict(vocab_size=8192, d_model=512, n_heads=8, num_layers=8, d_ff=2048,
                                      max_len=1024, dropout=0.0), kw))


@register_model
def transformer_tiny(**kw: Any) -> Transformer:
    """Guide 000's encoder-decoder Transformer, tiny."""
    return Transformer(**_cfg(dict(src_vocab_size=64, tgt_vocab_size=64, d_model=32, n_heads=4, num_encoder_layers=2,
                                   num_decoder_layers=2, d_ff=64, max_len=128, dropout=0.0), kw))


@register_model
def transformer003_tiny(**kw: Any) -> Transformer003:
    """Guide 003's language model (decoder mode, rotary by default), tiny."""
    return Transformer003(**_cfg(dict(vocab_size=64, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_len=128,
                                      dropout=0.0, mode="decoder", pos_encoding="rotary"), kw))


@register_model
def clip_tiny(**kw: Any) -> CLIP:
    """CLIP with 32px images (patch 8), 16-token text, width 32, 1 layer per tower."""
    return CLIP(**_cfg(dict(embed_dim=32, vision_depth=1, text_depth=1, vision_heads=4, text_heads=4, vocab_size=64,
                            img_size=32, patch_size=8, context_length=16), kw))


@register_model
def multimodal_tiny(**kw: Any) -> MultiModalTransformer:
    return MultiModalTransformer(**_cfg(dict(vision_dim=24, text_vocab=64, d_model=32, n_heads=4, num_layers=1,
                                             num_classes=5), kw))


@register_model
def lstm_tiny(**kw: Any) -> LSTM:
    return LSTM(**_cfg(dict(input_size=8, hidden_size=16, output_size=4, num_layers=2), kw))


@register_model
def gru_tiny(**kw: Any) -> GRU:
    return GRU(**_cfg(dict(input_size=8, hidden_size=16, output_size=4, num_layers=2), kw))


@register_model
def rnn_tiny(**kw: Any) -> VanillaRNN:
    return VanillaRNN(**_cfg(dict(input_size=8, hidden_size=16, output_size=4, num_layers=2), kw))
