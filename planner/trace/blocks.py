"""Which modules are the repeated blocks of a model, found from its module tree alone."""

from __future__ import annotations

from collections import Counter

from torch import nn

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def block_units(modules: dict[str, nn.Module]) -> list[str]:
    """Module paths of the repeated blocks, in definition order.

    The children of the outermost ModuleList/Sequential/ModuleDict whose majority
    class repeats and has parameters (transformer layers; ResNet's four stages
    contribute all their blocks). Without one, each top-level child that has
    parameters is a block.
    """
    candidates = []
    for path, module in modules.items():
        if not isinstance(module, _CONTAINERS):
            continue
        children = list(module.named_children())
        if len(children) < 2:
            continue
        cls, count = Counter(type(c) for _, c in children).most_common(1)[0]
        if count < 2 or 2 * count < len(children):
            continue
        members = [f"{path}.{n}" if path else n for n, c in children if type(c) is cls]
        if any(sum(p.numel() for p in modules[m].parameters()) for m in members):
            candidates.append((path, members))
    chosen: list[tuple[str, list[str]]] = []
    for path, members in sorted(candidates, key=lambda c: c[0].count(".") + bool(c[0])):
        if not any(not outer or path.startswith(f"{outer}.") for outer, _ in chosen):
            chosen.append((path, members))
    if chosen:
        return [m for _, members in chosen for m in members]
    root = modules[""]
    return [name for name, child in root.named_children()
            if any(p.numel() for p in child.parameters())]


def unit_of(module: str, units: set[str]) -> str | None:
    """The block that module path `module` belongs to, if any."""
    path = module
    while path:
        if path in units:
            return path
        path = path.rpartition(".")[0]
    return None
