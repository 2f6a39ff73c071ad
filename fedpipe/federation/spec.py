"""The federation's spec: what both the ServerApp and every site build the same algorithm from.

It carries the parts of a run's config that decide the math (method, train, engine, seed, the resolved
model name and the data's shape), not the run config itself: `fedpipe.run.config` pulls in the report
and plotting stack, which a site does not need (and the Flower environment does not carry).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from pydantic import TypeAdapter

from fedpipe.algorithms import Algorithm, MethodConfig, build_algorithm, phases_of
from fedpipe.algorithms.base import MethodParams, Phase
from fedpipe.algorithms.robust import SECURE_AGGREGATION_REFUSAL
from fedpipe.config import EngineConfig, FederationConfig, PrivacyConfig, TrainConfig
from fedpipe.errors import ConfigError
from fedpipe.federation.support import FEDERATED, NOT_YET, secure_refusal
from fedpipe.nn.networks import build_model
from fedpipe.seeding import derive_seed

#: Methods that run federated today (`fedpipe.federation.support` says why the others do not yet).
SUPPORTED = tuple(FEDERATED)


def refusal(method: str, privacy: bool = False, finetune_epochs: int = 0, secure_aggregation: bool = False,
            robust: bool = False) -> str | None:
    """Why `method` cannot run federated yet (with `secure_aggregation`: under SecAgg+), in one line; None when it can.
    A `finetune` phase (`finetune_epochs` > 0) runs at the sites like any phase: each site fine-tunes, keeps the result
    in its own store and evaluates it there (`client_app.evaluate`); it uploads nothing, so under SecAgg+ its rounds are
    plain ones (nothing to mask).
    `robust`: train.robust is active (a robust rule needs each update, which SecAgg+ never shows the server)."""
    if robust and secure_aggregation:
        return SECURE_AGGREGATION_REFUSAL
    if method not in SUPPORTED:
        return (f"method {method!r} is not federated yet: {NOT_YET.get(method, 'not wired to the SuperLink')} "
                f"(federated today: {', '.join(SUPPORTED)})")
    if secure_aggregation:
        return secure_refusal(method)
    return None


def train_dump(train: TrainConfig) -> dict:
    """The train section as the spec carries it: `robust` only when active, so that a spec (and the fingerprint its
    checkpoints are matched by, `fedpipe.federation.resume`) made before train.robust existed stays the same."""
    dumped = train.model_dump(mode="json")
    if not train.robust.active:
        dumped.pop("robust")
    return dumped


def _effective_privacy(cfg, num_sites: int) -> dict:
    """The run's privacy section as it applies it (in .venv: `fedpipe.run.privacy.effective`, with the noise multiplier
    calibrated to target_epsilon over the sites), dumped; {} when privacy is off."""
    if not cfg.privacy.enabled:
        return {}
    from fedpipe.run.privacy import effective

    return effective(cfg, num_sites).model_dump(mode="json")


@dataclass
class FederationSpec:
    method: dict  # the MethodConfig, dumped
    train: dict  # TrainConfig, dumped
    engine: dict  # EngineConfig, dumped
    seed: int
    model_name: str  # resolved (never "auto")
    input_shape: list[int]
    num_classes: int
    num_sites: int
    threads: int = 1  # torch threads in each ServerApp / ClientApp process
    federation: dict = field(default_factory=dict)  # FederationConfig, dumped (timeouts, secure aggregation)
    # own_data.site_params: each site splits its own files with these; empty: sites hold exported splits (try-out)
    site_data: dict = field(default_factory=dict)
    # the privacy section as the run applies it (`fedpipe.run.privacy.effective`: noise calibrated); {} when off
    privacy: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    # --- (de)serialisation ---------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> FederationSpec:
        return cls(**json.loads(text))

    @classmethod
    def read(cls, path: str | Path) -> FederationSpec:
        return cls.from_json(Path(path).read_text())

    @classmethod
    def from_run_config(cls, cfg, input_shape: tuple[int, ...], num_classes: int, num_sites: int) -> FederationSpec:
        """From a `fedpipe.run.config.RunConfig` (in .venv, where the run config lives); refuses what is not federated yet."""
        why = refusal(cfg.method.name, cfg.privacy.enabled, cfg.method.finetune_epochs, cfg.federation.secure_aggregation.enabled,
                      cfg.train.robust.active)
        if why:
            raise ConfigError(why)
        return cls(cfg.method.model_dump(mode="json"), train_dump(cfg.train), cfg.engine.model_dump(mode="json"),
                   cfg.run.seed, cfg.model_name(tuple(input_shape)), list(input_shape), num_classes, num_sites,
                   threads=cfg.run.threads or 1, federation=cfg.federation.model_dump(mode="json"),
                   privacy=_effective_privacy(cfg, num_sites))

    @classmethod
    def for_sites(cls, cfg, num_sites: int, site_data: dict) -> FederationSpec:
        """For sites with their own files (`fedpipe.federation.own_data.site_params`): the data's shape, classes and
        (with model.name=auto) network come from the sites' census (`with_data`), not from data the server holds."""
        why = refusal(cfg.method.name, cfg.privacy.enabled, cfg.method.finetune_epochs, cfg.federation.secure_aggregation.enabled,
                      cfg.train.robust.active)
        if why:
            raise ConfigError(why)
        return cls(cfg.method.model_dump(mode="json"), train_dump(cfg.train), cfg.engine.model_dump(mode="json"),
                   cfg.run.seed, cfg.model.name, [], 0, num_sites, threads=cfg.run.threads or 1,
                   federation=cfg.federation.model_dump(mode="json"), site_data=site_data, privacy=_effective_privacy(cfg, num_sites))

    def with_data(self, input_shape: tuple[int, ...], num_classes: int) -> FederationSpec:
        """This spec with the data's shape and classes as the census found them (model.name=auto resolved for them)."""
        from dataclasses import replace

        from fedpipe.nn.networks import auto_model_name

        name = auto_model_name(tuple(input_shape)) if self.model_name == "auto" else self.model_name
        return replace(self, input_shape=list(input_shape), num_classes=int(num_classes), model_name=name)

    # --- what both sides build -------------------------------------------------------------------
    @property
    def method_params(self) -> MethodParams:
        return TypeAdapter(MethodConfig).validate_python(self.method)

    @property
    def train_cfg(self) -> TrainConfig:
        return TrainConfig.model_validate(self.train)

    @property
    def privacy_cfg(self) -> PrivacyConfig | None:
        return PrivacyConfig.model_validate(self.privacy) if self.privacy else None

    @property
    def federation_cfg(self) -> FederationConfig:
        return FederationConfig.model_validate(self.federation)

    @property
    def engine_cfg(self) -> EngineConfig:
        return EngineConfig.model_validate(self.engine)

    def phases(self) -> list[Phase]:
        return phases_of(self.method_params, self.train_cfg.rounds)

    def phase(self, name: str) -> Phase:
        for p in self.phases():
            if p.name == name:
                return p
        raise ConfigError(f"method {self.method['name']!r} has no phase {name!r}")

    def build(self, device: torch.device) -> tuple[Algorithm, dict[str, torch.Tensor]]:
        """The algorithm and the seeded initial global parameters: the same steps as
        `fedpipe.run.run.Run.build_algorithm` (same seed key, same weights), without loading the dataset."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(self.seed, "init-global"))
            model = build_model(self.model_name, tuple(self.input_shape), self.num_classes)
        model = model.to(device)
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        return build_algorithm(self.method_params, model, self.seed), initial
