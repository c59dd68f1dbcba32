"""The forms of GeM's input-gradient pass (``pool_tuner.gem``'s backward): a work-item per input
(``kernels/operators/gem_input_gradient.c``, any problem and device) or per plane
(``kernels/operators/gem_plane_gradient.c``, small channels-first planes on CPU devices), and the
one rule that chooses between them for a problem and device -- read by the pass that runs them
(``pool_tuner.gem``) and by ``explain`` (``pool_tuner.ops``), which names the form a call runs."""

from __future__ import annotations

import dataclasses
import math

from .operations import find
from .problem import Problem
from .variants import GemPlaneWindows

#: The input-gradient kernel, as GeM's op object names it (``Operation.backward_kernel``), and its one
#: configuration (neighbouring work-items on neighbouring inputs).
INPUT_GRADIENT_KERNEL = find("gem", 2).backward_kernel
INPUT_GRADIENT_CONFIG = find("gem", 2).backward_kernel_config
#: The inputs one work-group of the input-gradient kernel takes.
GROUP_INPUTS = INPUT_GRADIENT_CONFIG["block_size_x"] * INPUT_GRADIENT_CONFIG["items_per_thread"]


@dataclasses.dataclass(frozen=True)
class GradientForm:
    """A form of GeM's input-gradient pass: its kernel (``kernels/operators/<kernel>.c``), its one
    configuration, and whether a work-item takes a whole plane (one term of ``dL/dp`` per plane)
    or an input (one term per work-group of ``GROUP_INPUTS`` inputs)."""
    kernel: str
    config: dict = dataclasses.field(hash=False, compare=False)
    per_plane: bool

    @property
    def file(self) -> str:
        return f"operators/{self.kernel}.c"


#: A work-item per input: any problem, any device.
ELEMENT_FORM = GradientForm(INPUT_GRADIENT_KERNEL, INPUT_GRADIENT_CONFIG, False)
#: A work-item per plane (its inputs in vector steps in OpenCL), neighbouring work-items on neighbouring
#: planes: small channels-first planes on CPU devices, where the element form's work-items each load
#: their plane's coefficients and reduce the terms of p in local memory, which cost several times the
#: plane form's time on PoCL.  On GPUs the element form's neighbouring work-items read neighbouring
#: inputs; the plane form's would read a plane apart (not measured on a GPU).
PLANE_FORM = GradientForm("gem_plane_gradient", {"block_size_x": 64}, True)


def input_gradient_form(device, problem: Problem) -> GradientForm:
    """The form of the input-gradient pass that GeM's backward ``problem`` runs on ``device``: the
    plane form for channels-first planes of at most ``GemPlaneWindows.PLANE_LIMIT`` inputs into at
    most ``GemPlaneWindows.OUTPUTS_LIMIT`` outputs on a CPU device (the forward's limits: both
    kernels unroll the plane's inputs times its outputs), else the element form."""
    small = (math.prod(problem.in_spatial) <= GemPlaneWindows.PLANE_LIMIT
             and math.prod(problem.out_spatial) <= GemPlaneWindows.OUTPUTS_LIMIT)
    return PLANE_FORM if small and not problem.channels_last and device.info.is_cpu else ELEMENT_FORM
