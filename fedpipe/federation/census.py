"""The federation's partition step: a census of the sites instead of a split of pooled data.

Each site answers the server's census query with who it is and what it holds (`client_app.identify`): a site
folder the try-out exported from a simulation carries its client id; a site with its own files reports its name
(its client folder or client value), its label names, input shape, the label counts of its splits and its data's
snapshot digest (`fedpipe.federation.own_data.prepare_own`). No sample leaves a site.

`read_answer` checks one site's answer before anything in it is used (`CensusAnswer`: bounded, typed, its
`num_classes` the number of labels it names, its label counts one per label) and fixes the site's sample counts for
the run (`Samples`): the server weighs the site's uploads and its held-out scores by these counts, never by what a
later reply claims (`fedpipe.federation.server_app`). A malformed answer is a `CensusError` naming the site, which the
server treats as that site's refusal: the others go on.

`take_census` checks the answers together (one kind of site; own-files sites agreeing on labels and input shape; no
name or id twice) and numbers the own-files sites by their names sorted as `fedpipe.data.files` sorts a pooled folder's
clients, so site k trains as client k of the simulation of all sites' files (same seeds, same draws).
Plain data in and out: no Flower, no torch (the .venv side draws the heatmap from the census it writes).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

#: bounds on one census answer, checked before it is parsed: a label set as large as a data manifest may name
#: (fedpipe.data.files.manifest.MAX_LABELS), an input of at most 2^24 values (a 3 x 1024 x 1024 image, data.image_size at most), and the text itself
MAX_LABELS = 100_000
MAX_SIDE = 1_000_000
MAX_INPUT_VALUES = 2**24
MAX_ANSWER_CHARS = 4_000_000
MAX_SAMPLES = 10**9


class CensusError(ValueError):
    """The sites' answers do not make one federation (named: which site, what differs)."""


class ClaimRefused(ValueError):
    """A site's reply states a count or a score the server cannot take (named: which site, which figure, why)."""


Count = Annotated[int, Field(ge=0, le=MAX_SAMPLES)]


class Samples(BaseModel):
    """A site's sample counts, fixed by the census for the run: its training split (the weight of its uploads in a
    weighted mean), its test split and its share of the global test set (the weight of its held-out score in the
    federated gate)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    train: Count
    test: Count
    holdout: Count = 0


class OwnFilesCensus(BaseModel):
    """What a site with its own files reports (`fedpipe.federation.own_data.prepare_own`), bounded."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(min_length=1, max_length=256)
    labels: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(min_length=2, max_length=MAX_LABELS)
    input_shape: list[Annotated[int, Field(ge=1, le=MAX_SIDE)]] = Field(min_length=1, max_length=3)
    num_classes: int = Field(ge=2, le=MAX_LABELS)
    counts: dict[Literal["train", "val", "test", "holdout"], list[Count]] | None
    snapshot: dict[Literal["digest"], Annotated[str, Field(max_length=128)]]
    opt_out: bool = False
    counts_noise: float | None = Field(None, gt=0, le=1e6)  # privacy: the std of the Gaussian noise on each count

    @model_validator(mode="after")
    def _consistent(self) -> OwnFilesCensus:
        if math.prod(self.input_shape) > MAX_INPUT_VALUES:
            raise ValueError(f"input_shape {self.input_shape} holds more than {MAX_INPUT_VALUES} values per sample")
        if self.num_classes != len(self.labels):
            raise ValueError(f"num_classes {self.num_classes} but {len(self.labels)} labels named")
        for split, counts in (self.counts or {}).items():
            if len(counts) != self.num_classes:
                raise ValueError(f"{len(counts)} label counts in split {split!r} for {self.num_classes} labels")
        return self


class CensusAnswer(BaseModel):
    """One site's answer as the server reads it: `client-id` (-1: a site with its own files, numbered by the census),
    `opt-out`, `census` (own files: an `OwnFilesCensus` as JSON text) and `samples` (a `Samples` as JSON text; absent
    under local privacy, where the server weighs no upload by its size)."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    client_id: int = Field(alias="client-id", ge=-1, le=10**6)
    opt_out: bool = Field(alias="opt-out")
    census: Annotated[str, Field(max_length=MAX_ANSWER_CHARS)] | None = None
    samples: Annotated[str, Field(max_length=1000)] | None = None


def read_answer(node: int, content) -> dict:
    """A site's census answer (the `site` record of its reply: a mapping) checked and parsed into
    {"client-id", "opt-out", "census": dict | None, "samples": Samples | None}; any malformed part is a CensusError that
    names the site (by its node, and its name when that much could be read), the part and what is wrong."""
    part, census = "the answer", None
    try:
        answer = CensusAnswer.model_validate(dict(content))
        part = "census"
        census = OwnFilesCensus.model_validate_json(answer.census) if answer.census is not None else None
        part = "samples"
        samples = Samples.model_validate_json(answer.samples) if answer.samples is not None else None
    except (ValidationError, TypeError, ValueError, RecursionError) as e:
        who = _who(node, census.name if census is not None else _name_in(content))
        raise CensusError(f"{who} sent a census answer fedpipe cannot take ({part}: {_first_error(e)}): it is left out of "
                          "the run. Its admin should run the fedpipe version the other sites run (`fedpipe site check`)") from None
    who = _who(node, census.name if census is not None else None)
    if census is not None and answer.client_id != -1:
        raise CensusError(f"{who} reads its own files but names client id {answer.client_id}: the census numbers such sites")
    return {"client-id": answer.client_id, "opt-out": answer.opt_out,
            "census": census.model_dump() if census is not None else None, "samples": samples}


def _who(node: int, name: str | None) -> str:
    return f"site {name!r} (node {node})" if name else f"the site on node {node}"


def _name_in(content) -> str | None:
    """The name a malformed own-files answer gives, when it gives a plain one (for the error message only)."""
    try:
        text = dict(content).get("census")
        if isinstance(text, str) and len(text) <= MAX_ANSWER_CHARS:
            name = json.loads(text).get("name")
            return name if isinstance(name, str) and 0 < len(name) <= 256 else None
    except (ValueError, TypeError, AttributeError, RecursionError):
        pass
    return None


def _first_error(e: Exception) -> str:
    if isinstance(e, ValidationError):
        err = e.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ())) or "the answer"
        return f"{where}: {err.get('msg', '')}"[:300] if where != "the answer" else str(err.get("msg", ""))[:300]
    return f"{type(e).__name__}: {e}"[:300]


@dataclass(frozen=True)
class Counted:
    """One site as the census found it."""

    client_id: int
    opt_out: bool
    node_id: int
    name: str
    census: dict | None  # own files: what the site reported; None for an exported try-out folder
    samples: Samples | None = None  # the counts the server weighs this site by (None: local privacy, no weights)


@dataclass(frozen=True)
class Census:
    sites: tuple[Counted, ...]
    input_shape: tuple[int, ...] | None  # own files: as the sites reported (None: exported folders, known to the spec)
    num_classes: int | None
    labels: tuple[str, ...] = ()
    refused: tuple[str, ...] = ()  # the refusals of the sites that took no part under their own policies, each named

    def summary(self) -> dict:
        """census.json: per site its id, name, opt-out flag and label counts per split (own files); the sites' refusals."""
        return {"labels": list(self.labels), "input_shape": list(self.input_shape or ()), "num_classes": self.num_classes,
                "refused": list(self.refused),
                "sites": [{"client_id": s.client_id, "name": s.name, "node_id": s.node_id, "opt_out": s.opt_out,
                           # noised counts (privacy): the exact sizes stay with the server, which weighs by them
                           **({"samples": s.samples.model_dump()} if s.samples is not None and not _noised(s) else {}),
                           **({"counts": s.census["counts"], "snapshot": s.census["snapshot"]} if s.census else {}),  # None: withheld
                           **({"counts_noise": s.census["counts_noise"]} if _noised(s) else {})}
                          for s in self.sites]}

    @property
    def noised(self) -> bool:
        """Whether some site released its label counts through the Gaussian mechanism (privacy)."""
        return any(_noised(s) for s in self.sites)


def _noised(site: Counted) -> bool:
    return bool(site.census and site.census.get("counts") is not None and site.census.get("counts_noise"))


def take_census(answers: list[tuple[int, dict]]) -> Census:
    """The census from (node id, answer) pairs; an answer is {"client-id": int (-1: ask the census), "opt-out": bool,
    "census": dict or None, "samples": Samples or None} (`read_answer`'s)."""
    if not answers:
        raise CensusError("no site answered the census")
    own = [(node, a) for node, a in answers if a.get("census")]
    if own and len(own) != len(answers):
        raise CensusError(f"{len(own)} site(s) read their own files and {len(answers) - len(own)} hold exported try-out "
                          "folders: one federation takes one kind of site")
    if not own:
        negative = [node for node, a in answers if int(a["client-id"]) < 0]
        if negative:
            raise CensusError(f"the site on node {negative[0]} holds an exported try-out folder but names no client id: "
                              "export the site's folder again (`fedpipe federation try-out`)")
        sites = tuple(sorted((Counted(int(a["client-id"]), bool(a["opt-out"]), node, f"site-{a['client-id']}", None, a.get("samples"))
                              for node, a in answers), key=lambda s: s.client_id))
        _no_twice([s.client_id for s in sites], "client id")
        return Census(sites, None, None)
    first_node, first = own[0]
    ref = first["census"]
    for node, a in own[1:]:
        c = a["census"]
        if c["labels"] != ref["labels"]:
            raise CensusError(f"site {c['name']!r} (node {node}) names the labels {c['labels'][:10]}, site {ref['name']!r} "
                              f"(node {first_node}) {ref['labels'][:10]}: every site's fedpipe-data.yaml must list the same labels "
                              "in the same order (copy one manifest to every site)")
        if c["input_shape"] != ref["input_shape"]:
            raise CensusError(f"site {c['name']!r} (node {node}) reads inputs of shape {c['input_shape']}, site {ref['name']!r} "
                              f"{ref['input_shape']}: set one data.image_size for the run (or make the sites' tables agree)")
    names = [a["census"]["name"] for _, a in own]
    _no_twice(names, "name")
    order = {name: k for k, name in enumerate(sorted(names))}  # as a pooled folder's clients are numbered
    sites = tuple(sorted((Counted(order[a["census"]["name"]], bool(a["opt-out"]), node, a["census"]["name"], a["census"],
                                  a.get("samples"))
                          for node, a in own), key=lambda s: s.client_id))
    return Census(sites, tuple(ref["input_shape"]), int(ref["num_classes"]), tuple(ref["labels"]))


def _no_twice(values: list, what: str) -> None:
    seen, twice = set(), set()
    for v in values:
        (twice if v in seen else seen).add(v)
    if twice:
        raise CensusError(f"two sites have the same {what}: {sorted(twice)[:5]} (each site holds its own client)")


def vouched_samples(site: str, counted: Samples | None, metrics, private: bool) -> int:
    """The weight of `site`'s upload: the training samples the census counted for it (`census.Samples`), once the
    count its reply states (`num-samples`) is checked against it: a claim that is not a finite whole number equal to
    the census's count refuses the reply (a site claiming 10^12 samples would otherwise make the weighted mean its own
    upload, and a negative one flip its sign). With privacy the weights are not sample counts (the accountant's fixed
    denominator, `fedpipe.engine.privacy`) and a local-privacy site states none: 0."""
    if private:
        return 0
    if counted is None:
        raise ClaimRefused(f"{site} gave the census no sample counts: its upload cannot be weighed")
    claim = metrics.get("num-samples")
    if (not isinstance(claim, (int, float)) or isinstance(claim, bool) or not math.isfinite(claim) or claim != int(claim)
            or int(claim) != counted.train):
        raise ClaimRefused(f"{site} states {claim!r} training samples, but the census counted {counted.train}: a site's "
                             "weight is the count it gave the census, and a reply that disagrees is refused")
    return counted.train


#: what a site's evaluation reply may hold (`client_app.evaluate`): fractions, and the counts the census fixed
FRACTIONS = ("accuracy", "global-accuracy", "holdout-accuracy", "champion-holdout-accuracy", "has-state")
COUNTED = {"test-samples": "test", "holdout-samples": "holdout"}
OTHER_SCORES = ("loss", "chosen")


def vouched_scores(site: str, counted: Samples | None, metrics) -> dict[str, float]:
    """A site's evaluation figures, checked before the report and the federated gate use them: each a finite number,
    the accuracies fractions in [0, 1], and its test and held-out sizes the census's counts (the gate weighs a site's
    held-out score by its size: a site claiming 10^9 held-out samples would decide the gate alone). Raises
    ClaimRefused naming the site and the figure."""
    if counted is None:
        raise ClaimRefused(f"{site} gave the census no sample counts: its scores cannot be weighed")
    out = {}
    for key, value in dict(metrics).items():
        if key not in (*FRACTIONS, *COUNTED, *OTHER_SCORES):
            raise ClaimRefused(f"{site} sent an evaluation figure fedpipe does not make: {str(key)[:64]!r}")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ClaimRefused(f"{site} sent {key}={value!r}: not a finite number")
        if key in FRACTIONS and not 0.0 <= value <= 1.0:
            raise ClaimRefused(f"{site} sent {key}={value!r}: an accuracy is a fraction in [0, 1]")
        if key in COUNTED and value != getattr(counted, COUNTED[key]):
            raise ClaimRefused(f"{site} states {key}={value!r}, but the census counted {getattr(counted, COUNTED[key])}: "
                                 "a site's scores are weighed by the counts it gave the census")
        out[key] = float(value)
    return out
