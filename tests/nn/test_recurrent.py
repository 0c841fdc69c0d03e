"""Recurrent family: drop-in vs the guide's classes, fused fast paths == per-step references."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fastarch.nn as fnn
from fastarch.testing.dropin import assert_dropin, assert_trains
from fastarch.testing.guides import LSTMCell as RefLSTMCell


# ---- guide 000 reference code ----------------------------------------------------------------------------
class RefGRUCell(nn.Module):
    def __init__(self, input_size, hidden_size):
        super().__init__()
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.weight_ih = nn.Parameter(torch.randn(2 * hidden_size, input_size))
        self.weight_hh = nn.Parameter(torch.randn(2 * hidden_size, hidden_size))
        self.bias_ih = nn.Parameter(torch.randn(2 * hidden_size))
        self.bias_hh = nn.Parameter(torch.randn(2 * hidden_size))
        self.weight_ih_candidate = nn.Parameter(torch.randn(hidden_size, input_size))
        self.weight_hh_candidate = nn.Parameter(torch.randn(hidden_size, hidden_size))
        self.bias_ih_candidate = nn.Parameter(torch.randn(hidden_size))
        self.bias_hh_candidate = nn.Parameter(torch.randn(hidden_size))
        std = 1.0 / (self.hidden_size) ** 0.5
        for weight in self.parameters():
            weight.data.uniform_(-std, std)

    def forward(self, x, h):
        gates = (torch.mm(x, self.weight_ih.t()) + self.bias_ih + torch.mm(h, self.weight_hh.t()) + self.bias_hh)
        reset_gate, update_gate = gates.chunk(2, 1)
        r_t = torch.sigmoid(reset_gate)
        z_t = torch.sigmoid(update_gate)
        h_candidate = (torch.mm(x, self.weight_ih_candidate.t()) + self.bias_ih_candidate
                       + torch.mm(r_t * h, self.weight_hh_candidate.t()) + self.bias_hh_candidate)
        h_tilde = torch.tanh(h_candidate)
        return (1 - z_t) * h + z_t * h_tilde


class RefVanillaRNN(nn.Module):
    def __init__(self, input_size, hidden_size, output_size, num_layers=1):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.rnn = nn.RNN(input_size, hidden_size, num_layers, batch_first=True)
        self.fc = nn.Linear(hidden_size, output_size)

    def forward(self, x, h0=None):
        if h0 is None:
            h0 = torch.zeros(self.num_layers, x.size(0), self.hidden_size).to(x.device)
        out, h_n = self.rnn(x, h0)
        return self.fc(out), h_n


class RefLSTM(nn.Module):
    def __init__(self, input_size, hidden_size, output_size, num_layers=1):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.lstm = nn.LSTM(input_size, hidden_size, num_layers, batch_first=True)
        self.fc = nn.Linear(hidden_size, output_size)

    def forward(self, x, hidden=None):
        if hidden is None:
            h0 = torch.zeros(self.num_layers, x.size(0), self.hidden_size).to(x.device)
            c0 = torch.zeros(self.num_layers, x.size(0), self.hidden_size).to(x.device)
            hidden = (h0, c0)
        out, (h_n, c_n) = self.lstm(x, hidden)
        return self.fc(out), (h_n, c_n)


class RefGRU(nn.Module):
    def __init__(self, input_size, hidden_size, output_size, num_layers=1):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.gru = nn.GRU(input_size, hidden_size, num_layers, batch_first=True)
        self.fc = nn.Linear(hidden_size, output_size)

    def forward(self, x, h0=None):
        if h0 is None:
            h0 = torch.zeros(self.num_layers, x.size(0), self.hidden_size).to(x.device)
        out, h_n = self.gru(x, h0)
        return self.fc(out), h_n


class RefBidirectionalRNN(nn.Module):
    def __init__(self, rnn_type, input_size, hidden_size, output_size, num_layers=1):
        super().__init__()
        self.hidden_size = hidden_size
        if rnn_type == 'rnn':
            self.rnn = nn.RNN(input_size, hidden_size, num_layers, batch_first=True, bidirectional=True)
        elif rnn_type == 'lstm':
            self.rnn = nn.LSTM(input_size, hidden_size, num_layers, batch_first=True, bidirectional=True)
        elif rnn_type == 'gru':
            self.rnn = nn.GRU(input_size, hidden_size, num_layers, batch_first=True, bidirectional=True)
        self.fc = nn.Linear(2 * hidden_size, output_size)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.fc(out)


X = torch.randn(3, 7, 5)


@pytest.mark.parametrize("ours,ref", [
    (lambda: fnn.VanillaRNN(5, 6, 4, 2), lambda: RefVanillaRNN(5, 6, 4, 2)),
    (lambda: fnn.LSTM(5, 6, 4, 2), lambda: RefLSTM(5, 6, 4, 2)),
    (lambda: fnn.GRU(5, 6, 4, 2), lambda: RefGRU(5, 6, 4, 2)),
    (lambda: fnn.BidirectionalRNN("lstm", 5, 6, 4, 2), lambda: RefBidirectionalRNN("lstm", 5, 6, 4, 2)),
    (lambda: fnn.BidirectionalRNN("gru", 5, 6, 4), lambda: RefBidirectionalRNN("gru", 5, 6, 4)),
    (lambda: fnn.BidirectionalRNN("rnn", 5, 6, 4), lambda: RefBidirectionalRNN("rnn", 5, 6, 4)),
])
def test_dropin_matches_guide(ours, ref):
    assert_dropin(ours(), ref(), X)


@pytest.mark.parametrize("build", [
    lambda: fnn.VanillaRNN(5, 6, 4, 2), lambda: fnn.LSTM(5, 6, 4, 2), lambda: fnn.GRU(5, 6, 4, 3),
    lambda: fnn.BidirectionalRNN("lstm", 5, 6, 4, 2), lambda: fnn.BidirectionalRNN("gru", 5, 6, 4, 2),
    lambda: fnn.BidirectionalRNN("rnn", 5, 6, 4, 1),
])
def test_fused_equals_per_step_loop(build):
    m = build()
    x = X.clone().requires_grad_(True)
    fast = m(x)
    ref = m.forward_reference(x)
    fast_o = fast[0] if isinstance(fast, tuple) else fast
    ref_o = ref[0] if isinstance(ref, tuple) else ref
    torch.testing.assert_close(fast_o, ref_o, atol=1e-5, rtol=1e-4)
    if isinstance(fast, tuple):  # final states too
        fs, rs = fast[1], ref[1]
        for a, b in zip(fs if isinstance(fs, tuple) else (fs,), rs if isinstance(rs, tuple) else (rs,)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    g1 = torch.autograd.grad(fast_o.square().sum(), [x] + list(m.parameters()))
    g2 = torch.autograd.grad(ref_o.square().sum(), [x] + list(m.parameters()))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


def test_lstm_cell_fused_matches_guide_and_grads():
    ours, ref = fnn.LSTMCell(5, 6), RefLSTMCell(5, 6)
    ours.load_state_dict(ref.state_dict(), strict=True)
    x, h, c = torch.randn(4, 5), torch.randn(4, 6), torch.randn(4, 6)
    a, b = ours(x, (h, c)), ref(x, (h, c))
    torch.testing.assert_close(a[0], b[0])
    torch.testing.assert_close(a[1], b[1])
    ga = torch.autograd.grad((a[0] * a[1]).sum(), list(ours.parameters()))
    gb = torch.autograd.grad((b[0] * b[1]).sum(), list(ref.parameters()))
    for p, q in zip(ga, gb):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4)


def test_lstm_cell_sequence_fused_equals_guide_loop():
    ours, ref = fnn.LSTMCell(5, 6), RefLSTMCell(5, 6)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(3, 11, 5)
    out, (h, c) = ours.forward_sequence(x)
    hid = (torch.zeros(3, 6), torch.zeros(3, 6))
    outs = []
    for t in range(11):
        hid = ref(x[:, t], hid)
        outs.append(hid[0])
    torch.testing.assert_close(out, torch.stack(outs, 1), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(c, hid[1], atol=1e-5, rtol=1e-4)
    ga = torch.autograd.grad(out.sum(), list(ours.parameters()))
    gb = torch.autograd.grad(torch.stack(outs, 1).sum(), list(ref.parameters()))
    for p, q in zip(ga, gb):
        torch.testing.assert_close(p, q, atol=1e-4, rtol=1e-3)
    out_r, _ = ours.forward_sequence_reference(x)
    torch.testing.assert_close(out, out_r, atol=1e-5, rtol=1e-4)


def test_gru_cell_matches_guide_and_sequence():
    ours, ref = fnn.GRUCell(5, 6), RefGRUCell(5, 6)
    ours.load_state_dict(ref.state_dict(), strict=True)
    x, h = torch.randn(4, 5), torch.randn(4, 6)
    torch.testing.assert_close(ours(x, h), ref(x, h))
    torch.testing.assert_close(ours.forward_reference(x, h), ref(x, h))
    seq = torch.randn(2, 9, 5)
    out, hT = ours.forward_sequence(seq)
    hh = torch.zeros(2, 6)
    for t in range(9):
        hh = ref(seq[:, t], hh)
    torch.testing.assert_close(hT, hh, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out[:, -1], hh, atol=1e-5, rtol=1e-4)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="rnn_type"):
        fnn.BidirectionalRNN("transformer", 5, 6, 4)
    with pytest.raises(ValueError, match="'x'"):
        fnn.LSTM(5, 6, 4)(torch.randn(2, 3, 4))
    with pytest.raises(TypeError, match="hidden"):
        fnn.LSTMCell(5, 6)(torch.randn(2, 5), torch.zeros(2, 6))


@pytest.mark.parametrize("build", [lambda: fnn.LSTM(3, 16, 1), lambda: fnn.GRU(3, 16, 1), lambda: fnn.VanillaRNN(3, 16, 1)])
def test_training_lowers_loss(build):
    # Toy task: predict the running sum of the first input channel.
    x = torch.randn(8, 10, 3)
    y = x[..., :1].cumsum(1) / 3
    assert_trains(build(), lambda m: F.mse_loss(m(x)[0], y), steps=10)


def test_lstm_layer_guide004():
    m = fnn.LSTMLayer(4, 5)
    out, (h, c) = m(torch.randn(7, 2, 4))
    assert out.shape == (7, 2, 5) and h.shape == (1, 2, 5)
