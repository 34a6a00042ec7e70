"""Which model variable each Keras optimizer variable (a slot) was made from, and the
optimizers a Keras optimizer wraps: what gt.keras needs to give a slot its weight's
sharding and to re-key an optimizer's variable indices after the variables behind it
were replaced."""

from __future__ import annotations


def slot_references(optimizer, trainable):
    """id(optimizer variable) -> the model variable it was created from."""
    refs = dict(getattr(optimizer, "_gt_slot_refs", {}))
    prefixes = [(v.path.replace("/", "_") + "_", v) for v in trainable]
    prefixes.sort(key=lambda p: -len(p[0]))
    for var in optimizer.variables:
        if id(var) in refs:
            continue
        for prefix, ref in prefixes:  # Keras names slots "{ref path with _}_{slot name}"
            if var.name.startswith(prefix) and tuple(var.shape) == tuple(ref.shape):
                refs[id(var)] = ref
                break
    return refs


def optimizer_chain(optimizer):
    """`optimizer` and the optimizers it wraps (a LossScaleOptimizer's inner_optimizer,
    as keras.mixed_precision's "mixed_float16" policy makes), outermost first."""
    chain = []
    while optimizer is not None and all(optimizer is not seen for seen in chain):
        chain.append(optimizer)
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return chain


def build_optimizer(optimizer, trainable):
    """Build the optimizer for `trainable`, recording which model variable each
    optimizer variable (of it or of an optimizer it wraps) was made from."""
    refs = {}
    chain = optimizer_chain(optimizer)

    def recording(original):
        def record(reference_variable, *args, **kwargs):
            made = original(reference_variable, *args, **kwargs)
            refs[id(made)] = reference_variable
            return made
        return record

    for wrapped in chain:
        object.__setattr__(wrapped, "add_variable_from_reference",
                           recording(wrapped.add_variable_from_reference))
    try:
        optimizer.build(trainable)
    finally:
        for wrapped in chain:
            object.__delattr__(wrapped, "add_variable_from_reference")
    object.__setattr__(optimizer, "_gt_slot_refs", refs)
