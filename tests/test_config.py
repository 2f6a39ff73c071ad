"""The run config: YAML in, --set overrides, errors that name the field and the allowed values."""

import pytest

from fedpipe.errors import ConfigError
from fedpipe.run.config import RunConfig, load_config


def test_defaults_are_the_embedded_default_run():
    cfg = load_config()
    assert (cfg.method.name, cfg.data.dataset, cfg.partition.scheme, cfg.partition.num_clients) == ("superfed_mm", "mnist5k", "pathological", 20)
    assert cfg.model_name() == "superfed_cnn"
    assert load_config(None, ["data.dataset=digits"]).model_name() == "twonn"  # 8x8 images


def test_yaml_file_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("method: {name: fedprox, mu: 0.1}\ntrain: {rounds: 7}\npartition: {scheme: dirichlet, num_clients: 30}\n")
    cfg = load_config(path, ["train.rounds=50", "method.mu=0.5", "partition.alpha=1.5", "train.lr=1e-3"])
    assert cfg.train.rounds == 50 and cfg.method.mu == 0.5 and cfg.partition.alpha == 1.5 and cfg.train.lr == 0.001
    assert cfg.partition.num_clients == 30


def test_override_keeps_the_default_choice_when_only_a_parameter_is_set():
    cfg = load_config(None, ["partition.num_clients=50", "method.nu=3"])
    assert cfg.partition.scheme == "pathological" and cfg.partition.num_clients == 50
    assert cfg.method.name == "superfed_mm" and cfg.method.nu == 3


@pytest.mark.parametrize(
    "override, words",
    [
        ("method.name=nope", ["method", "'fedavg'", "'superfed_lm'"]),
        ("partition.scheme=random", ["partition", "'iid'", "'dirichlet'"]),
        ("run.device=tpu", ["run.device", "'auto'", "'cpu'", "'cuda'"]),
        ("train.client_fraction=1.5", ["train.client_fraction", "less than or equal to 1"]),
        ("data.dataset=imagenet", ["data.dataset", "mnist5k", "cifar10"]),
        ("model.name=resnet", ["model.name", "superfed_cnn"]),
        ("train.rounds", ["KEY=VALUE"]),
    ],
)
def test_errors_name_the_field_and_what_is_allowed(override, words):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    for word in words:
        assert word in str(err.value)


def test_missing_or_broken_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_run_id_follows_the_config_but_not_where_results_go():
    a, b = load_config(), load_config(None, ["run.store=/elsewhere", "telemetry.progress=false"])
    assert a.run_id() == b.run_id() and a.run_id().startswith("superfed_mm-mnist5k-pathological-s0-")
    assert load_config(None, ["train.rounds=31"]).run_id() != a.run_id()
    assert load_config(None, ["run.id=mine"]).run_id() == "mine"


def test_every_field_is_documented():
    def walk(model):
        for name, field in type(model).model_fields.items():
            value = getattr(model, name)
            if hasattr(type(value), "model_fields"):
                yield from walk(value)
            else:
                yield f"{type(model).__name__}.{name}", field.description

    undocumented = [name for name, doc in walk(RunConfig()) if not doc and not name.endswith(".name") and not name.endswith(".scheme")]
    assert undocumented == []


def test_fields_added_later_leave_existing_run_ids_unchanged():
    """The default config's id as fedpipe 0.1.0 made it before data.source, data.snapshot, data.image_size,
    train.init_from and the registry section existed: an upgrade must not move existing runs to new ids
    (they would no longer resume). Setting a new field does change the id."""
    assert load_config().run_id() == "superfed_mm-mnist5k-pathological-s0-b1159e8b"
    assert load_config(None, ["registry.name=line", "registry.tolerance=0.1"]).run_id() == load_config().run_id()
    assert load_config(None, ["train.init_from=3"]).run_id() != load_config().run_id()
