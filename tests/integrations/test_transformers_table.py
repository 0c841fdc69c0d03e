"""The table of docs/integrations.md that says which fastarch ops each transformers family runs, per dtype and
per mode (prefill, decode, training), is generated here: every cell is the set of ops the selector decided
for while a tiny random model of that family ran (``fastarch.backend.log_decisions``). The test fails when
the document differs from what runs; ``FASTARCH_UPDATE_DOCS=1`` rewrites the table. The table records the
transformers release it was generated with, and is compared only on that release."""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fastarch import backend as B  # noqa: E402
from fastarch.integrations import transformers as fh  # noqa: E402

from .test_transformers import _gpt2, _llama  # noqa: E402
from .test_transformers import _gpt_oss as _gpt_oss_model  # noqa: E402
from .test_transformers import _mamba as _mamba_model  # noqa: E402
from .test_transformers_families import _model as _family_model  # noqa: E402
from .test_transformers_mamba2 import _mamba2 as _mamba2_model  # noqa: E402

DOC = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"
BEGIN, END = "<!-- ops-table:begin -->", "<!-- ops-table:end -->"

MODELS = {
    "Llama": lambda: _llama(),
    "GPT-2": lambda: _gpt2(),
    "gpt-oss (sinks)": lambda: _gpt_oss_model(),
    "Mamba": lambda: _mamba_model(),
    "Mamba-2": lambda: _mamba2_model(),
    **{name: (lambda family=family: _family_model(family))
       for name, family in (("Jamba", "jamba"), ("Bamba", "bamba"), ("FalconH1", "falcon_h1"),
                            ("GraniteMoeHybrid", "granitemoehybrid"), ("LFM2", "lfm2"),
                            ("FalconMamba", "falcon_mamba"))},
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _ops_run(model, dtype: torch.dtype, mode: str) -> str:
    model = model.to(dtype)
    vocab = model.config.vocab_size
    torch.manual_seed(0)
    ids = torch.randint(3, vocab, (2, 9))
    if hasattr(model.config, "_attn_implementation"):
        model.set_attn_implementation("fastarch")
    if mode == "decode":  # what generating two more tokens adds to the prefill's ops
        model.eval()
        counts = []
        for new in (1, 3):
            with B.log_decisions() as log, torch.no_grad():
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                               pad_token_id=0)
            counts.append(Counter(op for op, *_ in log))
        return ", ".join(sorted(counts[1] - counts[0])) or "none"
    with B.log_decisions() as log:
        if mode == "training":
            model.train()
            model(input_ids=ids).logits.float().square().mean().backward()
        else:
            model.eval()
            with torch.no_grad():
                model(input_ids=ids)
    return ", ".join(sorted({op for op, *_ in log})) or "none"


def _table() -> str:
    fh.unregister()
    fh.register()
    try:
        rows = [f"transformers {transformers.__version__}; CPU; cells: the fastarch ops that ran.", "",
                "| model | dtype | prefill | decode | training |", "|---|---|---|---|---|"]
        for name, make in MODELS.items():
            for dname, dtype in DTYPES.items():
                cells = [_ops_run(make(), dtype, mode) for mode in ("prefill", "decode", "training")]
                rows.append(f"| {name} | {dname} | " + " | ".join(cells) + " |")
        return "\n".join(rows)
    finally:
        fh.unregister()


def test_docs_table_is_what_runs():
    text = DOC.read_text()
    if BEGIN not in text or END not in text:
        pytest.fail(f"{DOC.name} has no generated ops table ({BEGIN} ... {END})")
    current = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    recorded = re.search(r"transformers (\S+);", current)
    generated = _table()
    if os.environ.get("FASTARCH_UPDATE_DOCS"):
        DOC.write_text(text.split(BEGIN, 1)[0] + BEGIN + "\n" + generated + "\n" + END
                       + text.split(END, 1)[1])
        return
    if recorded is None or recorded.group(1) != transformers.__version__:
        pytest.skip(f"the table was generated with transformers {recorded.group(1) if recorded else '?'}, "
                    f"this is {transformers.__version__} (FASTARCH_UPDATE_DOCS=1 regenerates it)")
    assert current == generated, "docs/integrations.md's ops table is stale: run with FASTARCH_UPDATE_DOCS=1"
