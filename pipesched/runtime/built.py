"""What a Pipeline was built from, checked at each ``step()`` to be unchanged: the model's layers and the parameters
of this rank's stages (a rank's own check, ruled on in the opening: every rank refuses the step together, and the
pipeline stays usable).

The stages run the layers of construction, and the data-parallel all-reduce, the tied-gradient sums and the count of
saved activation bytes hold the parameter objects of construction. A layer replaced in the model afterwards
(``model[3] = nn.Linear(...)``) would silently not run; a parameter replaced (``layer.weight = nn.Parameter(...)``,
``load_state_dict(..., assign=True)``), added (an adapter) or removed would be left out of those sums: the replicas'
gradients silently not averaged, a tie's copies not summed (found by a hunt, session 14). Values copied in place
(``p.copy_(...)`` under ``no_grad``, ``load_state_dict`` without ``assign``) keep the objects and need nothing."""
from __future__ import annotations

from .stage import layers_of
from .state import rank_view

_MISSING = object()  # no key: never a module's child or parameter

#: what to do instead, said by every refusal
REMEDY = ("the stages, the data-parallel all-reduce, the tied-gradient sums and the activation accounting hold what "
          "the Pipeline was built from; copy new values in place (with torch.no_grad(): p.copy_(new), or "
          "load_state_dict without assign=True), or build a new Pipeline")


class Built:
    """The model's layers and every module of this rank's stages with the parameters it held at construction (by
    identity).

    Args:
        model: the model the Pipeline was built from (an ``nn.Sequential`` or a list of modules).
        stages, first_layers, names: as :func:`~pipesched.runtime.state.rank_view` (``Pipeline.stages``,
            ``Pipeline.first_layers``, ``Pipeline.layer_names``): parameters are named as in the unsplit model.
    """

    def __init__(self, model, stages: dict, first_layers, names=None) -> None:
        self.model, self.layers, self.names = model, layers_of(model), names
        #: the indices of this rank's layers: only those are checked (a rank may drop the others, e.g. replace them
        #: by nn.Identity() to free their memory; the rank holding one checks it)
        self.mine = [i for s in sorted(stages) for i in range(first_layers[s], first_layers[s + 1])]
        self.view = rank_view(stages, first_layers, names)
        self.stage_of = {key: s for s in sorted(stages) for key in _keys(self.view, stages[s])}
        self.named = dict(self.view.named_parameters(remove_duplicate=False))
        self.built = {id(p) for p in self.named.values()}  # the parameter objects of construction
        self.held = self._hold()

    def _hold(self) -> list:
        """Every module with the parameters and children it holds now: the fast path's snapshot (the tree is
        unchanged iff each module still holds the same children and parameters)."""
        return [(m, tuple(m._parameters.items()), tuple(m._modules.items())) for m in self.view.modules()]

    def changed(self) -> str | None:
        """``None`` while this rank's layers and parameter objects are those of construction, else what changed, in
        words: the first layer of the model replaced (added, removed), or parameter of this rank replaced (added,
        removed), by its name in the unsplit model and its stage, and what to do instead. Not a change: a
        parameter-free child module added or swapped inside a layer, a parameter renamed while the object stays
        (pruning's ``weight_orig``, a parametrization's ``original``). About half a microsecond per module."""
        try:
            layers = layers_of(self.model)
        except (TypeError, ValueError) as exc:  # e.g. a hook registered on the container since
            return f"the model changed after this Pipeline was built: {exc}"
        if len(layers) != len(self.layers) or any(layers[i] is not self.layers[i] for i in self.mine):
            return self._layer_text(layers)
        if all(_holds(m._parameters, params) and _holds(m._modules, children) for m, params, children in self.held):
            return None
        text = self._parameter_text()
        if text is None:  # the same parameter objects: nothing the Pipeline holds is stale; the fast path again
            self.held, self.named = self._hold(), dict(self.view.named_parameters(remove_duplicate=False))
        return text

    def _layer_text(self, layers) -> str:
        if len(layers) != len(self.layers):
            return (f"the model has {len(layers)} layers, was built from {len(self.layers)}: layers were added or "
                    f"removed after this Pipeline was built; build a new Pipeline")
        i = next(i for i in self.mine if layers[i] is not self.layers[i])
        name = str(i) if self.names is None else self.names[i]
        where = f" (stage {self.stage_of[name]})" if name in self.stage_of else ""
        return (f"layer '{name}'{where} of the model is not the one this Pipeline was built with: it was replaced "
                f"after construction, and the stages run the layers of construction; build a new Pipeline (or copy "
                f"the new layer's values into the old one in place)")

    def _parameter_text(self) -> str | None:
        """What differs between the parameter objects now and at construction (by identity; names only say it)."""
        now = dict(self.view.named_parameters(remove_duplicate=False))
        alive = {id(p) for p in now.values()}
        for name, p in self.named.items():
            if id(p) not in alive:
                return self._text(name, "is not the one this Pipeline was built with: it was replaced after "
                                        "construction (a new nn.Parameter assigned, or load_state_dict(..., "
                                        "assign=True))" if name in now else "was removed after this Pipeline was built")
        added = next((name for name, p in now.items() if id(p) not in self.built), None)
        return None if added is None else self._text(added, "was added after this Pipeline was built")

    def _text(self, name: str, what: str) -> str:
        stage = self.stage_of.get(name.split(".")[0])
        where = "" if stage is None else f" (stage {stage})"
        return f"parameter '{name}'{where} {what}; {REMEDY}"


def _holds(now: dict, before: tuple) -> bool:
    """``now`` holds the same objects under the same keys as ``before`` (its items then), in any order."""
    return len(now) == len(before) and all(now.get(key, _MISSING) is value for key, value in before)


def _keys(view, stage_module) -> list[str]:
    """The keys in ``view`` of the layers of ``stage_module``."""
    layers = {id(layer) for layer in stage_module}
    return [key for key, layer in view.named_children() if id(layer) in layers]
