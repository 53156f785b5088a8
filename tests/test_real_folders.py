"""Real model folders: training-state files skipped, model checks before loading (issue 26,
items 5 and 6)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from driftcli.cli import app
from driftcli.io.readers import open_inputs

runner = CliRunner()


def _fine_tune(folder: Path) -> Path:
    """An HF-style fine-tune folder: weights plus the files a Trainer writes beside them."""
    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    save_file({"w.weight": torch.randn(8, 32, generator=g) * 100,
               "w.bias": torch.randn(8, generator=g)}, folder / "model.safetensors")
    torch.save(argparse.Namespace(lr=1e-3), folder / "training_args.bin")  # a pickled class
    torch.save({"state": {}, "param_groups": []}, folder / "optimizer.pt")
    torch.save({"last_epoch": 3}, folder / "scheduler.pt")
    torch.save({"python": 1.0}, folder / "rng_state_0.pth")
    (folder / "trainer_state.json").write_text("{}")
    return folder


def test_training_state_files_are_skipped_and_listed(tmp_path: Path) -> None:
    folder = _fine_tune(tmp_path / "ft")
    inputs = open_inputs([folder])
    assert [p.name for p in inputs.skipped] == [
        "optimizer.pt", "rng_state_0.pth", "scheduler.pt", "training_args.bin"]
    assert inputs.errors == ()
    assert sorted(r.name for r in inputs.tensors) == ["w.bias", "w.weight"]
    # named on its own, a training-state file is read as asked (here: refused, a pickle)
    named = open_inputs([folder / "training_args.bin"])
    assert named.skipped == () and len(named.errors) == 1


def test_fine_tune_folder_exits_0(tmp_path: Path) -> None:
    folder = _fine_tune(tmp_path / "ft")
    result = runner.invoke(app, ["clip-rate", str(folder), "-c", "mxfp8_e4m3",
                                 "--out", str(tmp_path / "o"), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert [Path(f).name for f in summary["skipped_files"]] == [
        "optimizer.pt", "rng_state_0.pth", "scheduler.pt", "training_args.bin"]
    assert summary["errors"] == []
    assert summary["casts"][0]["tensors"] == 2


def test_folder_of_training_state_only_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "state"
    folder.mkdir()
    torch.save({"state": {}}, folder / "optimizer.pt")
    result = runner.invoke(app, ["clip-rate", str(folder), "-c", "mxfp8_e4m3",
                                 "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert "only optimizer.pt, which hold no weights" in result.output


@pytest.fixture(autouse=True)
def _no_cwd_output(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)


# --- model checks before loading (item 5) --------------------------------------------------

def _llama(folder: Path, **extra: object) -> Path:
    """A tiny Llama causal LM folder, saved by transformers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=32)
    LlamaForCausalLM(config).save_pretrained(folder)
    if extra:
        data = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**data, **extra}))
    return folder


def _bert(folder: Path, architectures: bool = True) -> Path:
    """A tiny BERT encoder folder (as sentence-transformers models ship: ``BertModel``)."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=32)
    BertModel(config).save_pretrained(folder)
    if not architectures:
        data = json.loads((folder / "config.json").read_text())
        del data["architectures"]
        (folder / "config.json").write_text(json.dumps(data))
    return folder


def _refusal(path: Path) -> str:
    from driftcli.models.loaders import CheckpointError, load_causal_lm

    with pytest.raises(CheckpointError) as info:
        load_causal_lm(path, float64_copies=4)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_causal_lm_folder_loads(tmp_path: Path) -> None:
    from driftcli.models.loaders import load_causal_lm

    lm = load_causal_lm(_llama(tmp_path / "llama"), float64_copies=4)
    assert lm.kind == "hf" and type(lm.model).__name__ == "LlamaForCausalLM"


def test_bert_encoder_is_refused(tmp_path: Path) -> None:
    message = _refusal(_bert(tmp_path / "bert"))
    assert "is not a causal language model (BertModel)" in message


def test_fresh_weights_are_refused_and_named(tmp_path: Path) -> None:
    # no architectures: transformers would load it as BertLMHeadModel with a random head
    message = _refusal(_bert(tmp_path / "bert", architectures=False))
    assert "would be initialised at random: cls.predictions." in message
    folder = _llama(tmp_path / "llama")
    from safetensors.torch import load_file
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.0.mlp.up_proj.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    message = _refusal(folder)
    assert ("1 weight(s) are not in the folder (or have another shape) and would be "
            "initialised at random: model.layers.0.mlp.up_proj.weight;") in message


def test_quantized_folders_load_where_drift_reads_the_layout(tmp_path: Path) -> None:
    from driftcli.models.loaders import load_causal_lm

    # a layout drift reads: loaded as stored (here no weight is stored quantized, so each is
    # read as it is; test_quantized.py runs a folder whose projections are FP8)
    folder = _llama(tmp_path / "fp8", quantization_config={"quant_method": "fp8",
                                                            "weight_block_size": [128, 128]})
    from safetensors.torch import load_file

    stored = load_file(folder / "model.safetensors")
    held = load_causal_lm(folder, float64_copies=4).model.state_dict()
    assert all(torch.equal(held[k], v) for k, v in stored.items())
    gptq = _llama(tmp_path / "gptq", quantization_config={"quant_method": "gptq", "bits": 4})
    assert _refusal(gptq).endswith(
        "holds quantized weights (quantization_config, quant_method gptq) in a layout drift "
        "does not read (it reads deepseek-fp8, mxfp8, ct-fp8, ct-nvfp4, modelopt-nvfp4, "
        "gpt-oss-mxfp4, ct-mxfp4, mxfp4, mxfp6-e2m3, mxfp6-e3m2); give the unquantized "
        "model's folder to run the model")


def test_config_without_sizes_is_refused(tmp_path: Path) -> None:
    folder = _llama(tmp_path / "llama")
    (folder / "config.json").write_text(json.dumps(
        {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 64}))
    message = _refusal(folder)
    assert "does not give hidden_size, num_hidden_layers, num_attention_heads" in message
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 16}))
    assert "does not give vocab_size, n_layer, n_head:" in _refusal(gpt2)


def test_model_too_large_for_memory_is_refused(tmp_path: Path) -> None:
    from driftcli.models.loaders import CheckpointError, _load_hf, estimate_memory

    folder = _llama(tmp_path / "llama")
    n, need = estimate_memory(folder, float64_copies=4)
    # embedding, head, attention, MLP, norms
    assert n == 64 * 16 * 2 + 16 * 16 * 4 + 3 * 16 * 32 + 16 * 3
    assert need == n * (4 + 4 * 8)
    with pytest.raises(CheckpointError, match=(
            rf"has {n:,} parameters: holding it as loaded and 4 float64 copies takes about "
            r"0\.2 MiB, more than the 0\.2 MiB available")):
        _load_hf(folder, float64_copies=4, available=need - 1)
    # a 70B config's estimate (on the meta device: nothing allocated) is refused on any machine
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
        "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
        "num_attention_heads": 64, "num_key_value_heads": 8}))
    message = _refusal(folder)
    assert "has 70,553,706,496 parameters" in message and "takes about 2365.5 GiB" in message


def test_grad_cosine_on_bert_is_exit_2(tmp_path: Path) -> None:
    folder = _bert(tmp_path / "bert")
    batch = tmp_path / "batch.safetensors"
    save_file({"input_ids": torch.arange(8)}, batch)
    result = runner.invoke(app, ["grad-cosine", str(folder), "-p", "mxfp8_e4m3",
                                 "--batch", str(batch), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert "is not a causal language model (BertModel)" in result.output
    assert "Traceback" not in result.output


# --- one report line per model input and cast (item 6) --------------------------------------

def test_sharded_folder_is_one_report_group_per_cast(tmp_path: Path) -> None:
    from driftcli.report.load import load
    from driftcli.report.summary import summarize

    sh = tmp_path / "sharded"
    sh.mkdir()
    shards = {"model-00001-of-00002.safetensors": {"l0.weight": torch.full((4, 32), 500.0),
                                                   "l0.bias": torch.ones(4)},
              "model-00002-of-00002.safetensors": {"l1.weight": torch.full((4, 32), 1.0)}}
    for name, tensors in shards.items():
        save_file(tensors, sh / name)
    (sh / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {t: f for f, ts in shards.items() for t in ts}}))
    single = tmp_path / "single.safetensors"
    save_file({"x": torch.full((8, 32), 1000.0)}, single)
    out = tmp_path / "o"
    result = runner.invoke(app, ["clip-rate", str(sh), str(single), "-c", "float8_e4m3fn",
                                 "-c", "bf16", "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    s = summarize(load([out / "clip-rate.parquet"]).tables[0])
    got = {(dict(g.group)["source"], s.shown("cast", dict(g.group)["cast"])):
           (g.n_rows, g.aggregate_value("n_tensors"), g.worst_value, [w.name for w in g.worst])
           for g in s.groups}
    # one line per input and cast: the folder's three tensors under it, its aggregate beside
    # them (a shard per line and a "rows 0" line for the folder before); the unscaled
    # e4m3 cast clips 500 and 1000 (above 448), bf16 nothing
    assert got == {
        (str(sh), "float8_e4m3fn"): (3, 3, 1.0, ["model-00001-of-00002.safetensors l0.weight"]),
        (str(sh), "bf16"): (3, 3, 0.0, []),
        (str(single), "float8_e4m3fn"): (1, 1, 1.0, []),
        (str(single), "bf16"): (1, 1, 0.0, []),
    }


# --- an axis that some tensors lack (item 6) -------------------------------------------------

def test_axis_1_skips_and_names_the_1d_tensors(tmp_path: Path) -> None:
    path = tmp_path / "layer.safetensors"
    save_file({"fc.weight": torch.full((4, 64), 1000.0), "fc.bias": torch.ones(4),
               "norm.weight": torch.ones(64), "step": torch.tensor([3])}, path)
    result = runner.invoke(app, ["clip-rate", str(path), "-c", "float8_e4m3fn", "--axis", "1",
                                 "--out", str(tmp_path / "o"), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["axis_skipped"] == [
        f"{path} fc.bias [4]: --axis 1 is not one of its axes",
        f"{path} norm.weight [64]: --axis 1 is not one of its axes"]
    assert summary["casts"][0]["tensors"] == 1 and summary["casts"][0]["clip_rate"] == 1.0
    printed = runner.invoke(app, ["clip-rate", str(path), "-c", "float8_e4m3fn", "--axis", "1",
                                  "--out", str(tmp_path / "o2")])
    assert "skipped " + f"{path} fc.bias [4]: --axis 1 is not one of its axes" in (
        printed.output.replace("\n", ""))


def test_axis_that_fits_no_tensor_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "biases.safetensors"
    save_file({"a": torch.ones(4), "b": torch.ones(8)}, path)
    result = runner.invoke(app, ["clip-rate", str(path), "-c", "mxfp8_e4m3", "--axis", "1",
                                 "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert ("--axis 1 fits no tensor of the inputs (they have 1 dimension(s), first a [4]); "
            "give an axis they have, e.g. --axis -1") in result.output


def test_axis_misfits_match_names_exactly() -> None:
    from driftcli.io.readers.core import TensorRef
    from driftcli.measures.axes import AxisFit, fits

    assert fits((4, 8), 1) and fits((4, 8), -2) and not fits((8,), 1) and not fits((8,), -2)
    assert fits((), -1) and not fits((), 1)
    fit = AxisFit(1, (TensorRef("f", "a[0].*?", "float32", (4,)),))
    import fnmatch
    [glob] = fit.exclude
    assert fnmatch.fnmatchcase("a[0].*?", glob) and not fnmatch.fnmatchcase("a0.xy", glob)
