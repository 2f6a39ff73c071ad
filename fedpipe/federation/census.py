"""The federation's partition step: a census of the sites instead of a split of pooled data.

Each site answers the server's census query with who it is and what it holds (`client_app.identify`): a site
folder the try-out exported from a simulation carries its client id; a site with its own files reports its name
(its client folder or client value), its label names, input shape, the label counts of its splits and its data's
snapshot digest (`fedpipe.federation.own_data.prepare_own`). No sample leaves a site.

`take_census` checks the answers (one kind of site; own-files sites agreeing on labels and input shape; no name or
id twice) and numbers the own-files sites by their names sorted as `fedpipe.data.files` sorts a pooled folder's
clients, so site k trains as client k of the simulation of all sites' files (same seeds, same draws).
Plain data in and out: no Flower, no torch (the .venv side draws the heatmap from the census it writes).
"""

from __future__ import annotations

from dataclasses import dataclass


class CensusError(ValueError):
    """The sites' answers do not make one federation (named: which site, what differs)."""


@dataclass(frozen=True)
class Counted:
    """One site as the census found it."""

    client_id: int
    opt_out: bool
    node_id: int
    name: str
    census: dict | None  # own files: what the site reported; None for an exported try-out folder


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
                           **({"counts": s.census["counts"], "snapshot": s.census["snapshot"]} if s.census else {})}  # counts None: withheld (privacy)
                          for s in self.sites]}


def take_census(answers: list[tuple[int, dict]]) -> Census:
    """The census from (node id, answer) pairs; an answer is {"client-id": int (-1: ask the census), "opt-out": bool,
    "census": dict or None}."""
    if not answers:
        raise CensusError("no site answered the census")
    own = [(node, a) for node, a in answers if a.get("census")]
    if own and len(own) != len(answers):
        raise CensusError(f"{len(own)} site(s) read their own files and {len(answers) - len(own)} hold exported try-out "
                          "folders: one federation takes one kind of site")
    if not own:
        sites = tuple(sorted((Counted(int(a["client-id"]), bool(a["opt-out"]), node, f"site-{a['client-id']}", None)
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
    sites = tuple(sorted((Counted(order[a["census"]["name"]], bool(a["opt-out"]), node, a["census"]["name"], a["census"])
                          for node, a in own), key=lambda s: s.client_id))
    return Census(sites, tuple(ref["input_shape"]), int(ref["num_classes"]), tuple(ref["labels"]))


def _no_twice(values: list, what: str) -> None:
    seen, twice = set(), set()
    for v in values:
        (twice if v in seen else seen).add(v)
    if twice:
        raise CensusError(f"two sites have the same {what}: {sorted(twice)[:5]} (each site holds its own client)")
