"""Drop-in checks for fastarch.nn.attention: the guide-000 classes (copied verbatim below as the reference)
and fastarch's versions load the same state dict with strict=True and give the same eval outputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fastarch.nn.attention as FA

# ---- guide 000 reference classes (verbatim copy) ---------------------------------------------------------
# fmt: off
# ruff: noqa
class ScaledDotProductAttention(nn.Module):
    """
    Scaled Dot-Product Attention
    
    Formula:
        Attention(Q, K, V) = softmax(QK^T / √d_k) V
    
    Where:
        Q: queries (batch, seq_len_q, d_k)
        K: keys (batch, seq_len_k, d_k)
        V: values (batch, seq_len_v, d_v)
        d_k: dimension of keys/queries
    
    Scaling by √d_k prevents softmax saturation for large d_k
    """
    def __init__(self, temperature=None, dropout=0.1):
        super(ScaledDotProductAttention, self).__init__()
        self.temperature = temperature
        self.dropout = nn.Dropout(dropout)
    
    def forward(self, q, k, v, mask=None):
        """
        Args:
            q: (batch, n_heads, len_q, d_k)
            k: (batch, n_heads, len_k, d_k)
            v: (batch, n_heads, len_v, d_v)
            mask: (batch, 1, len_q, len_k) or None
        
        Returns:
            output: (batch, n_heads, len_q, d_v)
            attention: (batch, n_heads, len_q, len_k)
        """
        d_k = q.size(-1)
        
        # If temperature not set, use sqrt(d_k)
        temperature = self.temperature or d_k ** 0.5
        
        # Compute attention scores: QK^T / √d_k
        # (batch, n_heads, len_q, d_k) x (batch, n_heads, d_k, len_k)
        # -> (batch, n_heads, len_q, len_k)
        scores = torch.matmul(q, k.transpose(-2, -1)) / temperature
        
        # Apply mask (for padding or causal attention)
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        
        # Apply softmax to get attention weights
        attention = F.softmax(scores, dim=-1)
        attention = self.dropout(attention)
        
        # Apply attention to values
        # (batch, n_heads, len_q, len_k) x (batch, n_heads, len_k, d_v)
        # -> (batch, n_heads, len_q, d_v)
        output = torch.matmul(attention, v)
        
        return output, attention


class MultiHeadAttention(nn.Module):
    """
    Multi-Head Attention
    
    Formula:
        MultiHead(Q, K, V) = Concat(head_1, ..., head_h)W^O
        where head_i = Attention(QW_i^Q, KW_i^K, VW_i^V)
    
    Difference from single attention:
        - Projects Q, K, V into h different subspaces
        - Allows model to attend to different representation subspaces
        - Each head has dimension d_model / h
    """
    def __init__(self, d_model, n_heads, dropout=0.1):
        super(MultiHeadAttention, self).__init__()
        
        assert d_model % n_heads == 0, "d_model must be divisible by n_heads"
        
        self.d_model = d_model
        self.n_heads = n_heads
        self.d_k = d_model // n_heads
        
        # Linear projections for Q, K, V
        self.w_q = nn.Linear(d_model, d_model)
        self.w_k = nn.Linear(d_model, d_model)
        self.w_v = nn.Linear(d_model, d_model)
        
        # Output projection
        self.w_o = nn.Linear(d_model, d_model)
        
        # Attention mechanism
        self.attention = ScaledDotProductAttention(dropout=dropout)
        
        self.dropout = nn.Dropout(dropout)
        self.layer_norm = nn.LayerNorm(d_model)
    
    def forward(self, q, k, v, mask=None):
        """
        Args:
            q: (batch, len_q, d_model)
            k: (batch, len_k, d_model)
            v: (batch, len_v, d_model)
            mask: (batch, 1, len_q, len_k) or None
        
        Returns:
            output: (batch, len_q, d_model)
            attention: (batch, n_heads, len_q, len_k)
        """
        batch_size = q.size(0)
        residual = q
        
        # 1. Linear projections
        q = self.w_q(q)  # (batch, len_q, d_model)
        k = self.w_k(k)  # (batch, len_k, d_model)
        v = self.w_v(v)  # (batch, len_v, d_model)
        
        # 2. Split into multiple heads
        # (batch, len, d_model) -> (batch, len, n_heads, d_k)
        # -> (batch, n_heads, len, d_k)
        q = q.view(batch_size, -1, self.n_heads, self.d_k).transpose(1, 2)
        k = k.view(batch_size, -1, self.n_heads, self.d_k).transpose(1, 2)
        v = v.view(batch_size, -1, self.n_heads, self.d_k).transpose(1, 2)
        
        # 3. Apply attention
        output, attention = self.attention(q, k, v, mask)
        
        # 4. Concatenate heads
        # (batch, n_heads, len_q, d_k) -> (batch, len_q, n_heads, d_k)
        # -> (batch, len_q, d_model)
        output = output.transpose(1, 2).contiguous().view(
            batch_size, -1, self.d_model
        )
        
        # 5. Final linear projection
        output = self.w_o(output)
        output = self.dropout(output)
        
        # 6. Residual connection and layer norm
        output = self.layer_norm(output + residual)
        
        return output, attention


class SelfAttention(nn.Module):
    """
    Self-Attention: Q, K, V all come from same source
    
    Usage: Within encoder or decoder to attend to own sequence
    Formula: Attention(X, X, X)
    """
    def __init__(self, d_model, n_heads, dropout=0.1):
        super(SelfAttention, self).__init__()
        self.mha = MultiHeadAttention(d_model, n_heads, dropout)
    
    def forward(self, x, mask=None):
        # x: (batch, seq_len, d_model)
        return self.mha(x, x, x, mask)


class CrossAttention(nn.Module):
    """
    Cross-Attention: Q from one source, K and V from another
    
    Usage: Decoder attending to encoder output
    Formula: Attention(Q_decoder, K_encoder, V_encoder)
    
    Difference from self-attention:
        - Q comes from decoder
        - K, V come from encoder
        - Allows decoder to focus on relevant encoder information
    """
    def __init__(self, d_model, n_heads, dropout=0.1):
        super(CrossAttention, self).__init__()
        self.mha = MultiHeadAttention(d_model, n_heads, dropout)
    
    def forward(self, q, kv, mask=None):
        """
        Args:
            q: decoder features (batch, len_q, d_model)
            kv: encoder features (batch, len_kv, d_model)
            mask: attention mask
        """
        return self.mha(q, kv, kv, mask)


class LongformerAttention(nn.Module):
    """
    Longformer: Combines local windowed attention with global attention
    
    Attention Patterns:
        1. Local window: Each token attends to w tokens on each side
        2. Global attention: Special tokens attend to all, all attend to them
        3. Dilated window: Increases receptive field
    
    Complexity: O(n × w) where w is window size (typically w << n)
    
    Formula:
        Attention_local(i) = softmax(Q_i K_{i-w:i+w}^T / √d) V_{i-w:i+w}
        Attention_global(i) = softmax(Q_i K_all^T / √d) V_all  (for special tokens)
    """
    def __init__(self, d_model, n_heads, window_size=512, 
                 global_tokens=[], dropout=0.1):
        super(LongformerAttention, self).__init__()
        
        assert d_model % n_heads == 0
        
        self.d_model = d_model
        self.n_heads = n_heads
        self.d_k = d_model // n_heads
        self.window_size = window_size
        self.global_tokens = global_tokens  # List of token positions with global attention
        
        # Q, K, V projections
        self.w_q = nn.Linear(d_model, d_model)
        self.w_k = nn.Linear(d_model, d_model)
        self.w_v = nn.Linear(d_model, d_model)
        
        # Separate projections for global attention
        self.w_q_global = nn.Linear(d_model, d_model)
        self.w_k_global = nn.Linear(d_model, d_model)
        self.w_v_global = nn.Linear(d_model, d_model)
        
        # Output projection
        self.w_o = nn.Linear(d_model, d_model)
        
        self.dropout = nn.Dropout(dropout)
    
    def _sliding_window_attention(self, q, k, v, window_size):
        """
        Compute sliding window attention
        
        Args:
            q, k, v: (batch, n_heads, seq_len, d_k)
            window_size: size of local window
        """
        batch_size, n_heads, seq_len, d_k = q.size()
        
        # For simplicity, compute full attention and mask
        # Production implementation would use efficient sliding window
        scores = torch.matmul(q, k.transpose(-2, -1)) / (d_k ** 0.5)
        
        # Create sliding window mask
        mask = self._create_sliding_window_mask(seq_len, window_size, q.device)
        mask = mask.unsqueeze(0).unsqueeze(0)  # (1, 1, seq_len, seq_len)
        
        scores = scores.masked_fill(mask == 0, -1e9)
        
        attention = F.softmax(scores, dim=-1)
        attention = self.dropout(attention)
        
        output = torch.matmul(attention, v)
        
        return output
    
    def _create_sliding_window_mask(self, seq_len, window_size, device):
        """
        Create mask for sliding window attention
        
        Returns: (seq_len, seq_len) mask where 1 = attend, 0 = don't attend
        """
        # Create distance matrix
        positions = torch.arange(seq_len, device=device)
        distance = positions.unsqueeze(0) - positions.unsqueeze(1)
        
        # Allow attention within window
        mask = torch.abs(distance) <= window_size
        
        return mask.float()
    
    def forward(self, x, global_mask=None):
        """
        Args:
            x: (batch, seq_len, d_model)
            global_mask: (batch, seq_len) - 1 for global tokens, 0 for local
        
        Returns:
            output: (batch, seq_len, d_model)
        """
        batch_size, seq_len, _ = x.size()
        
        # Local attention
        Q = self.w_q(x).view(batch_size, seq_len, self.n_heads, self.d_k).transpose(1, 2)
        K = self.w_k(x).view(batch_size, seq_len, self.n_heads, self.d_k).transpose(1, 2)
        V = self.w_v(x).view(batch_size, seq_len, self.n_heads, self.d_k).transpose(1, 2)
        
        # Compute sliding window attention
        output = self._sliding_window_attention(Q, K, V, self.window_size)
        
        # Add global attention for special tokens (e.g., [CLS])
        if global_mask is not None:
            Q_global = self.w_q_global(x).view(batch_size, seq_len, self.n_heads, self.d_k).transpose(1, 2)
            K_global = self.w_k_global(x).view(batch_size, seq_len, self.n_heads, self.d_k).transpose(1, 2)
            V_global = self.w_v_global(x).view(batch_size, seq_len, self.n_heads, self.d_k).transpose(1, 2)
            
            # Global tokens attend to all
            global_scores = torch.matmul(Q_global, K_global.transpose(-2, -1)) / (self.d_k ** 0.5)
            global_attn = F.softmax(global_scores, dim=-1)
            global_output = torch.matmul(global_attn, V_global)
            
            # Merge local and global attention based on mask
            mask_expanded = global_mask.unsqueeze(1).unsqueeze(-1)  # (batch, 1, seq_len, 1)
            output = output * (1 - mask_expanded) + global_output * mask_expanded
        
        # Concatenate heads and project
        output = output.transpose(1, 2).contiguous().view(batch_size, seq_len, self.d_model)
        output = self.w_o(output)
        output = self.dropout(output)
        
        return output
# fmt: on


def _same_weights(ref: nn.Module, ours: nn.Module) -> None:
    ours.load_state_dict(ref.state_dict(), strict=True)
    assert set(ref.state_dict()) == set(ours.state_dict())
    ref.eval()
    ours.eval()


def test_sdpa_matches_guide_with_masks():
    ref, ours = ScaledDotProductAttention(), FA.ScaledDotProductAttention()
    _same_weights(ref, ours)
    q, k, v = torch.randn(2, 3, 7, 16), torch.randn(2, 3, 11, 16), torch.randn(2, 3, 11, 24)  # d_v != d_k
    for mask in (None,
                 (torch.rand(2, 1, 1, 11) > 0.3).float(),           # key padding form
                 (torch.rand(2, 1, 7, 11) > 0.5).int(),             # general form
                 torch.ones(2, 1, 7, 11).index_fill_(2, torch.tensor([3]), 0)):  # a fully masked row
        o_r, w_r = ref(q, k, v, mask)
        o_f, w_f = ours(q, k, v, mask)
        torch.testing.assert_close(o_f, o_r, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(w_f, w_r, rtol=1e-5, atol=1e-5)


def test_sdpa_temperature_and_no_weights():
    ref, ours = ScaledDotProductAttention(temperature=3.0), FA.ScaledDotProductAttention(3.0, need_weights=False)
    _same_weights(ref, ours)
    q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))
    o_f, w_f = ours(q, k, v)
    assert w_f is None
    torch.testing.assert_close(o_f, ref(q, k, v)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cls", ["MultiHeadAttention", "SelfAttention", "CrossAttention"])
def test_mha_family_matches_guide(cls):
    torch.manual_seed(1)
    ref = globals()[cls](32, 4, 0.1)
    ours = getattr(FA, cls)(32, 4, 0.1)
    _same_weights(ref, ours)
    x, y = torch.randn(2, 9, 32), torch.randn(2, 13, 32)
    mask = (torch.rand(2, 1, 1, 9 if cls == "SelfAttention" else 13) > 0.2).float()
    if cls == "MultiHeadAttention":
        args = (x, y, y, mask)
    elif cls == "SelfAttention":
        args = (x, mask)
    else:
        args = (x, y, mask)
    (o_r, w_r), (o_f, w_f) = ref(*args), ours(*args)
    torch.testing.assert_close(o_f, o_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w_f, w_r, rtol=1e-5, atol=1e-5)


def test_mha_causal_mask_and_training_grad():
    ours = FA.MultiHeadAttention(16, 2, 0.0)
    x = torch.randn(2, 6, 16, requires_grad=True)
    causal = torch.tril(torch.ones(6, 6)).view(1, 1, 6, 6)
    ref = MultiHeadAttention(16, 2, 0.0)
    ref.load_state_dict(ours.state_dict())
    o, _ = ours(x, x, x, causal)
    o_r, _ = ref(x, x, x, causal)
    torch.testing.assert_close(o, o_r, rtol=1e-5, atol=1e-5)
    g = torch.autograd.grad(o.sum(), x)[0]
    g_r = torch.autograd.grad(o_r.sum(), x)[0]
    torch.testing.assert_close(g, g_r, rtol=1e-4, atol=1e-5)


def test_mha_bad_input():
    with pytest.raises(ValueError, match="d_model"):
        FA.MultiHeadAttention(30, 4)
    m = FA.MultiHeadAttention(16, 2)
    with pytest.raises(ValueError, match="'q'"):
        m(torch.randn(2, 5, 8), torch.randn(2, 5, 16), torch.randn(2, 5, 16))
    with pytest.raises(ValueError, match="mask"):
        m(torch.randn(2, 5, 16), torch.randn(2, 5, 16), torch.randn(2, 5, 16), torch.ones(3, 1, 5, 5))


@pytest.mark.parametrize("gm_kind", ["none", "binary", "fractional"])
def test_longformer_matches_guide(gm_kind):
    torch.manual_seed(2)
    ref = LongformerAttention(32, 4, window_size=3, dropout=0.1)
    ours = FA.LongformerAttention(32, 4, window_size=3, dropout=0.1)
    _same_weights(ref, ours)
    x = torch.randn(2, 20, 32)
    gm = None
    if gm_kind == "binary":
        gm = torch.zeros(2, 20)
        gm[0, 0] = 1
        gm[1, [2, 7, 19]] = 1
    elif gm_kind == "fractional":
        gm = torch.rand(2, 20)
    torch.testing.assert_close(ours(x, gm), ref(x, gm), rtol=1e-5, atol=1e-5)


def test_longformer_hf_semantics_against_dense():
    torch.manual_seed(3)
    m = FA.LongformerAttention(16, 2, window_size=2, global_mode="hf").eval()
    B, L, w = 2, 12, 2
    x = torch.randn(B, L, 16, requires_grad=True)
    gm = torch.zeros(B, L)
    gm[0, 0] = 1
    gm[1, [1, 9]] = 1
    out = m(x, gm)
    # Dense reference: local rows see window ∪ globals; global rows see everything (global projections).
    H, d = 2, 8
    heads = lambda t: t.view(B, L, H, d).transpose(1, 2)  # noqa: E731
    q, k, v = heads(m.w_q(x)), heads(m.w_k(x)), heads(m.w_v(x))
    i = torch.arange(L)
    allowed = ((i[:, None] - i[None, :]).abs() <= w).view(1, 1, L, L) | (gm == 1).view(B, 1, 1, L)
    s = (q @ k.transpose(-1, -2)) / d**0.5
    loc = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ v
    qg, kg, vg = heads(m.w_q_global(x)), heads(m.w_k_global(x)), heads(m.w_v_global(x))
    glob = torch.softmax((qg @ kg.transpose(-1, -2)) / d**0.5, -1) @ vg
    o = torch.where((gm == 1).view(B, 1, L, 1), glob, loc)
    ref = m.w_o(o.transpose(1, 2).reshape(B, L, 16))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.autograd.grad(out.square().sum(), x)[0]
    g_r = torch.autograd.grad(ref.square().sum(), x)[0]
    torch.testing.assert_close(g, g_r, rtol=1e-4, atol=1e-5)


def test_longformer_global_tokens_constructor_arg():
    ref = LongformerAttention(16, 2, window_size=2)
    ours = FA.LongformerAttention(16, 2, window_size=2, global_tokens=[0, 5])
    _same_weights(ref, ours)
    x = torch.randn(1, 10, 16)
    gm = torch.zeros(1, 10)
    gm[0, [0, 5]] = 1
    torch.testing.assert_close(ours(x), ref(x, gm), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch_first", [True, False])
def test_torch_multihead_wrapper(batch_first):
    torch.manual_seed(4)
    ref = nn.MultiheadAttention(24, 3, batch_first=batch_first).eval()
    ours = FA.MultiheadAttention(24, 3, batch_first=batch_first).eval()
    _same_weights(ref, ours)
    q, kv = torch.randn(2, 5, 24), torch.randn(2, 8, 24)
    if not batch_first:
        q, kv = q.transpose(0, 1), kv.transpose(0, 1)
    kpm = torch.zeros(2, 8, dtype=torch.bool)
    kpm[1, -3:] = True
    am = torch.randn(5, 8)
    o_r, _ = ref(q, kv, kv, key_padding_mask=kpm, attn_mask=am > 1.0, need_weights=False)  # bool + bool
    o_f, w = ours(q, kv, kv, key_padding_mask=kpm, attn_mask=am > 1.0, need_weights=False)
    assert w is None
    torch.testing.assert_close(o_f, o_r, rtol=1e-5, atol=1e-5)
    kpm_f = torch.zeros(2, 8).masked_fill(kpm, float("-inf"))  # float + float
    o_r, _ = ref(q, kv, kv, key_padding_mask=kpm_f, attn_mask=am, need_weights=False)
    o_f, _ = ours(q, kv, kv, key_padding_mask=kpm_f, attn_mask=am, need_weights=False)
    torch.testing.assert_close(o_f, o_r, rtol=1e-5, atol=1e-5)
    causal = torch.ones(5, 5).triu(1).bool()  # self-attention with torch's is_causal hint
    o_r, _ = ref(q, q, q, need_weights=False, attn_mask=causal, is_causal=True)
    o_f, _ = ours(q, q, q, need_weights=False, attn_mask=causal, is_causal=True)
    torch.testing.assert_close(o_f, o_r, rtol=1e-5, atol=1e-5)
    o_r, w_r = ref(q, kv, kv)  # weights requested: torch's own path
    o_f, w_f = ours(q, kv, kv)
    torch.testing.assert_close(o_f, o_r)
    torch.testing.assert_close(w_f, w_r)
