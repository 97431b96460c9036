"""LSTM, GRU and RNN layers as explicit gates, so ONNX Runtime 1.19 can train them.

ORT 1.19 has no gradient for ONNX's ``LSTM``/``GRU``/``RNN`` operators. :class:`UnrolledRNN` computes
what ``nn.LSTM``/``nn.GRU``/``nn.RNN`` compute, step by step, with MatMul, Add, Sigmoid, Tanh, Mul and
Split (all with gradients), and holds the very same parameters under the same names
(``weight_ih_l0``, ``bias_hh_l1_reverse``...), so the manifest, checkpoints and exported weights
read like the original model's. The recurrence is unrolled over the example's sequence length:
the exported graph has a fixed length. Exactness against PyTorch's own layers (outputs and
gradients) is tested; the generated artifacts are verified like any other.
"""

from __future__ import annotations

import torch
from torch import nn

from ._modules import replace_modules
from .errors import InputSpecError, UnsupportedOperatorError

__all__ = ["UnrolledRNN", "unroll_recurrent", "RECURRENT"]

RECURRENT = (nn.LSTM, nn.GRU, nn.RNN)


class UnrolledRNN(nn.Module):
    """The recurrence of ``rnn`` (an ``nn.LSTM``, ``nn.GRU`` or ``nn.RNN``) over its own parameters."""

    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        if getattr(rnn, "proj_size", 0):
            raise UnsupportedOperatorError("LSTM with proj_size is not unrolled yet: use proj_size=0.")
        self.mode = type(rnn).__name__ if isinstance(rnn, (nn.LSTM, nn.GRU)) else "RNN"
        self.activation = torch.relu if getattr(rnn, "nonlinearity", "tanh") == "relu" else torch.tanh
        self.num_layers, self.hidden_size = rnn.num_layers, rnn.hidden_size
        self.directions = 2 if rnn.bidirectional else 1
        self.batch_first, self.bias = rnn.batch_first, rnn.bias
        # between layers in training, as PyTorch's layers do (a module: verification can switch it off)
        self.between = nn.Dropout(float(rnn.dropout)) if rnn.dropout and rnn.num_layers > 1 else None
        for name, parameter in rnn.named_parameters(recurse=False):
            self.register_parameter(name, parameter)  # the same tensors, the same names

    def forward(self, x: torch.Tensor, hx: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None):  # type: ignore[no-untyped-def]
        unbatched = x.dim() == 2
        if unbatched:
            x = x.unsqueeze(0 if self.batch_first else 1)
            hx = None if hx is None else tuple(h.unsqueeze(1) for h in hx) if isinstance(hx, tuple) else hx.unsqueeze(1)
        if not self.batch_first:
            x = x.transpose(0, 1)  # (batch, time, features) below
        states = self.num_layers * self.directions
        zeros = x.new_zeros(states, x.shape[0], self.hidden_size)
        if self.mode == "LSTM":
            h0, c0 = hx if hx is not None else (zeros, zeros)
        else:
            h0, c0 = (hx if hx is not None else zeros), None
        layer_input, last_h, last_c = x, [], []
        for layer in range(self.num_layers):
            outputs = []
            for direction in range(self.directions):
                index = layer * self.directions + direction
                out, h, c = self._direction(layer_input, layer, direction, h0[index], None if c0 is None else c0[index])
                outputs.append(out)
                last_h.append(h)
                last_c.append(c)
            layer_input = torch.cat(outputs, dim=-1) if self.directions == 2 else outputs[0]
            if self.between is not None and layer < self.num_layers - 1:
                layer_input = self.between(layer_input)
        output = layer_input if self.batch_first else layer_input.transpose(0, 1)
        h_n = torch.stack(last_h)
        if unbatched:
            output, h_n = output.squeeze(0 if self.batch_first else 1), h_n.squeeze(1)
        if self.mode == "LSTM":
            c_n = torch.stack(last_c)
            return output, (h_n, c_n.squeeze(1) if unbatched else c_n)
        return output, h_n

    def _direction(self, x: torch.Tensor, layer: int, direction: int, h: torch.Tensor, c: torch.Tensor | None):  # type: ignore[no-untyped-def]
        suffix = f"_l{layer}" + ("_reverse" if direction else "")
        w_ih, w_hh = getattr(self, f"weight_ih{suffix}"), getattr(self, f"weight_hh{suffix}")
        # every step's input projection at once, time first, with the bias as the Gemm's C
        rows = x.transpose(0, 1).reshape(-1, x.shape[-1])
        b_hh = getattr(self, f"bias_hh{suffix}") if self.bias else None
        if self.bias:
            b_ih = getattr(self, f"bias_ih{suffix}")
            inputs = torch.addmm(b_ih + b_hh if self.mode != "GRU" else b_ih, rows, w_ih.t())
        else:
            inputs = rows @ w_ih.t()
        inputs = inputs.view(x.shape[1], x.shape[0], -1)
        steps = range(x.shape[1] - 1, -1, -1) if direction else range(x.shape[1])
        outputs: list[torch.Tensor | None] = [None] * x.shape[1]
        # One Split per sequence and per step's gates (their gradient is one Concat): indexing or chunk
        # export as Slices, whose gradients write a zeroed tensor of the whole input each (measured: 0.76x
        # of PyTorch's step with Slices for the next-word LSTM).
        step_inputs = inputs.unbind(0)
        size = self.hidden_size
        for t in steps:
            if self.mode != "GRU":  # the step's input (and both biases) as the Gemm's C: no Add per step
                hidden = torch.addmm(step_inputs[t], h, w_hh.t())
            else:
                hidden = h @ w_hh.t() if b_hh is None else torch.addmm(b_hh, h, w_hh.t())
            if self.mode == "LSTM":
                i, f, g, o = hidden.split(size, dim=1)
                c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                h = torch.sigmoid(o) * torch.tanh(c)
            elif self.mode == "GRU":
                x_r, x_z, x_n = step_inputs[t].split(size, dim=1)
                h_r, h_z, h_n = hidden.split(size, dim=1)
                r, z = torch.sigmoid(x_r + h_r), torch.sigmoid(x_z + h_z)
                h = (1 - z) * torch.tanh(x_n + r * h_n) + z * h
            else:
                h = self.activation(hidden)
            outputs[t] = h
        return torch.stack(outputs, dim=1), h, c  # type: ignore[arg-type]


def unroll_recurrent(model: nn.Module, dynamic_axes: dict[str, dict[int, str]]) -> nn.Module:
    """A copy of ``model`` with every LSTM/GRU/RNN unrolled (``model`` itself when it has none).

    The unrolled graph has the example's sequence length: a dynamic axis besides the batch is refused.
    """
    found = [name for name, module in model.named_modules() if isinstance(module, RECURRENT)]
    if not found:
        return model
    named = {name: axes for name, axes in dynamic_axes.items() if any(axis != 0 for axis in axes)}
    if named:
        raise InputSpecError(
            f"{found[0]} ({type(model.get_submodule(found[0])).__name__}) is unrolled over a fixed sequence length, "
            f"but {sorted(named)} have dynamic axes besides the batch. Give the length as a fixed size "
            "(--input ids:32x20:int64, no AXIS=SIZE), and pad or cut sequences to it."
        )
    return replace_modules(model, lambda module: isinstance(module, RECURRENT), UnrolledRNN)
