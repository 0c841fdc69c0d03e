"""Trainer: exact resume, accumulation, atomic checkpoints that survive a kill, guide trainer APIs."""

import copy
import os
import pickle
import random
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils.data import TensorDataset

from fastarch import optim as O
from fastarch import train as T


def _setup(tmp, seed=0, ckpt_every=None, accumulation=1):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.2), torch.nn.ReLU(),
                                torch.nn.Linear(16, 3))
    opt = O.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    return T.Trainer(model, opt, scheduler=sched, checkpoint_dir=tmp, checkpoint_every=ckpt_every, log_dir=tmp,
                     accumulation_steps=accumulation, progress=False)


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 6, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


def test_interrupted_run_resumes_to_identical_weights(tmp_path):
    full = _setup(tmp_path / "a")
    full.fit(_data(), batch_size=8, epochs=2)
    part = _setup(tmp_path / "b", ckpt_every=5)
    part.fit(_data(), batch_size=8, epochs=2, max_steps=17)  # interrupted mid-epoch 2 (12 steps per epoch)
    torch.manual_seed(123)  # a fresh process would start from another RNG state
    resumed = _setup(tmp_path / "b", seed=99)
    resumed.fit(_data(), batch_size=8, epochs=2, resume=True)
    assert resumed.step == full.step == 24
    for a, b in zip(full.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    rows = (tmp_path / "b" / "metrics.csv").read_text().splitlines()
    assert len(rows) == 1 + 24 and rows[0].startswith("step,epoch,loss,lr")


def test_accumulation_equals_large_batch(tmp_path):
    big = _setup(tmp_path / "a")
    big.model.eval()  # dropout off for the comparison
    big.model[1].p = 0.0
    small = _setup(tmp_path / "b", accumulation=4)
    small.model[1].p = 0.0
    big.fit(_data(), batch_size=32, epochs=1)
    small.fit(_data(), batch_size=8, epochs=1)
    assert big.step == small.step == 3
    for a, b in zip(big.model.parameters(), small.model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_loss_decreases_and_checkpoints_load_safely(tmp_path):
    tr = _setup(tmp_path, ckpt_every=6)
    losses = tr.fit(_data(), batch_size=8, epochs=3)
    assert sum(losses[-6:]) < sum(losses[:6])
    ck = T.latest_checkpoint(tmp_path)
    assert ck is not None and ck.name == f"ckpt-{tr.step}.pt"
    state = T.load_checkpoint(ck)  # weights_only=True
    assert state["position"]["step"] == tr.step


def test_kill_during_checkpoint_write_keeps_previous(tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, torch
        from fastarch.train import save_checkpoint
        save_checkpoint({{"w": torch.ones(3), "step": 1}}, {str(tmp_path / "ckpt-1.pt")!r})
        real_save = torch.save
        def dying_save(obj, f, *a, **k):
            f.write(b"partial bytes of a checkpoint")
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        torch.save = dying_save
        save_checkpoint({{"w": torch.zeros(3), "step": 2}}, {str(tmp_path / "ckpt-1.pt")!r})
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()
    state = T.load_checkpoint(tmp_path / "ckpt-1.pt")
    assert state["step"] == 1 and torch.equal(state["w"], torch.ones(3))
    assert T.latest_checkpoint(tmp_path).name == "ckpt-1.pt"  # the leftover temp file is ignored


def test_guide_trainer_apis(tmp_path):
    torch.manual_seed(0)
    vocab = 11

    class TinyLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(vocab, 16)
            self.out = torch.nn.Linear(16, vocab)

        def forward(self, src, src_mask=None):
            return self.out(self.emb(src))

    model = TinyLM()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    tt = T.TransformerTrainer(model, opt, torch.optim.lr_scheduler.StepLR(opt, 100))
    src = torch.randint(1, vocab, (4, 7))
    tgt = (src + 1) % vocab
    src_mask, tgt_mask = tt.create_mask(src, tgt)
    assert src_mask.shape == (4, 1, 1, 7) and tgt_mask.shape == (4, 1, 7, 7)
    first = tt.train_step(src, tgt)
    for _ in range(30):
        last = tt.train_step(src, tgt)
    assert last < first
    assert tt.train_epoch([(src, tgt)] * 2) < first

    clf = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 3))
    x = torch.randn(30, 3, 2, 2)
    y = x.flatten(1)[:, :3].argmax(1)
    loader = [(x[i:i + 10], y[i:i + 10]) for i in range(0, 30, 10)]
    at = T.ArchitectureTrainer(clf, device="cpu", checkpoint_dir=tmp_path, epochs_hint=10)
    loss0, _ = at.evaluate(loader)
    best = at.train(loader, loader, epochs=10, verbose=False)
    loss1, acc1 = at.evaluate(loader)
    assert loss1 < loss0 and best >= acc1
    state = T.load_checkpoint(tmp_path / "best_model.pth")
    assert set(state) == set(clf.state_dict())


def test_trainer_rejects_bad_config(tmp_path):
    m = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="accumulation_steps"):
        T.Trainer(m, O.SGD(m.parameters()), accumulation_steps=0)
    tr = T.Trainer(m, O.SGD(m.parameters()), progress=False)
    with pytest.raises(ValueError, match="no full batch"):
        tr.fit(TensorDataset(torch.randn(3, 2), torch.zeros(3, dtype=torch.long)), batch_size=8)
    with pytest.raises(ValueError, match="checkpoint_dir"):
        tr.save_checkpoint()


def _everything(tr):
    """Every piece of state a load could change, copied."""
    return (copy.deepcopy(tr.model.state_dict()), copy.deepcopy(tr.optimizer.state_dict()),
            copy.deepcopy(tr.scheduler.state_dict()), torch.get_rng_state().clone(), random.getstate(),
            (tr.step, tr.epoch, tr.batch_in_epoch))


def _assert_same(a, b, path="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def _tamper(state, bad):
    if bad == "param_groups":
        state["optimizer"]["param_groups"].append(dict(state["optimizer"]["param_groups"][0], params=[]))
    elif bad == "rng_torch":
        state["rng"]["torch"] = state["rng"]["torch"][:100]
    elif bad == "rng_python":
        state["rng"]["python"] = (3, (1, 2, 3), None)
    elif bad == "extra_key":
        state["model"]["9.weight"] = torch.zeros(3)
    elif bad == "missing_key":
        del state["model"]["3.bias"]
    elif bad == "shape":
        state["model"]["3.weight"] = torch.zeros(3, 15)
    elif bad == "optimizer_shape":
        st = state["optimizer"]["state"]
        first = next(iter(st))
        st[first] = {k: (v[:1] if v.dim() else v) for k, v in st[first].items()}
    elif bad == "missing_position":
        del state["position"]
    elif bad == "step_str":
        state["position"]["step"] = "abc"
    elif bad == "step_negative":
        state["position"]["step"] = -1
    elif bad == "unknown_field":
        state["extra"] = 1


@pytest.mark.parametrize("bad", ["param_groups", "rng_torch", "rng_python", "extra_key", "missing_key", "shape",
                                 "optimizer_shape", "missing_position", "step_str", "step_negative",
                                 "unknown_field"])
def test_rejected_checkpoint_changes_nothing(tmp_path, bad):
    """A checkpoint that does not fit is refused, naming the field, before the model, optimizer, scheduler,
    RNG or position change."""
    src = _setup(tmp_path / "a")
    src.fit(_data(), batch_size=16, max_steps=3)
    state = src.state_dict()
    _tamper(state, bad)
    path = T.save_checkpoint(state, tmp_path / "bad.pt")
    tr = _setup(tmp_path / "b", seed=1)
    tr.fit(_data(), batch_size=16, max_steps=1)
    before = _everything(tr)
    with pytest.raises((ValueError, TypeError), match="Trainer.load_checkpoint"):
        tr.load_checkpoint(path)
    _assert_same(before, _everything(tr))


def test_failure_while_applying_restores_optimizer_and_scheduler(tmp_path, monkeypatch):
    """Should loading still fail once applying has begun, the objects already loaded are put back."""
    src = _setup(tmp_path / "a")
    src.fit(_data(), batch_size=16, max_steps=3)
    tr = _setup(tmp_path / "b", seed=1)
    tr.fit(_data(), batch_size=16, max_steps=1)
    before = _everything(tr)

    def broken(*args, **kwargs):
        raise RuntimeError("load failed")

    monkeypatch.setattr(tr.model, "load_state_dict", broken)
    with pytest.raises(RuntimeError, match="load failed"):
        tr.load_state_dict(src.state_dict())
    _assert_same(before, _everything(tr))


def test_checkpoint_with_pickled_code_is_never_unpickled(tmp_path):
    """Checkpoints load with weights_only: an object that would run code when unpickled is refused."""
    src = _setup(tmp_path / "a")
    state = src.state_dict()
    state["position"] = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "hook": _Exploding()}
    torch.save(state, tmp_path / "evil.pt")
    tr = _setup(tmp_path / "b", seed=1)
    before = _everything(tr)
    with pytest.raises(pickle.UnpicklingError):
        tr.load_checkpoint(tmp_path / "evil.pt")
    assert not _Exploding.ran
    _assert_same(before, _everything(tr))


class _Exploding:
    ran = False

    def __reduce__(self):
        return (_Exploding._run, ())

    @staticmethod
    def _run():
        _Exploding.ran = True
        return None
