"""Communication times: alpha-beta models of collectives and point-to-point transfers.

Conventions follow nccl-tests: for a collective over S bytes (the full buffer)
and n ranks, algbw = S / time predicts time, and busbw = algbw * factor
compares with a link's peak (all-reduce 2(n-1)/n, all-gather and
reduce-scatter (n-1)/n, broadcast and point-to-point 1).

Algorithms (the faster one is used, as NCCL picks per size; `collective_choice` names
it, and a plan records it for each stage's gradient sync, `StagePlan.grad_sync`, which
the runtime runs):

    ring          over all n ranks; every step crosses the slowest link in the
                  group: intra-node links between devices of a node, the
                  node-to-node link between nodes (a mixed group is bounded by
                  its slowest link)
    hierarchical  reduce-scatter inside each node, a ring across the N nodes
                  on 1/g of the data per device (the g devices of a node share
                  its network bandwidth), all-gather inside each node

With B_i the intra-node and B_n the per-node network bandwidth, g ranks per
node (the most on any node), N nodes:

    ring all-reduce          2(n-1)/n * S / min(B_i, B_n) + 2(n-1) * alpha
    hierarchical all-reduce  2(g-1)/g * S / B_i + 2(g-1) * alpha_i
                           + 2(N-1)/N * S / B_n + 2(N-1) * alpha_n

A link may carry the bus bandwidth NCCL was measured at on it, size by size
(`LinkSpec.bus_rates`, e.g. the catalog's NVLink 3). A ring over such a link takes the
longer of its alpha-beta time and the measured one, factor * S / busbw(S)
(`measured_seconds`), with no alpha added to the measured time: NCCL's latency is in it.
The measurement only slows a price: where NCCL beat the alpha-beta line (on NVLink 3 up
to 16 MB and from 512 MB) the line stays, since the solver's floors take a link's
alpha-beta as the least any collective over it costs (planner/solver/links.py,
`cheapest_gather`). One table serves every group size (busbw is nccl-tests' measure
independent of n) and every ring collective; all-to-all across nodes stays alpha-beta.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from enum import Enum

from planner.errors import PlannerError
from planner.types import ClusterSpec, LinkSpec, SyncAlgorithm
from planner.types.cluster import BusRate


class Collective(str, Enum):
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    BROADCAST = "broadcast"
    ALL_TO_ALL = "all_to_all"


# (bandwidth terms, latency terms) as multiples of (n-1)/n * S / B and (n-1) * alpha
_SHAPE = {Collective.ALL_REDUCE: (2.0, 2.0), Collective.REDUCE_SCATTER: (1.0, 1.0),
          Collective.ALL_GATHER: (1.0, 1.0), Collective.ALL_TO_ALL: (1.0, 1.0)}


@dataclass(frozen=True)
class CommGroup:
    """Ranks of a collective, as (node name, ranks on that node) pairs."""

    members: tuple[tuple[str, int], ...]
    # a group is a memo key many times over and may hold hundreds of nodes: hashed once
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash(self.members))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple:  # (string hashes differ between processes)
        return CommGroup, (self.members,)

    @property
    def size(self) -> int:
        return sum(count for _, count in self.members)

    @staticmethod
    def of(nodes: list[str]) -> CommGroup:
        """A group from one node name per rank."""
        counts: dict[str, int] = {}
        for name in nodes:
            counts[name] = counts.get(name, 0) + 1
        return CommGroup(tuple(sorted(counts.items())))


def bus_factor(kind: Collective, n: int) -> float:
    if n <= 1 or kind is Collective.BROADCAST:
        return 1.0
    return _SHAPE[kind][0] * (n - 1) / n


def group_links(cluster: ClusterSpec, group: CommGroup) -> tuple[LinkSpec | None, LinkSpec | None]:
    """(slowest intra-node link among nodes with several ranks, slowest link between
    any two member nodes); None where the group has no such pair."""
    intra = [cluster.node(name).intra_link for name, count in group.members if count > 1]
    # nodes in the same groups with the same NIC see the same links: one pair of each
    # kind of node (and two nodes of one kind, if it has two) is enough
    kinds: dict[tuple, list[str]] = {}
    for name, _ in group.members:
        node = cluster.node(name)
        same = kinds.setdefault((node.groups, node.nic), [])
        if len(same) < 2:
            same.append(name)
    names = [name for same in kinds.values() for name in same]
    inter = [cluster.link_between(a, b) for i, a in enumerate(names) for b in names[i + 1:]]
    slowest_intra = intra[0].slowest(*intra[1:]) if intra else None
    slowest_inter = inter[0].slowest(*inter[1:]) if inter else None
    return slowest_intra, slowest_inter


def _ring(kind: Collective, nbytes: float, n: int, link: LinkSpec) -> float:
    if kind is Collective.BROADCAST:
        modelled = nbytes / link.bandwidth + (n - 1) * link.latency
    else:
        bw_terms, lat_terms = _SHAPE[kind]
        modelled = (bw_terms * (n - 1) / n * nbytes / link.bandwidth
                    + lat_terms * (n - 1) * link.latency)
    measured = measured_seconds(link, nbytes)
    return modelled if measured is None else max(modelled, bus_factor(kind, n) * measured)


def measured_seconds(link: LinkSpec, nbytes: float) -> float | None:
    """S / busbw(S): the seconds a collective of `nbytes` took per unit of its bus factor
    where the link's bus bandwidth was measured (`LinkSpec.bus_rates`); None below the
    smallest size measured, or without measurements. Between two sizes the bus bandwidth
    follows a power law of the size (a straight line on nccl-tests' log-log plots); at or
    above the largest size it is the largest size's."""
    if not link.bus_rates or nbytes < link.bus_rates[0].size:
        return None
    curve = _measured_curve(link.bus_rates)
    i = bisect.bisect_right(curve.sizes, nbytes) - 1
    if i == len(curve.sizes) - 1:
        return curve.times[-1] * nbytes / curve.sizes[-1]
    step = math.log(nbytes / curve.sizes[i]) / math.log(curve.sizes[i + 1] / curve.sizes[i])
    return curve.times[i] * (curve.times[i + 1] / curve.times[i]) ** step


@dataclass(frozen=True)
class MeasuredCurve:
    """A link's measured sizes and each one's S / busbw, raised to the most of any
    smaller size's (`_measured_curve`)."""

    sizes: tuple[float, ...]
    times: tuple[float, ...]


@functools.lru_cache(maxsize=32)
def _measured_curve(rates: tuple[BusRate, ...]) -> MeasuredCurve:
    """The sizes and their times, once per table (every collective price reads them):
    each time raised to the most of any smaller size's, as NCCL's tables dip (on NVLink 3,
    2 MB took less time than 1 MB, 16 MB moved at a lower bus bandwidth than 8 MB) and
    the solver's floors need fewer bytes to take no more time."""
    times, most = [], 0.0
    for rate in rates:
        most = max(most, rate.size / rate.bus_bandwidth)
        times.append(most)
    return MeasuredCurve(tuple(rate.size for rate in rates), tuple(times))


def collective_time(kind: Collective, nbytes: float, group: CommGroup,
                    cluster: ClusterSpec) -> float:
    """Seconds for a collective over `nbytes` (the full buffer) among `group`."""
    return collective_over(kind, nbytes, group, *group_links(cluster, group))


def collective_over(kind: Collective, nbytes: float, group: CommGroup,
                    intra: LinkSpec | None, inter: LinkSpec | None) -> float:
    """`collective_time` given the group's links (`group_links`)."""
    return collective_choice(kind, nbytes, group, intra, inter).seconds


@dataclass(frozen=True)
class Priced:
    """A collective's seconds and the algorithm that takes them (the faster of the two,
    see the module docstring; a ring where they tie or there is no choice)."""

    algorithm: SyncAlgorithm
    seconds: float


def collective_choice(kind: Collective, nbytes: float, group: CommGroup,
                      intra: LinkSpec | None, inter: LinkSpec | None) -> Priced:
    """The faster algorithm for a collective among `group` given its links
    (`group_links`), and its seconds: what every price of a collective is."""
    if nbytes < 0:
        raise PlannerError("bad-value", f"A collective cannot move {nbytes} bytes.")
    n = group.size
    if n <= 1 or nbytes == 0:
        return Priced(SyncAlgorithm.RING, 0.0)
    if inter is None:
        return Priced(SyncAlgorithm.RING, _ring(kind, nbytes, n, intra))
    nodes = len(group.members)
    per_node = max(count for _, count in group.members)
    if kind is Collective.ALL_TO_ALL:
        # every rank sends nbytes/n to every other; a node's cross-node share of its
        # per_node * nbytes goes through its network link
        cross = per_node * nbytes * (n - per_node) / n / inter.bandwidth
        local = nbytes * (per_node - 1) / n / intra.bandwidth if intra else 0.0
        return Priced(SyncAlgorithm.RING, max(cross, local) + (n - 1) * inter.latency)
    bottleneck = inter.slowest(intra)
    flat = _ring(kind, nbytes, n, bottleneck)
    if per_node == 1:
        return Priced(SyncAlgorithm.RING, flat)
    # inside each node, then (all-reduce and the like) the inter-node ring carries
    # nbytes/g per device over bandwidth/g each: nbytes/B_n
    nested = _ring(kind, nbytes, per_node, intra) + _ring(kind, nbytes, nodes, inter)
    if nested < flat:
        return Priced(SyncAlgorithm.HIERARCHICAL, nested)
    return Priced(SyncAlgorithm.RING, flat)


def send_sharing(boundaries: Iterable[tuple[str, str, int]]) -> dict[str, int]:
    """Per node, how many pipeline sends its network card carries at once.

    boundaries: (node of a stage, node of the next stage, tensor-parallel ranks that
    each send their own copy) for every stage boundary of every pipeline. A node's
    network bandwidth is what the whole node can send, and in the steady state every
    pipeline sends once per period, so a boundary between two nodes shares the busier
    card with every other such transfer (one direction each: activations forward,
    gradients back). Boundaries inside a node use device-to-device links, unshared."""
    flows: dict[str, int] = {}
    for a, b, ranks in boundaries:
        if a != b:
            flows[a] = flows.get(a, 0) + ranks
            flows[b] = flows.get(b, 0) + ranks
    return flows


def busiest_card(charges: Iterable[tuple[str, Hashable, CommGroup, float]]) -> float:
    """The longest any node's network card is busy with the gradient sync.

    charges: (node, collective, its group, its time alone) for each collective a node
    sends gradients of its own stages in; all start together. A collective whose group
    spans several nodes goes through the card of each node it is charged to, and the
    collectives that share a card take turns on it, so their times add up (a node's
    network bandwidth is what the whole node can send, as for `send_sharing`). A
    collective charged twice to one node counts once; one inside a node uses
    device-to-device links and is not counted."""
    busy: dict[str, float] = {}
    seen: set[tuple[str, Hashable]] = set()
    for node, key, group, seconds in charges:
        if len(group.members) > 1 and (node, key) not in seen:
            seen.add((node, key))
            busy[node] = busy.get(node, 0.0) + seconds
    return max(busy.values(), default=0.0)


def shared_by(flows: dict[str, int], a: str, b: str) -> int:
    """How many transfers share the link of a boundary from node a to node b."""
    return 1 if a == b else max(flows.get(a, 1), flows.get(b, 1), 1)


def p2p_time(nbytes: float, link: LinkSpec) -> float:
    """One-way transfer of `nbytes` over `link`."""
    return link.latency + nbytes / link.bandwidth if nbytes > 0 else 0.0
