"""Pull versus recompute on two live engines: ``p2pworker calibrate`` and what benchmarks/pull_vs_recompute.py shares.

A pull pays off only above some prompt length: below it, computing the prefix on the engine that serves the request
is faster than fetching its KV from a peer.  llm-d's ``p2p-source-producer`` asks for that length as
``minCachedTokenDelta`` (a peer is named as the source only when it caches at least that many more prompt tokens).
This module measures it the way llm-d's calibration script does, stricter:

* per length and rep, two fresh random token-ID prompts: the *control* (seeded on the source, then computed by the
  puller with no transfer params) and the *pull* (seeded on the source, then served by the puller with
  ``remote_kv_source`` naming the source's worker);
* time to first token, streamed (a pull's gain is in the prefill, not in the decode steps after it);
* attribution by vLLM's own ``vllm:prompt_tokens_cached_by_source_total{source}`` on the puller, read around each
  request: the control must show no cached token at all, the pull exactly every full block from ``p2p``.  A leg
  that silently recomputed therefore cannot pass as a pull, nor a leg that hit a cache as a recompute;
* the recommendation is the smallest tested length where the median pull beats the median recompute *and keeps
  winning at every longer tested length* (one noisy win below the real crossover does not set the value).

Only HTTP (the OpenAI server and /metrics of each engine) and, for the fingerprint check, one p2pworker handshake
with each worker; no vLLM import, so it runs from any machine that reaches the engines.
"""

from __future__ import annotations

import enum
import json
import math
import random
import re
import statistics
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable

CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"
TIER_SERIES = "vllm:kv_offload_p2pworker_"  # every series our tier exports (vllm_adapter/tier.py TIER_METRICS)
OFFLOAD_CONFIG_INFO = "vllm:kv_offload_config_info"  # 0.33: a tier's static labels, our p2p_address among them
CACHE_CONFIG_INFO = "vllm:cache_config_info"
LLM_D_LENGTHS = (2048, 4096, 8192, 16384, 32768)  # llm-d's calibration ladder


# ---------------------------------------------------------------------------------------------------- refusals
class Refusal(enum.Enum):
    """Why calibrate stops without a recommendation (every one exits non-zero)."""

    UNREACHABLE = "unreachable"  # an engine's HTTP server (or a worker) did not answer
    NO_TIER = "no tier"  # an engine without the P2PWorkerTier, or no address to pull from
    FINGERPRINT = "fingerprint mismatch"  # source and puller could never exchange KV
    CONTAMINATED = "contaminated"  # the control leg found its prompt cached: its timing is not a recompute
    NO_PULL = "no pull"  # a pull leg recomputed (or pulled part): its timing is not a pull
    NO_CROSSOVER = "no crossover"  # recompute won (or the pull did not keep winning) up to the longest length


class Refused(Exception):
    def __init__(self, why: Refusal, message: str):
        super().__init__(message)
        self.why = why


# ---------------------------------------------------------------------------------------------------- /metrics
_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)$", re.M)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of metric ``name`` in a Prometheus text exposition: (labels, value)."""
    out = []
    for m in _SAMPLE.finditer(text):
        if m.group(1) == name:
            out.append((dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))))
    return out


def total(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (vLLM labels per engine and model)."""
    return sum(v for lab, v in samples(text, name) if all(lab.get(k) == w for k, w in labels.items()))


class CacheSource(enum.Enum):
    """The ``source`` label of vLLM's cached-prompt-token counter."""

    DEVICE = "device"
    HOST = "host"  # the engine's own CPU tier
    P2P = "p2p"  # a secondary tier that fetched from a peer (ours and vLLM's in-tree one alike)


@dataclass(frozen=True)
class CachedTokens:
    """Prompt tokens an engine served from each cache (a reading, or the difference of two)."""

    device: float = 0.0
    host: float = 0.0
    p2p: float = 0.0

    @classmethod
    def read(cls, metrics_text: str) -> "CachedTokens":
        return cls(**{s.value: total(metrics_text, CACHED_BY_SOURCE, source=s.value) for s in CacheSource})

    def __sub__(self, other: "CachedTokens") -> "CachedTokens":
        return CachedTokens(self.device - other.device, self.host - other.host, self.p2p - other.p2p)


class Served(enum.Enum):
    """Where one request's prefix came from, as the serving engine's counters tell it."""

    RECOMPUTED = "recomputed"
    HOST_HIT = "host hit"
    P2P_PULL = "p2p pull"
    DEVICE_HIT = "device hit"
    PARTIAL = "partial"  # one source only, fewer tokens than every full block
    MIXED = "mixed"  # more than one source


def classify(delta: CachedTokens, expect_tokens: int) -> Served:
    """What served a request whose prompt has ``expect_tokens`` tokens in full blocks, from its counter deltas."""
    moved = {CacheSource.DEVICE: delta.device, CacheSource.HOST: delta.host, CacheSource.P2P: delta.p2p}
    nonzero = [s for s, v in moved.items() if v != 0]
    if not nonzero:
        return Served.RECOMPUTED
    if len(nonzero) > 1:
        return Served.MIXED
    (only,) = nonzero
    if moved[only] != expect_tokens:
        return Served.PARTIAL
    return {CacheSource.DEVICE: Served.DEVICE_HIT, CacheSource.HOST: Served.HOST_HIT,
            CacheSource.P2P: Served.P2P_PULL}[only]


def expected_hit_tokens(prompt_tokens: int, block_size: int) -> int:
    """Tokens a cache can serve of a prompt: its full blocks, but never the last token (vLLM computes that one
    itself to produce the first output), so a prompt of exactly k blocks gives k - 1."""
    return (prompt_tokens - 1) // block_size * block_size


# ---------------------------------------------------------------------------------------------------- HTTP
class Http:
    """One engine's OpenAI server: every call bounded by ``timeout_s``; any failure to reach it is UNREACHABLE."""

    def __init__(self, url: str, timeout_s: float = 60.0):
        self.url, self.timeout_s = url.rstrip("/"), timeout_s

    def _open(self, path: str, body: dict | None = None, method: str | None = None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data, {"Content-Type": "application/json"} if data else {},
                                     method=method)
        try:
            return urllib.request.urlopen(req, timeout=self.timeout_s)
        except urllib.error.HTTPError as e:
            detail = e.read()[:300].decode(errors="replace")
            raise Refused(Refusal.UNREACHABLE, f"{self.url}{path}: HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise Refused(Refusal.UNREACHABLE, f"{self.url}{path}: {reason}") from None

    def get(self, path: str) -> bytes:
        with self._open(path) as r:
            return r.read()

    def post(self, path: str, body: dict | None = None) -> dict:
        with self._open(path, body, method="POST") as r:
            raw = r.read()
        return json.loads(raw) if raw[:1] in (b"{", b"[") else {"text": raw.decode(errors="replace")}

    def metrics(self) -> str:
        return self.get("/metrics").decode(errors="replace")

    def cached(self) -> CachedTokens:
        return CachedTokens.read(self.metrics())

    def ttft(self, body: dict) -> float:
        """Seconds from sending a streamed completion to its first chunk with a token; drains the rest."""
        t0 = time.perf_counter()
        with self._open("/v1/completions", {**body, "stream": True}, method="POST") as r:
            for line in r:
                if line.startswith(b"data: {"):
                    first = time.perf_counter() - t0
                    r.read()
                    return first
        raise Refused(Refusal.UNREACHABLE, f"{self.url}/v1/completions: the stream ended without a token")


# ---------------------------------------------------------------------------------------------------- engines
@dataclass(frozen=True)
class EngineInfo:
    """What an engine tells over HTTP about itself."""

    url: str
    model: str  # the served name requests use
    root: str  # the model it loaded (what the tier's fingerprint names)
    max_model_len: int
    block_size: int | None
    cache_dtype: str | None
    has_tier: bool  # exports the P2PWorkerTier's series
    p2p_address: str | None  # its worker's host:port (0.33's info metric), None when it does not say

    def identity(self) -> dict:
        """What two engines must share to exchange KV, as far as HTTP shows it (the workers' fingerprints say the
        rest: dtype, geometry, hash seed, parallelism)."""
        return {"model": self.root, "block_size": self.block_size, "cache_dtype": self.cache_dtype}


def inspect_engine(http: Http) -> EngineInfo:
    models = json.loads(http.get("/v1/models"))["data"]
    if not models:
        raise Refused(Refusal.UNREACHABLE, f"{http.url}/v1/models lists no model")
    m = models[0]
    text = http.metrics()
    cache = samples(text, CACHE_CONFIG_INFO)
    block = cache[0][0].get("block_size") if cache else None
    addresses = {lab["p2p_address"] for lab, _ in samples(text, OFFLOAD_CONFIG_INFO) if lab.get("p2p_address")}
    return EngineInfo(url=http.url, model=m["id"], root=m.get("root") or m["id"],
                      max_model_len=int(m.get("max_model_len") or 0), block_size=int(block) if block else None,
                      cache_dtype=cache[0][0].get("cache_dtype") if cache else None, has_tier=TIER_SERIES in text,
                      p2p_address=min(addresses) if addresses else None)


def identity_diff(a: EngineInfo, b: EngineInfo) -> dict[str, tuple]:
    ia, ib = a.identity(), b.identity()
    return {k: (ia[k], ib[k]) for k in ia if ia[k] != ib[k] and None not in (ia[k], ib[k])}


# ---------------------------------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class Settings:
    lengths: tuple[int, ...] = ()  # prompt tokens; empty: llm-d's ladder, clipped to the engines' limit
    reps: int = 5
    settle_s: float = 2.0  # after seeding the source: its CPU tier stores a step after computing
    timeout_s: float = 60.0  # every HTTP call
    token_low: int = 100  # random prompt token ids in [low, high): any vocabulary of 1000+ holds them
    token_high: int = 1000
    seed: int | None = None


def plan_lengths(requested: Iterable[int], block_size: int, limit: int) -> tuple[list[int], list[int]]:
    """(lengths to run, lengths dropped as longer than ``limit``), each rounded up to a multiple of the block size
    (llm-d's lengths are multiples: the block the router counts in).  With nothing requested: llm-d's ladder, or,
    when fewer than two of its points fit, a doubling ladder from one block."""
    asked = sorted({max(1, math.ceil(n / block_size)) * block_size for n in requested})
    if not asked:
        asked = [n for n in LLM_D_LENGTHS if n <= limit]
        if len(asked) < 2:
            asked = [block_size << k for k in range(32) if block_size << k <= limit]
    return [n for n in asked if n <= limit], [n for n in asked if n > limit]


# ---------------------------------------------------------------------------------------------------- results
class Leg(enum.Enum):
    CONTROL = "recompute"
    PULL = "pull"


@dataclass
class Sample:
    length: int
    rep: int
    leg: Leg
    ttft_s: float
    delta: CachedTokens
    served: Served


@dataclass
class Point:
    length: int
    recompute_s: list[float] = field(default_factory=list)
    pull_s: list[float] = field(default_factory=list)
    pulled_tokens: list[int] = field(default_factory=list)

    @property
    def recompute_median(self) -> float:
        return statistics.median(self.recompute_s)

    @property
    def pull_median(self) -> float:
        return statistics.median(self.pull_s)

    @property
    def pull_wins(self) -> bool:
        return self.pull_median < self.recompute_median


def crossover(points: list[Point]) -> int | None:
    """The smallest length from which the pull wins at every longer tested length too; None if it loses at the
    longest."""
    found = None
    for p in sorted(points, key=lambda p: p.length, reverse=True):
        if not p.pull_wins:
            break
        found = p.length
    return found


def fit_per_token_us(points: list[Point], which: str) -> tuple[float, float] | None:
    """Least-squares line of median TTFT over length: (µs per token, fixed ms), llm-d's costModel shape."""
    if len(points) < 2:
        return None
    xs = [p.length for p in points]
    ys = [p.recompute_median if which == "recompute" else p.pull_median for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return slope * 1e6, (my - slope * mx) * 1e3


@dataclass
class Result:
    source: str
    puller: str
    source_p2p: str
    model: str
    block_size: int
    settings: Settings
    points: list[Point]
    samples: list[Sample]
    dropped_lengths: list[int]
    crossover: int | None

    def to_json(self) -> dict:
        fits = {w: fit_per_token_us(self.points, w) for w in ("recompute", "pull")}
        return {
            "source": self.source, "puller": self.puller, "source_p2p": self.source_p2p, "model": self.model,
            "block_size": self.block_size, "settings": asdict(self.settings), "dropped_lengths": self.dropped_lengths,
            "points": [{"length": p.length, "recompute_ms": _ms_stats(p.recompute_s), "pull_ms": _ms_stats(p.pull_s),
                        "pulled_tokens": p.pulled_tokens, "pull_wins": p.pull_wins} for p in self.points],
            "fit": {w: (None if f is None else {"us_per_token": round(f[0], 3), "fixed_ms": round(f[1], 3)})
                    for w, f in fits.items()},
            "samples": [{"length": s.length, "rep": s.rep, "leg": s.leg.value, "ttft_ms": round(s.ttft_s * 1e3, 3),
                         "served": s.served.value, "cached": asdict(s.delta)} for s in self.samples],
            "min_cached_token_delta": self.crossover,
        }


def _ms_stats(v: list[float]) -> dict:
    return {"median": round(statistics.median(v) * 1e3, 3), "min": round(min(v) * 1e3, 3),
            "max": round(max(v) * 1e3, 3), "n": len(v)}


def table(result: Result) -> str:
    rows = [("tokens", "recompute ms (median [min..max])", "pull ms (median [min..max])", "p2p tokens", "faster")]
    for p in result.points:
        rows.append((str(p.length), _cell(p.recompute_s), _cell(p.pull_s), ",".join(map(str, p.pulled_tokens)),
                     "pull" if p.pull_wins else "recompute"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _cell(v: list[float]) -> str:
    return f"{statistics.median(v) * 1e3:.1f} [{min(v) * 1e3:.1f}..{max(v) * 1e3:.1f}]"


def recommendation(result: Result) -> str:
    """llm-d's output shape: the value, then the plugin's parameters as YAML."""
    n = result.crossover
    return (f"MIN_CACHED_TOKEN_DELTA={n}\n"
            f"# the EPP's plugin configuration:\n"
            f"- type: p2p-source-producer\n"
            f"  parameters:\n"
            f"    minCachedTokenDelta: {n}")


# ---------------------------------------------------------------------------------------------------- the run
FingerprintOf = Callable[[str], tuple[str, dict]]  # worker host:port -> (digest, fields)


class Calibration:
    """The measurement against a source engine and a puller engine, both with the P2PWorkerTier."""

    def __init__(self, source: Http, puller: Http, settings: Settings, source_p2p: str | None = None,
                 puller_p2p: str | None = None):
        self.source, self.puller, self.s = source, puller, settings
        self.source_p2p, self.puller_p2p = source_p2p, puller_p2p
        self.rng = random.Random(settings.seed) if settings.seed is not None else random.SystemRandom()
        self.info: dict[str, EngineInfo] = {}

    # ------------------------------------------------------------ refusals before anything is measured
    def preflight(self, fingerprint_of: FingerprintOf | None = None) -> None:
        """Both engines answer and carry the tier, the source's worker address is known, and nothing shows that
        the two could not exchange KV; raises Refused otherwise."""
        self.info = {"source": inspect_engine(self.source), "puller": inspect_engine(self.puller)}
        for role, info in self.info.items():
            if not info.has_tier:
                raise Refused(Refusal.NO_TIER, f"the {role} engine at {info.url} does not run the P2PWorkerTier "
                                               f"(its /metrics has no {TIER_SERIES}* series): nothing to calibrate")
        self.source_p2p = self.source_p2p or self.info["source"].p2p_address
        self.puller_p2p = self.puller_p2p or self.info["puller"].p2p_address
        if not self.source_p2p:
            raise Refused(Refusal.NO_TIER, f"the source engine at {self.source.url} does not publish its worker's "
                                           "address (vLLM 0.33's vllm:kv_offload_config_info): pass --source-p2p "
                                           "HOST:PORT, the tier's host and port")
        diff = identity_diff(self.info["source"], self.info["puller"])
        if diff:
            raise Refused(Refusal.FINGERPRINT, "source and puller serve different KV: "
                          + "; ".join(f"{k}: source {a!r}, puller {b!r}" for k, (a, b) in diff.items()))
        if fingerprint_of is not None:
            self._check_fingerprints(fingerprint_of)

    def _check_fingerprints(self, fingerprint_of: FingerprintOf) -> None:
        src_digest, src_fields = fingerprint_of(self.source_p2p)
        if not self.puller_p2p:
            return  # only the source's worker known: a mismatch then shows as a pull that never fires
        pul_digest, pul_fields = fingerprint_of(self.puller_p2p)
        if src_digest != pul_digest:
            keys = sorted(set(src_fields) | set(pul_fields))
            diff = [f"{k}: source {src_fields.get(k, '<absent>')!r}, puller {pul_fields.get(k, '<absent>')!r}"
                    for k in keys if src_fields.get(k) != pul_fields.get(k)]
            raise Refused(Refusal.FINGERPRINT, f"the workers' fingerprints differ ({src_digest} at "
                          f"{self.source_p2p}, {pul_digest} at {self.puller_p2p}), so no pull can succeed: "
                          + "; ".join(diff))

    @property
    def block_size(self) -> int:
        return self.info["source"].block_size or 16  # vLLM's default when the engine does not say

    @property
    def limit(self) -> int:
        """The longest cached prefix to test: its prompt (one token more) plus one output token fit both engines."""
        return min(i.max_model_len for i in self.info.values()) - 2

    # ------------------------------------------------------------ one leg
    def fresh_prompt(self, length: int) -> list[int]:
        """``length`` tokens a cache can serve (full blocks) and one more, the token vLLM always computes itself:
        so ``length`` is the cached-token delta the router compares with minCachedTokenDelta."""
        return [self.rng.randrange(self.s.token_low, self.s.token_high) for _ in range(length + 1)]

    def _body(self, prompt: list[int], **extra) -> dict:
        return {"model": self.info["puller"].model, "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}

    def seed_source(self, prompt: list[int]) -> None:
        self.source.post("/v1/completions", {**self._body(prompt), "model": self.info["source"].model})
        time.sleep(self.s.settle_s)

    def leg(self, leg: Leg, length: int, rep: int) -> Sample:
        prompt = self.fresh_prompt(length)
        self.seed_source(prompt)  # the control is seeded too: both legs see the same source
        extra = {}
        if leg is Leg.PULL:
            host, _, port = self.source_p2p.rpartition(":")
            extra = {"kv_transfer_params": {"remote_kv_source": {
                "kv_request_id": f"calibrate-{self.rng.getrandbits(64):016x}", "remote_host": host,
                "remote_port": int(port)}}}
        before = self.puller.cached()
        took = self.puller.ttft(self._body(prompt, **extra))
        delta = self.puller.cached() - before
        return Sample(length, rep, leg, took, delta, classify(delta, length))

    def check(self, s: Sample) -> None:
        """The control must have recomputed, the pull must have pulled every full block: else its timing is not
        what the table would call it."""
        if s.leg is Leg.CONTROL and s.served is not Served.RECOMPUTED:
            raise Refused(Refusal.CONTAMINATED, f"CONTAMINATED: the recompute leg at {s.length} tokens (rep "
                          f"{s.rep}) was served from a cache ({s.served.value}: {asdict(s.delta)}); the puller must "
                          "not share its prompts with anything else while calibrating")
        if s.leg is Leg.PULL and s.served is not Served.P2P_PULL:
            raise Refused(Refusal.NO_PULL, f"NO PULL: the pull leg at {s.length} tokens (rep {s.rep}) was "
                          f"{s.served.value} ({asdict(s.delta)}, want p2p {s.length}): check that the puller reaches "
                          f"{self.source_p2p}, that both run with the same $P2PWORKER_SECRET, and `p2pworker ping "
                          f"{self.source_p2p}`")

    # ------------------------------------------------------------ the ladder
    def warm(self, length: int) -> None:
        """One discarded pull: the first between two workers pays the session's setup."""
        self.leg(Leg.PULL, length, -1)

    def run(self, progress: Callable[[int], None] = lambda n: None) -> Result:
        lengths, dropped = plan_lengths(self.s.lengths, self.block_size, self.limit)
        if not lengths:
            raise Refused(Refusal.NO_CROSSOVER, f"no length to test: every one asked for ({dropped}) is longer "
                                                f"than the engines take ({self.limit} tokens)")
        self.warm(lengths[0])
        points, legs = [], []
        for length in lengths:
            p = Point(length)
            for rep in range(self.s.reps):
                order = (Leg.CONTROL, Leg.PULL) if rep % 2 == 0 else (Leg.PULL, Leg.CONTROL)
                for which in order:
                    s = self.leg(which, length, rep)
                    legs.append(s)
                    self.check(s)
                    (p.recompute_s if which is Leg.CONTROL else p.pull_s).append(s.ttft_s)
                    if which is Leg.PULL:
                        p.pulled_tokens.append(int(s.delta.p2p))
                progress(1)
            points.append(p)
        src = self.info["source"]
        return Result(self.source.url, self.puller.url, self.source_p2p or "", src.model, self.block_size, self.s,
                      points, legs, dropped, crossover(points))

    def total_steps(self) -> int:
        lengths, _ = plan_lengths(self.s.lengths, self.block_size, self.limit)
        return len(lengths) * self.s.reps
