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


def least_score(lengths, budget, most, score):
    """The least ``score(groups)`` over every contiguous cut of at most ``most`` forwards, each holding at most
    ``budget`` padded tokens: what the time-ruled cut must reach."""
    return min(score(groups) for groups in contiguous_cuts(lengths)
               if len(groups) <= most and all(len(gr) * max(lengths[i] for i in gr) <= budget for gr in groups))
