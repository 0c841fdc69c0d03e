"""fastarch.optim: guide update rules, trajectories against torch.optim, foreach == loop, state round trip."""

import copy

import pytest
import torch

from fastarch import optim as O


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def _trajectory(make, steps=8, sched=None):
    m = _model()
    opt = make(m.parameters())
    s = sched(opt) if sched else None
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 5, generator=g), torch.randn(32, 2, generator=g)
    for _ in range(steps):
        opt.zero_grad()
        ((m(x) - y) ** 2).mean().backward()
        opt.step()
        if s:
            s.step()
    return torch.cat([p.detach().flatten() for p in m.parameters()])


PAIRS = {
    "SGD": (lambda p, fe: O.SGD(p, lr=0.1, foreach=fe), lambda p: torch.optim.SGD(p, lr=0.1)),
    "Momentum": (lambda p, fe: O.Momentum(p, lr=0.05, momentum=0.9, foreach=fe),
                 lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
    "Nesterov": (lambda p, fe: O.NesterovMomentum(p, lr=0.05, foreach=fe),
                 lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True)),
    "Adagrad": (lambda p, fe: O.Adagrad(p, lr=0.1, foreach=fe), lambda p: torch.optim.Adagrad(p, lr=0.1, eps=1e-8)),
    "RMSprop": (lambda p, fe: O.RMSprop(p, lr=0.01, foreach=fe), lambda p: torch.optim.RMSprop(p, lr=0.01, eps=1e-8)),
    "Adam": (lambda p, fe: O.Adam(p, lr=0.01, foreach=fe), lambda p: torch.optim.Adam(p, lr=0.01)),
    "AdamW": (lambda p, fe: O.AdamW(p, lr=0.01, weight_decay=0.1, foreach=fe),
              lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1)),
}


@pytest.mark.parametrize("name", list(PAIRS))
@pytest.mark.parametrize("foreach", [False, True])
def test_trajectory_matches_torch(name, foreach):
    ours, theirs = PAIRS[name]
    torch.testing.assert_close(_trajectory(lambda p: ours(p, foreach)), _trajectory(theirs), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", list(PAIRS))
def test_works_with_torch_lr_schedulers(name):
    ours, theirs = PAIRS[name]
    sched = lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)  # noqa: E731
    torch.testing.assert_close(_trajectory(lambda p: ours(p, None), sched=sched), _trajectory(theirs, sched=sched),
                               atol=1e-6, rtol=1e-5)


class GuideAdadelta:
    """Guide 003's Adadelta (eps added to the square roots)."""

    def __init__(self, params, rho=0.9, eps=1e-6):
        self.params, self.rho, self.eps, self.state = list(params), rho, eps, {}

    def zero_grad(self):
        for p in self.params:
            if p.grad is not None:
                p.grad.zero_()

    def step(self):
        for i, p in enumerate(self.params):
            if i not in self.state:
                self.state[i] = {"sq_avg": torch.zeros_like(p.data), "acc_delta": torch.zeros_like(p.data)}
            sq, acc = self.state[i]["sq_avg"], self.state[i]["acc_delta"]
            sq.mul_(self.rho).addcmul_(p.grad.data, p.grad.data, value=1 - self.rho)
            std = sq.sqrt().add_(self.eps)
            delta = acc.sqrt().add_(self.eps).div_(std).mul_(p.grad.data)
            p.data -= delta
            acc.mul_(self.rho).addcmul_(delta, delta, value=1 - self.rho)


@pytest.mark.parametrize("foreach", [False, True])
def test_adadelta_follows_the_guide(foreach):
    ours = _trajectory(lambda p: O.Adadelta(p, foreach=foreach))
    torch.testing.assert_close(ours, _trajectory(GuideAdadelta), atol=1e-7, rtol=1e-6)


def test_state_dict_round_trip_resumes_identically():
    m1, m2 = _model(), _model()
    o1 = O.Adam(m1.parameters(), lr=0.01)
    x = torch.randn(8, 5)
    for _ in range(3):
        o1.zero_grad()
        m1(x).pow(2).sum().backward()
        o1.step()
    m2.load_state_dict(m1.state_dict())
    o2 = O.Adam(m2.parameters(), lr=0.01)
    o2.load_state_dict(copy.deepcopy(o1.state_dict()))  # state_dict() holds references, as in torch.optim
    assert set(o1.state[next(iter(m1.parameters()))]) == {"step", "m", "v"}  # the guide's state names
    for m, o in ((m1, o1), (m2, o2)):
        o.zero_grad()
        m(x).pow(2).sum().backward()
        o.step()
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_param_groups_and_validation():
    m = _model()
    opt = O.Momentum([{"params": m[0].parameters(), "lr": 0.0}, {"params": m[2].parameters()}], lr=0.1)
    before = m[0].weight.detach().clone()
    m(torch.randn(4, 5)).sum().backward()
    opt.step()
    assert torch.equal(m[0].weight, before)  # lr 0 group untouched
    with pytest.raises(ValueError, match="lr"):
        O.SGD(m.parameters(), lr=-1.0)
    with pytest.raises(ValueError, match="beta1"):
        O.Adam(m.parameters(), beta1=1.0)
