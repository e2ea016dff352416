#!/usr/bin/env python3
"""Generates data/corpus.txt: a small, redistributable English-like corpus.

Written for Apiary (MIT); nothing is downloaded. A seeded grammar of short
fables, almanac notes and dialogues about bees, gardens and weather, so a
byte-level model has real structure to learn (spelling, punctuation, recurring
names, simple syntax). Deterministic: same seed, same bytes.

usage: scripts/gen_corpus.py [--seed 7] [--bytes 300000] [--out data/corpus.txt]
"""
import argparse
import random

NAMES = ["Ada", "Basil", "Clover", "Dorian", "Elsa", "Fennel", "Greta", "Hugo", "Iris",
         "Jasper", "Kestrel", "Linden", "Marigold", "Nettle", "Otto", "Posy", "Quill",
         "Rowan", "Sorrel", "Thyme", "Ursa", "Violet", "Wren", "Yarrow", "Zinnia"]
ROLES = ["the beekeeper", "the miller", "the old gardener", "the young scout",
         "the queen", "the forager", "the drone", "the carpenter", "the baker",
         "the shepherd", "the weaver", "the ferryman"]
ANIMALS = ["bee", "wasp", "moth", "sparrow", "hare", "fox", "heron", "beetle",
           "ant", "owl", "mouse", "crow"]
PLACES = ["the hive", "the meadow", "the orchard", "the river bank", "the mill",
          "the old oak", "the hedgerow", "the village green", "the hill", "the barn",
          "the clover field", "the lavender rows", "the stone bridge", "the pond"]
FLOWERS = ["clover", "heather", "lavender", "thyme", "borage", "lime blossom",
           "apple blossom", "dandelion", "foxglove", "sunflower", "rosemary", "willowherb"]
ADJ = ["quiet", "golden", "busy", "patient", "clever", "tired", "bright", "humble",
       "careful", "restless", "gentle", "stubborn", "cheerful", "weary", "small", "old"]
WEATHER = ["a warm wind from the south", "a cold rain", "a heavy mist", "a clear sky",
           "a sudden storm", "a long dry spell", "the first frost", "a soft drizzle",
           "bright sunshine", "a low grey cloud"]
VERBS_T = ["carried", "found", "counted", "mended", "guarded", "shared", "gathered",
           "followed", "watched", "remembered", "measured", "painted"]
OBJS = ["the honey", "the pollen", "a basket of pears", "the map of the fields",
        "a jar of wax", "the lantern", "the seeds", "a broken comb", "the bread",
        "a ribbon of silk", "the wooden frames", "the bell"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December"]
MORALS = ["Many small hands make light work.", "A full hive is built one cell at a time.",
          "Who shares the nectar shares the summer.", "Slow wings still reach the flower.",
          "The swarm is wiser than the bee.", "Mend the comb before the rain.",
          "No bee is too small to carry news.", "What is counted twice is known once."]


def plural(a):
    return {"mouse": "mice", "fox": "foxes"}.get(a, a + "s")


def cap(s):
    return s[0].upper() + s[1:]


class Gen:
    def __init__(self, seed):
        self.r = random.Random(seed)

    def c(self, xs):
        return self.r.choice(xs)

    def who(self):
        k = self.r.random()
        if k < 0.45:
            return self.c(NAMES)
        if k < 0.75:
            return self.c(ROLES)
        return "the " + self.c(ADJ) + " " + self.c(ANIMALS)

    def sentence(self):
        k = self.r.randrange(9)
        w = self.who()
        if k == 0:
            return f"{cap(w)} {self.c(VERBS_T)} {self.c(OBJS)} to {self.c(PLACES)}."
        if k == 1:
            return f"In {self.c(MONTHS)} there was {self.c(WEATHER)}, and {w} stayed near {self.c(PLACES)}."
        if k == 2:
            n = self.r.randrange(2, 60)
            return f"{cap(w)} counted {n} {plural(self.c(ANIMALS))} by {self.c(PLACES)}."
        if k == 3:
            return f"The bees went out to the {self.c(FLOWERS)} while {w} {self.c(VERBS_T)} {self.c(OBJS)}."
        if k == 4:
            return f"\"{cap(self.c(ADJ))} work,\" said {w}, \"but the {self.c(FLOWERS)} will not wait.\""
        if k == 5:
            return f"When {self.c(WEATHER)} came, {w} and {self.who()} {self.c(VERBS_T)} {self.c(OBJS)} together."
        if k == 6:
            return f"{cap(w)} was {self.c(ADJ)} and {self.c(ADJ)}, and knew the way to {self.c(PLACES)}."
        if k == 7:
            return f"Nobody had {self.c(VERBS_T)} {self.c(OBJS)} since {self.c(MONTHS)}."
        return f"{cap(w)} asked {self.who()} where the {self.c(FLOWERS)} grew, and was told: by {self.c(PLACES)}."

    def fable(self):
        hero = self.c(NAMES)
        lines = [f"THE {self.c(ADJ).upper()} {self.c(ANIMALS).upper()} AND {hero.upper()}", ""]
        par = []
        for _ in range(self.r.randrange(4, 9)):
            par.append(self.sentence())
        lines.append(" ".join(par))
        lines.append("")
        lines.append(f"{hero} said: \"{self.c(MORALS)}\"")
        lines.append("")
        return "\n".join(lines)

    def almanac(self):
        m = self.c(MONTHS)
        out = [f"ALMANAC, {m.upper()}"]
        for d in sorted(self.r.sample(range(1, 29), 4)):
            fl = self.c(FLOWERS)
            frames = self.r.randrange(1, 12)
            out.append(f"  {m} {d}: {self.c(WEATHER)}; bees on {fl}; {frames} frames drawn.")
        out.append("")
        return "\n".join(out)

    def dialogue(self):
        a, b = self.c(NAMES), self.c(NAMES)
        out = []
        for i in range(self.r.randrange(3, 7)):
            sp = a if i % 2 == 0 else b
            out.append(f"{sp.upper()}: {self.sentence()}")
        out.append("")
        return "\n".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--bytes", type=int, default=300000)
    ap.add_argument("--out", default="data/corpus.txt")
    a = ap.parse_args()
    g = Gen(a.seed)
    parts, size = [], 0
    while size < a.bytes:
        k = g.r.random()
        s = g.fable() if k < 0.5 else g.almanac() if k < 0.75 else g.dialogue()
        parts.append(s + "\n")
        size += len(s) + 1
    text = "".join(parts)[: a.bytes]
    with open(a.out, "w", encoding="ascii") as f:
        f.write(text)


if __name__ == "__main__":
    main()
