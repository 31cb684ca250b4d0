"""What the token cut's dynamic programmes are checked against: every cut enumerated."""

import itertools


def contiguous_cuts(lengths):
    """Every partition of the rows, sorted by length (stable), into contiguous groups of row indices."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    for cuts in itertools.product([0, 1], repeat=len(order) - 1):
        groups, cur = [], [order[0]]
        for c, i in zip(cuts, order[1:]):
            if c:
                groups.append(cur)
                cur = []
            cur.append(i)
        groups.append(cur)
        yield groups
