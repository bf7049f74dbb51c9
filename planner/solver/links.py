"""The fastest links and gathers any placement could give a family's pipelines, for
bounds that hold wherever `structure.place` puts them."""

from __future__ import annotations

import dataclasses
import itertools

from cost_models.comm import send_sharing, shared_by
from planner.solver.keys import BestLinkKey
from planner.solver.partition import ZERO_GATHER_REF
from planner.solver.structure import node_labels
from planner.solver.table import CostTable
from planner.types import LinkSpec


def best_link(table: CostTable, a: str, b: str, across: bool = False) -> LinkSpec:
    """The fastest link any stage of type a could have to a next stage of type b (on
    another node if `across`; any link if none is)."""
    key = BestLinkKey(a, b, across)
    if key not in table.cache:
        nodes_a, nodes_b = table.type(a).nodes, table.type(b).nodes
        links = [table.link(x, y) for x in nodes_a for y in nodes_b if not across or x != y]
        if not links:
            return best_link(table, a, b)
        fastest = max(links, key=lambda link: link.bandwidth)
        table.cache[key] = LinkSpec(name=fastest.name, bandwidth=fastest.bandwidth,
                                    latency=min(link.latency for link in links))
    return table.cache[key]


def boundary_links(table: CostTable, types: tuple[str, ...], tps: tuple[int, ...],
                    crowd: int = 1, interleaved: bool = False) -> list[LinkSpec]:
    """The fastest link each send of a family's pipeline could have (`evaluate.hops`:
    interleaved, the wrap-around too). A send whose stages `place` puts on different
    nodes (`structure.node_labels`) crosses them, so its chains' copies (one per rank
    of the narrower stage: `comm.send_sharing`) share the
    busier card with the pipeline's other sends through it (`comm.send_sharing`;
    other pipelines' sends only add to them), and where the types change with at
    least `crowd` sends (see `bound.crowded`); the other sends take the fastest link of
    their types."""
    labels = node_labels(table, types, tps)
    ends = list(itertools.pairwise(range(len(types))))
    if interleaved and len(types) > 1:
        ends.append((len(types) - 1, 0))
    flows = send_sharing((labels[x], labels[y], min(tps[x], tps[y])) for x, y in ends)
    out = []
    for x, y in ends:
        a, b = types[x], types[y]
        if labels[x] == labels[y]:
            out.append(best_link(table, a, b))
            continue
        link = best_link(table, a, b, across=True)
        ways = max(shared_by(flows, labels[x], labels[y]), crowd if a != b else 1)
        out.append(dataclasses.replace(link, bandwidth=link.bandwidth / ways))
    return out


def cheapest_gather(table: CostTable, kind: str) -> tuple[float, float]:
    """A ZeRO-3 all-gather no group of type-`kind` replicas beats: two ranks (the
    smallest group, moving half the bytes) over the fastest link of that type."""
    link = best_link(table, kind, kind)
    intra = table.link(table.type(kind).nodes[0], table.type(kind).nodes[0])
    bandwidth = max(link.bandwidth, intra.bandwidth)
    latency = min(link.latency, intra.latency)
    return latency, latency + ZERO_GATHER_REF / (2 * bandwidth)
