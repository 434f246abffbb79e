"""The ``torchtitan_ext`` operators: Python functions registered with ``torch.library.Library``.

``torch.library.custom_op`` gives the same operators with Python layers around every call: an
autograd kernel on every op (also those without a gradient formula), a check that no output
aliases an input, and a wrapper that turns Dynamo off. On a 2-core CPU with torch 2.13, with
gradients off (as a compiled graph calls its ops), a call of a trivial op took 21 us that way
against 6.6 us with the function registered as the op's kernel, and 23 against 12.6 us for an op
with a gradient formula. A compiled MoE layer calls 5 (bf16 ``triton``) to 22 (FP8 ``triton``) of
these ops a forward+backward, and a layer whose GPU waits for the host pays every microsecond.

``kernel_op(name)`` defines ``torchtitan_ext::name`` from the function's type hints
(``torch.library.infer_schema``, nothing mutated), tags it ``pt2_compliant_tag`` as ``custom_op``
does, and registers the function as its kernel on every device (``CompositeExplicitAutograd``).
It returns the operator (``torch.ops.torchtitan_ext.<name>.default``). The fake (meta) function and,
for an op with a gradient formula, the autograd function are registered with
``torch.library.register_fake`` / ``register_autograd``, as for any operator. The aliasing rule
(no output is an input or a view of one) is held by ``torch.library.opcheck`` in the tests. An op
without a gradient formula is called where autograd records nothing: inside an
``autograd.Function``'s forward, in a backward, or on tensors that need no gradient.
"""

from collections.abc import Callable

import torch

NAMESPACE = "torchtitan_ext"
_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")


def kernel_op(name: str) -> Callable[[Callable], torch._ops.OpOverload]:
    """Decorator: the function below as the operator ``torchtitan_ext::name`` (module docstring)."""

    def define(kernel: Callable) -> torch._ops.OpOverload:
        schema = torch.library.infer_schema(kernel, mutates_args=())
        _LIBRARY.define(name + schema, tags=[torch.Tag.pt2_compliant_tag])
        _LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
        return getattr(getattr(torch.ops, NAMESPACE), name).default

    return define
