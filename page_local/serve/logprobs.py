"""A chat answer's logprobs in OpenAI's shape, handed out with the text they belong to.

The engine records, for each answer token, its log-probability and the most likely alternatives
under the logits it was sampled from (engine.token_logprobs: a log-softmax over the whole
vocabulary, before any sampler, as llama-server's n_probs and OpenAI report them). Text reaches the
client in pieces that a stop string may cut; a token goes out with the piece that holds its first
byte, and the tokens past a stop string's cut never go out.
"""

from __future__ import annotations


class LogprobTracker:
    """Follows one Stream (engine.Stream, whose .logprobs grows as tokens are generated). take(text),
    after `text` was sent, gives the entries of the tokens that text begins; None when the request
    did not ask for logprobs."""

    def __init__(self, model, stream, wanted: int | None):
        self.model, self.stream, self.on = model, stream, wanted is not None
        self.seen = 0  # stream.logprobs entries read
        self.pending: list[tuple[int, dict]] = []  # (the byte offset a token starts at, its entry)
        self.offset = 0  # bytes of all tokens read
        self.shown = 0  # bytes of text sent
        self.sent: list[dict] = []  # every entry sent, in order (the non-streamed body's list)
        self._pieces: dict[int, bytes] = {}

    def _piece(self, tok: int) -> bytes:
        if tok not in self._pieces:
            self._pieces[tok] = self.model.token_to_piece(tok)
        return self._pieces[tok]

    def _entry(self, tok: int, lp: float) -> dict:
        raw = self._piece(tok)
        return {"token": raw.decode("utf-8", "replace"), "logprob": lp, "bytes": list(raw)}

    def take(self, text: str) -> list[dict] | None:
        if not self.on:
            return None
        entries = self.stream.logprobs
        for tok, lp, top in entries[self.seen:]:
            e = self._entry(tok, lp)
            e["top_logprobs"] = [self._entry(t, v) for t, v in top]
            self.pending.append((self.offset, e))
            self.offset += len(e["bytes"])
        self.seen = len(entries)
        self.shown += len(text.encode("utf-8"))
        out = []
        while self.pending and self.pending[0][0] < self.shown:
            out.append(self.pending.pop(0)[1])
        self.sent += out
        return out

    @property
    def all(self) -> list[dict] | None:
        return self.sent if self.on else None
