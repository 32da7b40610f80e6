"""A small word-level tokenizer for mmsdk's embedded models (stable across transformers versions)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

__all__ = ["BASE_SPECIALS", "WordTokenizer"]

BASE_SPECIALS = ("<pad>", "<unk>", "<s>", "</s>")


class WordTokenizer:
    """Whitespace word tokenizer with whole-token specials; ids are positions in ``vocab``."""

    def __init__(self, vocab: Sequence[str], specials: Iterable[str] = ()) -> None:
        self.vocab = list(vocab)
        if len(set(self.vocab)) != len(self.vocab):
            raise ValueError("WordTokenizer vocab has duplicate entries; each word must appear once.")
        self._ids = {word: index for index, word in enumerate(self.vocab)}
        self.specials = tuple(dict.fromkeys((*BASE_SPECIALS, *specials)))
        missing = [s for s in self.specials if s not in self._ids]
        if missing:
            raise ValueError(f"WordTokenizer vocab lacks special tokens {missing}; add them to the vocab.")
        pattern = "|".join(re.escape(s) for s in sorted(self.specials, key=len, reverse=True))
        self._split = re.compile(f"({pattern})")

    @classmethod
    def build(cls, words: Iterable[str], specials: Iterable[str] = ()) -> WordTokenizer:
        """Vocab = base specials, extra specials, then ``words`` (deduplicated, order kept)."""
        specials = tuple(specials)
        vocab = list(dict.fromkeys((*BASE_SPECIALS, *specials, *words)))
        return cls(vocab, specials)

    pad_token_id = property(lambda self: self._ids["<pad>"])
    unk_token_id = property(lambda self: self._ids["<unk>"])
    bos_token_id = property(lambda self: self._ids["<s>"])
    eos_token_id = property(lambda self: self._ids["</s>"])

    def __len__(self) -> int:
        return len(self.vocab)

    def token_id(self, token: str) -> int:
        """The id of one token (specials included); unknown words map to <unk>."""
        return self._ids.get(token, self.unk_token_id)

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``: specials are matched anywhere, other words split on whitespace."""
        ids: list[int] = []
        for piece in self._split.split(text):
            if piece in self._ids and piece in self.specials:
                ids.append(self._ids[piece])
            else:
                ids.extend(self.token_id(word) for word in piece.split())
        return ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """Words for ``ids`` joined by spaces (specials dropped unless asked)."""
        special_ids = {self._ids[s] for s in self.specials}
        words = [
            self.vocab[i] if 0 <= i < len(self.vocab) else "<unk>"
            for i in (int(x) for x in ids)
            if not (skip_special_tokens and i in special_ids)
        ]
        return " ".join(words)

    def to_dict(self) -> dict[str, object]:
        """JSON-able form."""
        return {"vocab": self.vocab, "specials": list(self.specials)}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> WordTokenizer:
        """Inverse of :meth:`to_dict`."""
        return cls(list(data["vocab"]), list(data["specials"]))  # type: ignore[arg-type]
