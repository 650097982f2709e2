"""Which groups to create, roll or delete this pass. A pure function of what is observed.

Groups are the unit (a group restarts as a whole), with Deployment-like bounds counted in groups:
at most `max_unavailable` groups below the desired count may be unavailable, and at most
`max_surge` extra groups (labelled surge, indices from `replicas` up) may exist while rolling.
Each pass decides from the current state only, so running it again changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ObservedGroup:
    index: int
    revision: str  # the revision label on its StatefulSet
    desired_revision: str  # what this pass renders for the same index
    available: bool  # serving (router) or all pods ready
    surge: bool = False

    @property
    def current(self) -> bool:
        return self.revision == self.desired_revision


@dataclass(frozen=True)
class RolloutPlan:
    create: list[int] = field(default_factory=list)  # base groups to create
    create_surge: list[int] = field(default_factory=list)
    roll: list[int] = field(default_factory=list)  # apply the new template and replace all pods
    delete: list[int] = field(default_factory=list)

    @property
    def idle(self) -> bool:
        return not (self.create or self.create_surge or self.roll or self.delete)


def plan(
    groups: list[ObservedGroup], replicas: int, max_unavailable: int, max_surge: int
) -> RolloutPlan:
    """Decide one step of scaling and rolling.

    - Missing base groups (index < replicas) are created at once: they are not yet serving, so
      they cannot lower availability.
    - Base groups above `replicas` are deleted (scale down removes the highest indices).
    - Outdated base groups roll: unavailable ones first (free), then available ones while the
      available count stays at or above replicas − max_unavailable. Surge groups count as
      available capacity, so with max_surge > 0 an old group goes down only once a new one serves.
    - Surge groups are created only for outdated base groups, and kept (not deleted) while some
      base group is outdated or not yet available: a rolled group restarting is current but
      not serving, and the surge group is what serves in its place until it does.
    """
    # A surge group at an index below `replicas` (scaled up mid-rollout) becomes a base group.
    by_index = {g.index: g for g in groups if not g.surge or g.index < replicas}
    surge = sorted((g for g in groups if g.surge and g.index >= replicas), key=lambda g: g.index)
    out = RolloutPlan()
    out.create.extend(i for i in range(replicas) if i not in by_index)
    out.delete.extend(sorted(i for i in by_index if i >= replicas))
    base = [by_index[i] for i in range(replicas) if i in by_index]
    outdated = [g for g in base if not g.current]
    settled = not outdated and len(base) == replicas and all(g.available for g in base)
    if settled or replicas == 0:
        out.delete.extend(g.index for g in surge)
        return out
    want_surge = min(max_surge, len(outdated))
    # A current base group that does not serve yet (rolled, restarting; or new) keeps a surge
    # group that exists: deleting it now would take the serving count below `replicas`.
    starting = sum(1 for g in base if g.current and not g.available) + replicas - len(base)
    keep_surge = min(max_surge, len(outdated) + starting)
    for k in range(keep_surge):
        idx = replicas + k
        existing = next((g for g in surge if g.index == idx), None)
        if existing is None and k < want_surge:
            out.create_surge.append(idx)
    out.delete.extend(g.index for g in surge if g.index >= replicas + keep_surge)
    # Availability counts only groups that will still exist after this pass, an old revision's
    # as much as the new one's: both serve. An outdated surge group (a second change arrived
    # mid-roll) rolls under the same budget as a base group, after them.
    kept_surge = [g for g in surge if g.index < replicas + keep_surge]
    available = sum(g.available for g in base) + sum(g.available for g in kept_surge)
    budget = available - (replicas - max_unavailable)
    stale = outdated + [g for g in kept_surge if not g.current]
    for g in sorted(stale, key=lambda g: (g.available, g.surge, g.index)):
        if not g.available:
            out.roll.append(g.index)
        elif budget > 0:
            out.roll.append(g.index)
            budget -= 1
    return out
