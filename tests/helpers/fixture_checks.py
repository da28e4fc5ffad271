"""Checks that a rebuilt embedded model is the committed fixture.

Reproducibility across machines: every file that is not float weights (configs, tokenizer, chat
template, index) is byte-identical wherever it is rebuilt; the weights come out of a training
run whose float rounding depends on the processor's kernels (AVX2, AVX-512, NEON, generic), so
they are compared within a tolerance. Bit-for-bit equality of the weights holds only for a
rebuild on the same machine and software.
"""

from __future__ import annotations

from pathlib import Path

# Largest relative distance ||rebuilt - fixture|| / ||fixture|| allowed per weight tensor. A
# rebuild under AVX2 kernels of a fixture built under AVX-512 ones measured 0.041 (worst
# tensor, after 450 training steps); a different model would be off by ~1.4 (random init).
WEIGHT_TOLERANCE = 0.10


def weight_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.safetensors"))


def assert_same_files(built: Path, fixture: Path) -> None:
    names = sorted(p.name for p in fixture.iterdir())
    assert sorted(p.name for p in built.iterdir()) == names
    for name in names:
        assert (built / name).read_bytes() == (fixture / name).read_bytes(), name


def weight_distances(built: Path, fixture: Path) -> dict[str, float]:
    """Relative Frobenius distance of every tensor, over all safetensors files."""
    from safetensors.torch import load_file

    out: dict[str, float] = {}
    for name in weight_files(fixture):
        want, got = load_file(fixture / name), load_file(built / name)
        assert sorted(got) == sorted(want), f"{name}: other tensor names"
        for key, ref in want.items():
            assert got[key].shape == ref.shape and got[key].dtype == ref.dtype, key
            ref32, got32 = ref.float(), got[key].float()
            out[key] = float((got32 - ref32).norm() / ref32.norm().clamp_min(1e-12))
    return out


def assert_rebuild_matches(
    built: Path, fixture: Path, tolerance: float | None = WEIGHT_TOLERANCE
) -> None:
    """Non-weight files byte-identical; weights with the same names, shapes and dtypes, and
    within `tolerance` (None: no bound, for a training run too chaotic to stay close)."""
    names = sorted(p.name for p in fixture.iterdir())
    assert sorted(p.name for p in built.iterdir()) == names
    weights = set(weight_files(fixture))
    for name in names:
        if name not in weights:
            assert (built / name).read_bytes() == (fixture / name).read_bytes(), name
    distances = weight_distances(built, fixture)
    if tolerance is None:
        return
    worst = max(distances, key=distances.__getitem__)
    assert distances[worst] <= tolerance, (
        f"{worst} is {distances[worst]:.3f} (relative) from the fixture, more than "
        f"{tolerance}: the build is not the one that made the fixture"
    )
