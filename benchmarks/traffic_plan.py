"""The pure half of benchmarks/traffic.py (no engine, no process, no clock): the seeded multi-turn chat workload,
where each turn goes, the request records, percentiles, a rate's summary, the TTFT target and each arm's goodput.
Unit-tested in tests/unit/test_traffic.py.

The workload is a replay, as vLLM's own multi-turn benchmark and ShareGPT replays do it: every conversation's
history (its system prompt, each user turn and each assistant answer) is token ids drawn from the seed, never the
model's own output, so every arm at a rate sends exactly the same prompts, and turn t's prompt extends turn t-1's
prompt (the engine that served t-1 holds its full blocks: what a pull can bring)."""

from __future__ import annotations

import enum
import math
import random
from dataclasses import dataclass, field

TOKEN_LO, TOKEN_HI = 100, 1000  # token ids inside any vocabulary of 1000+ (the tiny model has 1024)


class Arm(enum.Enum):
    """Who may serve a turn's history from another engine."""

    OURS = "ours"  # the P2PWorkerTier: the turn names the last turn's engine as its remote_kv_source
    INTREE = "intree"  # vLLM's in-tree p2p tier, same request shape
    NONE = "none"  # no secondary tier, no kv_transfer_params: the other engine recomputes the history

    @property
    def shares(self) -> bool:
        return self is not Arm.NONE


class Shape(enum.Enum):
    """How turns reach the engines."""

    P2P = "p2p"  # llm-d's P2P guide: each turn on another engine than the last, remote_kv_source naming that one
    PD = "pd"  # through `p2pworker router` in PD mode, the last turn's decode named by x-kv-cache-source-host-port


# ---------------------------------------------------------------------------------------------------- workload
@dataclass(frozen=True)
class Span:
    """A length range, both ends included."""

    lo: int
    hi: int

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.lo, self.hi)

    @classmethod
    def parse(cls, text: str) -> "Span":
        lo, _, hi = text.partition("-")
        return cls(int(lo), int(hi or lo))


@dataclass(frozen=True)
class Workload:
    """Everything that makes the prompts: the same spec and salt give the same prompts, whatever the rate."""

    conversations: int = 16
    turns: int = 4
    system_prompts: int = 2  # distinct system prompts; conversation c uses c mod this (shared prefixes)
    system_tokens: int = 256
    user_tokens: Span = Span(150, 300)
    answer_tokens: Span = Span(40, 100)  # the replayed assistant answer added to the history after each turn
    output_tokens: int = 16  # max_tokens of each turn (ignore_eos: every turn generates exactly this many)
    think_s: float = 1.0  # mean of the exponential pause between a turn's answer and the next turn
    engines: int = 2
    check_every: int = 4  # every k-th turn overall (by conversation and turn) is checked against a plain engine
    seed: int = 0

    def longest_prompt(self) -> int:
        return self.system_tokens + self.turns * self.user_tokens.hi + (self.turns - 1) * self.answer_tokens.hi


@dataclass(frozen=True)
class Turn:
    conversation: int
    index: int
    prompt: tuple[int, ...]
    max_tokens: int
    engine: int  # which engine serves it
    source: int | None  # the engine that served the previous turn (None: the first turn)
    think_s: float  # pause before it, after the previous turn's answer (0 for the first)
    check: bool  # its answer is compared with a plain engine's

    @property
    def key(self) -> str:
        return f"c{self.conversation}t{self.index}"


@dataclass(frozen=True)
class Conversation:
    index: int
    start_s: float  # Poisson arrival, seconds after the run's start
    turns: tuple[Turn, ...]


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n)]


def route(conversation: int, turn: int, engines: int) -> tuple[int, int | None]:
    """(engine, source) of a turn: each turn on another engine than the last (round robin from the conversation's
    own first engine, so first turns spread over the engines), its source the last turn's engine."""
    engine = (conversation + turn) % engines
    return engine, (None if turn == 0 else (conversation + turn - 1) % engines)


def arrivals(n: int, rate_conv_s: float, rng: random.Random) -> list[float]:
    """Start offsets of ``n`` conversations arriving as a Poisson process of ``rate_conv_s`` per second (the first at
    0)."""
    out, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate_conv_s)
        out.append(t)
    return out


def build(w: Workload, rate_rps: float, salt: int) -> list[Conversation]:
    """The conversations of one run at ``rate_rps`` requests per second (conversations start at rate / turns per
    second); ``salt`` makes prompts no earlier run on the same engines sent.  Prompts depend on ``w`` and ``salt``
    only, arrivals and think times on the rate too."""
    if w.engines < 2 or w.turns < 1 or w.conversations < 1 or rate_rps <= 0:
        raise ValueError(f"a workload needs 2+ engines, 1+ turns and conversations, a positive rate: {w}, {rate_rps}")
    text = random.Random(f"{w.seed}/{salt}/text")
    systems = [_ids(text, w.system_tokens) for _ in range(w.system_prompts)]
    timing = random.Random(f"{w.seed}/{salt}/{rate_rps}/timing")
    starts = arrivals(w.conversations, rate_rps / w.turns, timing)
    out = []
    for c in range(w.conversations):
        history = list(systems[c % w.system_prompts])
        turns = []
        for t in range(w.turns):
            if t:
                history += _ids(text, w.answer_tokens.draw(text))
            history += _ids(text, w.user_tokens.draw(text))
            engine, source = route(c, t, w.engines)
            think = timing.expovariate(1 / w.think_s) if t and w.think_s > 0 else 0.0
            turns.append(Turn(c, t, tuple(history), w.output_tokens, engine, source, think,
                              (c * w.turns + t) % w.check_every == 0))
        out.append(Conversation(c, starts[c], tuple(turns)))
    return out


# ---------------------------------------------------------------------------------------------------- records
@dataclass
class Record:
    """One turn as the client saw it (seconds on the client's monotonic clock, relative to the run's start)."""

    key: str
    engine: int
    sent_s: float
    ttft_s: float | None = None
    done_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)  # between successive streamed chunks with tokens
    prompt_tokens: int = 0
    output_tokens: int = 0
    tokens: list[str] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft_s is not None


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 2)


@dataclass(frozen=True)
class Shares:
    """Where the prompt tokens of a run came from, by the engines' own counters (summed over the engines)."""

    prompt: float
    pulled: float  # vllm:prompt_tokens_cached_by_source_total{source="p2p"}
    local: float  # source device or host: the serving engine's own prefix cache or CPU tier

    @property
    def recomputed(self) -> float:
        return max(self.prompt - self.pulled - self.local, 0.0)

    def to_json(self) -> dict:
        p = self.prompt or 1.0
        return {"prompt_tokens": self.prompt, "pulled_tokens": self.pulled, "local_tokens": self.local,
                "recomputed_tokens": self.recomputed, "pulled_share": round(self.pulled / p, 4),
                "local_share": round(self.local / p, 4), "recomputed_share": round(self.recomputed / p, 4)}


def summarize(records: list[Record], wall_s: float) -> dict:
    """A run's client-side figures: TTFT, inter-token latency and request latency percentiles (ms), output tokens
    per second, failed requests; and every answered request's TTFT, sorted, for the goodput at a target known only
    once the no-sharing arm ran (:func:`request_goodput`)."""
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_s for r in ok]
    gaps = [g for r in ok for g in r.gaps_s]
    latency = [r.done_s - r.sent_s for r in ok if r.done_s is not None]
    out_tokens = sum(r.output_tokens for r in ok)
    return {"requests": len(records), "failed": len(records) - len(ok),
            "ttft_ms": {f"p{q}": _ms(percentile(ttft, q)) for q in (50, 90, 99)},
            "itl_ms": {f"p{q}": _ms(percentile(gaps, q)) for q in (50, 99)},
            "latency_ms": {f"p{q}": _ms(percentile(latency, q)) for q in (50, 90)},
            "ttft_ms_sorted": sorted(_ms(t) for t in ttft),
            "output_tokens": out_tokens, "wall_s": round(wall_s, 2),
            "output_tokens_per_s": round(out_tokens / wall_s, 2) if wall_s > 0 else None,
            "requests_per_s": round(len(ok) / wall_s, 3) if wall_s > 0 else None}


def request_goodput(ttfts_ms: list[float], target_ms: float, wall_s: float) -> float | None:
    """Goodput as `vllm bench serve --goodput ttft:<ms>` and inference-perf's ``request_goodput`` count it (the
    DistServe definition): answered requests per second whose own TTFT met the target.  A failed request never
    counts."""
    if wall_s <= 0:
        return None
    return round(sum(t <= target_ms for t in ttfts_ms) / wall_s, 3)


def answer_problem(got: Record, want_tokens: list[str], want_logprobs: list[float | None], tol: float) -> str | None:
    """Why a turn's streamed answer is not a plain engine's (tokens equal, logprobs within ``tol``); None when it
    is."""
    if got.tokens != want_tokens:
        return f"{got.key}: tokens differ from a plain engine's: {got.tokens} vs {want_tokens}"
    worst = max((abs(a - b) for a, b in zip(got.logprobs, want_logprobs) if a is not None and b is not None),
                default=0.0)
    return None if worst <= tol else f"{got.key}: logprobs differ from a plain engine's by {worst:.2e}"


# ------------------------------------------------------------------------------------------ the rate sustained
@dataclass(frozen=True)
class RatePoint:
    rate_rps: float
    p90_ms: float | None  # None: the run failed requests (never within the target)
    p99_ms: float | None = None


def ttft_target_ms(none_points: list[RatePoint], factor: float) -> float | None:
    """The TTFT target: ``factor`` × the no-sharing arm's p90 TTFT at its lowest swept rate (its figure at low load);
    None when that arm has no such figure."""
    pts = sorted((p for p in none_points if p.p90_ms is not None), key=lambda p: p.rate_rps)
    return None if not pts else round(pts[0].p90_ms * factor, 1)


@dataclass(frozen=True)
class Sustained:
    """The highest offered rate an arm sustains with its p90 TTFT within the target (llm-d's reports: the rate a
    setup "sustains"; not a goodput, which counts requests: :func:`request_goodput`)."""

    highest_rate_rps: float | None  # the highest swept rate whose p90 stays under the target (and all below too)
    interpolated_rps: float | None  # where p90 crosses the target, linear between that rate and the next one

    def to_json(self) -> dict:
        return {"highest_rate_rps": self.highest_rate_rps, "interpolated_rps": self.interpolated_rps}


def sustained(points: list[RatePoint], target_ms: float) -> Sustained:
    """The highest rate at which p90 TTFT stays under ``target_ms``, counting up from the lowest swept rate and
    stopping at the first rate over it (a later dip under the target does not count); interpolated linearly between
    the last rate within and the first over it, or that rate itself when every swept rate was within."""
    pts = sorted(points, key=lambda p: p.rate_rps)
    best: RatePoint | None = None
    for p in pts:
        if p.p90_ms is None or p.p90_ms > target_ms:
            if best is None or p.p90_ms is None:
                return Sustained(best.rate_rps if best else None, best.rate_rps if best else None)
            frac = (target_ms - best.p90_ms) / (p.p90_ms - best.p90_ms)
            return Sustained(best.rate_rps, round(best.rate_rps + frac * (p.rate_rps - best.rate_rps), 3))
        best = p
    return Sustained(best.rate_rps if best else None, best.rate_rps if best else None)


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 2)


def verdict(rates: dict[str, Sustained], points: dict[str, list[RatePoint]]) -> dict:
    """The comparisons a reader looks for, each as measured: the ratios of the rates sustained (interpolated) and
    whether ours' p99 TTFT stayed at or under no sharing's at every rate both ran."""
    ours, none, intree = (rates.get(a.value) for a in (Arm.OURS, Arm.NONE, Arm.INTREE))
    out: dict = {"sustained_ours_over_none": ratio(ours and ours.interpolated_rps, none and none.interpolated_rps),
                 "sustained_ours_over_intree": ratio(ours and ours.interpolated_rps,
                                                     intree and intree.interpolated_rps)}
    by_rate = {a: {p.rate_rps: p.p99_ms for p in pts} for a, pts in points.items()}
    shared = sorted(set(by_rate.get(Arm.OURS.value, {})) & set(by_rate.get(Arm.NONE.value, {})))
    worse = [r for r in shared if (by_rate["ours"][r] is None or
                                   (by_rate["none"][r] is not None and by_rate["ours"][r] > by_rate["none"][r]))]
    out["p99_ours_above_none_at_rates"] = worse if shared else None
    return out
