"""Model-layer shape presets: the benchmark suite of docs/design.md (Benchmarks), as data.

Each preset is a list of ``(op, input_shape, output_size)``; ``pool-tuner tune --preset NAME``
tunes them and ``pool-tuner bench`` measures them.
"""

from __future__ import annotations

PRESETS = {
    "resnet50_head": [("adaptive_avg_pool2d", (32, 2048, 7, 7), (1, 1))],
    "vgg16_256px": [("adaptive_avg_pool2d", (32, 512, 8, 8), (7, 7))],
    "alexnet_256px": [("adaptive_avg_pool2d", (64, 256, 7, 7), (6, 6))],
    "pspnet_ppm": [("adaptive_avg_pool2d", (8, 2048, 64, 64), (s, s)) for s in (1, 2, 3, 6)],
    "spp_net": [("adaptive_max_pool2d", (32, 256, 13, 13), (s, s)) for s in (4, 2, 1)],
    "se_block": [("adaptive_avg_pool2d", (32, 256, 56, 56), (1, 1))],
    "coord_attention": [
        ("adaptive_avg_pool2d", (32, 64, 56, 56), (56, None)),
        ("adaptive_avg_pool2d", (32, 64, 56, 56), (None, 56)),
    ],
    "upsample_area": [("adaptive_avg_pool2d", (16, 64, 5, 5), (7, 7))],
    "video_head": [("adaptive_avg_pool3d", (8, 2048, 8, 7, 7), (1, 1, 1))],
    "audio_1d": [("adaptive_avg_pool1d", (32, 512, 1000), (128,))],
}


#: Multi-level presets (pool_tuner.pyramid): pspnet_ppm's and spp_net's levels as one fused call each,
#: and timm's avg+max head.  Tuned by name (``pool-tuner tune --preset pspnet_ppm_fused``) and
#: measured by benchmarks/pyramid.py; ``all`` -- the benchmark suite -- keeps to the single-level ops.
FUSED_PRESETS = {
    "pspnet_ppm_fused": [("adaptive_avg_pool_pyramid2d", (8, 2048, 64, 64), [(s, s) for s in (1, 2, 3, 6)])],
    "spp_net_fused": [("adaptive_max_pool_pyramid2d", (32, 256, 13, 13), [(s, s) for s in (4, 2, 1)])],
    "avgmax_head": [("adaptive_avgmax_pool2d", (32, 2048, 7, 7), (1, 1))],
}


def preset_shapes(name: str, argument: str = "preset") -> list:
    """The shapes of a preset, or of every (single-level) preset for ``"all"`` (``argument``: the
    name's argument, or option, in errors)."""
    if name == "all":
        return [shape for shapes in PRESETS.values() for shape in shapes]
    if name in FUSED_PRESETS:
        return list(FUSED_PRESETS[name])
    if name not in PRESETS:
        raise ValueError(f"{argument} must be one of {sorted(PRESETS) + sorted(FUSED_PRESETS) + ['all']}, got {name!r}")
    return list(PRESETS[name])


#: The name ``pool-tuner bench`` gives the shapes below.
UNTUNED_NAME = "untuned"
#: Shapes that no preset has -- so ``tune --preset all`` never tunes them -- which the benchmark runs
#: beside the presets: how calls fare where dispatch has only the nearest tuned shape or the
#: default rules to go on.  Each is a preset's layer at another size, with windows that do not
#: divide evenly.
UNTUNED = [
    ("adaptive_avg_pool2d", (16, 1024, 14, 14), (1, 1)),
    ("adaptive_avg_pool2d", (4, 512, 60, 80), (6, 6)),
    ("adaptive_max_pool2d", (16, 128, 27, 27), (3, 3)),
    ("adaptive_avg_pool2d", (8, 96, 45, 45), (45, 1)),
    ("adaptive_avg_pool1d", (16, 256, 777), (100,)),
    ("adaptive_avg_pool3d", (4, 256, 9, 14, 14), (2, 3, 3)),
]
