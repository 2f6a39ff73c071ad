"""Poisoning attacks against FedAvg, and what each defence costs and stops (issue 53, item 5): the main-task accuracy
of the global model and the backdoor's success, per attack, malicious fraction and defence.

    nice -n 10 .venv/bin/python benchmarks/attacks.py                       # 2 seeds, writes benchmarks/results/attacks.*
    .venv/bin/python benchmarks/attacks.py --seeds 0 --rounds 3 --out /tmp/a  # a quick look

The setting: FedAvg on mnist5k (the default data) split by Dirichlet label skew (alpha 0.3, the scheme's default; the
default `pathological` split, 2 labels a client, left FedAvg at 22-41% after 10 rounds here, too weak to measure an
attack against) over 10 clients, every client every round, the 2NN (784-200-200-10), 1 local epoch of batch 20 at
fedpipe's default lr 0.01, momentum 0.9, images standardised with the fixed constants (data.standardisation=fixed, so
the private runs see the same inputs). Bagdasaryan et al. split by Dirichlet label skew too.
Clients 0..a-1 are malicious (a = 1 or 3 of 10) and attack in every round.

The attackers live here, never in the library: `Attacked` wraps the engine's RoundTrainer (what `run_round` calls):
every client trains honestly (`ClientTrainer`), then the malicious clients' outcomes are replaced:

- `inflated_count`: the client trains the backdoor below (unscaled) and reports 10^6 training samples, so that the
  weighted mean is almost its model (the server weighs by reported counts);
- `model_replacement`: the scaled model-replacement backdoor (Bagdasaryan, Veit, Hua, Estrin, Shmatikov, AISTATS 2020,
  "How to backdoor federated learning", Sec. 4): the client trains on its data plus as many copies stamped with a
  3x3 white square in the bottom-right corner and relabelled to the target class 0, and uploads
  global + gamma (X - global) with gamma = n / a (their n / eta with the server rate eta = 1, shared by the a attackers);
- `sign_flip`: global - gamma u, the client's honest update u flipped and scaled by the same gamma;
- `alie`: "a little is enough" (Baruch, Baruch, Goldberg, NeurIPS 2019, Sec. 3): every malicious client uploads
  global + mu - z_max sigma, mu and sigma the per-coordinate mean and standard deviation of the round's honest updates
  (all n clients trained honestly first: the attackers are taken to know them), z_max = Phi^-1((n - s) / n) with
  s = floor(n / 2 + 1) - a. For n = 10, a = 1 that is z_max = 0 (the attack degenerates to the mean), for a = 3 0.52.

The defences: `none` (FedAvg, weights the reported counts); `census` (fedpipe's federation rule, the library's own
`fedpipe.federation.census.vouched_samples`: each client's weight is the count its census fixed, its training-split
size, and a reply stating another count is refused, so that client is left out of the round);
`norm_bound` (train.robust.norm_bound, Sun et al. 2019); `median`, `trimmed_mean` (beta = 0.3: Yin et al. need beta
at least the malicious fraction) and `multi_krum` (f = 3, m = n - f) of train.robust; and `privacy` (privacy.enabled,
central DP-FedAvg: each update clipped to privacy.clip and Gaussian noise on the sum; seeded noise). A malicious client
would not clip its own update, so under `privacy` the clip is applied to every upload after the attack, as a server
that clips would (fedpipe clips on the client side of the round: an honest client's).

Main-task accuracy: the final global model on the clean global test set. Backdoor success: the fraction of the global
test images not of the target class that, stamped with the pattern, the final global model classifies as the target.
Results: OUT/attacks.md (means over the seeds), OUT/attacks.json (every run) and OUT/attacks.png.

`--federation` adds one cell run on a loopback federation (SuperLink and one site process per client, TLS, registered
keys: `fedpipe.federation.tryout.LoopbackFederation`; the Flower environment of scripts/flower-env.sh): the inflated
count, 1 of 10, seed 0. Its attacker is the tests' fault injector (a site started with FEDPIPE_TEST_FAULT_INJECTOR=
samples-huge states 10^6 samples), the defence the census the federation always takes. The simulation's cell of the
same seed runs beside it, and the two global models must agree (the loopback tolerance, rtol 1e-5): OUT/attacks.md's
last section.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import tempfile
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
ATTACKS = ("inflated_count", "model_replacement", "sign_flip", "alie")
DEFENCES = ("none", "census", "norm_bound", "median", "trimmed_mean", "multi_krum", "privacy")
FRACTIONS = (1, 3)  # malicious clients of NUM_CLIENTS
NUM_CLIENTS = 10
TARGET = 0  # the backdoor's target class
INFLATED = 10**6  # the sample count an `inflated_count` attacker reports
NORM_BOUND = 1.0  # train.robust.norm_bound: above the honest updates' median norm (0.7 in a probe; attacks.md gives it)
#: privacy.clip (the same bound) and privacy.noise_multiplier: the noise on the mean, sigma C / 10 per coordinate, is about
#: half a typical mean update in L2 over the 2NN's 199,210 weights (weak DP, as Sun et al.'s: no meaningful epsilon)
CLIP, NOISE = 1.0, 0.005
BASE = ["method.name=fedavg", "data.dataset=mnist5k", "partition.scheme=dirichlet", f"partition.num_clients={NUM_CLIENTS}",
        "model.name=twonn", "train.local_epochs=1", "train.batch_size=20", "train.lr=0.01", "train.client_fraction=1.0",
        "data.standardisation=fixed", "engine.clients=sequential", "telemetry.progress=false", "eval.every=0"]
DEFENCE_SETTINGS = {
    "none": [], "census": [],
    "norm_bound": [f"train.robust.norm_bound={NORM_BOUND}"],
    "median": ["train.robust.rule=median"],
    "trimmed_mean": ["train.robust.rule=trimmed_mean", "train.robust.trim_fraction=0.3"],
    "multi_krum": ["train.robust.rule=multi_krum", "train.robust.byzantine=3"],
    "privacy": ["privacy.enabled=true", f"privacy.clip={CLIP}", f"privacy.noise_multiplier={NOISE}", "privacy.seeded_noise=true"],
}

Params = dict[str, torch.Tensor]


# --- the attackers (pure functions of tensors: tests/test_benchmark_attacks.py) -------------------------------------
def stamp(x: torch.Tensor, white: float) -> torch.Tensor:
    """The images with the backdoor's pattern: a 3x3 square of `white` in the bottom-right corner."""
    out = x.clone()
    out[..., -3:, -3:] = white
    return out


def model_replacement(global_: Params, backdoored: Params, gamma: float) -> Params:
    """global + gamma (X - global) (Bagdasaryan et al. 2020, Eq. 3: the scaled model-replacement upload)."""
    return {k: global_[k] + gamma * (backdoored[k] - global_[k]) for k in global_}


def sign_flip(global_: Params, honest: Params, gamma: float) -> Params:
    """global - gamma u with u = honest - global: the client's own update flipped and scaled."""
    return {k: global_[k] - gamma * (honest[k] - global_[k]) for k in global_}


def alie_z(n: int, a: int) -> float:
    """z_max of Baruch et al. 2019 (Sec. 3): s = floor(n / 2 + 1) - a clients must be "won over"; z_max is the largest z
    with Phi(z) < (n - s) / n."""
    s = math.floor(n / 2 + 1) - a
    p = min(max((n - s) / n, 1e-12), 1 - 1e-12)
    return statistics.NormalDist().inv_cdf(p)


def alie(global_: Params, honest: list[Params], n: int, a: int) -> Params:
    """global + mu - z_max sigma, per coordinate over the honest updates (sigma: the sample standard deviation)."""
    z = alie_z(n, a)
    out = {}
    for k in global_:
        updates = torch.stack([h[k] - global_[k] for h in honest])
        out[k] = global_[k] + updates.mean(dim=0) - z * updates.std(dim=0)
    return out


def train_backdoor(forward, start: Params, x: torch.Tensor, y: torch.Tensor, white: float, epochs: int, lr: float,
                   momentum: float, batch: int, generator: torch.Generator) -> Params:
    """The attacker's model X: from `start`, SGD on its data plus a stamped copy of it relabelled to TARGET."""
    xs = torch.cat([x, stamp(x, white)])
    ys = torch.cat([y, torch.full_like(y, TARGET)])
    params = {k: v.detach().clone().requires_grad_(True) for k, v in start.items()}
    opt = torch.optim.SGD(list(params.values()), lr=lr, momentum=momentum)
    for _ in range(epochs):
        order = torch.randperm(len(ys), generator=generator)
        for i in range(0, len(ys), batch):
            idx = order[i : i + batch]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(forward(params, xs[idx]), ys[idx]).backward()
            opt.step()
    return {k: v.detach() for k, v in params.items()}


class Attacked:
    """The engine's RoundTrainer with clients 0..a-1 malicious: honest training, then their outcomes replaced by
    `attack`; `census` replaces every reported count by the training-split size; `privacy` clips (and the server
    noises) every upload after the attack."""

    def __init__(self, trainer, attack: str, malicious: int, census: bool, privacy, white: float):
        """`census`: fedpipe's federation rule (`fedpipe.federation.census.vouched_samples`)."""
        self.trainer, self.attack, self.malicious, self.census, self.privacy = trainer, attack, malicious, census, privacy
        self.white = white
        self.honest_norms: list[float] = []

    def __call__(self, round_: int, lr: float, works):
        from fedpipe.engine.clients import privatize

        outcomes = self.trainer._train(works, round_, lr)
        by_id = {w.client_id: w for w in works}
        honest = [o.upload for o in outcomes if o.upload is not None]
        for o in outcomes:
            if o.upload is None:  # failed (non-finite weights once an attack made the global model diverge): left out
                continue
            g = by_id[o.client_id].download
            if o.client_id >= self.malicious:
                self.honest_norms.append(math.sqrt(sum(float(((o.upload[k] - g[k]) ** 2).sum()) for k in g)))
            elif self.attack != "none":
                o.upload, o.num_samples = self._malicious(o, g, honest, round_, lr)
        if self.census:
            from fedpipe.federation.census import ClaimRefused, Samples, vouched_samples

            for o in outcomes:
                data = self.trainer.by_id[o.client_id]
                counted = Samples(train=len(data.train), test=len(data.test))
                try:
                    o.num_samples = vouched_samples(f"client {o.client_id}", counted, {"num-samples": o.num_samples}, private=False)
                except ClaimRefused as e:
                    o.upload, o.error = None, f"UploadRejected: {e}"
        if self.privacy is not None:
            privatize(self.privacy, works, outcomes, round_)
        return outcomes, None

    def _malicious(self, o, g: Params, honest: list[Params], round_: int, lr: float) -> tuple[Params, int]:
        n, a = len(honest), self.malicious
        gamma = NUM_CLIENTS / a
        if self.attack == "sign_flip":
            return sign_flip(g, o.upload, gamma), o.num_samples
        if self.attack == "alie":
            return alie(g, honest, n, a), o.num_samples
        data = self.trainer.by_id[o.client_id].train
        t = self.trainer.train_cfg
        x = train_backdoor(self.trainer.algorithm.forward, g, data.x, data.y, self.white, t.local_epochs, lr, t.momentum,
                           t.batch_size, torch.Generator().manual_seed((self.trainer.seed * 100_003 + round_) * 1000 + o.client_id))
        if self.attack == "inflated_count":
            return x, INFLATED
        return model_replacement(g, x, gamma), o.num_samples


# --- one run ----------------------------------------------------------------------------------------------------------
def scores(algorithm, params: Params, data, white: float) -> tuple[float, float]:
    """(main-task accuracy on the clean global test set, backdoor success on its stamped non-target images)."""
    x, y = data.global_test.x, data.global_test.y
    with torch.no_grad():
        clean = torch.cat([algorithm.forward(params, x[i : i + 1000]).argmax(1) for i in range(0, len(y), 1000)])
        others = x[y != TARGET]
        stamped = torch.cat([algorithm.forward(params, stamp(others[i : i + 1000], white)).argmax(1) for i in range(0, len(others), 1000)])
    return float((clean == y).double().mean()), float((stamped == TARGET).double().mean())


def one_run(seed: int, rounds: int, attack: str, malicious: int, defence: str, store: str, keep: bool = False) -> dict:
    """One cell's run; `keep`: the row also holds the final global model ("params") and the scorer ("score")."""
    from fedpipe.algorithms.base import ServerState
    from fedpipe.data.federated import prepare_data
    from fedpipe.data.partition import make_partition
    from fedpipe.engine.clients import ClientTrainer
    from fedpipe.engine.rounds import run_phase
    from fedpipe.engine.state import PhaseState
    from fedpipe.errors import TrainingError
    from fedpipe.run.config import load_config
    from fedpipe.run.privacy import phase_privacy
    from fedpipe.run.run import Run

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Optimal order is the smallest alpha")  # opacus, at an epsilon this large
    t0 = time.perf_counter()
    cfg = load_config(None, [*BASE, *DEFENCE_SETTINGS[defence], f"train.rounds={rounds}", f"run.seed={seed}",
                             f"run.store={store}", "run.device=cpu"])
    run = Run(cfg)
    data = prepare_data(run.bundle, make_partition(run.bundle, cfg.partition, seed), torch.device("cpu"), cfg.standardisation())
    white = float(max(float(c.train.x.max()) for c in data.clients))
    algorithm, initial = run.build_algorithm(torch.device("cpu"))
    phase = run.phases()[0]
    privacy = phase_privacy(cfg, algorithm, phase, data)
    trainer = ClientTrainer(algorithm, phase, data, cfg.train, cfg.engine, seed)  # honest; privacy is applied after the attack
    attacked = Attacked(trainer, attack, malicious if attack != "none" else 0, defence == "census", privacy, white)
    state = PhaseState("fedavg", "init", 0, ServerState({k: v.clone() for k, v in initial.items()}), {})
    diverged = False
    try:
        state = run_phase(algorithm, phase, data, state, cfg.train, seed, attacked, privacy=privacy)
    except TrainingError:  # every client failed: the attack drove the global model to non-finite weights
        diverged = True
    diverged = diverged or not all(bool(torch.isfinite(t).all()) for t in state.server.global_params.values())
    accuracy, backdoor = scores(algorithm, state.server.global_params, data, white)
    norms = sorted(attacked.honest_norms)
    return {"seed": seed, "attack": attack, "malicious": malicious if attack != "none" else 0, "defence": defence,
            "rounds": rounds, "accuracy": accuracy, "backdoor": backdoor, "diverged": diverged, "round_reached": state.round,
            "honest_norm_median": norms[len(norms) // 2] if norms else None,
            "epsilon": state.privacy.epsilon() if state.privacy is not None else None,
            "seconds": time.perf_counter() - t0,
            **({"params": state.server.global_params, "score": lambda p: scores(algorithm, p, data, white)} if keep else {})}


def federation_cell(seed: int, rounds: int, env: Path, work: Path) -> dict:
    """The inflated count, 1 of 10, under the census, on a loopback federation beside the simulation's same cell."""
    import safetensors.torch

    from fedpipe.federation.faults import FAULT_INJECTOR_ENV
    from fedpipe.federation.tryout import LoopbackFederation, prepare
    from fedpipe.run.config import load_config

    sim = one_run(seed, rounds, "inflated_count", 1, "census", str(work / "sim-store"), keep=True)
    cfg = load_config(None, [*BASE, f"train.rounds={rounds}", f"run.seed={seed}", f"run.store={work / 'store'}", "run.device=cpu",
                             "run.threads=1", "run.id=attacks-federation"])
    spec_file, folders = prepare(cfg, work / "sites")
    t0 = time.perf_counter()
    with LoopbackFederation(work / "fed", env) as fed:
        for folder in folders:  # client 0 is the simulation's attacker: it states 10^6 samples every round
            fed.start_site(folder, env={FAULT_INJECTOR_ENV: "samples-huge"} if folder.name.endswith("-0") else None)
        fed.run(spec_file, work / "out", timeout=3600)
    seconds = time.perf_counter() - t0
    params = safetensors.torch.load_file(str(work / "out" / "global.safetensors"))
    rounds_log = [json.loads(line) for line in (work / "out" / "rounds.jsonl").read_text().splitlines()]
    refused = sum(1 for r in rounds_log for e in r["rejected"] if e["client"] == 0 and "census counted" in e["error"])
    accuracy, backdoor = sim["score"](params)
    diff = max(float((params[k] - sim["params"][k].cpu()).abs().max()) for k in params)
    return {"seed": seed, "rounds": rounds, "simulation": {"accuracy": sim["accuracy"], "backdoor": sim["backdoor"]},
            "federation": {"accuracy": accuracy, "backdoor": backdoor, "seconds": seconds}, "max_abs_difference": diff,
            "rounds_refused": refused, "sites": len(folders)}


def _job(args) -> dict:
    return one_run(*args)


# --- the report -------------------------------------------------------------------------------------------------------
#: What the papers report where their setting is comparable (approximate, read from their figures and tables).
PAPERS = {
    "inflated_count": "no paper figure: the claimed 10^6 samples outweigh the honest clients' ~3,500 together, so the "
                      "weighted mean is the attacker's model (model replacement through the count). Norm bounding does not "
                      "help (the bound applies to the update, the weight stays); the census refuses the claimant's reply "
                      "outright (weight and upload), and the unweighted rules remove the weight",
    "model_replacement": "Bagdasaryan et al. 2020 (CIFAR-10 and word prediction, one attacker selected in one round, gamma = "
                         "n / eta): backdoor accuracy about 100% right after the replacement round with the main task "
                         "barely moved. Here, attacking every round: 99-100% backdoor, and the scaled uploads also cost "
                         "main accuracy. Sun et al. 2019 (EMNIST, 3,383 users, 30 a round): norm bounding stops most of a "
                         "few attackers' backdoor at little main-task cost; here, with 1 of 10 attacking every round, it "
                         "brings the backdoor from 99% to about 76% at M = 1",
    "sign_flip": "Blanchard et al. 2017 (Lemma 1): a single Byzantine client can move a linear rule such as the mean anywhere; "
                 "here one flipped update scaled by 10 makes FedAvg diverge. Krum's guarantee needs n > 2f + 2, which "
                 "multi-Krum with f = 3 of 10 meets; it holds at both fractions",
    "alie": "Baruch et al. 2019 (MNIST and CIFAR-10, n = 50 with 12 malicious: z_max = Phi^-1(0.72) = 0.58 by their "
            "formula): accuracy drops of tens of points against trimmed mean, Krum and Bulyan (their Table 1, approximate). "
            "Here n = 10 gives z_max = 0 for 1 attacker (no attack at all) and 0.52 for 3: a few points against the median "
            "(-5) and the trimmed mean (-3), none against FedAvg's mean",
}


def mean_of(rows: list[dict], key: str) -> float:
    return statistics.fmean(r[key] for r in rows)


def table(rows: list[dict]) -> str:
    lines = ["| attack | malicious | " + " | ".join(DEFENCES) + " |", "| --- | ---: |" + " ---: |" * len(DEFENCES)]
    cases = [("none", 0)] + [(a, m) for a in ATTACKS for m in FRACTIONS]
    for attack, m in cases:
        cells = []
        for d in DEFENCES:
            got = [r for r in rows if r["attack"] == attack and r["malicious"] == m and r["defence"] == d]
            mark = " (d)" if any(r["diverged"] for r in got) else ""
            cells.append(f"{100 * mean_of(got, 'accuracy'):.1f} / {100 * mean_of(got, 'backdoor'):.1f}{mark}" if got else "-")
        lines.append(f"| {attack} | {m}/{NUM_CLIENTS} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cell(rows: list[dict], attack: str, m: int, defence: str) -> tuple[float, float, bool] | None:
    """(accuracy, backdoor success, any seed diverged) of one cell, means over the seeds; None when not run."""
    got = [r for r in rows if (r["attack"], r["malicious"], r["defence"]) == (attack, m, defence)]
    return (mean_of(got, "accuracy"), mean_of(got, "backdoor"), any(r["diverged"] for r in got)) if got else None


def reading(rows: list[dict]) -> list[str]:
    """The table in sentences, computed from it: how far each attack gets without a defence, what each defence costs
    without an attack, and which defences hold each attack (backdoor success under 10%, accuracy within 10 points of clean)."""
    clean = cell(rows, "none", 0, "none")
    if clean is None:
        return []
    out = ["## Reading", "", f"Without a defence (clean FedAvg: {100 * clean[0]:.1f}% accuracy, {100 * clean[1]:.1f}% on the pattern):"]
    for a in ATTACKS:
        for m in FRACTIONS:
            got = cell(rows, a, m, "none")
            if got:
                what = ("the global model diverged (non-finite weights): accuracy at chance" if got[2] else
                        f"accuracy {100 * got[0]:.1f}% ({100 * (got[0] - clean[0]):+.1f} points), backdoor {100 * got[1]:.1f}%")
                out.append(f"- {a}, {m}/{NUM_CLIENTS} malicious: {what}.")
    out += ["", "What each defence costs without an attack (accuracy against clean FedAvg's):"]
    for d in DEFENCES[1:]:
        got = cell(rows, "none", 0, d)
        if got:
            out.append(f"- {d}: {100 * got[0]:.1f}% ({100 * (got[0] - clean[0]):+.1f} points).")
    out += ["", "Which defences hold (backdoor success under 10% and accuracy within 10 points of clean FedAvg's):"]
    for a in ATTACKS:
        for m in FRACTIONS:
            held = [d for d in DEFENCES if (c := cell(rows, a, m, d)) and not c[2] and c[1] < 0.10 and c[0] >= clean[0] - 0.10]
            out.append(f"- {a}, {m}/{NUM_CLIENTS}: {', '.join(held) or 'none of them'}.")
    return out + [""]


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    short = {"none": "no attack", "inflated_count": "inflated\ncount", "model_replacement": "model\nreplacement",
             "sign_flip": "sign\nflip", "alie": "ALIE"}
    cases = [("none", 0)] + [(a, m) for a in ATTACKS for m in FRACTIONS]
    fig, axes = plt.subplots(2, 1, figsize=(12, 7.5), sharex=True)
    width = 0.8 / len(DEFENCES)
    for ax, key, title in ((axes[0], "accuracy", "main-task accuracy (%)"), (axes[1], "backdoor", "backdoor success (%)")):
        for j, d in enumerate(DEFENCES):
            values = []
            for a, m in cases:
                got = [r for r in rows if (r["attack"], r["malicious"], r["defence"]) == (a, m, d)]
                # a diverged model's backdoor figure means nothing (NaN weights predict class 0): no bar
                skip = not got or (key == "backdoor" and any(r["diverged"] for r in got))
                values.append(float("nan") if skip else 100 * mean_of(got, key))
            ax.bar([i + j * width for i in range(len(cases))], values, width, label=d)
        ax.set_ylabel(title)
        ax.set_ylim(0, 100)
        ax.grid(axis="y", alpha=0.3)
    axes[1].set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
    axes[1].set_xticklabels([f"{short[a]}\n{m}/{NUM_CLIENTS}" for a, m in cases], fontsize=8)
    axes[0].legend(fontsize=8, ncol=len(DEFENCES), loc="lower center", bbox_to_anchor=(0.5, 1.0), title="defence")
    fig.suptitle("FedAvg on mnist5k, 10 clients: attacks and defences (mean over seeds; no backdoor bar where the model diverged)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def federation_section(out: Path) -> list[str]:
    """attacks.md's section on the loopback federation's cell (`--federation`), when it was run."""
    path = out / "attacks_federation.json"
    if not path.exists():
        return []
    c = json.loads(path.read_text())
    sim, fed = c["simulation"], c["federation"]
    return ["## The same cell on a loopback federation", "",
            f"The inflated count, 1 of {c['sites']} malicious, seed {c['seed']}, {c['rounds']} rounds, on a loopback federation "
            f"(a SuperLink and {c['sites']} site processes, TLS and registered keys): site 0 states 10^6 training samples in every "
            "reply (the tests' fault injector), and the server refuses it by the census's count in "
            f"{c['rounds_refused']} of {c['rounds']} rounds.", "",
            "| | accuracy | backdoor success |", "| --- | ---: | ---: |",
            f"| simulation (census) | {100 * sim['accuracy']:.2f}% | {100 * sim['backdoor']:.2f}% |",
            f"| federation | {100 * fed['accuracy']:.2f}% | {100 * fed['backdoor']:.2f}% |", "",
            f"The two global models differ by at most {c['max_abs_difference']:.2g} in any weight (the loopback tolerance is "
            f"rtol 1e-5); the federation took {fed['seconds']:.0f} s on 2 cores.", ""]


def write(rows: list[dict], out: Path, args, seconds: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    meta = {"seconds": seconds, "jobs": args.jobs, "rounds": args.rounds, "seeds": args.seeds}
    (out / "attacks.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    plot(rows, out / "attacks.png")
    clean = [r for r in rows if r["attack"] == "none" and r["defence"] == "none"]
    norms = [r["honest_norm_median"] for r in rows if r["honest_norm_median"] is not None]
    eps = [r["epsilon"] for r in rows if r["epsilon"] is not None]
    text = [
        "# Attacks and defences (`benchmarks/attacks.py`)",
        "",
        f"FedAvg on mnist5k, Dirichlet label skew (alpha 0.3) over {NUM_CLIENTS} clients (all every round), the 2NN, {args.rounds} rounds of 1 "
        f"local epoch (batch 20, lr 0.01, momentum 0.9), seeds {', '.join(map(str, args.seeds))}; the malicious clients attack every round. "
        f"{len(rows)} runs in {seconds / 60:.1f} min on {args.jobs} process(es) of one thread ({platform.machine()}, 2 shared cores). "
        "The rounds are few (the papers run hundreds) so that the whole grid fits a laptop's quarter of an hour: the clean "
        "accuracy is below what longer training reaches, and a backdoor has 20 rounds to be planted, not to fade.",
        "",
        "Each cell: main-task accuracy / backdoor success, in %, mean over the seeds. Backdoor success is the share of "
        f"the stamped non-target test images classified as class {TARGET}; without an attack it is the clean model's "
        "rate on the pattern (the floor). (d): in at least one seed the global model diverged (its weights went "
        "non-finite and every client failed; the run stops there and is scored as it stood: a model of NaNs predicts "
        f"class {TARGET} everywhere, so its backdoor figure means nothing).",
        "",
        table(rows),
        "",
        "![attacks](attacks.png)",
        "",
        "Settings: census = fedpipe's federation rule (weights are the counts the census fixed; a reply stating "
        "another is refused, its client left out of the round); norm_bound M = "
        f"{NORM_BOUND:g} (the honest updates' median L2 norm was {statistics.median(norms):.2f} over all runs); trimmed_mean "
        f"beta = 0.3; multi_krum f = 3, m = 7; privacy: clip {CLIP:g}, noise multiplier {NOISE:g}, central"
        + (f" (epsilon after {args.rounds} rounds {statistics.median(eps):.3g} at delta 1e-5: no meaningful guarantee; the "
           "noise of Sun et al.'s weak-DP defence, with the clip applied to the attackers' uploads too)" if eps else "") + ".",
        f"Clean FedAvg: {100 * mean_of(clean, 'accuracy'):.1f}% accuracy." if clean else "",
        "",
        *reading(rows),
        "## Beside the papers (their figures approximate, from their text and tables; their settings differ; the figures "
        "quoted for this benchmark are those of the run of 2026-11-29)",
        "",
        *[f"- {a}: {PAPERS[a]}." for a in ATTACKS],
        "",
        *federation_section(out),
    ]
    (out / "attacks.md").write_text("\n".join(text))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--jobs", type=int, default=2, help="worker processes, one thread each")
    ap.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=ATTACKS)
    ap.add_argument("--defences", nargs="+", default=list(DEFENCES), choices=DEFENCES)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--report-only", action="store_true", help="rewrite attacks.md and attacks.png from OUT/attacks.json")
    ap.add_argument("--federation", action="store_true", help="also run the inflated-count cell (1 of 10, seed 0, census) on "
                    "a loopback federation beside its simulation (needs the Flower environment: scripts/flower-env.sh)")
    ap.add_argument("--federation-only", action="store_true", help="run only that cell; the grid's rows stay as they are")
    ap.add_argument("--env", type=Path, default=ROOT / ".cache" / "flower-venv", help="the Flower environment (scripts/flower-env.sh)")
    args = ap.parse_args(argv)
    if args.federation or args.federation_only:
        if not (args.env / "bin" / "python").exists():
            sys.exit(f"no Flower environment at {args.env}: run scripts/flower-env.sh first (about 1-3 minutes), or pass --env")
        cell = federation_cell(0, args.rounds, args.env, Path(tempfile.mkdtemp(prefix="fedpipe-attacks-federation-")))
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "attacks_federation.json").write_text(json.dumps(cell, indent=1))
        print(f"federation cell: {cell}", file=sys.stderr)
    if args.report_only or args.federation_only:
        saved = json.loads((args.out / "attacks.json").read_text())
        for key in ("jobs", "rounds", "seeds"):
            setattr(args, key, saved["meta"][key])
        write(saved["rows"], args.out, args, saved["meta"]["seconds"])
        return
    store = tempfile.mkdtemp(prefix="fedpipe-attacks-")
    jobs = [(s, args.rounds, "none", 0, d, store) for s in args.seeds for d in args.defences]
    jobs += [(s, args.rounds, a, m, d, store) for s in args.seeds for a in args.attacks for m in FRACTIONS for d in args.defences]
    t0 = time.perf_counter()
    rows = []
    partial = args.out / "attacks.partial.jsonl"  # every finished run, as it finishes (deleted once the report is written)
    args.out.mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(args.jobs) as pool, partial.open("a") as log:
        for row in pool.map(_job, jobs):
            rows.append(row)
            log.write(json.dumps(row) + "\n")
            log.flush()
            print(f"[{len(rows)}/{len(jobs)} {time.perf_counter() - t0:.0f}s] seed {row['seed']} {row['attack']} "
                  f"{row['malicious']}/{NUM_CLIENTS} {row['defence']}: accuracy {row['accuracy']:.3f} backdoor "
                  f"{row['backdoor']:.3f} ({row['seconds']:.1f}s)", file=sys.stderr, flush=True)
    write(rows, args.out, args, time.perf_counter() - t0)
    partial.unlink()
    print(f"wrote {args.out / 'attacks.md'}, attacks.json and attacks.png", file=sys.stderr)


if __name__ == "__main__":
    main()
