"""``rht=checkpoint``: each layer's ``_rht_sign_vector`` (torchao's NVFP4 training) read from the
scanned checkpoint, on hand-built safetensors files (nothing unpickled)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from driftcli.casts.hadamard import transform
from driftcli.cli import app
from driftcli.errors import CastSpecError
from driftcli.io import rht_signs
from driftcli.io.rht_signs import SignVectorError, vector_name
from driftcli.measures.scan import ScanOptions, scan
from driftcli.records.castspec import parse_cast

# two layers with different signs, as torchao draws one vector per layer
SIGNS_A = (1, -1, -1, 1, 1, 1, -1, 1, -1, -1, 1, 1, -1, 1, 1, -1)
SIGNS_B = (-1, -1, 1, 1, -1, 1, 1, 1, -1, 1, -1, -1, 1, -1, 1, 1)


def _spec(signs: tuple[int, ...]) -> str:
    return "signs/" + "".join("+" if s > 0 else "-" for s in signs)


def _checkpoint(path: Path, *, extra: dict[str, torch.Tensor] | None = None) -> Path:
    g = torch.Generator().manual_seed(7)
    sd = {"layers.0.w1.weight": torch.randn(48, 64, generator=g) * 3,
          "layers.0.w1._rht_sign_vector": torch.tensor(SIGNS_A, dtype=torch.int8),
          "layers.1.w1.weight": torch.randn(32, 32, generator=g).to(torch.bfloat16),
          "layers.1.w1._rht_sign_vector": torch.tensor(SIGNS_B, dtype=torch.int8),
          **(extra or {})}
    save_file(sd, str(path))
    return path


def _facts(r: object) -> tuple[object, ...]:
    st = r.draws[0]  # type: ignore[attr-defined]
    return (st.clipped, st.underflowed, st.ee, st.e_sum, st.xx, st.ex)


def test_the_key_is_the_layer_of_the_tensor() -> None:
    assert vector_name("layers.0.w1.weight") == "layers.0.w1._rht_sign_vector"
    assert vector_name("weight") == "_rht_sign_vector"


def test_each_layer_is_cast_with_its_own_signs_bit_equal_to_rht_signs(tmp_path: Path) -> None:
    ck = _checkpoint(tmp_path / "m.safetensors")
    got = scan([ck], ["nvfp4:rht=checkpoint", f"nvfp4:rht={_spec(SIGNS_A)}",
                      f"nvfp4:rht={_spec(SIGNS_B)}"], options=ScanOptions(draws=1))
    rows = {(r.ref.name, str(r.cast.rht)): r for r in got.results}
    assert len(rows) == 6 and not got.errors  # the int8 vectors are not scanned
    for layer, own, other in (("layers.0.w1.weight", SIGNS_A, SIGNS_B),
                              ("layers.1.w1.weight", SIGNS_B, SIGNS_A)):
        mine = rows[(layer, "checkpoint")]
        assert str(mine.cast).endswith("rht=checkpoint")  # the table keeps the spec given
        assert _facts(mine) == _facts(rows[(layer, _spec(own))])
        # a layer given the other's signs counts differently, so the match above could fail
        assert _facts(mine) != _facts(rows[(layer, _spec(other))])


def test_a_sliced_scan_resolves_the_same_signs(tmp_path: Path) -> None:
    ck = _checkpoint(tmp_path / "m.safetensors")
    whole = scan([ck], ["te/nvfp4:rht=checkpoint"], include=["layers.0.*"])
    sliced = scan([ck], ["te/nvfp4:rht=checkpoint"], include=["layers.0.*"],
                  options=ScanOptions(chunk_elements=16 * 64))
    assert [_facts(r) for r in whole.results] == [_facts(r) for r in sliced.results]


def test_a_tensor_without_a_vector_is_refused_naming_it(tmp_path: Path) -> None:
    ck = _checkpoint(tmp_path / "m.safetensors",
                     extra={"norm.weight": torch.ones(64)})
    with pytest.raises(SignVectorError, match=r"tensor norm\.weight has no sign vector "
                                              r"norm\._rht_sign_vector"):
        scan([ck], ["nvfp4:rht=checkpoint"])
    # leaving it out (or an --include that drops the vectors too) scans the rest
    got = scan([ck], ["nvfp4:rht=checkpoint"], include=["*w1.weight"])
    assert len(got.results) == 2 and not got.errors


@pytest.mark.parametrize(("vector", "why"), [
    (torch.tensor(SIGNS_A[:8], dtype=torch.int8), r"shape \[8\]"),
    (torch.tensor((0, *SIGNS_A[1:]), dtype=torch.int8), r"only \+1 and -1"),
    (torch.tensor(SIGNS_A, dtype=torch.float32) * 2, r"only \+1 and -1"),
])
def test_a_vector_that_is_not_16_signs_is_refused(tmp_path: Path, vector: torch.Tensor,
                                                   why: str) -> None:
    sd = {"l.weight": torch.randn(16, 16), "l._rht_sign_vector": vector}
    save_file(sd, str(tmp_path / "bad.safetensors"))
    with pytest.raises(SignVectorError, match=r"l\._rht_sign_vector .*" + why):
        scan([tmp_path / "bad.safetensors"], ["nvfp4:rht=checkpoint"])


def test_the_cli_exits_2_in_one_line(tmp_path: Path) -> None:
    ck = _checkpoint(tmp_path / "m.safetensors", extra={"norm.weight": torch.ones(64)})
    res = CliRunner().invoke(app, ["clip-rate", str(ck), "-c", "nvfp4:rht=checkpoint",
                                   "--out", str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    assert "norm.weight has no sign vector" in res.output
    ok = CliRunner().invoke(app, ["clip-rate", str(ck), "-c", "nvfp4:rht=checkpoint",
                                  "--include", "*w1.weight", "--out", str(tmp_path / "ok")])
    assert ok.exit_code == 0, ok.output


def test_outside_a_scan_the_signs_must_be_given() -> None:
    c = parse_cast("nvfp4:rht=checkpoint")
    assert c.rht is not None and c.rht.from_checkpoint and rht_signs.needs_signs([c])
    with pytest.raises(CastSpecError, match="only a scan of that checkpoint reads"):
        transform(torch.zeros(16), c.rht)


def _table(frame: object) -> object:
    """A measurement's rows without ``source`` (the library names an in-memory input)."""
    return frame.drop(columns=["source"]).reset_index(drop=True)  # type: ignore[attr-defined]


@pytest.mark.parametrize("what", ["error-bias", "clip-rate"])
def test_the_library_resolves_each_layers_signs_as_the_cli(tmp_path: Path, what: str) -> None:
    """``driftcli.measure`` on the checkpoint's path, on its state dict and on a module that
    holds the vectors as buffers (as torchao's ``NVFP4Linear``) gives the command's table, row
    for row; and each layer's rows are those of its own signs given by hand, not the other
    layer's (so a library that dropped or swapped the vectors would fail here)."""
    import pandas as pd
    from safetensors.torch import load_file

    from driftcli.api import measure

    ck = _checkpoint(tmp_path / "m.safetensors")
    casts = ["te/nvfp4:rht=checkpoint"]
    res = CliRunner().invoke(app, [what, str(ck), "-c", casts[0], "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    cli = _table(pd.read_parquet(next((tmp_path / "o").rglob("*.parquet"))))
    sd = load_file(str(ck))
    module = torch.nn.Module()
    for layer in ("layers.0.w1", "layers.1.w1"):
        m = torch.nn.Module()
        m.register_parameter("weight", torch.nn.Parameter(sd[f"{layer}.weight"]))
        m.register_buffer("_rht_sign_vector", sd[f"{layer}._rht_sign_vector"])
        module.add_module(layer.replace(".", "_"), m)
    renamed = {k.replace("layers.0.w1", "layers_0_w1").replace("layers.1.w1", "layers_1_w1"): v
               for k, v in sd.items()}
    assert set(module.state_dict()) == set(renamed)
    assert cli.equals(_table(measure(ck, casts, what)))
    assert cli.equals(_table(measure(sd, casts, what)))
    from_module = _table(measure(module, casts, what))
    assert from_module.drop(columns=["tensor"]).equals(cli.drop(columns=["tensor"]))
    assert len(cli) == 3  # two layers and the input's total; the int8 vectors are not scanned
    by_hand = {layer: _table(measure(ck, [f"te/nvfp4:rht={_spec(s)}"], what,
                                     include=[f"{layer}.weight"]))
               for layer, s in (("layers.0.w1", SIGNS_A), ("layers.1.w1", SIGNS_B))}
    swapped = _table(measure(ck, [f"te/nvfp4:rht={_spec(SIGNS_B)}"], what,
                             include=["layers.0.w1.weight"]))
    numbers = [c for c in cli.columns if c not in ("tensor", "cast", "cast_name", "dtype",
                                                   "shape", "error", "layer", "role",
                                                   "operand", "step")]
    lib = _table(measure(sd, casts, what))
    for i, layer in enumerate(("layers.0.w1", "layers.1.w1")):
        assert lib.loc[i, "tensor"] == f"{layer}.weight"
        assert lib.loc[[i], numbers].reset_index(drop=True).equals(
            by_hand[layer].loc[[0], numbers])
    assert not lib.loc[[0], numbers].reset_index(drop=True).equals(swapped.loc[[0], numbers])


def test_the_library_refuses_a_lone_tensor_naming_it() -> None:
    """A tensor on its own has no layer, so no vector: refused in one line that names the
    input as the caller named it (not the scratch file the library saves it to)."""
    from driftcli.api import measure

    with pytest.raises(SignVectorError, match=r"^w: tensor w has no sign vector") as err:
        measure(torch.randn(16, 16), "nvfp4:rht=checkpoint", name="w")
    assert "drift-measure" not in str(err.value) and "\n" not in str(err.value)


def test_cast_diff_resolves_each_layers_signs(tmp_path: Path) -> None:
    """cast-diff is a scan: against ``rht=signs/…`` with a layer's own signs, ``rht=checkpoint``
    differs in no code on that layer and in some on the other."""
    import pyarrow.parquet as pq

    ck = _checkpoint(tmp_path / "m.safetensors")
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["cast-diff", str(ck), "-c", "nvfp4:rht=checkpoint",
                                      "-c", f"nvfp4:rht={_spec(SIGNS_A)}", "--out", str(out),
                                      "-q"])
    assert result.exit_code == 0, result.output
    rows = pq.read_table(out / "cast-diff.parquet").to_pylist()
    # each row is a later cast against the first
    differ = {r["tensor"]: r["n_codes_differ"] for r in rows
              if "rht=signs" in r["cast"] and r["against"].endswith("rht=checkpoint")}
    assert differ["layers.0.w1.weight"] == 0
    assert differ["layers.1.w1.weight"] > 0
