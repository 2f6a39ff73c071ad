"""`fedpipe privacy`: differential privacy of a run planned before it starts."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from fedpipe.cli.common import ConfigOpt, SetOpt, _guarded, _load, app

privacy_app = typer.Typer(
    help="User-level differential privacy (the `privacy` config section): what a run's rounds will spend, in epsilon at "
         "delta, before it starts. With privacy.enabled each client's update is clipped to privacy.clip and Gaussian noise "
         "of std noise_multiplier * clip is added (central: once to the sum, by the server; local: by every client); "
         "clients join each round by Poisson sampling at rate train.client_fraction, which the accountant assumes. "
         "docs/privacy.md says what each method uploads, which methods are refused, and what epsilon covers.",
    no_args_is_help=True,
)
app.add_typer(privacy_app, name="privacy")
ClientsOpt = Annotated[Optional[int], typer.Option("--clients", help="Number of clients n, for the default delta min(1e-5, 0.01/n) "
                                                   "(default: partition.num_clients of the config; needed when the partition does not say).")]
PointsOpt = Annotated[int, typer.Option("--points", min=1, max=1000, help="Rounds of the epsilon schedule to print.")]


@privacy_app.command()
@_guarded
def plan(config: ConfigOpt = None, overrides: SetOpt = None, clients: ClientsOpt = None, points: PointsOpt = 10):
    """The noise multiplier and the epsilon after each round, for the run this config would start.

    With privacy.target_epsilon set, the noise multiplier is calibrated: the smallest that keeps every planned private
    round (the method's communicating phases; fine-tuning and Local's training release nothing) within the target at
    delta. Without it, the schedule of privacy.noise_multiplier as configured. Examples:

        fedpipe privacy plan -c examples/fedavg_ft_mnist5k.yaml --set privacy.target_epsilon=4 --set train.client_fraction=0.2

        fedpipe privacy plan --set privacy.noise_multiplier=1.2 --set train.rounds=100

    To run with the calibrated value: --set privacy.enabled=true --set privacy.target_epsilon=4 --set
    privacy.on_target=calibrate (the run calibrates the same way before its first round), or set
    privacy.noise_multiplier to the value printed."""
    from fedpipe.errors import ConfigError
    from fedpipe.run.privacy import plan as make_plan

    cfg = _load(config, overrides)
    n = clients if clients is not None else getattr(cfg.partition, "num_clients", None)
    if n is None:
        raise ConfigError(f"partition.scheme={cfg.partition.scheme} does not say how many clients there are: pass --clients N "
                          "(the default delta is min(1e-5, 0.01/N)), or set privacy.delta.")
    p = make_plan(cfg, n, points)
    how = f"calibrated to target_epsilon {cfg.privacy.target_epsilon}" if p["calibrated"] else "as configured"
    typer.echo(f"{cfg.method.name}: {p['private_rounds']} private rounds "
               f"({', '.join(f'{r} at sample rate {q:g}' for q, r in p['rounds']) or 'none: the method never uploads'})")
    typer.echo(f"  noise multiplier  {p['noise_multiplier']:.4f} ({how})")
    typer.echo(f"  clip              {p['clip']:g} ({p['mode']} DP: noise std {p['noise_multiplier'] * p['clip']:.4g} on the sum)")
    if cfg.privacy.adaptive_clip and p["rounds"]:
        from fedpipe.engine.privacy import Privacy

        q = p["rounds"][0][0]
        try:
            adaptive = Privacy(cfg.privacy.model_copy(update={"noise_multiplier": p["noise_multiplier"]}), 0, q, n)
        except ValueError as e:
            raise ConfigError(f"{e}.") from None
        typer.echo(f"  adaptive clip     from {p['clip']:g} towards the {cfg.privacy.target_quantile:g} quantile of the update norms; "
                   f"count noise std {adaptive.count_std:.4g}, so the updates carry noise multiplier {adaptive.update_sigma:.4f}")
    typer.echo(f"  delta             {p['delta']:.3g}" + ("" if cfg.privacy.delta is not None else f" (min(1e-5, 0.01/{n}))"))
    typer.echo(f"  accountant        {p['accountant']} (Opacus), Poisson sampling")
    typer.echo("  round  epsilon")
    for r, eps in p["schedule"]:
        typer.echo(f"  {r:>5}  {eps:.3f}")
