"""The GPU engine's paths, checked on the CPU (issue 34): the static-shape step that CUDA graphs
capture computes what the eager step computes; bf16 autocast trains and leaves aggregation in fp32;
engine.amp is resolved once and recorded; YAML's boolean words reach the fields that spell them.

The CUDA graph capture itself runs only on a GPU (`benchmarks/gpu.py` exercises and times it); here
the same `_StaticStep` runs uncaptured, on the same static buffers and with the same dispatch (which
steps are static, which eager), so a wrong buffer refill, a lost loss tally or a ragged batch sent
to the static step fails these tests."""

from __future__ import annotations

import json

import pytest
import torch
from runs import assert_same_params, small_run, train_all

import fedpipe.engine.batched as batched
from fedpipe.errors import ConfigError
from fedpipe.run.config import load_config
from fedpipe.run.run import engine_choice

# 30 training samples a client at batch 8: three full batches, then a ragged one of 6 (eager)
BATCHED = ["engine.clients=batched", "train.batch_size=8", "partition.num_clients=6", "train.rounds=2", "train.local_epochs=2"]


def test_yaml_boolean_words_reach_the_fields_that_spell_them(tmp_path):
    cfg = load_config(None, ["engine.amp=off", "engine.channels_last=on", "engine.graphs=on"])
    assert (cfg.engine.amp, cfg.engine.channels_last, cfg.engine.graphs) == ("off", "on", "on")
    path = tmp_path / "c.yaml"
    path.write_text("engine:\n  amp: off\n  channels_last: off\n")
    assert load_config(str(path), []).engine.amp == "off"
    with pytest.raises(ConfigError, match="engine.clients"):  # a field without such a word still refuses a boolean
        load_config(None, ["engine.clients=yes"])


@pytest.mark.parametrize("method", ["fedavg", "superfed_mm"])
def test_static_step_trains_exactly_what_the_eager_step_trains(tmp_path, monkeypatch, method):
    """graphs=on against off, bit for bit, with full batches (static) and a ragged last one (eager)
    in every epoch; SuPerFed's per-batch lam goes through the static noise buffer."""
    static_calls = []
    real = batched._StaticStep.run
    monkeypatch.setattr(batched._StaticStep, "run", lambda self, s, t: (static_calls.append(t), real(self, s, t))[1])
    extra = ["method.start_fraction=0.0"] if method == "superfed_mm" else []
    eager = train_all(small_run(tmp_path / "eager", *BATCHED, f"method.name={method}", *extra, "partition.scheme=iid"))
    assert not static_calls
    static = train_all(small_run(tmp_path / "static", *BATCHED, f"method.name={method}", *extra, "partition.scheme=iid", "engine.graphs=on"))
    assert static_calls and set(static_calls) != set(range(max(static_calls) + 2))  # both kinds of step were taken
    assert_same_params(eager.server.global_params, static.server.global_params)
    for cid in eager.clients:
        assert_same_params(eager.clients[cid], static.clients[cid])


def test_bf16_on_the_cpu_trains_above_chance_and_aggregates_in_fp32(tmp_path):
    common = ["method.name=fedavg", "partition.scheme=iid", "train.rounds=3", "engine.clients=sequential"]
    fp32 = small_run(tmp_path / "fp32", *common, "engine.amp=off")
    bf16 = small_run(tmp_path / "bf16", *common, "engine.amp=bf16")
    a, b = train_all(fp32), train_all(bf16)
    assert all(t.dtype == torch.float32 for t in b.server.global_params.values())
    assert any(not torch.equal(a.server.global_params[k], b.server.global_params[k]) for k in a.server.global_params)  # bf16 ran
    top1 = {name: run.evaluate()["global_model"]["top1"] for name, run in (("fp32", fp32), ("bf16", bf16))}
    assert top1["bf16"] > 0.5, top1  # 10 classes: chance is 0.1
    assert abs(top1["bf16"] - top1["fp32"]) < 0.1, top1


def test_amp_auto_is_resolved_once_recorded_and_reused(tmp_path):
    run = small_run(tmp_path, "engine.amp=auto", "train.rounds=1")
    train_all(run)
    key = run.layout.phase("federation").engine_choice
    recorded = json.loads(run.store.get_text(key))
    assert recorded["amp"] == "off"  # a CPU: auto is off
    run.store.delete(run.layout.phase("federation").final)  # stopped before its end: trained again
    recorded["amp"] = "bf16"  # as if the first attempt had run on a GPU with bf16 tensor cores
    run.store.put_text(key, json.dumps(recorded))
    assert engine_choice(run, "federation").amp == "bf16"  # the resume computes what the first attempt computed
    pinned = small_run(tmp_path, "engine.amp=off", "train.rounds=1")
    assert engine_choice(pinned, "federation").amp == "off"  # an explicit setting wins over the record


def test_chunk_auto_is_sized_from_a_probe_recorded_and_reused(tmp_path, monkeypatch):
    """The probe's per-client bytes divide the budget; the chunk is written to engine.json and a rerun
    of the phase takes it from there instead of probing again."""
    import fedpipe.engine.clients as clients

    budgets = []
    monkeypatch.setattr(clients, "memory_budget", lambda device, fraction: budgets.append(fraction) or 3 * 2**20)
    run = small_run(tmp_path, *BATCHED, "method.name=fedavg", "partition.scheme=iid", "train.rounds=1", "engine.chunk=auto")
    train_all(run)
    key = run.layout.phase("federation").engine_choice
    recorded = json.loads(run.store.get_text(key))
    # twonn: 199,210 weights (0.76 MiB) + gradient and momentum (1.52 MiB) + activations: ~2.4 MiB a
    # client, x1.5 for temporaries: one client fits in 3 MiB, two do not
    assert recorded["chunk"] == 1 and "MiB a client" in recorded["chunk_why"], recorded
    assert 2.2 < float(recorded["chunk_why"].split(" MiB")[0]) < 3.0, recorded
    assert budgets == [0.5]
    monkeypatch.setattr(clients, "memory_budget", lambda device, fraction: 1 << 40)  # a bigger machine on resume
    run.store.delete(run.layout.phase("federation").final)
    again = engine_choice(run, "federation")
    assert again.chunk == 1  # reused, not sized again
    from fedpipe.engine.chunking import auto_chunk
    assert auto_chunk(10 << 20, 1 << 30, 1000) == 68 and auto_chunk(10 << 20, 1 << 30, 20) == 20 and auto_chunk(1 << 40, 1, 5) == 1


def test_amp_auto_keeps_a_method_that_opts_out_in_fp32(monkeypatch):
    """On a GPU with bf16 tensor cores auto is bf16, except for a method whose `bf16_refusal` says why not;
    an explicit choice is the user's."""
    from fedpipe.engine.choice import amp_mode

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    cuda = torch.device("cuda", 0)
    assert amp_mode("auto", cuda) == "bf16"
    assert amp_mode("auto", cuda, "its inner solver stalls") == "off"
    assert amp_mode("bf16", cuda, "its inner solver stalls") == "bf16"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (7, 5))  # a T4: no bf16 tensor cores
    assert amp_mode("auto", cuda) == "off"
