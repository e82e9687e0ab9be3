"""Cost-based admission: load a prefix hit from L2/L3 only when loading it is
estimated faster than recomputing it.

A request's hit continues tier by tier: L1, then ``l2`` tokens on L2, then
``l3`` tokens on L3 (a prefix: the L3 part cannot be used without the L2 part
before it). Three choices, each costed with the same model:

- load both: ``load_s(L2 + L3)``;
- load L2, recompute the L3 part: ``load_s(L2) + l3 / prefill``;
- recompute both: ``(l2 + l3) / prefill``.
"""
from __future__ import annotations

import dataclasses
import enum
import math
import threading
from typing import Any, Mapping, NamedTuple

from hicache.core.errors import IntegrityError, InvalidArgument
from hicache.core.stats import AdmissionStats  # noqa: F401  (re-exported)


TIERS = ("L2", "L3")


class Estimate(NamedTuple):
    """Seconds to bring a hit into L1 by loading it, and to recompute it instead."""

    load_s: float
    recompute_s: float


def estimate(tokens_hit_per_tier: Mapping[str, int], *, bytes_per_token: int, bandwidth: Mapping[str, float],
             prefill_tokens_per_s: float, queued_bytes: Mapping[str, int] | None = None) -> Estimate:
    """``(load_s, recompute_s)`` of loading the hit ``{"L2": tokens, "L3": tokens}``
    (a prefix: L2 part first) versus recomputing all of it. Pure.

    ``bandwidth``: bytes/s of each link (``"L2"``: L2 -> L1, ``"L3"``: L3 -> L2);
    ``queued_bytes``: bytes already waiting on each link. Raises ``ValueError``
    for a non-positive rate of a tier that has tokens.
    """
    q = queued_bytes or {}
    t2, t3 = int(tokens_hit_per_tier.get("L2", 0)), int(tokens_hit_per_tier.get("L3", 0))
    if prefill_tokens_per_s <= 0:
        raise ValueError(f"prefill_tokens_per_s={prefill_tokens_per_s!r}: must be > 0")
    load = 0.0
    if t3:
        load += (q.get("L3", 0) + t3 * bytes_per_token) / _rate(bandwidth, "L3")
    if t2 or t3:
        load += (q.get("L2", 0) + (t2 + t3) * bytes_per_token) / _rate(bandwidth, "L2")
    return Estimate(load, (t2 + t3) / prefill_tokens_per_s)


def _rate(bandwidth: Mapping[str, float], tier: str) -> float:
    bw = bandwidth.get(tier, 0.0)
    if not bw or bw <= 0:
        raise ValueError(f"bandwidth[{tier!r}]={bw!r}: must be > 0 bytes/s")
    return float(bw)


class Choice(enum.Enum):
    LOAD = "load"  # load the L2 and the L3 part
    LOAD_L2 = "load_l2"  # load the L2 part, recompute the L3 part
    RECOMPUTE = "recompute"  # recompute both
    UNMEASURED = "unmeasured"  # an input is unknown yet: load (as without the model)


class Decision(NamedTuple):
    """What ``choose`` decided for one hit, and the figures it compared."""

    choice: Choice
    l2_tokens: int  # the L2 part of the hit
    l3_tokens: int  # the L3 part continuing it
    load_s: float  # estimated seconds of loading the whole L2 + L3 part (nan: unmeasured)
    recompute_s: float  # estimated seconds of recomputing the whole L2 + L3 part (nan: unmeasured)
    plan_s: float  # estimated seconds of the chosen plan (its loads + the recompute it leaves)

    @property
    def load_l2(self) -> bool:
        return self.choice is not Choice.RECOMPUTE

    @property
    def load_l3(self) -> bool:
        return self.choice in (Choice.LOAD, Choice.UNMEASURED)


@dataclasses.dataclass(frozen=True, slots=True)
class CostInputs:
    """The model's inputs at one moment (printed by ``hicache replay --simulate``)."""

    bytes_per_token: int  # KV bytes of one token, every plane (KVLayout.token_bytes)
    prefill_tokens_per_s: float | None  # None: not configured and not measured yet
    bandwidth: Mapping[str, float | None]  # "L2" (L2 -> L1), "L3" (L3 -> L2); None: unknown
    queued_bytes: Mapping[str, int]  # bytes already waiting per link


def choose(l2_tokens: int, l3_tokens: int, inputs: CostInputs) -> Decision:
    """The cheapest of load both / load L2 only / recompute (see ``CostModel``). Pure."""
    if not l2_tokens and not l3_tokens:
        return Decision(Choice.LOAD, 0, 0, 0.0, 0.0, 0.0)
    rate = inputs.prefill_tokens_per_s
    bw = inputs.bandwidth
    if not rate or not bw.get("L2") or (l3_tokens and not bw.get("L3")):
        nan = float("nan")
        return Decision(Choice.UNMEASURED, l2_tokens, l3_tokens, nan, nan, nan)
    kw = dict(bytes_per_token=inputs.bytes_per_token, bandwidth={k: v for k, v in bw.items() if v},
              prefill_tokens_per_s=rate, queued_bytes=inputs.queued_bytes)
    whole = estimate({"L2": l2_tokens, "L3": l3_tokens}, **kw)  # type: ignore[arg-type]
    options = [(whole.load_s, 0, Choice.LOAD)]
    if l2_tokens and l3_tokens:  # (without an L2 part, this is the recompute)
        part = estimate({"L2": l2_tokens}, **kw).load_s  # type: ignore[arg-type]
        options.append((part + l3_tokens / rate, 1, Choice.LOAD_L2))
    options.append((whole.recompute_s, 2, Choice.RECOMPUTE))
    best_s, _, best = min(options)  # ties: the option that loads more (listed first)
    return Decision(best, l2_tokens, l3_tokens, whole.load_s, whole.recompute_s, best_s)


class BandwidthMeter:
    """EWMA of bytes/s per link from real transfers, starting at a prior (0: unknown). Thread-safe."""

    def __init__(self, priors: Mapping[str, float], alpha: float):
        self.alpha = alpha
        self._lock = threading.Lock()
        self._rate: dict[str, float | None] = {t: (priors.get(t) or None) for t in TIERS}
        self.samples: dict[str, int] = {t: 0 for t in TIERS}

    def observe(self, tier: str, nbytes: int, seconds: float) -> None:
        """One finished transfer of ``nbytes`` in ``seconds`` on ``tier``'s link."""
        if not nbytes > 0 or not seconds > 0:  # NaN too
            return
        bw = nbytes / seconds
        if not math.isfinite(bw):  # an infinite rate would turn the EWMA NaN for good
            return
        with self._lock:
            old = self._rate[tier]
            self._rate[tier] = bw if old is None else old + self.alpha * (bw - old)
            self.samples[tier] += 1

    def rates(self) -> dict[str, float | None]:
        with self._lock:
            return dict(self._rate)


class CostModel:
    """One cache's meters and decision counters around ``choose``. Not thread-safe
    except ``observe_*`` (called from transfer completions).

    ``load_s``: the L3 part moves L3 -> L2 -> L1, the L2 part L2 -> L1; each link
    first drains the bytes already queued on it (one after the other, which is
    what ``HiCache.admit`` does: it waits for the prefetch, then loads back)::

        load_s = (queued_L3 + b3) / bw_L3 + (queued_L2 + b2 + b3) / bw_L2

    with ``b = tokens * bytes_per_token``. The cheapest choice wins; ties load
    (loading saves compute for the other requests of the batch). Bandwidths are
    EWMAs of real transfers (``BandwidthMeter``), starting from the configured
    priors; the prefill rate is ``admission.prefill_tokens_per_s`` or, when that is
    0, an EWMA of what the engine reports (``HiCache.observe_prefill``). While a
    needed input is unknown the choice is to load (counted as ``unmeasured``): a
    cache with no measurement yet behaves as before.

    ``estimate`` and ``choose`` are pure; ``CostModel`` holds the meters and the
    decision counters of one cache. In service mode (``hicache+unix://``) the
    node's service owns L2 and L3 and the engine's index sees no L2 hit before
    acquiring, so those admissions are not gated (a hit of 0 tokens: uncounted).
    """

    def __init__(self, *, bytes_per_token: int, enabled: bool, prefill_tokens_per_s: float = 0.0,
                 priors: Mapping[str, float] | None = None, alpha: float = 0.2):
        for name, v in (("prefill_tokens_per_s", prefill_tokens_per_s), *((f"{t} prior", p) for t, p in
                                                                        (priors or {}).items())):
            if not math.isfinite(v) or v < 0:
                raise InvalidArgument(f"CostModel {name}={v!r}: must be a finite number >= 0 (0: measured)")
        self.bytes_per_token = bytes_per_token
        self.enabled = enabled
        self.configured_rate = prefill_tokens_per_s or None
        self.bandwidth = BandwidthMeter(priors or {}, alpha)
        self.alpha = alpha
        self._prefill: float | None = None  # EWMA of observed tokens/s
        self.stats = AdmissionStats()

    @classmethod
    def from_config(cls, cfg: Any, bytes_per_token: int) -> "CostModel":
        """From ``cfg``, a ``hicache.core.config.AdmissionConfig`` (not imported: the config sits above)."""
        return cls(bytes_per_token=bytes_per_token, enabled=cfg.policy == "cost",
                   prefill_tokens_per_s=cfg.prefill_tokens_per_s,
                   priors={"L2": cfg.l2_bytes_per_s, "L3": cfg.l3_bytes_per_s}, alpha=cfg.ewma_alpha)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """One forward of ``tokens`` in ``seconds``. Zero of either is skipped; a value that is
        not finite is an ``InvalidArgument`` (it would make the estimate NaN for good)."""
        if not (math.isfinite(tokens) and math.isfinite(seconds)):
            raise InvalidArgument(f"observe_prefill(tokens={tokens!r}, seconds={seconds!r}): expected finite "
                                  "numbers (the tokens of one forward and its wall time)")
        if tokens > 0 and seconds > 0 and math.isfinite(tokens / seconds):
            r = tokens / seconds
            self._prefill = r if self._prefill is None else self._prefill + self.alpha * (r - self._prefill)

    def inputs(self, queued_bytes: Mapping[str, int] | None = None) -> CostInputs:
        """The inputs now (``queued_bytes`` is kept, not copied: pass a mapping nobody changes)."""
        return CostInputs(self.bytes_per_token, self.configured_rate or self._prefill, self.bandwidth.rates(),
                          queued_bytes if queued_bytes is not None else {})

    def decide(self, l2_tokens: int, l3_tokens: int, queued_bytes: Mapping[str, int] | None = None) -> Decision:
        """``choose`` on the current inputs, counted (hits of 0 tokens are not counted).
        With the model off (``admission.policy = "always_load"``): load, uncounted."""
        if not self.enabled:
            nan = float("nan")
            return Decision(Choice.LOAD, l2_tokens, l3_tokens, nan, nan, nan)
        d = choose(l2_tokens, l3_tokens, self.inputs(queued_bytes))
        if l2_tokens or l3_tokens:
            s = self.stats
            setattr(s, d.choice.value, getattr(s, d.choice.value) + 1)
            if d.choice is Choice.RECOMPUTE:
                s.recomputed_l2_tokens += l2_tokens
            if not d.load_l3:
                s.recomputed_l3_tokens += l3_tokens
        return d

    def check_integrity(self) -> None:
        s = self.stats
        bad = {k: v for k, v in s.as_dict().items() if v < 0}
        if bad:
            raise IntegrityError(f"negative admission counters {bad}")
        if (s.recomputed_l2_tokens and not s.recompute) or (s.recomputed_l3_tokens and not (s.recompute + s.load_l2)):
            raise IntegrityError(f"recomputed tokens without a decision that recomputes: {s}")
        for tier, r in self.bandwidth.rates().items():
            if r is not None and not (r > 0 and math.isfinite(r)):
                raise IntegrityError(f"bandwidth of {tier} is {r!r}; must be finite and > 0 once measured")
        for name, r in (("measured", self._prefill), ("configured", self.configured_rate)):
            if r is not None and not (r > 0 and math.isfinite(r)):
                raise IntegrityError(f"{name} prefill rate is {r!r}; must be finite and > 0")
