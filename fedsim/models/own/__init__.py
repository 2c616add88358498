"""Your own model: any ``nn.Module`` from a Python factory (``module.path:factory``) or from timm
(``timm:NAME``), adapted so that the federation and the attacker treat it like the built-in models.

Both kinds are entries of the one model table (``registry.MODELS``, keys ``CALLABLE_KEY`` and
``TIMM_KEY``); ``registry.model_family`` maps a name with a ``:`` to them (``own_model_key``), so no
caller needs to know which kind a model is. Their attack settings are the ``generic`` profile entry.

What ``adapt`` does to the model, once per build:

* every ``nn.Dropout`` with p > 0 becomes a ``MaskedDropout`` of the same p, so its masks are sampled,
  recorded, replayed and learned like the built-in models'; a dropout of rate 0 is an identity and is
  left as it is (timm reads ``attn_drop.p``, so it cannot be removed);
* functional dropout in ``forward`` (``F.dropout`` or ``torch.dropout``; timm's ResNet head calls
  ``F.dropout`` when ``drop_rate`` > 0) is routed, call by call, to a ``MaskedDropout`` of its own
  while the model runs (``routing.FunctionalCalls``);
* stochastic depth (timm's ``DropPath``, which ``drop_path_rate`` puts in the residual blocks, and
  torchvision's ``StochasticDepth`` in "row" mode) becomes a ``MaskedDropPath`` of the same rate: a
  second mask, one keep-or-drop per image (shape (B, 1, ..., 1)), sampled and recorded by the client,
  replayed by WIIG and learned by DIA like a dropout mask, with its own rate (timm spreads
  ``drop_path_rate`` linearly over the blocks) where the run's p is the dropout's;
* the dropout layers are listed in the order one forward pass first runs them (``routing.OwnModel``);
  a layer that runs more than once in a pass (timm's distilled DeiT runs ``head_drop`` on both
  heads' tokens) gets a mask per call, in call order, as every model does (``fedsim.models.dropout``);
* in-place activations and fused attention are switched off: the attack keeps layer outputs that an
  in-place op would overwrite, and differentiates the model's gradient a second time, which fused
  attention (``F.scaled_dot_product_attention``'s CPU kernel) does not support; any other in-place
  edit of a kept input or output (``x = self.conv(x); x += 1``, ``relu_``) is the engine's to handle:
  it finds it by the tensor's version, copies that layer's input or output and runs the pass again
  (attacker/engine/gradients.py), so it is not refused here;
* every activation whose derivative torch cannot differentiate (``nn.Hardsigmoid``: the attack
  differentiates the gradient a second time) becomes an exact equivalent built from ops it can
  (``TWICE_DIFFERENTIABLE``, one entry per activation): its modules are swapped for an
  ``ExactActivation``, and its functional calls in ``forward`` (``F.hardsigmoid``) are routed to the
  same function while the model runs (``routing.FunctionalCalls``);
* BatchNorm runs as the client runs it, chosen by the model option ``batchnorm_mode``
  (``BATCHNORM_OPTION``, never passed to the factory): "eval" (the default) keeps it in eval mode in
  the clients' training and in the attack alike, an affine map of each image with the running
  statistics, which the attack batches like any layer; "train" leaves it to the model's mode, so
  the clients' local rounds normalize by their batch's statistics (and update the running ones) and
  so does the attack's replay of a victim batch: the images of a batch are coupled, so the attack
  takes each victim batch as one job, one at a time (attacker/engine/gradients.py), and needs B >= 2
  wherever a feature map reaches 1x1 (train-mode BatchNorm rejects a single value per channel).

What it refuses, in one line naming the model or the layer (``ModelSpecError``): a factory that cannot
be imported or raises, an unknown timm name, an output that is not (batch, classes) logits, a dropout
whose rate is not the run's p, functional dropout it
cannot route (in place, channel-wise, alpha, inside attention), any other random draw in ``forward``
(a hand-written stochastic depth, torchvision's "batch" mode, a timm ``DropPath`` without
``scale_by_keep``: a mask the attack cannot record or replay), train-mode BatchNorm unless
``batchnorm_mode`` is "train", and a model whose gradient the attack cannot differentiate
(``check``).

The package, one job a module: ``spec`` (the spec fields it reads, the table keys, ``batchnorm_mode``),
``trust`` (which factories may be imported, and importing one), ``build`` (calling the factory or
timm), ``swap`` (the dropout and drop-path layers), ``activations`` (``TWICE_DIFFERENTIABLE`` and its
swap), ``routing`` (``OwnModel`` and the functional calls routed while it runs), ``probe`` (the probe
pass, the refusals, and ``adapt``, which puts these together) and ``check`` (the second-order check).
"""

from .activations import EXACT_CALLS, TWICE_DIFFERENTIABLE, Exact, ExactActivation, hardsigmoid
from .build import RUN_ARGUMENTS, TIMM_RUN_ARGUMENTS, from_callable, from_timm
from .check import check_callable, check_timm, model_problem, second_order_problem
from .probe import adapt
from .routing import OwnModel
from .spec import (
    BATCHNORM_MODES,
    BATCHNORM_OPTION,
    CALLABLE_KEY,
    TIMM_KEY,
    TIMM_PREFIX,
    ModelSpec,
    batchnorm_mode,
    own_model_key,
)
from .trust import TRUSTED_FACTORIES_ENV, trust_factory, trusted_factories, untrusted

# The name tests/test_own_models.py has imported since this package was one module.
_second_order_problem = second_order_problem

__all__ = [
    "BATCHNORM_MODES",
    "BATCHNORM_OPTION",
    "CALLABLE_KEY",
    "EXACT_CALLS",
    "RUN_ARGUMENTS",
    "TIMM_KEY",
    "TIMM_PREFIX",
    "TIMM_RUN_ARGUMENTS",
    "TRUSTED_FACTORIES_ENV",
    "TWICE_DIFFERENTIABLE",
    "Exact",
    "ExactActivation",
    "ModelSpec",
    "OwnModel",
    "adapt",
    "batchnorm_mode",
    "check_callable",
    "check_timm",
    "from_callable",
    "from_timm",
    "hardsigmoid",
    "model_problem",
    "own_model_key",
    "second_order_problem",
    "trust_factory",
    "trusted_factories",
    "untrusted",
]
