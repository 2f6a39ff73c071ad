"""A site's own policy: the file a site's admin writes (`fedpipe site join --policy FILE`, the fedpipe-site chart's
`policy` value), checked against every message before the site reads any of its data.

The model is NVIDIA FLARE's per-site policy files (`authorization.json`, `privacy.json`, `resources.json`: the site
refuses a job that asks for more than it grants, before anything runs), for what a fedpipe site can be asked:

- which methods it takes, which federations (SuperLink address, run-name prefix) it serves;
- privacy: whether it is required (and in which mode), the largest epsilon and delta per run, and in local mode the
  site's own noise: the least noise multiplier, the largest clip, and never seeded noise unless the site allows it
  (seeded noise is known to anyone holding the config: the server could subtract it);
- whether SecAgg+ is required;
- the most rounds, local epochs and seconds of training per round;
- the largest image size, decode budget, torch threads and cache of prepared splits the run may make it use;
- whether its evaluation scores and label counts may leave it.

A message outside the policy is refused with one line naming the rule (`hospital-a refused: epsilon 12.0 above its
8.0`); the server's round log and the report carry it, and the round rule counts the site as failed. The defaults
are what a site's admin would expect of a site that has said nothing: every method fedpipe federates, no privacy
required, bounds that keep a run from taking the machine (512-pixel images, a 4 GB decode budget, the machine's cores,
a 4 GB cache), scores and label counts released (the report needs them), any federation.

Plain data and pydantic: no torch, no Flower (the site's admin reads it with `fedpipe site check` in .venv).
"""

from __future__ import annotations

import fnmatch
import math
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fedpipe.errors import ConfigError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PrivacyPolicy(_Section):
    required: bool = False
    """Refuse every run without differential privacy (privacy.enabled)."""
    mode: Literal["any", "central", "local"] = "any"
    """The privacy mode this site takes: local (the site noises its own update; the server sees nothing without noise),
    central (the server noises the sum, so the site trusts it), or any."""
    max_epsilon: float | None = Field(None, gt=0)
    """The largest epsilon a run may spend (central mode: the run's; local mode: against the server itself)."""
    max_delta: float | None = Field(None, gt=0, lt=1)
    """The largest delta a run may use."""
    noise_multiplier: float | None = Field(None, ge=0)
    """Local mode: the least noise multiplier this site adds to its own update (a run asking for less is refused)."""
    clip: float | None = Field(None, gt=0)
    """Local mode: the largest clip (L2 norm of the update) this site accepts."""
    allow_seeded_noise: bool = False
    """Take runs with privacy.seeded_noise (tests and reproductions only: anyone with the config can regenerate the
    noise). Off: the noise is always drawn from this site's own secret."""


class Limits(_Section):
    max_rounds: int = Field(1000, ge=1)
    """The most rounds a run's phase may have (train.rounds)."""
    max_local_epochs: int = Field(50, ge=1)
    """The most local epochs per round (train.local_epochs)."""
    max_train_seconds: float = Field(3600.0, gt=0)
    """The most seconds one round's training (or evaluation) may take here; past it the site stops and refuses."""
    max_image_size: int = Field(512, ge=1)
    """The largest data.image_size a run may ask this site to decode its images at."""
    max_decoded_mb: int = Field(4096, ge=1)
    """The largest decode budget (data.max_decoded_mb) a run may ask for."""
    max_threads: int = Field(default_factory=lambda: os.cpu_count() or 1, ge=1)
    """The most torch threads a run may use here (more are cut to this)."""
    max_cache_mb: int = Field(4096, ge=1)
    """The most megabytes of prepared splits this site keeps (the oldest are removed past it)."""


class Release(_Section):
    scores: bool = True
    """Whether the site's evaluation scores may leave it (off: evaluation requests are refused)."""
    label_counts: bool = True
    """Whether its label counts may leave it in the census (off: it answers without them)."""


class Federation(_Section):
    superlink: str = "*"
    """The SuperLink address this site serves (host:port; shell wildcards allowed)."""
    run_prefix: str = ""
    """Run names this site serves start with this (empty: any run)."""


class SitePolicy(_Section):
    name: str = ""
    """The site's name in its refusals (default: its folder's name)."""
    methods: tuple[str, ...] | None = None
    """The methods this site takes (None: every method fedpipe federates)."""
    secure_aggregation_required: bool = False
    """Refuse every run without SecAgg+ (federation.secure_aggregation.enabled)."""
    opt_out: bool = False
    """Take part in no communicating phase: train only this site's own models (the mixture of experts' specialist and
    gate) and upload nothing; the census tells the server, and a round that asks anyway is refused here."""
    privacy: PrivacyPolicy = PrivacyPolicy()
    limits: Limits = Limits()
    release: Release = Release()
    federations: tuple[Federation, ...] = (Federation(),)
    """The federations this site serves; a run of any other is refused."""

    @classmethod
    def read(cls, path: str | Path | None) -> SitePolicy:
        """The policy in `path` (YAML), or the defaults when `path` is None. A ConfigError names what is wrong."""
        if path is None:
            return cls()
        from fedpipe.config import format_validation_error
        from fedpipe.safe_load import load_yaml_file

        tree = load_yaml_file(path, "site policy") or {}
        if not isinstance(tree, dict):
            raise ConfigError(f"site policy {path}: expected a mapping of settings (methods, privacy, limits, release, "
                              f"federations), found {type(tree).__name__}")
        try:
            return cls.model_validate(tree)
        except ValidationError as e:
            raise ConfigError(f"site policy {path}: {format_validation_error(e)} (`fedpipe site check --policy FILE` shows "
                              "the policy a site runs under; docs/site-admin.md lists every setting)") from None

    # --- the checks ---------------------------------------------------------------------------------
    def serves(self, superlink: str) -> str | None:
        """Why this site does not serve the SuperLink at `superlink` (None: it does)."""
        if any(fnmatch.fnmatchcase(superlink, f.superlink) for f in self.federations):
            return None
        return f"SuperLink {superlink} is not one of the federations this site serves ({', '.join(f.superlink for f in self.federations)})"

    def refusal(self, spec, run_name: str, superlink: str, kind: str) -> str | None:
        """Why this site refuses a `kind` message ("census", "train", "evaluate") of the run `run_name` under `spec` (a
        `FederationSpec`), in one line without the site's name; None when the policy allows it. Reads no data."""
        if not any(fnmatch.fnmatchcase(superlink, f.superlink) and run_name.startswith(f.run_prefix) for f in self.federations):
            prefixes = ", ".join(repr(f.run_prefix) for f in self.federations if fnmatch.fnmatchcase(superlink, f.superlink))
            return f"run {run_name!r} is not a run it serves (run names starting with {prefixes or 'none at this SuperLink'})"
        method = str(spec.method.get("name", "?"))
        if self.methods is not None and method not in self.methods:
            return f"method {method} is not one it takes ({', '.join(self.methods) or 'none'})"
        train, limits = spec.train, self.limits
        for key, most in (("rounds", limits.max_rounds), ("local_epochs", limits.max_local_epochs)):
            if int(train.get(key, 0)) > most:
                return f"train.{key} {train.get(key)} above its {most}"
        data = (spec.site_data or {}).get("data", {})
        if data.get("image_size") is not None and int(data["image_size"]) > limits.max_image_size:
            return f"image size {data['image_size']} above its {limits.max_image_size}"
        budget = data.get("max_decoded_mb")
        if isinstance(budget, (int, float)) and budget > limits.max_decoded_mb:
            return f"decode budget {budget} MB above its {limits.max_decoded_mb}"
        secure = bool(spec.federation.get("secure_aggregation", {}).get("enabled", False))
        if self.secure_aggregation_required and not secure:
            return "secure aggregation is off; it requires it"
        if kind == "evaluate" and not self.release.scores:
            return "its evaluation scores may not leave it"
        return self._privacy_refusal(spec)

    def _privacy_refusal(self, spec) -> str | None:
        want, got = self.privacy, spec.privacy_cfg
        if got is None:
            return "privacy is off; it requires it" if want.required else None
        if want.mode != "any" and got.mode != want.mode:
            return f"privacy mode {got.mode}; it takes {want.mode} only"
        if got.seeded_noise and not want.allow_seeded_noise:
            return "seeded noise asked for: anyone holding the config could regenerate it; the noise is the site's own"
        if got.mode == "local":
            if want.noise_multiplier is not None and got.noise_multiplier < want.noise_multiplier:
                return f"noise multiplier {got.noise_multiplier:g} below its {want.noise_multiplier:g}"
            if want.clip is not None and got.clip > want.clip:
                return f"clip {got.clip:g} above its {want.clip:g}"
        delta = run_delta(spec)
        if want.max_delta is not None and delta > want.max_delta:
            return f"delta {delta:g} above its {want.max_delta:g}"
        if want.max_epsilon is not None:
            epsilon = run_epsilon(spec)
            if not epsilon <= want.max_epsilon:
                return f"epsilon {epsilon:.3g} above its {want.max_epsilon:g}"
        return None

    def summary(self) -> list[str]:
        """What `fedpipe site check` prints of the policy, a line per rule."""
        p, lim, rel = self.privacy, self.limits, self.release
        privacy = "not required" if not p.required else f"required ({p.mode} mode)"
        if p.max_epsilon is not None:
            privacy += f", epsilon at most {p.max_epsilon:g}"
        if p.max_delta is not None:
            privacy += f", delta at most {p.max_delta:g}"
        if p.noise_multiplier is not None or p.clip is not None:
            privacy += f"; local noise multiplier at least {p.noise_multiplier}, clip at most {p.clip}"
        privacy += "; seeded noise " + ("allowed" if p.allow_seeded_noise else "refused")
        return [f"methods    {', '.join(self.methods) if self.methods is not None else 'every federated method'}",
                f"privacy    {privacy}",
                f"secagg     {'required' if self.secure_aggregation_required else 'not required'}",
                f"opt-out    {'yes: it uploads nothing' if self.opt_out else 'no'}",
                f"limits     {lim.max_rounds} rounds, {lim.max_local_epochs} local epochs, {lim.max_train_seconds:g} s a round, "
                f"images {lim.max_image_size} px, decode {lim.max_decoded_mb} MB, {lim.max_threads} threads, cache {lim.max_cache_mb} MB",
                f"releases   scores {'yes' if rel.scores else 'no'}, label counts {'yes' if rel.label_counts else 'no'}",
                "serves     " + "; ".join(f"{f.superlink} (runs {f.run_prefix + '*' if f.run_prefix else 'any'})" for f in self.federations)]


def run_delta(spec) -> float:
    from fedpipe.engine.accounting import default_delta

    cfg = spec.privacy_cfg
    return cfg.delta if cfg.delta is not None else default_delta(spec.num_sites)


def run_epsilon(spec) -> float:
    """The most epsilon the run `spec` can spend: the census's noised label counts and the planned rounds' (every
    communicating phase's rounds at its sample rate and the noise multiplier), capped by target_epsilon; in local mode the epsilon against the server itself
    (`fedpipe.engine.accounting.epsilon_against_server`), which a site that trusts nobody counts."""
    from fedpipe.engine.accounting import epsilon_against_server, epsilon_of
    from fedpipe.federation.private import census_release, sample_rate

    cfg = spec.privacy_cfg
    census = census_release(spec)  # the census's noised label counts, spent once before the first round
    history = [*([[census, 1.0, 1]] if census is not None else []),
               *([cfg.noise_multiplier, sample_rate(spec, p), len(p.rounds)] for p in spec.phases() if p.communicates)]
    if cfg.mode == "local":
        return epsilon_against_server(cfg.accountant, history, run_delta(spec))
    planned = epsilon_of(cfg.accountant, history, run_delta(spec))
    if cfg.target_epsilon is not None:
        planned = min(planned, cfg.target_epsilon)
    return planned if not math.isnan(planned) else math.inf
