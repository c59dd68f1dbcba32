"""pool_tuner: autotuned adaptive pooling kernels with PyTorch's exact semantics.

Output ``o`` of an axis with input size ``I`` and output size ``O`` pools input
``[floor(o*I/O), ceil((o+1)*I/O))``; kernels are written once for CUDA and OpenCL C, tuned per
device and shape, and dispatched at run time.  See README.md for the tour.
"""

from .ops import (
    adaptive_avg_pool1d,
    adaptive_avg_pool1d_backward,
    adaptive_avg_pool2d,
    adaptive_avg_pool2d_backward,
    adaptive_avg_pool3d,
    adaptive_avg_pool3d_backward,
    adaptive_max_pool1d,
    adaptive_max_pool1d_backward,
    adaptive_max_pool2d,
    adaptive_max_pool2d_backward,
    adaptive_max_pool3d,
    adaptive_max_pool3d_backward,
    devices,
    explain,
    release_memory,
    variants,
)
from .fleet import tune_many
from .measured import benchmark_mode
from .fused import (
    adaptive_avg_pool_pyramid,
    adaptive_avg_pool_pyramid_backward,
    adaptive_avgmax_pool2d,
    adaptive_avgmax_pool2d_backward,
    adaptive_max_pool_pyramid,
    adaptive_max_pool_pyramid_backward,
)
from .gem import (
    adaptive_gem_pool1d,
    adaptive_gem_pool1d_backward,
    adaptive_gem_pool2d,
    adaptive_gem_pool2d_backward,
    adaptive_gem_pool3d,
    adaptive_gem_pool3d_backward,
)
from .tuner import tune
from .version import __version__
from .windows import fixed_pool_equivalent, pooling_windows

__all__ = [
    "adaptive_avg_pool1d",
    "adaptive_avg_pool1d_backward",
    "adaptive_avg_pool2d",
    "adaptive_avg_pool2d_backward",
    "adaptive_avg_pool3d",
    "adaptive_avg_pool3d_backward",
    "adaptive_max_pool1d",
    "adaptive_max_pool1d_backward",
    "adaptive_max_pool2d",
    "adaptive_max_pool2d_backward",
    "adaptive_max_pool3d",
    "adaptive_max_pool3d_backward",
    "adaptive_avg_pool_pyramid",
    "adaptive_avg_pool_pyramid_backward",
    "adaptive_max_pool_pyramid",
    "adaptive_max_pool_pyramid_backward",
    "adaptive_avgmax_pool2d",
    "adaptive_avgmax_pool2d_backward",
    "adaptive_gem_pool1d",
    "adaptive_gem_pool1d_backward",
    "adaptive_gem_pool2d",
    "adaptive_gem_pool2d_backward",
    "adaptive_gem_pool3d",
    "adaptive_gem_pool3d_backward",
    "__version__",
    "benchmark_mode",
    "devices",
    "explain",
    "fixed_pool_equivalent",
    "pooling_windows",
    "release_memory",
    "tune",
    "tune_many",
    "variants",
]
