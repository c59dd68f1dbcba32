"""timm's pooling layers as ``replace_pooling`` sees them.

timm (``timm.layers.adaptive_avgmax_pool``) pools a model's features through its own layers --
``SelectAdaptivePool2d`` holds one as its ``pool`` -- which call ``F.adaptive_*_pool2d`` or
``x.mean``/``x.amax`` rather than being PyTorch's adaptive pooling layers, so they are recognised
here by their class's module and name: timm is never imported, and a model without timm's layers
costs a look at each module's class.  ``recognise`` says what a layer computes, in the terms of
pool_tuner's modules (``pool_tuner.torch`` builds the replacement), or why it stays timm's.
"""

from __future__ import annotations

import dataclasses

from .avgmax import MODES as TWO_LEVEL_MODES

#: Where timm defines its pooling layers.
TIMM_POOLING = "timm.layers.adaptive_avgmax_pool"
#: The layer ``SelectAdaptivePool2d`` holds, not a pooling itself.
CONTAINER = "SelectAdaptivePool2d"
#: timm's spatial dims -> the format pool_tuner's GlobalPool2d calls them by (timm's names).
FORMATS = {(2, 3): "NCHW", (1, 2): "NHWC"}
#: The channel dim of each format (timm's ``get_channel_dim``), where catavgmax concatenates.
CHANNEL_DIMS = {"NCHW": 1, "NHWC": 3}


@dataclasses.dataclass(frozen=True)
class TimmLayer:
    """One of timm's pooling layers in pool_tuner's terms.  ``mode`` is pool_tuner's name of
    timm's pool type (``"avg"``, ``"max"``, ``"avg+max"``, ``"cat"``).  A ``fast`` layer pools over
    the whole plane with ``x.mean``/``x.amax`` (pool_tuner's ``GlobalPool2d``: ``flatten``,
    ``input_fmt``); the others pool adaptively to ``output_size`` (``AdaptiveAvgMaxPool2d``)."""

    mode: str
    fast: bool
    reason: str
    output_size: object = 1
    flatten: bool = False
    input_fmt: str = "NCHW"

    @property
    def pools_twice(self) -> bool:
        """Whether timm pools the input twice (avg and max): pool_tuner's one read is the fused op."""
        return self.mode in TWO_LEVEL_MODES


#: timm's class name -> (mode, fast, why pool_tuner's module computes the same)
LAYERS = {
    "AdaptiveAvgMaxPool2d": ("avg+max", False, "timm's avgmax, 0.5 * (avg + max) of adaptive poolings: both "
                                               "levels from one read (pool_tuner's fused avgmax op)"),
    "AdaptiveCatAvgMaxPool2d": ("cat", False, "timm's catavgmax, adaptive avg and max concatenated along the "
                                              "channels: both levels from one read (pool_tuner's fused avgmax op)"),
    "FastAdaptiveAvgPool": ("avg", True, "timm's fast avg, x.mean over the spatial dims: pool_tuner's global "
                                         "average pooling"),
    "FastAdaptiveMaxPool": ("max", True, "timm's fast max, x.amax over the spatial dims: pool_tuner's global max "
                                         "pooling, its gradient amax's (split among tied maxima)"),
    "FastAdaptiveAvgMaxPool": ("avg+max", True, "timm's fast avgmax, 0.5 * avg + 0.5 * max by x.mean and x.amax: "
                                                "both levels from one read (pool_tuner's fused avgmax op), the "
                                                "gradient timm's"),
    "FastAdaptiveCatAvgMaxPool": ("cat", True, "timm's fast catavgmax, x.mean and x.amax concatenated along the "
                                               "channels: both levels from one read (pool_tuner's fused avgmax "
                                               "op), the gradient timm's"),
}


def _timm_class(cls) -> bool:
    return cls.__module__ == TIMM_POOLING


def recognise(module) -> TimmLayer | str | None:
    """What ``module`` is: one of timm's pooling layers that pool_tuner computes (a ``TimmLayer``),
    one it leaves as it is (the reason, a string), or None: not timm's pooling at all (and
    ``SelectAdaptivePool2d``, whose ``pool`` is the layer)."""
    cls = type(module)
    timm_bases = [base for base in cls.__mro__ if _timm_class(base)]
    if not timm_bases or timm_bases[0].__name__ == CONTAINER:
        return None
    name = cls.__name__
    if not _timm_class(cls):
        return (f"a subclass of timm's {timm_bases[0].__name__}: its forward may differ from timm's, "
                f"so it is left as it is")
    if name not in LAYERS:
        return f"a timm pooling layer pool_tuner does not know ({name}): left as it is"
    mode, fast, reason = LAYERS[name]
    if not fast:
        return TimmLayer(mode, fast, reason, output_size=module.output_size)
    dims = tuple(getattr(module, "dim_reduce", getattr(module, "dim", ())))
    input_fmt = FORMATS.get(dims)
    if input_fmt is None:
        return f"pools over dims {dims}, not those of a 2-d image in NCHW or NHWC: left as it is"
    flatten = bool(module.flatten)
    concatenated_along = getattr(module, "dim_cat", None)
    if concatenated_along is not None and concatenated_along != (1 if flatten else CHANNEL_DIMS[input_fmt]):
        return f"concatenates along dim {concatenated_along}, not the channels: left as it is"
    return TimmLayer(mode, fast, reason, flatten=flatten, input_fmt=input_fmt)
