"""One forward pass of the model, recorded for the per-job gradient terms (``gradients.py``): each
layer with parameters' calls (inputs, output) and the ops that read a parameter outside its own leaf
layer (``hybrid.ParamWatch``).

Why a recorder of its own: the pass must keep what the model's later in-place edits would change.
A layer's kept input or output that the model changes in place afterwards is marked to be copied
and the pass is run again; the marks stay for later passes.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial

from torch import Tensor, nn

from .hybrid import Call, ParamWatch, UnsupportedModelError, module_call
from .layer_terms import formula_for


@dataclass
class LayerMap:
    """The model's parameters and its leaf layers with parameters, found once from its modules."""

    names: list[str]  # parameter names, model.named_parameters() order
    index: dict[int, int]  # id(parameter) -> its index
    layers: list[tuple[nn.Module, dict[str, int]]] = field(default_factory=list)  # (layer, own key -> index)
    layer_names: list[str] = field(default_factory=list)
    # id(parameter) -> id(its leaf layer), or None for a parameter of a module that also runs children
    owner: dict[int, int | None] = field(default_factory=dict)
    loose: list[int] = field(default_factory=list)  # indices of the parameters read outside a leaf layer

    @classmethod
    def of(cls, model: nn.Module) -> LayerMap:
        named = list(model.named_parameters())
        found = cls([name for name, _ in named], {id(p): i for i, (_, p) in enumerate(named)})
        for mname, module in model.named_modules():
            own = dict(module.named_parameters(recurse=False))
            if not own:
                continue
            label = f"{mname or type(module).__name__} ({type(module).__name__})"
            if any(id(p) in found.owner for p in own.values()):
                raise UnsupportedModelError(f"layer {label} shares a parameter with another layer")
            entry = formula_for(module)
            if entry is not None and entry.couples(module):
                raise UnsupportedModelError(
                    f"layer {label} couples the images of a batch (BatchNorm with batch statistics): one job at a time"
                )
            if next(module.children(), None) is not None:
                for p in own.values():
                    found.owner[id(p)] = None
                    found.loose.append(found.index[id(p)])
                continue
            found.layers.append((module, {k: found.index[id(p)] for k, p in own.items()}))
            found.layer_names.append(mname or type(module).__name__)
            found.owner.update({id(p): id(module) for p in own.values()})
        return found


class PassRecorder:
    def __init__(self, model: nn.Module, layers: LayerMap) -> None:
        self.model, self.map = model, layers
        # Watch parameter reads (ParamWatch) while a pass may read one outside its leaf layer: always
        # with loose parameters, else in the first pass only (a model that finds none is not watched again).
        self.watch = True
        self.clone_in: set[int] = set()  # layers whose inputs / output the model changes in place later
        self.clone_out: set[int] = set()
        self.op_clone_in: set[int] = set()
        self.op_clone_out: set[int] = set()

    def run(self, x: Tensor) -> tuple[Tensor, list[list[Call]], list[Call]]:
        """The logits, each layer's calls and the recorded parameter reads of one pass of ``x``."""
        logits, calls, ops, again = self._forward(x)
        if again:
            logits, calls, ops, again = self._forward(x)
            if again:
                raise UnsupportedModelError("a layer's input or output is changed in place, unstably")
        if self.watch and not ops and not self.map.loose:
            self.watch = False  # nothing read outside its layer: later passes need no watching
        return logits, calls, ops

    def _forward(self, x: Tensor) -> tuple[Tensor, list[list[Call]], list[Call], bool]:
        """The logits, each layer's calls, the recorded parameter reads, and whether the pass must be
        run again (a kept input or output was changed in place later: now marked to be copied)."""
        m = self.map
        calls: list[list[Call]] = [[] for _ in m.layers]
        running: list[int] = []
        watch = ParamWatch(m.owner, m.index, m.names, running, x.shape[0]) if self.watch else None
        if watch is not None:
            watch.clone_in, watch.clone_out = self.op_clone_in, self.op_clone_out

        def enter(i: int, module: nn.Module, args: tuple, kwargs: dict):
            running.append(id(module))
            if i in self.clone_in:  # copies of the inputs (not parameter reads)
                return tuple(a.clone() if isinstance(a, Tensor) else a for a in args), kwargs
            return None

        def keep(i: int, module: nn.Module, args: tuple, kwargs: dict, out: Tensor):
            running.pop()
            if not isinstance(out, Tensor):
                raise UnsupportedModelError(f"layer {m.layer_names[i]} returns a {type(out).__name__}, not one tensor")
            keys = list(m.layers[i][1])
            indices = [m.layers[i][1][k] for k in keys]
            if watch is not None:
                watch.paused = True
            try:
                calls[i].append(module_call(module, keys, indices, args, kwargs, out, f"layer {m.layer_names[i]}"))
                return out.clone() if i in self.clone_out else None
            finally:
                if watch is not None:
                    watch.paused = False

        hooks = []
        for i, (module, _) in enumerate(m.layers):
            hooks.append(module.register_forward_pre_hook(partial(enter, i), with_kwargs=True))
            hooks.append(module.register_forward_hook(partial(keep, i), with_kwargs=True))
        try:
            with watch if watch is not None else nullcontext():
                logits = self.model(x)
        finally:
            for h in hooks:
                h.remove()
        ops = watch.calls if watch is not None else []
        again = False
        for i, layer_calls in enumerate(calls):
            for call in layer_calls:
                for t, v in call.versions[:-1]:
                    if t._version != v:
                        again = again or i not in self.clone_in
                        self.clone_in.add(i)
                if call.versions and call.versions[-1][0]._version != call.versions[-1][1]:
                    again = again or i not in self.clone_out
                    self.clone_out.add(i)
        for k, call in enumerate(ops):
            if call.changed():
                if any(t._version != v for t, v in call.versions[:-1]):
                    again = again or k not in self.op_clone_in
                    self.op_clone_in.add(k)
                if call.versions[-1][0]._version != call.versions[-1][1]:
                    again = again or k not in self.op_clone_out
                    self.op_clone_out.add(k)
        if not again and any(c.changed() for cs in calls for c in cs):
            raise UnsupportedModelError("a layer's input or output is changed in place even when copied")
        return logits, calls, ops, again
