"""Where a run's artifacts live in the store: every key of a run is spelled here and nowhere else.

    <run>/run.json                          the run record (one config per run)
    <run>/owner.json                        who writes the run now, with a heartbeat (one writer)
    <run>/partition/manifest.json           the partition
    <run>/phases/<phase>/round-00007.pt     a phase's checkpoint after round 7 (while it runs)
    <run>/phases/<phase>/final.pt           a phase's final state
    <run>/phases/<phase>/engine.json        how its clients are trained, when the config says auto
    <run>/phases/<phase>/clients/c00012-r00007-<sha256[:16]>.pt   a spilled client state
    <run>/privacy-secret                    privacy.enabled: the run's noise secret (32 random bytes, never published)
    <run>/report/...                        the report; rounds-<phase>.jsonl, one line per round
    <run>/manifest.json                     the run manifest, written last (`fedpipe verify`)

The engine knows only a phase's keys, through the `fedpipe.engine.state.PhaseKeys` protocol that
`RunLayout.phase` satisfies. `RunLayout.owns` says whether a key is one of these: `Run.fresh`
deletes only those, never a file that merely lies in the run's folder.

Keys are matched whole (anchored), never by a pattern found somewhere inside a key:
``phases/p/old-round-00003.pt`` is not a checkpoint.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_ROUND = re.compile(r"round-(\d+)\.pt")  # fullmatch of the part after the phase's folder
# a client state of any phase of any run: "<run>/phases/<phase>/clients/c00012-r00007-<16 hex>.pt", whole
_CLIENT = re.compile(r".+/phases/[^/]+/clients/c(\d+)-r(\d+)-([0-9a-f]{16})\.pt")
# the keys of a run's folder that fedpipe writes, relative to it (`RunLayout.owns`)
_RUN_FILES = ("run.json", "owner.json", "manifest.json", "partition/manifest.json", "privacy-secret")
_OWN_KEY = re.compile(
    r"phases/[^/]+/(?:final\.pt|engine\.json|round-\d+\.pt|clients/c\d+-r\d+-[0-9a-f]{16}\.pt)"
    r"|report/[^/]+\.(?:png|csv|json|jsonl|md|html)"
)


@dataclass(frozen=True)
class PhaseLayout:
    """One phase's folder: its checkpoints, its final state and its spilled client states."""

    folder: str  # ends with "/"

    @property
    def final(self) -> str:
        return self.folder + "final.pt"

    @property
    def engine_choice(self) -> str:
        """How the phase's clients are trained when the config says auto (`fedpipe.engine.choice`)."""
        return self.folder + "engine.json"

    def round(self, round_: int) -> str:
        return f"{self.rounds}{round_:05d}.pt"

    @property
    def rounds(self) -> str:
        """What every checkpoint key starts with (listing it does not walk the clients folder)."""
        return self.folder + "round-"

    def round_of(self, key: str) -> int | None:
        """The round of this phase's checkpoint `key`; None for any other key."""
        m = _ROUND.fullmatch(key[len(self.folder):]) if key.startswith(self.folder) else None
        return int(m.group(1)) if m else None

    @property
    def clients(self) -> str:
        return self.folder + "clients/"

    def client_state(self, client_id: int, round_: int, digest: str) -> str:
        return f"{self.clients}c{client_id:05d}-r{round_:05d}-{digest}.pt"

    @staticmethod
    def client_state_of(key: str) -> tuple[int, int, str] | None:
        """(client, round, digest) named by a client-state key of any phase; None for another key."""
        m = _CLIENT.fullmatch(key) if isinstance(key, str) else None
        return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else None


@dataclass(frozen=True)
class RunLayout:
    """The keys of run `run_id`."""

    run_id: str

    @property
    def folder(self) -> str:
        return f"{self.run_id}/"

    @property
    def run_record(self) -> str:
        return f"{self.run_id}/run.json"

    @property
    def owner(self) -> str:
        """Who writes the run now (`fedpipe.run.record.RunOwner`)."""
        return f"{self.run_id}/owner.json"

    def owns(self, key: str) -> bool:
        """True when `key` is one fedpipe writes for this run (a key this module names)."""
        if not key.startswith(self.folder):
            return False
        rest = key[len(self.folder):]
        return rest in _RUN_FILES or _OWN_KEY.fullmatch(rest) is not None

    @property
    def privacy_secret(self) -> str:
        """The run's noise secret (`fedpipe.engine.privacy.new_secret`): written before the run's first private
        round, so a round replayed after a crash draws the noise it drew the first time."""
        return f"{self.run_id}/privacy-secret"

    @property
    def partition_manifest(self) -> str:
        return f"{self.run_id}/partition/manifest.json"

    @property
    def run_manifest(self) -> str:
        return f"{self.run_id}/manifest.json"

    @property
    def report_dir(self) -> str:
        return f"{self.run_id}/report"

    def report(self, name: str) -> str:
        return f"{self.report_dir}/{name}"

    def rounds(self, phase: str) -> str:
        return self.report(f"rounds-{phase}.jsonl")

    def phase(self, name: str) -> PhaseLayout:
        return PhaseLayout(f"{self.run_id}/phases/{name}/")
