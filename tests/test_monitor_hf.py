"""drift.monitor's integrations: a Hugging Face Trainer callback on a tiny Llama made from a
config (no download), and TensorBoard scalars through any writer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import driftcli as drift
from driftcli.live.integrations import hf_callback, scalars
from driftcli.live.tables import read_monitor

transformers = pytest.importorskip("transformers", reason="the HF callback needs "
                                   "driftcli[hf] (transformers, a dev extra)")


class _Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int, length: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


@pytest.mark.slow
def test_the_trainer_callback_writes_the_tables(tmp_path: Path) -> None:
    """Six optimizer steps of a two-layer Llama, monitored every 2: steps 0, 2 and 4, each
    with both layers' projections, attention's two products and the head."""
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), per_device_train_batch_size=2, max_steps=6,
        learning_rate=1e-3, report_to=[], save_strategy="no", logging_strategy="no",
        use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
    callback = hf_callback(["mxfp8_e4m3", "nvfp4"], out=tmp_path / "mon", every=2,
                           measurements=["clip-rate", "stats"])
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(12, 16, 64),
                                   callbacks=[callback])
    trainer.train()
    tables = read_monitor(tmp_path / "mon")
    clip = tables["clip-rate"]
    assert sorted(clip.step.unique()) == [0, 2, 4]
    layers = set(clip.layer)
    for i in (0, 1):
        assert {f"model.layers.{i}.self_attn.q_proj", f"model.layers.{i}.mlp.down_proj",
                f"model.layers.{i}.self_attn"} <= layers  # sdpa's q·kᵀ and p·v are its own
    assert "lm_head" in layers
    assert set(clip.direction) == {"forward", "dgrad", "wgrad"}
    per_step = clip.groupby("step").size()
    assert per_step.nunique() == 1 and per_step.iloc[0] > 100
    assert callback.monitor is not None and callback.monitor._capture is None  # closed


class _Writer:
    def __init__(self) -> None:
        self.got: list[tuple[str, float, int]] = []

    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> None:
        self.got.append((tag, scalar_value, global_step))


def test_scalars_write_each_headline_per_operand_direction_and_cast() -> None:
    """One scalar per row and headline of each sampled step, at that step; a planted listener
    that drops the cast from the tag would merge two casts' series and is caught."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 16)
    writer = _Writer()
    with drift.monitor(layer, ["nvfp4", "mxfp8_e4m3"], every=2,
                       measurements=["clip-rate", "stats"]) as mon:
        mon.add_listener(scalars(writer))
        for _ in range(3):
            layer(torch.randn(4, 32)).square().sum().backward()
            mon.step()
    clip, stats = mon.rows("clip-rate"), mon.rows("stats")
    # 3 operands x 2 directions, x 2 casts for clip-rate, at steps 0 and 2
    assert len(clip) == 24 and len(stats) == 12 and len(writer.got) == 36
    tags = {(t, s) for t, _, s in writer.got}
    assert len(tags) == 36  # no two rows share a tag at one step
    want = {(f"drift/monitor-clip-rate/clip_rate/{r.cast}/{r.tensor}/{r.direction}", r.step):
            r.clip_rate for r in clip.itertuples()}
    got = {(t, s): v for t, v, s in writer.got if "clip_rate" in t}
    assert got == want
    assert ("drift/monitor-stats/dynamic_range/<root>/weight/dgrad", 2) in tags
