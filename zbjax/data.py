"""A small text corpus generated at run time, a character tokenizer, and training batches.

The demo trains a language model without downloading anything: ``synthetic_text`` writes
sentences from a small English grammar (determiner, adjectives, noun, verb, object, an optional
prepositional phrase or clause), so the text has structure at every scale a small model can
learn: letter pairs, words, agreement between a plural subject and its verb, punctuation.
``CharTokenizer`` maps each character to an id, and ``batch_at`` draws training windows.

Everything is a pure function of its arguments (a seed, a step number), so a pipelined run and
its unpipelined reference see exactly the same batches.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

#: Every character ``synthetic_text`` can write; the tokenizer's ids follow this order.
ALPHABET = "\n .,abcdefghijklmnopqrstuvwxyz"

_DETERMINERS = ("the", "a", "every", "one", "that", "this")
_PLURAL_DETERMINERS = ("the", "some", "many", "two", "three", "these", "all")
_ADJECTIVES = (
    "quick",
    "lazy",
    "small",
    "old",
    "green",
    "quiet",
    "bright",
    "tired",
    "clever",
    "heavy",
    "gentle",
    "brown",
)
_NOUNS = (
    "fox",
    "dog",
    "bird",
    "river",
    "farmer",
    "child",
    "stone",
    "horse",
    "garden",
    "sailor",
    "king",
    "mountain",
)
_PLURAL = {"fox": "foxes", "child": "children", "stone": "stones"}
_VERBS = (
    ("sees", "see"),
    ("follows", "follow"),
    ("finds", "find"),
    ("watches", "watch"),
    ("carries", "carry"),
    ("remembers", "remember"),
    ("likes", "like"),
    ("builds", "build"),
)
_INTRANSITIVE = (
    ("sleeps", "sleep"),
    ("runs", "run"),
    ("sings", "sing"),
    ("waits", "wait"),
    ("laughs", "laugh"),
)
_PREPOSITIONS = ("near", "under", "behind", "beside", "across", "over")
_ADVERBS = ("slowly", "quietly", "again", "today", "happily", "at night")
_CONJUNCTIONS = ("and", "but", "while", "because")


def _plural(noun: str) -> str:
    return _PLURAL.get(noun, noun + "s")


def _noun_phrase(rng: random.Random, plural: bool) -> str:
    determiner = rng.choice(_PLURAL_DETERMINERS if plural else _DETERMINERS)
    adjectives = rng.sample(_ADJECTIVES, k=rng.choice((0, 0, 1, 1, 2)))
    noun = rng.choice(_NOUNS)
    return " ".join([determiner, *adjectives, _plural(noun) if plural else noun])


def _clause(rng: random.Random) -> str:
    plural = rng.random() < 0.4
    subject = _noun_phrase(rng, plural)
    if rng.random() < 0.7:
        verb = rng.choice(_VERBS)[1 if plural else 0]
        words = [subject, verb, _noun_phrase(rng, rng.random() < 0.3)]
    else:
        words = [subject, rng.choice(_INTRANSITIVE)[1 if plural else 0]]
    if rng.random() < 0.35:
        words += [rng.choice(_PREPOSITIONS), _noun_phrase(rng, rng.random() < 0.3)]
    if rng.random() < 0.3:
        words.append(rng.choice(_ADVERBS))
    return " ".join(words)


def synthetic_sentence(rng: random.Random) -> str:
    """Returns one sentence of the grammar ending in a full stop: one or two joined clauses."""
    sentence = _clause(rng)
    if rng.random() < 0.3:
        sentence += ", " + rng.choice(_CONJUNCTIONS) + " " + _clause(rng)
    return sentence + "."


def synthetic_text(num_chars: int = 16_384, seed: int = 0) -> str:
    """Returns at least ``num_chars`` characters of grammar sentences, a few per line."""
    if num_chars < 1:
        raise ValueError(f"num_chars={num_chars}; ask for at least 1 character of text")
    rng = random.Random(seed)
    lines: list[str] = []
    total = 0
    while total < num_chars:
        line = " ".join(synthetic_sentence(rng) for _ in range(rng.randint(1, 4)))
        lines.append(line)
        total += len(line) + 1
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class CharTokenizer:
    """Character-level tokenizer: id ``i`` is ``alphabet[i]``."""

    alphabet: str = ALPHABET

    def __post_init__(self) -> None:
        if len(set(self.alphabet)) != len(self.alphabet) or not self.alphabet:
            raise ValueError(
                f"alphabet {self.alphabet!r} is empty or repeats a character; give each "
                "character once"
            )

    @property
    def vocab_size(self) -> int:
        """Returns the number of token ids."""
        return len(self.alphabet)

    def encode(self, text: str) -> np.ndarray:
        """Returns the int32 ids of ``text``; raises ValueError naming an unknown character."""
        index = {c: i for i, c in enumerate(self.alphabet)}
        unknown = sorted(set(text) - index.keys())
        if unknown:
            raise ValueError(
                f"characters {unknown!r} are not in the tokenizer's alphabet "
                f"{self.alphabet!r}; lower-case the text or extend the alphabet"
            )
        return np.fromiter((index[c] for c in text), dtype=np.int32, count=len(text))

    def decode(self, ids: np.ndarray) -> str:
        """Returns the text of the ids ``ids``."""
        return "".join(self.alphabet[int(i)] for i in np.ravel(ids))


def batch_at(
    tokens: np.ndarray, step: int, batch_size: int, seq_len: int, seed: int = 0
) -> dict[str, np.ndarray]:
    """Returns step ``step``'s batch: ``{"tokens", "targets"}``, int32 ``[batch_size, seq_len]``.

    Each row is a window of ``seq_len + 1`` consecutive corpus tokens at a random start drawn
    from ``(seed, step)``; targets are the tokens shifted by one.
    """
    windows = len(tokens) - seq_len
    if windows < 1:
        raise ValueError(
            f"the corpus has {len(tokens)} tokens, too few for windows of seq_len={seq_len} + 1; "
            "generate more text or use a shorter --seq-len"
        )
    rng = np.random.default_rng((seed, step))
    starts = rng.integers(0, windows, size=batch_size)
    rows = np.stack([tokens[s : s + seq_len + 1] for s in starts])
    return {"tokens": rows[:, :-1], "targets": rows[:, 1:]}
