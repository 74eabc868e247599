#!/usr/bin/env python3
"""Writes multiturn_text.txt: the text that bench/workloads/*.json cut their
prompts from (vLLM's generator reads a book; no book is downloaded here).
Deterministic: words drawn from a fixed list with a fixed seed, in
sentences. Run from anywhere; rewrites the file beside this script."""

import pathlib
import random

WORDS_TEXT = (
    "the of and to in is was for on that with as by at from they this have are but not you all were "
    "we when there can an which their said if do will each about how up out them then she many some so "
    "these would other into has more two like him see time could no make than first been its who now "
    "people my made over did down only way find use may water long little very after called just where "
    "most know get through back much before go good new write our used me man too any day same right "
    "look think also around another came come work three word must because does part even place well "
    "such here take why things help put years different away again off went old number great tell men "
    "say small every found still between name should home big give air line set own under read last "
    "never us left end along while might next sound below saw something thought both few those always "
    "looked show large often together asked house world going want school important until form food keep"
)


def main() -> None:
    words = WORDS_TEXT.split()
    rng = random.Random(1184)
    sentences = []
    size = 0
    while size < 120_000:
        words = [rng.choice(words) for _ in range(rng.randint(6, 18))]
        s = " ".join(words).capitalize() + "."
        sentences.append(s)
        size += len(s) + 1
    out = pathlib.Path(__file__).with_name("multiturn_text.txt")
    out.write_text(" ".join(sentences) + "\n")


if __name__ == "__main__":
    main()
