"""pFedMB (Mori et al., "Personalized Federated Learning with Multi-branch Architecture", 2023).

Every conv / linear layer is split into B branches shared by all clients; each client mixes them
with its own weights alpha on the simplex (Eq. 1-2, see fedpipe/nn/multibranch.py). Algorithm 1:

- a client downloads the branches W^t, then updates its alpha for E epochs with W fixed (Eq. 3,
  lr eta_alpha), then W for E epochs with alpha fixed (Eq. 4, lr eta_W);
- it uploads its branches and its alpha; the server averages every branch b of every layer l
  weighted by n_i alpha^i_{l,b} (Eq. 5), or by n_i alone (Eq. 6, the paper's ablation);
- after the last round every client fine-tunes its merged model for E epochs (`finetune_epochs`,
  the generic phase of finetune.py), as in the paper's comparisons.

State: the server keeps the branched weights (B x P numbers); a client keeps its alpha. alpha
leaves the client only inside its upload, as aggregation weights for that round: the server keeps
no copy. A client's personalized model is its merged single-branch model (Eq. 1).

Where the paper is silent (each a named option or stated here):
- alpha on the simplex: `simplex="projection"` (projected SGD: Euclidean projection after every
  step) or `"softmax"` (alpha = softmax(logits), the logits trained); both start equal (1/B).
- eta_W is train.lr (decayed per round like every method's rate); eta_alpha is `lr_alpha`, an
  absolute rate. The weight stage (Eq. 4) uses the run's optimiser (train.optimizer, momentum,
  weight decay). The alpha stage is Eq. 3's plain gradient step by default (`alpha_step: plain`:
  alpha <- alpha - eta_alpha grad, no momentum, no weight decay, then the projection), because
  momentum and weight decay change what Eq. 3 computes (weight decay pulls alpha toward 0, and with
  the projection toward uniform; momentum multiplies the step by up to 1 / (1 - momentum));
  `alpha_step: optimizer` runs the alpha stage with the run's optimiser too (fedpipe's earlier
  behaviour: lr_alpha 0.05 with momentum 0.9 steps like about 0.5 plain).
- With B = 1 the simplex is a single point, so the alpha stage is skipped: pFedMB is then FedAvg
  (Eq. 5 with alpha = 1 is sample-weighted averaging) followed by fine-tuning.
- A branch to which no participating client gave any weight (possible with the projection,
  which can set alpha_{b,l} to exactly 0) keeps its previous global value: Eq. 5 has no
  weight to average with (and a client with alpha_{b,l} = 0 has a zero gradient for it).
- Layers that are not branched (`branched_layers`) are averaged by sample count (FedAvg).
- The global model (evaluated on the global test set) is the branches merged with uniform alpha:
  the model a client that has not yet tuned its alpha starts from. Once the clients' alphas have
  specialised it is a blend of unrelated branches and scores low: personalization is the point.
- The server starts from the base model's initial weights; the first download branches them
  (`branch_init`: by default centred perturbations whose uniform-alpha merge is those weights).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from pathlib import Path
from typing import ClassVar, Literal

import torch
from pydantic import Field, field_validator

from fedpipe.algorithms.aggregation import Aggregation, custom, weighted_average
from fedpipe.algorithms.base import (
    Algorithm,
    ClientContext,
    MethodParams,
    Params,
    Phase,
    ServerState,
    Slots,
    Stage,
    Upload,
    cross_entropy,
    federation_phase,
)
from fedpipe.config import MAX_EPOCHS
from fedpipe.nn.multibranch import BranchLayout, project_onto_simplex
from fedpipe.search_space import Dimension, LogUniform

log = logging.getLogger(__name__)

ALPHA = "alpha"  # a client's alpha on the simplex (kept state with `simplex: projection`; always in uploads)
#: under SecAgg+, a branch whose mean alpha (sum_i n_i alpha^i / N) is at most this keeps its value: no site weighted it,
#: and a quotient of two quantised sums near 0 would be noise (SecAgg+'s step is 2 clipping_range / quantization_range)
SECURE_MIN_ALPHA = 1e-3
ALPHA_LOGITS = "alpha_logits"  # a client's kept state with `simplex: softmax`: alpha = softmax(logits)


class PFedMBParams(MethodParams):
    """pFedMB: multi-branch layers with client-specific branch weights alpha, alpha-weighted aggregation."""

    search_space: ClassVar[dict[str, Dimension]] = {"method.lr_alpha": LogUniform(0.005, 0.5)}
    """What a study tunes beside train.lr: the branch weights' step (Eq. 3)."""

    name: Literal["pfedmb"] = "pfedmb"
    num_branches: int = Field(5, ge=1, le=64)  # the paper: at most 10; cost grows B-fold
    """B: branches per branched layer (the paper tunes it; at most 10 in its experiments, 5 in the
    10-clients-in-5-pairs study). Communication and training cost B times FedAvg's for the branched layers."""
    alpha_scope: Literal["per_layer", "shared"] = "per_layer"
    """per_layer: one alpha vector per branched layer (Eq. 1's alpha_{b,l}); shared: one alpha for
    every layer (the paper's Section V-B)."""
    branched_layers: Literal["all"] | tuple[str, ...] = "all"
    """Which layers are split into branches: "all" Conv2d and Linear layers (the paper), or module-name
    prefixes (a list, or one comma-separated string), e.g. "features,head"; the others are shared
    and averaged as in FedAvg."""
    simplex: Literal["projection", "softmax"] = "projection"
    """How alpha stays on the simplex: projection (SGD on alpha, then the Euclidean projection onto
    the simplex after every step) or softmax (alpha = softmax(logits), SGD on the logits)."""
    branch_init: Literal["centred", "independent"] = "centred"
    """How the B branches start (the paper does not say): centred, W_b = W + N_b - mean(N) with N_b
    independent draws of the layer's init, so the branches differ like independent inits but
    their uniform-alpha merge is the base model at its own scale; independent, W_1 = W and the
    others fresh draws, whose merge starts every layer ~1/sqrt(B) too small (see BranchLayout.branch)."""
    alpha_step: Literal["plain", "optimizer"] = "plain"
    """How the alpha stage steps: 'plain' (the default, Eq. 3): alpha <- alpha - lr_alpha * grad, no
    momentum or weight decay (then the projection, or on the softmax logits); 'optimizer': the run's
    optimiser (train.optimizer with its momentum and weight decay), as the weight stage."""
    lr_alpha: float = Field(0.05, gt=0)
    """eta_alpha: learning rate of the alpha stage (Eq. 3), absolute (no per-round decay). eta_W of the
    weight stage (Eq. 4) is train.lr."""
    aggregation: Literal["alpha_weighted", "plain"] = "alpha_weighted"
    """alpha_weighted: branch b of layer l averaged with weights n_i * alpha^i_{l,b} (Eq. 5); plain:
    by n_i alone (Eq. 6, the paper's ablation)."""
    finetune_epochs: int = Field(5, ge=0, le=MAX_EPOCHS)
    """Local epochs of fine-tuning of each client's merged model after the last round (the paper
    fine-tunes every method for E = 5 epochs; 0: none)."""

    @field_validator("branched_layers", mode="before")
    @classmethod
    def _comma_separated(cls, v):
        # a pipeline parameter is a string: "features,head" means the list [features, head]
        if isinstance(v, str) and v != "all":
            return tuple(p.strip() for p in v.split(",") if p.strip())
        return v


def alpha_weighted_average(
    uploads: list[Upload], layout: BranchLayout, previous: Params, *, use_alpha: bool = True
) -> Params:
    """The new global branches from a round's uploads (each: branched tensors + its alpha):

        W_{l,b} = sum_i n_i alpha^i_{l,b} W^i_{l,b} / sum_j n_j alpha^j_{l,b}     (Eq. 5)
        W_{l,b} = sum_i n_i W^i_{l,b} / sum_j n_j                                 (Eq. 6, use_alpha=False)

    over the clients that took part. A branch no client weighted keeps its `previous` value;
    unbranched tensors are averaged by n_i (FedAvg)."""
    sizes = [u.num_samples for u in uploads]
    branched = layout.branched_names
    shared = [n for n in previous if n not in branched]
    out = weighted_average([{n: u.tensors[n] for n in shared} for u in uploads], sizes) if shared else {}
    for layer in layout.layers:
        row, names = layout.row_of(layer), layout.tensors[layer]
        per_branch = []
        for b in range(layout.num_branches):
            weights = [n * float(u.tensors[ALPHA][row, b]) for n, u in zip(sizes, uploads)] if use_alpha else sizes
            if sum(weights) > 0:
                per_branch.append(weighted_average([{n: u.tensors[n][b] for n in names} for u in uploads], weights))
            else:
                per_branch.append({n: previous[n][b] for n in names})
        out.update({n: torch.stack([p[n] for p in per_branch]) for n in names})
    return out


def secure_sum_terms(upload: Params, layout: BranchLayout) -> Params:
    """What a site puts under SecAgg+'s masks for Eq. 5: each branch b of layer l times its alpha_{l,b}, its alpha as it
    is. The sample-weighted mean of these is sum_i n_i alpha^i W^i / N and sum_i n_i alpha^i / N."""
    alpha, out = upload[ALPHA], dict(upload)
    for layer in layout.layers:
        row = layout.row_of(layer)
        for n in layout.tensors[layer]:
            t = upload[n]
            out[n] = t * alpha[row].to(t.dtype).view(-1, *([1] * (t.dim() - 1)))
    return out


def from_secure_means(mean: Params, layout: BranchLayout, previous: Params, use_alpha: bool = True) -> Params:
    """Eq. 5 from the means of `secure_sum_terms`: W_{l,b} = mean(n alpha W)_{l,b} / mean(n alpha)_{l,b}; a branch whose
    mean alpha is at most SECURE_MIN_ALPHA (no site weighted it, up to SecAgg+'s quantisation) keeps its `previous`
    value. Eq. 6 (`use_alpha=False`): the means themselves. Unbranched tensors: the sample-weighted mean."""
    out = {n: mean[n] for n in previous if n not in layout.branched_names}
    alpha = mean[ALPHA].double()
    for layer in layout.layers:
        row = layout.row_of(layer)
        for n in layout.tensors[layer]:
            branches = []
            for b in range(layout.num_branches):
                if not use_alpha:
                    branches.append(mean[n][b])
                elif float(alpha[row, b]) > SECURE_MIN_ALPHA:
                    branches.append((mean[n][b].double() / alpha[row, b]).to(previous[n].dtype))
                else:
                    branches.append(previous[n][b])
            out[n] = torch.stack(branches)
    return out


class PFedMB(Algorithm):
    name = "pfedmb"
    Params = PFedMBParams
    paper = "Mori et al. 2023, Eq. 1-6 and Algorithm 1"
    uploads = "its branches and its alpha (the branch weights)"
    privacy_refusal = ("its server weighs each client's branches by that client's alpha (Eq. 6): the alphas are "
                       "per-client statistics that steer the aggregate outside a clipped, noised sum")
    departures = (
        "branched_layers=all: every Conv2d and Linear layer is branched (the paper: 'each linear layer')",
        "branch_init=centred: the B branches start as centred perturbations of the base model (the paper does not say)",
        "lr_alpha=0.05 and train.lr: ours (the paper tunes eta_alpha and eta_W without giving them)",
    )
    params: PFedMBParams

    def __init__(self, params: PFedMBParams, model, seed: int):
        super().__init__(params, model, seed)
        self.layout = BranchLayout.of(model, params.num_branches, params.branched_layers, params.alpha_scope == "shared")
        self.base_shapes = {n: p.shape for n, p in model.named_parameters()}
        unbranched = BranchLayout.unbranchable(model)
        if params.branched_layers == "all" and unbranched:
            log.warning("pFedMB branches Conv2d and Linear layers only: %s of %s stay single, shared by every branch and "
                        "averaged by sample count (FedAvg).", ", ".join(unbranched), type(model).__name__)

    @classmethod
    def phases(cls, params: MethodParams, rounds: int) -> list[Phase]:
        return [federation_phase(rounds, "multi-branch federation: alpha, then branches, alpha-weighted aggregation")]

    # --- parameters -----------------------------------------------------------------------------
    def branches(self, global_params: Params) -> Params:
        """The server's branched weights (the base model's initial weights are branched on first use)."""
        if self.layout.is_branched(global_params, self.base_shapes):
            return global_params
        return self.layout.branch(self.model, global_params, self.seed, self.params.branch_init)

    def initial_alpha(self, device: torch.device) -> Params:
        """A new client's alpha: every branch 1/B (the paper: "the same value for all branches")."""
        alpha = self.layout.uniform_alpha(device)
        if self.params.simplex == "softmax":
            return {ALPHA_LOGITS: torch.zeros_like(alpha)}  # softmax(0) = 1/B
        return {ALPHA: alpha}

    @staticmethod
    def alpha_of(kept: Params) -> torch.Tensor:
        """A client's alpha on the simplex, shape (A, B), from what it keeps."""
        return torch.softmax(kept[ALPHA_LOGITS], dim=-1) if ALPHA_LOGITS in kept else kept[ALPHA]

    def _has_alpha(self, state: Params | None) -> bool:
        return bool(state) and (ALPHA in state or ALPHA_LOGITS in state)

    # --- client side ----------------------------------------------------------------------------
    def client_params(self, ctx: ClientContext, download: Params, state: Params | None) -> Slots:
        branches = self.branches(download)
        alpha = dict(state) if self._has_alpha(state) else self.initial_alpha(next(iter(branches.values())).device)
        return {"branches": branches, "alpha": alpha}

    def stages(self, ctx: ClientContext, local_epochs: int) -> list[Stage]:
        fit_weights = Stage(("branches",), local_epochs, self.loss)  # Eq. 4, eta_W = train.lr
        if self.layout.num_branches == 1:  # the simplex is one point: nothing to fit
            return [fit_weights]
        project = self._project if self.params.simplex == "projection" else None
        plain = self.alpha_gradient_step if self.params.alpha_step == "plain" else None
        fit_alpha = Stage(("alpha",), local_epochs, self.loss, lr=self.params.lr_alpha, after_step=project, update=plain)  # Eq. 3
        return [fit_alpha, fit_weights]

    def alpha_gradient_step(self, slots: Slots, x: torch.Tensor, y: torch.Tensor, noise: torch.Tensor | None, lr: float) -> torch.Tensor:
        """Eq. 3: alpha <- alpha - eta_alpha * grad_alpha f_i((W, alpha)) on one batch, W fixed (the
        stage's after_step then projects onto the simplex). Returns the batch loss before the step."""
        alpha = list(slots["alpha"].values())
        loss = self.loss(slots, x, y, noise)
        grads = torch.autograd.grad(loss, alpha)
        with torch.no_grad():
            for a, g in zip(alpha, grads):
                a.sub_(g, alpha=lr)
        return loss.detach()

    @staticmethod
    def _project(slots: Slots) -> None:
        alpha = slots["alpha"][ALPHA]
        alpha.copy_(project_onto_simplex(alpha))

    def loss(self, slots: Slots, x: torch.Tensor, y: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        merged = self.layout.merge(slots["branches"], self.alpha_of(slots["alpha"]))  # Eq. 1 = Eq. 2
        return cross_entropy(self.forward(merged, x), y)

    def client_result(self, ctx: ClientContext, slots: Slots, state: Params | None) -> tuple[Params | None, Params | None]:
        upload = {**slots["branches"], ALPHA: self.alpha_of(slots["alpha"]).detach()}
        return upload, dict(slots["alpha"])

    # --- server side ----------------------------------------------------------------------------
    def download(self, phase: Phase, server: ServerState, client_id: int) -> Params:
        return self.branches(server.global_params)

    def upload_layout(self, phase: Phase, download: Params, sent: Collection[str] = ()) -> Params:
        """Its branches (the download's layout) and its alpha, one row per alpha row, one column per branch."""
        return {**download, ALPHA: self.layout.uniform_alpha(next(iter(download.values())).device)}

    def aggregation(self, phase: Phase) -> Aggregation:
        """Custom even with `aggregation: plain` (Eq. 6): the uploads also carry each client's alpha,
        which the server must not keep (a plain weighted mean would average it into the global state)."""
        rule = "n_i alpha^i_{l,b} (Eq. 5)" if self.params.aggregation == "alpha_weighted" else "n_i (Eq. 6)"
        return custom(f"branch b of layer l averaged with weights {rule}, the others by n_i; the uploaded alphas are not kept")

    def aggregate(self, phase: Phase, server: ServerState, uploads: list[Upload]) -> ServerState:
        if not uploads:
            return server
        new = alpha_weighted_average(uploads, self.layout, self.branches(server.global_params),
                                     use_alpha=self.params.aggregation == "alpha_weighted")
        return ServerState(new, server.per_client)  # the alphas are not kept

    # --- under SecAgg+: Eq. 5 from two masked sums (`secure_sum_terms`, `from_secure_means`) -------------------------
    def secure_weighting(self, phase: Phase) -> str | None:
        """Eq. 5 (and Eq. 6) are quotients of sample-weighted sums: a masked sum of n_i alpha^i W^i and one of n_i alpha^i."""
        return "samples" if phase.communicates else None

    def secure_upload(self, phase: Phase, upload: Params) -> Params:
        return secure_sum_terms(upload, self.layout) if self.params.aggregation == "alpha_weighted" else upload

    def apply_mean(self, server: ServerState, mean: Params) -> ServerState:
        new = from_secure_means(mean, self.layout, self.branches(server.global_params), self.params.aggregation == "alpha_weighted")
        return ServerState(new, server.per_client)  # the alphas are not kept

    def round_details(self, server: ServerState, clients: dict[int, Params]) -> dict:
        """Each client's current alpha (rows: `alpha_rows`, columns: branches), for the heatmap."""
        return {
            "alpha_rows": self.layout.alpha_labels,
            "alpha": {str(cid): [[round(float(v), 4) for v in row] for row in self.alpha_of(s)]
                      for cid, s in sorted(clients.items()) if self._has_alpha(s)},
        }

    def report_plots(self, rounds: list[dict]) -> dict[str, Callable[[Path], object]]:
        from fedpipe import plots

        federated = [r for r in rounds if r.get("phase") == "federation" and r.get("details", {}).get("alpha")]
        if not federated:
            return {}
        return {"alpha_heatmap.png": lambda path: plots.alpha_heatmap(federated, path)}

    # --- evaluation -----------------------------------------------------------------------------
    def global_model(self, server: ServerState) -> Params | None:
        branches = self.branches(server.global_params)
        return self.layout.merge(branches, self.layout.uniform_alpha(next(iter(branches.values())).device))

    def personalized_candidates(self, server: ServerState, state: Params | None, client_id: int) -> list[tuple[float, Params]]:
        """The client's merged single-branch model (Eq. 1); uniform alpha for a client never sampled."""
        if not self._has_alpha(state):
            return [(0.0, self.global_model(server))]
        return [(0.0, self.layout.merge(self.branches(server.global_params), self.alpha_of(state)))]
