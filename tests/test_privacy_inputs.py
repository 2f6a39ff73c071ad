"""Privacy beyond the uploads (issue 40): the input standardisation a private run bakes into its models must not be
a statistic of the clients' data (P3), and a study must not tune or repeat private runs its ledger does not account
(P5). Real data (mnist5k, digits), tiny runs."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from runs import small_run, train_all

from fedpipe.data.federated import channel_stats, input_standardisation, prepare_data
from fedpipe.data.partition import make_partition
from fedpipe.errors import ConfigError
from fedpipe.models.export import SPEC_FILE, ServingSpec, export_run
from fedpipe.run.config import load_config
from fedpipe.run.run import federated_data

CPU = torch.device("cpu")
PRIVATE = ["privacy.enabled=true", "privacy.seeded_noise=true", "train.rounds=1"]
# 4 clients of 2 digits each, 2 rounds: an exportable run in about a second
TINY = ["data.dataset=digits", "model.name=twonn", "method.name=fedavg", "partition.num_clients=4", "train.rounds=2", "run.threads=1"]


def _run_and_partition(tmp_path, *sets):
    run = small_run(tmp_path / "runs", *sets)
    return run, make_partition(run.bundle, run.cfg.partition, run.cfg.run.seed)


def _without_first_client(partition):
    return dataclasses.replace(partition, clients=partition.clients[1:])


# --- P3: input standardisation ------------------------------------------------------------------------------


def test_private_inputs_do_not_change_when_one_client_is_removed(tmp_path):
    """What P3 measured: with the pooled mean and std, removing one client changed every other client's inputs
    (and the constants baked into the exported models). With privacy on they must not."""
    plain, partition = _run_and_partition(tmp_path, "partition.num_clients=6")
    fewer = _without_first_client(partition)
    # the premise: the pooled statistics do depend on each client's data
    pooled = federated_data(plain, partition, CPU), federated_data(plain, fewer, CPU)
    assert not torch.equal(pooled[0].clients[1].train.x, pooled[1].clients[0].train.x)

    private = small_run(tmp_path / "private", "partition.num_clients=6", "privacy.enabled=true")
    whole, less = federated_data(private, partition, CPU), federated_data(private, fewer, CPU)
    for before, after in zip(whole.clients[1:], less.clients, strict=True):
        for split in ("train", "val", "test"):
            assert torch.equal(getattr(before, split).x, getattr(after, split).x)
    assert torch.equal(whole.global_test.x, less.global_test.x)
    choice = private.cfg.standardisation()
    assert choice.source == "fixed"
    for p in (partition, fewer):
        _, mean, std = input_standardisation(private.bundle, p, choice)
        assert mean.tolist() == [0.5] and std.tolist() == [0.5]  # (x / 255 - 0.5) / 0.5: no client's data in it


def test_pooled_standardisation_with_privacy_is_refused_naming_the_reason_and_the_fix():
    with pytest.raises(ConfigError, match=r"data.standardisation=pooled computes the input mean and std exactly from all "
                                          r"clients' pooled training data.*outside the privacy accountant.*data.standardisation=fixed"):
        load_config(None, ["privacy.enabled=true", "data.standardisation=pooled"])
    # declared constants are another data-independent choice; a count that fits no channel is refused
    declared = load_config(None, ["privacy.enabled=true", "data.input_mean=[0.13]", "data.input_std=[0.31]"])
    assert declared.standardisation().source == "declared"
    with pytest.raises(ConfigError, match="mnist5k has 1 channel"):
        load_config(None, ["data.input_mean=[0.1, 0.2]", "data.input_std=[1, 1]"])


def test_a_private_runs_exported_spec_records_a_fixed_source_and_its_models_apply_it(tmp_path):
    run = small_run(tmp_path / "runs", *TINY, *PRIVATE)
    train_all(run)
    files, spec, _ = export_run(run)
    norm = json.loads(files[SPEC_FILE])["normalisation"]
    assert norm["source"] == "fixed" and norm["mean"] == [0.5] and norm["std"] == [0.5] and "data-independent" in norm["source_detail"]
    assert ServingSpec.from_bytes(files[SPEC_FILE], "spec.json").normalisation_source == "fixed"
    # the served model standardises raw pixels with the same constants the run trained on
    pixels = torch.from_numpy(run.bundle.train.x[:5].astype(np.float32))
    served = torch.export.load(_written(tmp_path, files[spec.global_model.file])).module()
    algorithm, _ = run.build_algorithm(CPU)
    state = run.checkpoints(run.phases()[-1].name).load_final(CPU)
    with torch.no_grad():
        expected = algorithm.forward(algorithm.global_model(state.server), (pixels / 255 - 0.5) / 0.5)
        assert torch.allclose(served(pixels), expected, atol=1e-5)


def test_privacy_off_keeps_todays_pooled_numbers_run_id_and_records_pooled(tmp_path):
    # the run id of a config that does not name the new field is the one it had (tests/test_config.py pins it too)
    assert load_config().run_id() == load_config(None, ["data.standardisation=pooled"]).run_id() \
        == "superfed_mm-mnist5k-pathological-s0-b1159e8b"
    assert load_config(None, ["data.standardisation=fixed"]).run_id() != load_config().run_id()
    run, partition = _run_and_partition(tmp_path / "a", *TINY)
    assert run.cfg.standardisation().source == "pooled"
    # today's numbers: the opt-in clients' training pixels, pooled, on the 0..1 scale
    today = channel_stats(np.concatenate([run.bundle.train.x[c.train] for c in partition.clients if not c.opt_out]))
    _, mean, std = input_standardisation(run.bundle, partition, run.cfg.standardisation())
    assert mean.tolist() == today[0].tolist() and std.tolist() == today[1].tolist()
    mine, old_default = federated_data(run, partition, CPU), prepare_data(run.bundle, partition, CPU)
    assert all(torch.equal(a.train.x, b.train.x) for a, b in zip(mine.clients, old_default.clients, strict=True))
    train_all(run)
    files, spec, _ = export_run(run)
    norm = json.loads(files[SPEC_FILE])["normalisation"]
    assert norm["source"] == "pooled" and norm["mean"] == np.float32(today[0]).tolist() and "not covered" in norm["source_detail"]


def _written(tmp_path, data: bytes):
    path = tmp_path / "model.pt2"
    path.write_bytes(data)
    return path


# --- P5: studies and reproductions ---------------------------------------------------------------------------

STUDY = """
study: {{name: private, store: {store}}}
base:
  data: {{dataset: digits}}
  partition: {{scheme: pathological, num_clients: 4}}
  model: {{name: twonn}}
{privacy}
methods: [{methods}]
budget: {{trials: 2, rounds: 1}}
seeds: [0]
"""


@pytest.mark.parametrize("where, privacy, methods", [
    ("the base run config", "  privacy: {enabled: true}", "pfedmb"),  # refused as a study before as a method privacy refuses
    ("method fedavg's fixed settings", "", "{name: fedavg, fixed: {privacy.enabled: true}}"),
])
def test_a_study_of_private_configs_is_refused_citing_what_private_tuning_needs(tmp_path, where, privacy, methods):
    from fedpipe.study.config import load_study

    with pytest.raises(ConfigError, match=rf"privacy.enabled is set \({where}\).*Papernot and Steinke 2022.*Renyi differential "
                                          r"privacy.*ICLR.*`fedpipe run`.*public or proxy data"):
        load_study(None, text=STUDY.format(store=tmp_path, privacy=privacy, methods=methods))
    assert load_study(None, text=STUDY.format(store=tmp_path, privacy="", methods="fedavg"))  # the same study, not private


def test_a_reproduction_of_private_configs_is_refused():
    from fedpipe.study.reproduce import run_config
    from fedpipe.study.reproduction import find_reproduction, load_reproduction

    repro = load_reproduction(find_reproduction("fedmoe_table1_fashion_mnist"))
    point = repro.points()[0]
    assert not run_config(repro, point, 0, []).privacy.enabled
    with pytest.raises(ConfigError, match="privacy.enabled is set, and a reproduction cannot run private configs.*composes"):
        run_config(repro, point, 0, ["privacy.enabled=yes"])  # named first, before what a private run needs besides
