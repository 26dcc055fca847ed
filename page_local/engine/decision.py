"""What a turn returns: the Decision (what the gate, the evictor and self-verification did), the Result
(the answer and how it ended) and the Sampling settings a caller passes in."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Decision:
    """What the gate and the evictor did on one turn."""

    T: int  # tokens of the conversation after this turn's prompt (the cells a full cache would hold)
    B: int  # budget (kept positions if the gate opens and T > B)
    D: float | None  # PAGE's drop (None when the probe did not run)
    z: float | None  # calibrated score, when the model has a profile
    open: bool  # the gate's decision
    evicted: bool  # eviction actually ran (open and T > B)
    kept: int  # positions held after the decision
    compression: float  # T / kept
    gate_mode: str
    rule: str  # raw | calibrated | forced
    reason: str  # plain words
    evictor: str
    prefill_ms: float = 0.0
    probe_ms: float = 0.0  # reading the probe result
    gate_ms: float = 0.0  # signal + gate
    evict_ms: float = 0.0  # selection + eviction + re-decode of the last prompt token
    agreement: list[float] = field(default_factory=list)  # per-layer head agreement
    # self-verified eviction (gate modes "verify" and "page+verify"); None when it did not run
    verify_m: int | None = None  # answer tokens checked (the span; its end-of-generation not counted)
    verify_until: str | None = None  # end (the answer ended in the span: its end was checked too) | cap | length
    verify_rule: str | None = None  # verify.RULES: how the span was scored
    verify_score: float | None = None  # the rule's score over the span
    verify_threshold: float | None = None  # score <= threshold commits the eviction
    verify_delta: float | None = None  # mean over the span of log p_full - log p_evicted (nats/token)
    verify_max: float | None = None  # the largest per-token loss (nats)
    verify_changed: int | None = None  # positions where the evicted cache's top token differs
    verify_top1: float | None = None  # fraction of positions the evicted cache ranks the same token first
    verify_kl_first: float | None = None  # KL(p_full || p_evicted) of the first generated token
    verify_ms: float | None = None  # the extra batch decode and the comparison
    verify_forced: int | None = None  # tokens decoded on candidates (a failing one stops where it fails;
    # search: the batched first chunks of rungs above the chosen one count too)
    disk_tokens: int = 0  # prompt tokens restored from the disk cache of prompt prefixes, not read (prefixes.py)
    disk_ms: float = 0.0  # reading, checking and restoring them
    disk_save_ms: float = 0.0  # the prompt just read copied to host memory for the disk cache (the write is after)
    lookahead_ms: float | None = None  # LORE-KV: sampling the futures and scoring the prompt (in evict_ms;
    # lorekv-answer: scoring the prompt by the answer, at the check, in verify_ms)
    gate_note: str | None = None  # a calibrated gate used far outside its pilot's prompt lengths
    # gate "search": every rung {B, label, score, passed, forced}, smallest first; passed None: not checked
    # past its first chunk (a smaller rung passed); forced: the tokens decoded on it before it passed or failed
    search: list[dict] | None = None
    # room on demand (engine/room.py): the turn did not fit and earlier cells were evicted, unchecked
    room_evicted: int = 0  # cells of earlier turns evicted to make room (before the prompt and while answering)
    room_from: tuple[int, int] | None = None  # the lowest and highest position evicted to make room
    chunks: int = 1  # the prompt was prefilled in this many pieces (a message longer than the context)
    prompt_tokens: int | None = None  # this turn's prompt tokens (set when room was made)
    prompt_held: int | None = None  # of them, how many the cache holds after prefill
    gaps_closed: int = 0  # positions the cells moved down to stay inside the trained context
    room_ranking: str | None = None  # what ranked the cells evicted to make room: question | recent (room.py)
    reread: int = 0  # earlier tokens read again before this message (Engine reread: room-making had cut them)
    room_probe_ms: float = 0.0  # decoding the message's last W tokens to rank them (W per eviction), ms
    # parking (engine/parking.py): cells the speed budget took out of the attention, kept in memory
    parked: int = 0  # cells parked after this turn's decision
    restored: int = 0  # parked cells that came back before this message was read (every one the cache could hold)
    park_dropped: int = 0  # parked cells that went for good before this message (the cache was full)
    park_from: int | None = None  # set when parking kept the full cache: the conversation was below this many cells
    # set when the check rested (selfcheck.Backoff): checks refused in a row before this turn, which kept the
    # full cache without one
    check_rested: int | None = None
    # set when parking skipped the check because the answer was over inside its span (its length in tokens): a
    # passed check would have parked cells for no token, and the next message chooses again from every cell
    check_unneeded: int | None = None
    # set when parking skipped the check at its cap because too few answer tokens were expected after it to pay the
    # check back (selfcheck.Payback: the tokens expected)
    check_unpaid: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Result:
    text: str
    tokens: list[int]
    decision: Decision
    finish_reason: str  # stop | length | context | interrupted
    prompt_tokens: int
    gen_s: float = 0.0
    # Sampling.logprobs set: per answer token (token, logprob, [(token, logprob)] the most likely first),
    # from the logits it was sampled from (log-softmax over the whole vocabulary, before any sampler)
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.gen_s if self.gen_s > 0 else 0.0


@dataclass
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 40
    top_p: float = 0.95
    seed: int = 0
    min_p: float = 0.0  # 0 = off
    # llama.cpp's penalties over the last penalty_last_n tokens of the conversation (-1: the context);
    # 1 and 0 = off
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (-100 bans it in practice)
    grammar: str | None = None  # GBNF (root rule "root"): every token of the answer obeys it
    logprobs: int | None = None  # record each answer token's log-probability and this many alternatives

    def validate(self) -> None:
        self._check_basic()
        if not (isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not (isinstance(self.repeat_penalty, (int, float)) and 0 < self.repeat_penalty <= 10):
            raise ValueError(f"repeat_penalty must be in (0, 10], got {self.repeat_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and -2 <= v <= 2):
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        if isinstance(self.penalty_last_n, bool) or not isinstance(self.penalty_last_n, int) \
                or self.penalty_last_n < -1:
            raise ValueError(f"penalty_last_n must be an int >= -1, got {self.penalty_last_n!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be None or an int in [0, 20], got {self.logprobs!r}")

    def _check_basic(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and 0 <= self.temperature <= 5):
            raise ValueError(f"temperature must be in [0, 5], got {self.temperature!r}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")
