"""A card's size as the tables name it (the one-card grid's and the GPU counts')."""

GIB = 2**30


def card_name(nbytes: int) -> str:
    if nbytes < GIB:
        return f"{nbytes / 2**20:g} MiB"
    return f"{nbytes // GIB} GiB" if nbytes % GIB == 0 else f"{nbytes / GIB:.3g} GiB"
