"""Recurrent family of guide 000, drop-in: VanillaRNN, LSTMCell/LSTM, GRUCell/GRU, BidirectionalRNN (and the
guide-004 ``LSTMLayer``).

Two paths compute every recurrence:

- the reference: the guide's equations stepped one time step at a time in Python (``forward_reference`` /
  ``*_reference`` functions), kept as the oracle;
- the fast path: the same weights handed to PyTorch's fused whole-sequence RNN kernels (``torch.lstm``,
  ``torch.gru``, ``torch.rnn_tanh``: oneDNN on CPU, cuDNN on GPU), where the guide's equations are the kernel's.

The guide's ``LSTMCell`` orders its gates [forget, input, output, candidate]; PyTorch's kernels use
[input, forget, candidate, output]. The fast path permutes the weight rows on the fly (gradients flow back to
the guide's layout), so ``LSTMCell.forward`` runs ``torch.lstm_cell`` and ``LSTMCell.forward_sequence`` runs a
whole sequence in one fused call. The guide's ``GRUCell`` applies the reset gate *before* the recurrent
matmul (``W (r * h)``) whereas every fused GRU kernel applies it after (``r * (W h)``): the equations differ,
so ``GRUCell`` keeps the loop and only batches the input projection of a sequence into one GEMM.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ._models_common import check_input
from .linear import Linear

__all__ = [
    "VanillaRNN",
    "LSTMCell",
    "LSTM",
    "GRUCell",
    "GRU",
    "BidirectionalRNN",
    "LSTMLayer",
    "rnn_reference",
    "lstm_reference",
    "gru_reference",
]

# Guide order [f, i, o, g] -> torch order [i, f, g, o].
_LSTM_PERM = (1, 0, 3, 2)


def _to_torch_gates(w: torch.Tensor) -> torch.Tensor:
    chunks = w.chunk(4, 0)
    return torch.cat([chunks[i] for i in _LSTM_PERM], 0)


def _layer_params(rnn: nn.RNNBase, layer: int, suffix: str = "") -> tuple[torch.Tensor, ...]:
    names = [f"weight_ih_l{layer}{suffix}", f"weight_hh_l{layer}{suffix}"]
    if rnn.bias:
        names += [f"bias_ih_l{layer}{suffix}", f"bias_hh_l{layer}{suffix}"]
    return tuple(getattr(rnn, n) for n in names)


def _affine(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return x @ w.t() if b is None else torch.addmm(b, x, w.t())


def _run_reference(rnn: nn.RNNBase, x: torch.Tensor, hx, cell) -> tuple[torch.Tensor, object]:
    """Step ``cell(x_t, state, params) -> (out_t, state)`` over time, layers and directions of a torch RNN
    module's weights (batch_first x (B, T, I)); returns the output (B, T, D*H) and the stacked final states."""
    dirs = 2 if rnn.bidirectional else 1
    inp = x
    finals = []
    for layer in range(rnn.num_layers):
        outs = []
        for d in range(dirs):
            params = _layer_params(rnn, layer, "_reverse" if d else "")
            idx = layer * dirs + d
            state = tuple(h[idx] for h in hx) if isinstance(hx, tuple) else hx[idx]
            steps = range(inp.shape[1] - 1, -1, -1) if d else range(inp.shape[1])
            ys: list[torch.Tensor] = [None] * inp.shape[1]  # type: ignore[list-item]
            for t in steps:
                y, state = cell(inp[:, t], state, params)
                ys[t] = y
            outs.append(torch.stack(ys, 1))
            finals.append(state)
        inp = torch.cat(outs, -1) if dirs == 2 else outs[0]
    if isinstance(hx, tuple):
        final = tuple(torch.stack([f[i] for f in finals]) for i in range(len(hx)))
    else:
        final = torch.stack(finals)
    return inp, final


def _rnn_cell(x, h, p):
    b_ih, b_hh = (p[2], p[3]) if len(p) == 4 else (None, None)
    h = torch.tanh(_affine(x, p[0], b_ih) + _affine(h, p[1], b_hh))
    return h, h


def _lstm_cell_torch_order(x, state, p):
    h, c = state
    b_ih, b_hh = (p[2], p[3]) if len(p) == 4 else (None, None)
    g = _affine(x, p[0], b_ih) + _affine(h, p[1], b_hh)
    i, f, gg, o = g.chunk(4, 1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(gg)
    h = torch.sigmoid(o) * torch.tanh(c)
    return h, (h, c)


def _gru_cell_torch(x, h, p):
    b_ih, b_hh = (p[2], p[3]) if len(p) == 4 else (None, None)
    gi = _affine(x, p[0], b_ih).chunk(3, 1)
    gh = _affine(h, p[1], b_hh).chunk(3, 1)
    r = torch.sigmoid(gi[0] + gh[0])
    z = torch.sigmoid(gi[1] + gh[1])
    n = torch.tanh(gi[2] + r * gh[2])
    h = (1 - z) * n + z * h
    return h, h


def rnn_reference(rnn: nn.RNN, x: torch.Tensor, h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-step Elman RNN on ``rnn``'s weights: h_t = tanh(W_ih x_t + b_ih + W_hh h_{t-1} + b_hh)."""
    return _run_reference(rnn, x, h0, _rnn_cell)  # type: ignore[return-value]


def lstm_reference(lstm: nn.LSTM, x: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor]):
    """Per-step LSTM on ``lstm``'s weights (PyTorch gate order). Returns (out, (h_n, c_n))."""
    return _run_reference(lstm, x, hidden, _lstm_cell_torch_order)


def gru_reference(gru: nn.GRU, x: torch.Tensor, h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-step GRU on ``gru``'s weights (PyTorch's equations, which the guide's GRU class uses)."""
    return _run_reference(gru, x, h0, _gru_cell_torch)  # type: ignore[return-value]


def _check_seq(x: object, size: int, owner: str) -> torch.Tensor:
    check_input("x", x, ndim=3, last=size, owner=owner)
    return x  # type: ignore[return-value]


class _RecurrentWithHead(nn.Module):
    """A ``batch_first`` torch RNN (attribute ``rnn_attr``) + per-step linear head ``fc``; ``forward`` runs the
    fused kernel, ``forward_reference`` steps the guide's equations on the same weights."""

    rnn_attr = "rnn"
    rnn_type: type[nn.RNNBase] = nn.RNN
    reference = staticmethod(rnn_reference)

    def __init__(self, input_size: int, hidden_size: int, output_size: int, num_layers: int = 1):
        super().__init__()
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        setattr(self, self.rnn_attr, self.rnn_type(input_size, hidden_size, num_layers, batch_first=True))
        self.fc = Linear(hidden_size, output_size)

    def _zeros(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(self.num_layers, x.shape[0], self.hidden_size)

    def _state(self, x: torch.Tensor, state):
        _check_seq(x, self.input_size, type(self).__name__)
        if state is None:
            return self._zeros(x)
        check_input("h0", state, ndim=3, owner=type(self).__name__)
        return state

    def forward(self, x: torch.Tensor, h0=None):
        out, h_n = getattr(self, self.rnn_attr)(x, self._state(x, h0))
        return self.fc(out), h_n

    def forward_reference(self, x: torch.Tensor, h0=None):
        out, h_n = type(self).reference(getattr(self, self.rnn_attr), x, self._state(x, h0))
        return self.fc(out), h_n


class VanillaRNN(_RecurrentWithHead):
    """Elman RNN + per-step linear head (guide 000). x (B, T, input_size), h0 (num_layers, B, H) ->
    (out (B, T, output_size), h_n (num_layers, B, H)). ``forward_reference`` steps the same weights."""

    def init_hidden(self, batch_size: int, device: str | torch.device = "cpu") -> torch.Tensor:
        return torch.zeros(self.num_layers, batch_size, self.hidden_size, device=device)


class _GatedCell(nn.Module):
    """Parameters of a gated cell: ``weight_ih``/``weight_hh``/``bias_ih``/``bias_hh`` stacked over ``gates``
    (plus any group :meth:`_add_gates` registers), initialised uniform in +-1/sqrt(hidden_size)."""

    def __init__(self, input_size: int, hidden_size: int, gates: int):
        super().__init__()
        self.input_size = input_size
        self.hidden_size = hidden_size
        self._add_gates(gates)

    def _add_gates(self, gates: int, suffix: str = "") -> None:
        rows, i, h = gates * self.hidden_size, self.input_size, self.hidden_size
        for name, shape in (("weight_ih", (rows, i)), ("weight_hh", (rows, h)), ("bias_ih", (rows,)),
                            ("bias_hh", (rows,))):
            self.register_parameter(name + suffix, nn.Parameter(torch.randn(*shape)))

    def init_weights(self) -> None:
        std = 1.0 / self.hidden_size**0.5
        for w in self.parameters():
            w.data.uniform_(-std, std)


class LSTMCell(_GatedCell):
    """One LSTM step with the guide's parameters (gates stacked [f, i, o, g]).

    forward(x (B, I), (h, c) each (B, H)) -> (h_new, c_new); fused ``torch.lstm_cell`` on permuted weights.
    ``forward_reference`` is the guide's arithmetic; ``forward_sequence`` runs (B, T, I) in one fused call.
    """

    def __init__(self, input_size: int, hidden_size: int):
        super().__init__(input_size, hidden_size, 4)
        self.init_weights()

    def _check(self, x: torch.Tensor, hidden) -> tuple[torch.Tensor, torch.Tensor]:
        check_input("x", x, ndim=2, last=self.input_size, owner="LSTMCell")
        if not isinstance(hidden, (tuple, list)) or len(hidden) != 2:
            raise TypeError("LSTMCell: argument 'hidden' must be a tuple (h, c) of (B, hidden_size) tensors")
        h, c = hidden
        for name, t in (("h", h), ("c", c)):
            check_input(f"hidden[{name}]", t, ndim=2, last=self.hidden_size, owner="LSTMCell")
        return h, c

    def torch_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The parameters reordered to PyTorch's [i, f, g, o] gate layout (differentiable)."""
        return (_to_torch_gates(self.weight_ih), _to_torch_gates(self.weight_hh), _to_torch_gates(self.bias_ih),
                _to_torch_gates(self.bias_hh))

    def forward(self, x: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor]):
        h, c = self._check(x, hidden)
        return torch.lstm_cell(x, (h, c), *self.torch_weights())

    def forward_reference(self, x: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor]):
        h, c = self._check(x, hidden)
        gates = torch.mm(x, self.weight_ih.t()) + self.bias_ih + torch.mm(h, self.weight_hh.t()) + self.bias_hh
        f, i, o, g = gates.chunk(4, 1)
        c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c_new), c_new

    def forward_sequence(self, x: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Run the cell over x (B, T, I) in one fused kernel -> (outputs (B, T, H), (h_T, c_T))."""
        _check_seq(x, self.input_size, "LSTMCell")
        if hidden is None:
            z = x.new_zeros(x.shape[0], self.hidden_size)
            hidden = (z, z)
        h, c = self._check(x[:, 0] if x.shape[1] else x.new_zeros(x.shape[0], self.input_size), hidden)
        out, h_n, c_n = torch.lstm(x, (h[None], c[None]), list(self.torch_weights()), True, 1, 0.0,
                                   self.training, False, True)
        return out, (h_n[0], c_n[0])

    def forward_sequence_reference(self, x: torch.Tensor, hidden=None):
        """The guide's per-step loop over x (B, T, I)."""
        if hidden is None:
            z = x.new_zeros(x.shape[0], self.hidden_size)
            hidden = (z, z)
        outs = []
        for t in range(x.shape[1]):
            hidden = self.forward_reference(x[:, t], hidden)
            outs.append(hidden[0])
        return torch.stack(outs, 1), hidden


class LSTM(_RecurrentWithHead):
    """Multi-layer LSTM + per-step linear head (guide 000). x (B, T, I), hidden (h0, c0) each
    (num_layers, B, H) -> (out (B, T, output_size), (h_n, c_n))."""

    rnn_attr = "lstm"
    rnn_type = nn.LSTM
    reference = staticmethod(lstm_reference)

    def _state(self, x, hidden):
        _check_seq(x, self.input_size, "LSTM")
        if hidden is None:
            z = self._zeros(x)
            return (z, z)
        if not isinstance(hidden, (tuple, list)) or len(hidden) != 2:
            raise TypeError("LSTM: argument 'hidden' must be a tuple (h0, c0) of (num_layers, B, H) tensors")
        return tuple(hidden)

    def forward(self, x: torch.Tensor, hidden=None):  # type: ignore[override]
        return super().forward(x, hidden)

    def forward_reference(self, x: torch.Tensor, hidden=None):  # type: ignore[override]
        return super().forward_reference(x, hidden)


class GRUCell(_GatedCell):
    """One GRU step with the guide's equations: r, z = sigmoid(...); h~ = tanh(W_c x + b + U_c (r * h) + b');
    h' = (1 - z) h + z h~. forward(x (B, I), h (B, H)) -> h' (B, H).

    No fused kernel computes ``U_c (r * h)`` (they compute ``r * (U_c h)``), so the step stays in Python;
    ``forward_sequence`` batches the input projections of all time steps into one GEMM.
    """

    def __init__(self, input_size: int, hidden_size: int):
        super().__init__(input_size, hidden_size, 2)
        self._add_gates(1, "_candidate")
        self.init_weights()

    def _step(self, xi: torch.Tensor, xc: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        # xi: input part of the gates (B, 2H) with both biases; xc: input part of the candidate with both biases
        r, z = torch.sigmoid(xi + h @ self.weight_hh.t()).chunk(2, 1)
        h_tilde = torch.tanh(xc + (r * h) @ self.weight_hh_candidate.t())
        return torch.lerp(h, h_tilde, z)

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        check_input("x", x, ndim=2, last=self.input_size, owner="GRUCell")
        check_input("h", h, ndim=2, last=self.hidden_size, owner="GRUCell")
        xi = torch.addmm(self.bias_ih + self.bias_hh, x, self.weight_ih.t())
        xc = torch.addmm(self.bias_ih_candidate + self.bias_hh_candidate, x, self.weight_ih_candidate.t())
        return self._step(xi, xc, h)

    def forward_reference(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        gates = torch.mm(x, self.weight_ih.t()) + self.bias_ih + torch.mm(h, self.weight_hh.t()) + self.bias_hh
        r, z = torch.sigmoid(gates).chunk(2, 1)
        cand = (torch.mm(x, self.weight_ih_candidate.t()) + self.bias_ih_candidate
                + torch.mm(r * h, self.weight_hh_candidate.t()) + self.bias_hh_candidate)
        return (1 - z) * h + z * torch.tanh(cand)

    def forward_sequence(self, x: torch.Tensor, h: torch.Tensor | None = None):
        """x (B, T, I) -> (outputs (B, T, H), h_T); input projections for all steps in one GEMM."""
        _check_seq(x, self.input_size, "GRUCell")
        if h is None:
            h = x.new_zeros(x.shape[0], self.hidden_size)
        w = torch.cat([self.weight_ih, self.weight_ih_candidate], 0)
        b = torch.cat([self.bias_ih + self.bias_hh, self.bias_ih_candidate + self.bias_hh_candidate], 0)
        proj = torch.nn.functional.linear(x, w, b)
        xi, xc = proj[..., : 2 * self.hidden_size], proj[..., 2 * self.hidden_size:]
        outs = []
        for t in range(x.shape[1]):
            h = self._step(xi[:, t], xc[:, t], h)
            outs.append(h)
        return torch.stack(outs, 1), h


class GRU(_RecurrentWithHead):
    """Multi-layer GRU + per-step linear head (guide 000). x (B, T, I), h0 (num_layers, B, H) ->
    (out (B, T, output_size), h_n)."""

    rnn_attr = "gru"
    rnn_type = nn.GRU
    reference = staticmethod(gru_reference)

    def _state(self, x, h0):
        _check_seq(x, self.input_size, "GRU")
        return self._zeros(x) if h0 is None else h0


class BidirectionalRNN(nn.Module):
    """Bidirectional 'rnn' | 'lstm' | 'gru' + linear head on [forward; backward] (guide 000).
    x (B, T, I) -> (B, T, output_size)."""

    def __init__(self, rnn_type: str, input_size: int, hidden_size: int, output_size: int, num_layers: int = 1):
        super().__init__()
        kinds = {"rnn": nn.RNN, "lstm": nn.LSTM, "gru": nn.GRU}
        if rnn_type not in kinds:
            raise ValueError(f"BidirectionalRNN: argument 'rnn_type' must be one of {sorted(kinds)}, got {rnn_type!r}")
        self.rnn_type = rnn_type
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.rnn = kinds[rnn_type](input_size, hidden_size, num_layers, batch_first=True, bidirectional=True)
        self.fc = Linear(2 * hidden_size, output_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_seq(x, self.input_size, "BidirectionalRNN")
        out, _ = self.rnn(x)
        return self.fc(out)

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        _check_seq(x, self.input_size, "BidirectionalRNN")
        z = x.new_zeros(2 * self.num_layers, x.shape[0], self.hidden_size)
        if self.rnn_type == "lstm":
            out, _ = lstm_reference(self.rnn, x, (z, z))  # type: ignore[arg-type]
        elif self.rnn_type == "gru":
            out, _ = gru_reference(self.rnn, x, z)  # type: ignore[arg-type]
        else:
            out, _ = rnn_reference(self.rnn, x, z)  # type: ignore[arg-type]
        return self.fc(out)


class LSTMLayer(nn.Module):
    """Guide 004's single-layer LSTM wrapper (sequence-first, as ``nn.LSTM``'s default).
    x (T, B, I) -> (output (T, B, H), (h, c))."""

    def __init__(self, input_size: int, hidden_size: int):
        super().__init__()
        self.lstm = nn.LSTM(input_size, hidden_size)

    def forward(self, x: torch.Tensor, hidden=None):
        output, (hidden, cell) = self.lstm(x, hidden)
        return output, (hidden, cell)
