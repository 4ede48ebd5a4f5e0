"""A sine-wave sequence model trained with L-BFGS through a closure.

Two ``nn.LSTMCell`` unrolled in a Python loop over the sequence (and over a few predicted
future points), ``nn.MSELoss``, ``torch.optim.LBFGS`` whose ``step(closure)`` runs forward and
backward many times per step, and a test prediction under ``torch.no_grad()`` after each step.

FIELD_FAULT=nan: the log of a negative number in the forward pass of step 3.
"""

import os

import numpy as np
import torch
import torch.nn as nn

FAULT = os.environ.get("FIELD_FAULT", "")


class Sequence(nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.hidden = hidden
        self.lstm1 = nn.LSTMCell(1, hidden)
        self.lstm2 = nn.LSTMCell(hidden, hidden)
        self.linear = nn.Linear(hidden, 1)
        self.poisoned = False

    def forward(self, input, future=0):
        outputs = []
        h_t = c_t = torch.zeros(input.size(0), self.hidden, dtype=input.dtype)
        h_t2 = c_t2 = torch.zeros(input.size(0), self.hidden, dtype=input.dtype)
        output = None
        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs.append(output)
        for _ in range(future):  # feed the prediction back in
            h_t, c_t = self.lstm1(output, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs.append(output)
        out = torch.cat(outputs, dim=1)
        if self.poisoned:
            out = torch.log(out - 5.0)  # <- fault
        return out


def make_waves(n, length, period, seed):
    rng = np.random.RandomState(seed)
    x = np.arange(length) + rng.randint(-4 * period, 4 * period, n).reshape(n, 1)
    return np.sin(x / period).astype("float64")


def main():
    np.random.seed(0)
    torch.manual_seed(0)
    data = torch.from_numpy(make_waves(12, 40, 4.0, seed=2))
    input, target = data[3:, :-1], data[3:, 1:]
    test_input, test_target = data[:3, :-1], data[:3, 1:]
    seq = Sequence().double()
    criterion = nn.MSELoss()
    optimizer = torch.optim.LBFGS(seq.parameters(), lr=0.8, max_iter=5)
    for i in range(6):
        seq.poisoned = FAULT == "nan" and i == 3

        def closure():
            optimizer.zero_grad()
            out = seq(input)
            loss = criterion(out, target)
            loss.backward()
            return loss

        loss = optimizer.step(closure)
        with torch.no_grad():
            pred = seq(test_input, future=10)
            test_loss = criterion(pred[:, :-10], test_target)
        print(f"step {i}: train loss {loss.item():.5f}, test loss {test_loss.item():.5f}")


if __name__ == "__main__":
    main()
