"""AG News: the standard ag_news_csv files (written tiny here, in their own format), from a folder and
from a real S3 server; the tokenizer and the training-only vocabulary; the text data path and the
BiLSTM; the mixture of experts on text, end to end."""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from fedpipe.data import PAD_ID, UNK_ID
from fedpipe.data.datasets import (
    AGNEWS_CLASSES,
    AGNEWS_MAX_LENGTH,
    AGNEWS_VOCAB_SIZE,
    DATASETS,
    DataConfig,
    load_dataset,
    tokenize,
    upload_agnews,
)
from fedpipe.errors import ConfigError, DataError

TOPICS = {1: "election minister parliament war", 2: "football match goal season", 3: "stocks market profit shares",
          4: "software internet computer chip"}


def write_agnews(folder: Path, per_class_train: int = 24, per_class_test: int = 5) -> Path:
    """train.csv and test.csv as the standard distribution has them: every field quoted, no header,
    class index 1-4, title, description (with the files' '#39;'-style entities and '\\' line breaks)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name, n in (("train.csv", per_class_train), ("test.csv", per_class_test)):
        rows = []
        for i in range(n):
            for label, words in TOPICS.items():
                picked = " ".join(rng.choice(words.split(), size=6))
                rows.append([str(label), f"Title {i}, about {picked.split()[0]} (Reuters)", f"Reuters - It#39;s {picked}\\said quot;{label}quot;"])
        if name == "test.csv":
            rows.append(["2", "Zebraword football", "unseenword goal"])
        else:
            rows.append(["3", "A long one", " ".join(f"w{i}" for i in range(200))])
        with open(folder / name, "w", newline="") as f:
            csv.writer(f, quoting=csv.QUOTE_ALL).writerows(rows)
    return folder


def test_tokenizer_undoes_the_files_escapes():
    text = "Wall St. Bears Claw Back Into the Black (Reuters) Reuters - Short-sellers, Wall Street#39;s dwindling\\band of ultra-cynics, quot;greenquot; &amp; more"
    assert tokenize(text) == ["wall", "st", "bears", "claw", "back", "into", "the", "black", "reuters", "reuters", "short",
                              "sellers", "wall", "street's", "dwindling", "band", "of", "ultra", "cynics", "green", "more"]


def test_agnews_loads_the_standard_csv_files_with_a_training_only_vocabulary(tmp_path):
    write_agnews(tmp_path / "ag_news_csv")
    bundle = load_dataset(DataConfig(dataset="agnews", root=tmp_path))
    assert bundle.is_text and bundle.vocab_size == AGNEWS_VOCAB_SIZE and bundle.class_names == AGNEWS_CLASSES
    assert bundle.train.x.shape == (4 * 24 + 1, AGNEWS_MAX_LENGTH) and bundle.train.x.dtype == np.int64
    assert bundle.test.x.shape == (4 * 5 + 1, AGNEWS_MAX_LENGTH)
    assert set(bundle.train.y.tolist()) == {0, 1, 2, 3} and bundle.train.y.dtype == np.int64  # class index 1-4 -> 0-3
    assert bundle.input_shape == DATASETS["agnews"].input_shape == (AGNEWS_MAX_LENGTH, AGNEWS_VOCAB_SIZE)
    # "zebraword" appears only in test.csv: the vocabulary comes from the training split, so it is unknown
    zebra = bundle.test.x[-1]
    assert zebra[0] == UNK_ID and (zebra > UNK_ID).any()
    # the long text is cut at the fixed length; short ones are right-padded
    assert (bundle.train.x[-1] != PAD_ID).all()
    first = bundle.train.x[0]
    n = int((first != PAD_ID).sum())
    assert 0 < n < AGNEWS_MAX_LENGTH and (first[n:] == PAD_ID).all() and (first[:n] != PAD_ID).all()
    # the most frequent training word ("reuters", in every title and description) has the first id
    assert (bundle.train.x[:, 0:20] == 2).any()
    assert load_dataset(DataConfig(dataset="agnews", root=str(tmp_path))).fingerprint == bundle.fingerprint


def test_agnews_says_where_the_files_belong(tmp_path):
    with pytest.raises(DataError, match=r"ag_news_csv.*train.csv, test.csv.*missing.*does not download"):
        load_dataset(DataConfig(dataset="agnews", root=tmp_path))
    (tmp_path / "ag_news_csv").mkdir()
    (tmp_path / "ag_news_csv" / "train.csv").write_text('"7","bad class","x"\n')
    (tmp_path / "ag_news_csv" / "test.csv").write_text('"1","a","b"\n')
    with pytest.raises(DataError, match="line 1: expected class index 1-4"):
        load_dataset(DataConfig(dataset="agnews", root=tmp_path))
    with pytest.raises(DataError, match="only agnews can be read from MinIO"):
        load_dataset(DataConfig(dataset="cifar10", root="s3://bucket/data"))


@pytest.mark.services
def test_agnews_is_read_from_minio(tmp_path, s3_env, s3_credentials):
    """The same files from a real S3-compatible server (moto over HTTP, through the minio client):
    uploaded through fedpipe's store, read back with data.root=s3://bucket/prefix."""
    folder = write_agnews(tmp_path / "ag_news_csv")
    local = load_dataset(DataConfig(dataset="agnews", root=tmp_path))
    written = upload_agnews(folder, "s3://fedpipe-datasets/text")
    assert written == ["s3://fedpipe-datasets/text/ag_news_csv/train.csv", "s3://fedpipe-datasets/text/ag_news_csv/test.csv"]
    remote = load_dataset(DataConfig(dataset="agnews", root="s3://fedpipe-datasets/text"))
    assert remote.fingerprint == local.fingerprint
    np.testing.assert_array_equal(remote.train.x, local.train.x)

    # files put there by another tool carry no sha256: the message says how to upload them
    from minio import Minio

    access, secret = s3_credentials
    client = Minio(s3_env.removeprefix("http://"), access_key=access, secret_key=secret, secure=False)
    for name in ("train.csv", "test.csv"):
        client.fput_object("fedpipe-datasets", f"other/ag_news_csv/{name}", str(folder / name))
    with pytest.raises(DataError, match="upload_agnews"):
        load_dataset(DataConfig(dataset="agnews", root="s3://fedpipe-datasets/other"))
    with pytest.raises(DataError, match="could not be read"):
        load_dataset(DataConfig(dataset="agnews", root="s3://fedpipe-datasets/missing"))


def test_bilstm_reads_token_sequences_and_skips_the_padding():
    from fedpipe.nn.networks import auto_model_name, build_model

    torch.manual_seed(0)
    short = build_model("bilstm", (12, 50), 4)
    long = build_model("bilstm", (20, 50), 4)
    long.load_state_dict(short.state_dict())
    assert short.head.out_features == 4 and short.head.in_features == 128 and short.embedding.embedding_dim == 100
    x = torch.zeros(3, 12, dtype=torch.long)
    x[0, :5], x[1, :12], x[2, :1] = torch.arange(2, 7), torch.arange(10, 22), 9
    padded = torch.cat([x, torch.zeros(3, 8, dtype=torch.long)], dim=1)
    torch.testing.assert_close(short(x), long(padded), rtol=0, atol=1e-6)  # the padding changes nothing
    assert auto_model_name((64, 20_000)) == "bilstm" and auto_model_name((1, 28, 28)) == "superfed_cnn"
    with pytest.raises(ConfigError, match="image model.*model.name=bilstm"):
        build_model("lenet5", (64, 20_000), 4)
    with pytest.raises(ConfigError, match="reads token sequences"):
        build_model("bilstm", (1, 28, 28), 10)


def test_fedmoe_runs_on_agnews_end_to_end(tmp_path):
    """The text path: token ids reach the device untouched, and the mixture of experts (BiLSTM experts
    and gate) trains all three phases on them."""
    from runs import small_run

    from fedpipe.data.federated import prepare_data

    write_agnews(tmp_path / "data" / "ag_news_csv")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run = small_run(
            tmp_path / "runs", "data.dataset=agnews", f"data.root={tmp_path / 'data'}", "model.name=bilstm",
            "method.name=fedmoe", "partition.scheme=majority_class", "partition.p=0.5", "partition.num_clients=4",
            "partition.samples_per_client=16", "partition.opt_out_fraction=0.25", "train.rounds=1", "train.optimizer=adam",
            "train.lr=0.001", "train.weight_decay=0", "method.max_epochs=2", "method.patience=1", "method.finetune_lr=0.001",
            "method.baselines=false", "eval.personalized_on_global_test=true", "run.threads=1",
        )
        summary = run.run_all()
    finally:
        torch.set_num_threads(before)
    assert summary["dataset"] == "agnews" and summary["num_clients"] == 4
    assert 0 <= summary["personalized_accuracy"]["on_global_test"] <= 1 and summary["global_model"]["n"] == 21
    partition = run.load_partition()
    data = prepare_data(run.bundle, partition, torch.device("cpu"))
    assert data.input_shape == (AGNEWS_MAX_LENGTH, AGNEWS_VOCAB_SIZE)
    assert data.clients[0].train.x.dtype == torch.long
    np.testing.assert_array_equal(data.clients[0].train.x.numpy(), run.bundle.train.x[partition.clients[0].train])
    shifted = dataclasses.replace(partition, clients=(dataclasses.replace(partition.clients[0], transform="flip"),
                                                      *partition.clients[1:]))
    with pytest.raises(DataError, match="feature_shift transforms images"):
        prepare_data(run.bundle, shifted, torch.device("cpu"))
