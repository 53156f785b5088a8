"""block-stats refuses a micro-scaled cast (hifloat4, mx6, mx9) with the fix, rather than
report the scale rule's scales as the cast's: their base scale and micro-exponents are not
modelled."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from driftcli.cli import app
from driftcli.errors import DriftError
from driftcli.measures.block_stats import block_stats


@pytest.mark.parametrize("cast", ["hifloat4", "mx6", "mx9"])
def test_a_micro_scaled_cast_is_refused_with_the_fix(tmp_path: Path, cast: str) -> None:
    path = tmp_path / "a.safetensors"
    save_file({"w": torch.linspace(-3, 3, 256).reshape(4, 64).contiguous()}, str(path))
    with pytest.raises(DriftError, match=f"has micro-exponents \\({cast}\\).*clip-rate"):
        block_stats([path], [cast])
    # beside a cast it does model, nothing is written either
    out = tmp_path / "o"
    result = CliRunner().invoke(app, ["block-stats", str(path), "-c", "mxfp4_e2m1", "-c", cast,
                                      "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert "micro-exponents" in result.output and len(result.output.strip().splitlines()) == 1
    if cast == "hifloat4":  # the message docs/block-stats.md shows
        assert result.output.strip() == (
            "error: block-stats: cast hifloat4:rna:saturate has micro-exponents (hifloat4), "
            "which block-stats does not model yet; measure it with clip-rate, underflow-rate "
            "or error-bias, or give a block cast without them (mxfp4_e2m1, nvfp4)")
    assert not (out / "block-stats.parquet").exists()
