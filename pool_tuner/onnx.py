"""ONNX export of adaptive pooling as exact decompositions into standard ONNX operators.

PyTorch refuses to export ``nn.AdaptiveAvgPool*d``/``AdaptiveMaxPool*d`` to ONNX unless every
output size divides its input size, and ONNX runtimes cannot run pool_tuner's kernels.  Both
have exact equivalents in standard operators (``pool_tuner.decomposition`` says which).

``export(model, args, f)`` exports a copy of ``model`` whose PyTorch and pool_tuner adaptive
pooling layers are replaced by these decompositions, and pool_tuner's other layers (GeM,
avg+max, global and pyramid pooling) by their ``composed()`` forms in standard operators;
pool_tuner's layers and functional forms also decompose themselves under a plain
``torch.onnx.export``.  The pooled input sizes must be
static (batch and channel sizes may be dynamic).  ``onnx`` and ``onnxscript`` (the exporter) are
imported only by ``export``: ``pip install "pool-tuner[onnx]"``.
"""

from __future__ import annotations

import copy

try:
    import torch
except ModuleNotFoundError as error:  # only torch itself missing, not something torch imports
    if error.name != "torch":
        raise
    raise ImportError(
        'pool_tuner.onnx needs PyTorch, which is not installed: pip install "pool-tuner[onnx]"'
    ) from error

from .decomposition import decompose
from .shapes import resolve_output_size
from .torch import REPLACEMENTS, _OwnModule, _PoolTunerModule, swap_layers

__all__ = ["export"]


class DecomposedPool(torch.nn.Module):
    """An adaptive pooling layer as its ONNX-exportable decomposition (see ``decompose``);
    ``name`` is the qualified name of the layer it stands for."""

    def __init__(self, kind: str, ndim: int, output_size, name: str):
        super().__init__()
        self.kind, self.ndim, self.output_size, self.name = kind, ndim, output_size, name

    def forward(self, input):
        spatial = tuple(input.shape[input.dim() - self.ndim:])
        output_size = resolve_output_size(self.output_size, spatial, f"{self.name}.output_size")
        return decompose(self.kind, self.ndim, input, output_size, f"layer {self.name!r}")

    def extra_repr(self) -> str:
        return f"{self.kind}, {self.ndim}d, output_size={self.output_size!r}, name={self.name!r}"


#: pool_tuner's and PyTorch's layer classes -> (kind, ndim)
_KNOWN = {cls: (ours.kind, ours.ndim) for cls, ours in REPLACEMENTS.items()}
_KNOWN.update({ours: (ours.kind, ours.ndim) for ours in REPLACEMENTS.values()})
_ADAPTIVE_BASES = tuple(REPLACEMENTS)


def _decomposed(name: str, module: torch.nn.Module) -> torch.nn.Module:
    if isinstance(module, _OwnModule) and hasattr(module, "composed"):  # GeM, avg+max, global, pyramid layers
        return module.composed()
    known = _KNOWN.get(type(module))
    if known is None:
        if isinstance(module, _ADAPTIVE_BASES + (_PoolTunerModule,)):
            raise TypeError(
                f"layer {name or '<root>'!r} is a {type(module).__module__}.{type(module).__qualname__}, a subclass "
                f"of an adaptive pooling layer that pool_tuner.onnx does not know (its forward may differ); "
                f"known layers: torch.nn.Adaptive{{Avg,Max}}Pool{{1,2,3}}d and pool_tuner.torch's"
            )
        return module
    if getattr(module, "return_indices", False):
        raise ValueError(
            f"layer {name or '<root>'!r} ({type(module).__name__}) has return_indices=True: pool_tuner.onnx exports "
            f"max pooling values only; construct it with return_indices=False for export"
        )
    kind, ndim = known
    return DecomposedPool(kind, ndim, module.output_size, name or "<root>")


def decomposed(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` with every adaptive pooling layer (PyTorch's or pool_tuner's)
    replaced by its ``DecomposedPool``; ``model`` itself is untouched."""
    return swap_layers(copy.deepcopy(model), _decomposed)


def export(model: torch.nn.Module, args: tuple, f=None, *, kwargs=None, dynamic_shapes=None, **options):
    """Export ``model`` to ONNX with every adaptive pooling layer (PyTorch's, including the
    non-divisible sizes PyTorch's exporter refuses, and pool_tuner's) as an exact decomposition
    into standard ONNX operators; returns the ``torch.onnx.ONNXProgram``, saved to ``f`` if given.

    ``args``/``kwargs``/``dynamic_shapes`` are ``torch.export.export``'s; ``options`` go to
    ``torch.onnx.export`` (e.g. ``opset_version``).  Raises ``ValueError``/``TypeError`` naming the
    layer for a pooled size that is dynamic, a max layer with ``return_indices=True``, or a
    subclass of an adaptive pooling layer it does not know."""
    _require("onnx")
    _require("onnxscript")
    program = torch.export.export(decomposed(model), tuple(args), kwargs, dynamic_shapes=dynamic_shapes)
    onnx_program = torch.onnx.export(program, f, **options)
    return onnx_program


def _require(package: str):
    try:
        __import__(package)
    except ModuleNotFoundError as error:
        if error.name != package:
            raise
        raise ImportError(
            f"pool_tuner.onnx.export needs {package}, which is not installed: pip install \"pool-tuner[onnx]\""
        ) from error
