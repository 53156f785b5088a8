"""Compare drift's ``te/...`` presets with Transformer Engine itself, on an NVIDIA GPU.

drift reproduces Transformer Engine's casts on the CPU from their CUDA source (docs/recipes.md);
its tests compare every preset with a numpy transcription of the kernels. This script closes
the loop where a GPU and Transformer Engine are at hand: it quantizes seeded boundary-heavy
tensors (and stories260K's weights, when ``../shared/data`` is beside the checkout) with TE's
own quantizers, dequantizes them with TE, and compares the bits with drift's presets on the
CPU. It prints the elements compared and the differences per preset, and exits 1 on any.

    python examples/gpu/compare_te.py            # on a machine with CUDA and transformer_engine
    python examples/gpu/compare_te.py --presets te/mxfp8 te/nvfp4

Blackwell (sm_100+) runs every preset; Hopper has no FP4 conversions (the NVFP4 presets are
left out there, and said so) and takes Transformer Engine's software ``float_to_e8m0``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

import driftcli as drift

STORIES = Path(__file__).resolve().parents[3] / "shared" / "data" / "models" / "stories260K-hf"


def quantizers() -> dict[str, Callable[[], object]]:
    """Each ``te/`` preset's Transformer Engine quantizer (rowwise only, no RHT, no stochastic
    rounding: the cast the preset describes)."""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer
    from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer
    from transformer_engine.pytorch.tensor.nvfp4_tensor import NVFP4Quantizer

    e4m3, e5m2 = tex.DType.kFloat8E4M3, tex.DType.kFloat8E5M2
    return {
        "te/float8_current": lambda: Float8CurrentScalingQuantizer(
            e4m3, torch.device("cuda"), columnwise=False),
        "te/float8_current_e5m2": lambda: Float8CurrentScalingQuantizer(
            e5m2, torch.device("cuda"), columnwise=False),
        "te/float8_current_pow2": lambda: Float8CurrentScalingQuantizer(
            e4m3, torch.device("cuda"), columnwise=False, force_pow_2_scales=True),
        "te/float8_block": lambda: Float8BlockQuantizer(
            e4m3, rowwise=True, columnwise=False, block_scaling_dim=1),
        "te/float8_block_weight": lambda: Float8BlockQuantizer(
            e4m3, rowwise=True, columnwise=False, block_scaling_dim=2),
        "te/mxfp8": lambda: MXFP8Quantizer(e4m3, rowwise=True, columnwise=False),
        "te/nvfp4": lambda: NVFP4Quantizer(rowwise=True, columnwise=False),
        "te/nvfp4_2d": lambda: NVFP4Quantizer(rowwise=True, columnwise=False,
                                              with_2d_quantization=True),
    }


def tensors(seed: int = 15) -> Iterator[tuple[str, torch.Tensor]]:
    """Seeded 512 x 512 tensors whose rows span 2**-40..2**40, with row maxima one ulp either
    side of powers of two and of 448 · 2**k, and elements on E4M3 and E2M1 grid midpoints
    times powers of two; then stories260K's weights, zero padded to multiples of 128."""
    gen = torch.Generator().manual_seed(seed)
    for i in range(8):
        x = torch.randn(512, 512, generator=gen)
        x *= torch.exp2(torch.randint(-40, 40, (512, 1), generator=gen).float())
        peaks = torch.where(torch.rand(512, generator=gen) < 0.5, 1.0, 448.0) * torch.exp2(
            torch.randint(-20, 20, (512,), generator=gen).float())
        ulps = torch.randint(-2, 3, (512,), generator=gen, dtype=torch.int32)
        x[:, 0] = (peaks.view(torch.int32) + ulps).view(torch.float32)
        mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 1.0625, 1.1875, 1.3125])
        pick = mids[torch.randint(0, len(mids), (512, 256), generator=gen)]
        x[:, 256:] = pick * torch.exp2(torch.randint(-6, 6, (512, 1), generator=gen).float())
        yield f"synthetic {i}", x
    if STORIES.is_dir():
        from safetensors import safe_open

        with safe_open(STORIES / "model.safetensors", "pt") as f:
            for key in f.keys():  # noqa: SIM118 (not a mapping)
                w = f.get_tensor(key).float()
                w = w.reshape(1, -1) if w.dim() == 1 else w
                yield key, torch.nn.functional.pad(w, (0, -w.shape[1] % 128, 0,
                                                       -w.shape[0] % 128))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="*", help="te/ presets to compare (default: all)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("error: this comparison needs an NVIDIA GPU (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    try:
        factories = quantizers()
    except ImportError as err:
        print(f"error: Transformer Engine is not importable ({err}); pip install "
              "transformer_engine[pytorch]", file=sys.stderr)
        return 2
    major, _ = torch.cuda.get_device_capability()
    failed = False
    for name in args.presets or list(factories):
        if name.startswith("te/nvfp4") and major < 10:
            print(f"{name}: left out, FP4 conversions need Blackwell (sm_100+)")
            continue
        compared = differ = 0
        for label, x in tensors():
            q = factories[name]()(x.cuda())
            theirs = q.dequantize(dtype=torch.float32).cpu()
            ours = drift.quantize(x, name)
            assert isinstance(ours, torch.Tensor)
            same = (ours.view(torch.int32) == theirs.view(torch.int32)) | (
                ours.isnan() & theirs.isnan())
            compared += x.numel()
            if not bool(same.all()):
                i = int((~same).flatten().nonzero()[0])
                print(f"  {name} on {label}: {int((~same).sum())} differ, first x = "
                      f"{float(x.flatten()[i])!r}: drift {float(ours.flatten()[i])!r}, "
                      f"Transformer Engine {float(theirs.flatten()[i])!r}")
                differ += int((~same).sum())
        failed |= differ > 0
        print(f"{name}: {compared:,} elements compared with Transformer Engine, {differ:,} "
              "differences")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
