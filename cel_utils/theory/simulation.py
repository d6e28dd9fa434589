"""Vectorised simulation of the toy model of section 4: thousands of seeds trained at once.

Each seed is one run of full-batch gradient descent on the population objective (R_A + R_B) / 4 of
`cel_utils.theory.derivation`, from its own alpha * N(0, 1) initialisation.  Parameters are returned as arrays of
shape (4, seeds, heads, features) whose leading axis is (q, k, v, o).  The seed axis is vectorised;
the only Python loop is over steps.

Because the objective is an exact expectation, so is its gradient: no data are sampled, and the only
randomness is the initialisation, drawn from `numpy.random.default_rng(random_seed)`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pandas as pd
from scipy import stats
from tqdm import tqdm

HEADS = 3
FEATURES = ("U", "V", "W")
# Per-feature factor of the objective's gradient in w: d/dw of (R_A + R_B)/4 is
# (w1 - a/2, (w2 - b)/2, (w3 - c)/2) (cel_utils.theory.objective_gradient).
GRADIENT_RATE = np.array([1.0, 0.5, 0.5])
# A feature counts as localized when its runner-up head carries under this fraction of the winner.
LOCALIZED_RATIO = 0.1


@dataclass(frozen=True)
class SimConfig:
    """One simulation: the model's constants, the initial scale and the optimiser."""

    seeds: int = 10_000
    alpha: float = 0.1
    lr: float = 0.4
    steps: int = 8_000
    a: float = 1.0
    b: float = 1.5
    c: float = 2.0
    random_seed: int = 0
    n_traces: int = 0  # how many of the first seeds keep their whole trajectory of coefficients
    record_every: int = 10  # step spacing of those trajectories
    progress: bool = False

    @property
    def t(self) -> float:
        return self.a / 2

    @property
    def target(self) -> np.ndarray:
        """The minimiser (a/2, b, c) of the joint objective."""
        return np.array([self.a / 2, self.b, self.c])


@dataclass
class SimResult:
    """Final state and diagnostics of every seed; arrays have the seed axis first."""

    config: SimConfig
    params: np.ndarray  # (4, seeds, heads, features): q, k, v, o
    coef: np.ndarray  # (seeds, heads, features): c_hj
    w: np.ndarray  # (seeds, features)
    winners: np.ndarray  # (seeds, features): argmax over heads of c_hj
    event_E: np.ndarray  # (seeds,): feature U's winner wins neither V nor W
    risk_A: np.ndarray
    risk_B: np.ndarray
    risk_A_deleted: np.ndarray  # after zeroing every coefficient of feature U's winner
    risk_B_deleted: np.ndarray
    grad_norm: np.ndarray  # Euclidean norm of the full parameter gradient at the end
    dist_to_opt: np.ndarray  # |w - (a/2, b, c)|
    loser_ratio: np.ndarray  # (seeds, features): largest |loser c| / |winner c|
    escape_step: np.ndarray  # (seeds, features): first step with w_j >= target_j / 2, else -1
    help_step: np.ndarray  # first step from which deleting U's final winner lowers R_A at every later step
    half_help_step: np.ndarray  # same, for lowering R_A by at least t^2 / 2
    trace_steps: np.ndarray
    trace: np.ndarray  # (n_traces, len(trace_steps), heads, features)
    diverged: np.ndarray  # (seeds,): some parameter overflowed

    @property
    def localized(self) -> np.ndarray:
        """Seeds where every feature's runner-up carries under LOCALIZED_RATIO of its winner."""
        return (self.loser_ratio < LOCALIZED_RATIO).all(axis=1)


def init_params(seeds: int, alpha: float, rng: np.random.Generator) -> np.ndarray:
    """Every scalar q, k, v, o of every head and feature drawn as alpha * N(0, 1)."""
    return alpha * rng.standard_normal((4, seeds, HEADS, len(FEATURES)))


def coefficients(params: np.ndarray) -> np.ndarray:
    """c_hj = o * v * tanh(q * k), shape (seeds, heads, features)."""
    q, k, v, o = params
    return o * v * np.tanh(q * k)


def task_risks(w: np.ndarray, a: float, b: float, c: float) -> tuple[np.ndarray, np.ndarray]:
    """Population risks R_A = w1^2 + (w2-b)^2 and R_B = (w1-a)^2 + (w3-c)^2, over the last axis of w."""
    risk_a = w[..., 0] ** 2 + (w[..., 1] - b) ** 2
    risk_b = (w[..., 0] - a) ** 2 + (w[..., 2] - c) ** 2
    return risk_a, risk_b


def joint_objective(w: np.ndarray, a: float, b: float, c: float) -> np.ndarray:
    """(R_A + R_B) / 4 for each read-out w."""
    risk_a, risk_b = task_risks(w, a, b, c)
    return (risk_a + risk_b) / 4


def _gradient_seeds_last(params: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Gradient and coefficients for parameters laid out (4, heads, features, seeds).

    Training keeps the seed axis last so that every operation runs over long contiguous rows (reducing
    over a middle axis of length 3 was the slowest step); the public functions take seeds first.
    """
    q, k, v, o = params
    th = np.tanh(q * k)
    ov = o * v
    coef = ov * th
    g = ((coef.sum(axis=0) - target[:, None]) * GRADIENT_RATE[:, None])[None]  # (1, features, seeds)
    g_ovs = g * ov * (1 - th * th)
    g_th = g * th
    grad = np.empty_like(params)
    np.multiply(g_ovs, k, out=grad[0])
    np.multiply(g_ovs, q, out=grad[1])
    np.multiply(g_th, o, out=grad[2])
    np.multiply(g_th, v, out=grad[3])
    return grad, coef


def population_gradient(params: np.ndarray, a: float, b: float, c: float) -> np.ndarray:
    """Exact gradient of each seed's joint objective in its parameters, same shape as params."""
    grad, _ = _gradient_seeds_last(params.transpose(0, 2, 3, 1), np.array([a / 2, b, c]))
    return grad.transpose(0, 3, 1, 2)


def _delta_risk_a_per_head(coef: np.ndarray, w: np.ndarray, b: float) -> np.ndarray:
    """R_A after deleting each head minus R_A now, for coef (heads, features, seeds): (heads, seeds)."""
    c_u, c_v = coef[:, 0], coef[:, 1]
    return c_u * (c_u - 2 * w[0]) + c_v * (c_v - 2 * (w[1] - b))


def winners_of(coef: np.ndarray) -> np.ndarray:
    """Winning head of each feature: the largest signed coefficient (the targets are positive)."""
    return coef.argmax(axis=1)


def event_E_of(winners: np.ndarray) -> np.ndarray:
    """E: feature U's winner is neither V's nor W's winner."""
    return (winners[:, 0] != winners[:, 1]) & (winners[:, 0] != winners[:, 2])


def train(config: SimConfig) -> SimResult:
    """Train all seeds by full-batch gradient descent and collect the diagnostics of section 4."""
    rng = np.random.default_rng(config.random_seed)
    params = np.ascontiguousarray(init_params(config.seeds, config.alpha, rng).transpose(0, 2, 3, 1))
    target = config.target

    escape_step = np.full((len(FEATURES), config.seeds), -1)
    # Which head is U's winner is known only at the end, so track every head: the last step at
    # which deleting it did NOT lower R_A (resp. not by t^2/2); -1 means at no step.
    last_no_help = np.full((HEADS, config.seeds), -1)
    last_no_half = np.full((HEADS, config.seeds), -1)
    trace_steps, trace = [], []

    def track(step: int, coef: np.ndarray) -> None:
        w = coef.sum(axis=0)
        escape_step[(escape_step < 0) & (w >= target[:, None] / 2)] = step
        delta = _delta_risk_a_per_head(coef, w, config.b)
        last_no_help[delta >= 0] = step
        last_no_half[delta > -config.t**2 / 2] = step
        if config.n_traces and step % config.record_every == 0:
            trace_steps.append(step)
            trace.append(coef[..., : config.n_traces].transpose(2, 0, 1).copy())

    # A diverging seed overflows to inf/nan; it is reported in `diverged`, not raised.
    with np.errstate(over="ignore", invalid="ignore"):
        for step in tqdm(range(config.steps), disable=not config.progress, mininterval=1.0):
            grad, coef = _gradient_seeds_last(params, target)
            track(step, coef)
            params -= config.lr * grad
        params = np.ascontiguousarray(params.transpose(0, 3, 1, 2))
        coef = coefficients(params)
        track(config.steps, coef.transpose(1, 2, 0))

        s_idx = np.arange(config.seeds)
        w = coef.sum(axis=1)
        winners = winners_of(coef)
        risk_a, risk_b = task_risks(w, config.a, config.b, config.c)
        risk_a_del, risk_b_del = task_risks(w - coef[s_idx, winners[:, 0], :], config.a, config.b, config.c)
        grad = population_gradient(params, config.a, config.b, config.c)
        mags = np.sort(np.abs(coef), axis=1)
        loser_ratio = mags[:, -2, :] / mags[:, -1, :]

    def first_good_step(last_bad: np.ndarray) -> np.ndarray:
        last = last_bad[winners[:, 0], s_idx]
        return np.where(last >= config.steps, -1, last + 1)

    return SimResult(
        config=config,
        params=params,
        coef=coef,
        w=w,
        winners=winners,
        event_E=event_E_of(winners),
        risk_A=risk_a,
        risk_B=risk_b,
        risk_A_deleted=risk_a_del,
        risk_B_deleted=risk_b_del,
        grad_norm=np.sqrt((grad**2).sum(axis=(0, 2, 3))),
        dist_to_opt=np.linalg.norm(w - target, axis=1),
        loser_ratio=loser_ratio,
        escape_step=escape_step.T.copy(),
        help_step=first_good_step(last_no_help),
        half_help_step=first_good_step(last_no_half),
        trace_steps=np.array(trace_steps),
        trace=np.stack(trace, axis=1) if trace else np.zeros((0, 0, HEADS, len(FEATURES))),
        diverged=~np.isfinite(params).all(axis=(0, 2, 3)),
    )


def wilson_interval(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion."""
    z = stats.norm.ppf(0.5 + confidence / 2)
    p = successes / trials
    centre = (p + z**2 / (2 * trials)) / (1 + z**2 / trials)
    half = z / (1 + z**2 / trials) * np.sqrt(p * (1 - p) / trials + z**2 / (4 * trials**2))
    return float(centre - half), float(centre + half)


def converged_mask(result: SimResult, tol: float = 1e-6) -> np.ndarray:
    """Seeds whose read-out is within tol of (a/2, b, c)."""
    return result.dist_to_opt < tol


def winner_tests(winners: np.ndarray) -> pd.DataFrame:
    """Chi-square tests that winners are uniform over heads and independent across features.

    One goodness-of-fit test per feature against 1/3 each, one contingency-table test of independence
    per pair of features, and one test of the 27-cell joint table against the uniform 1/27.
    """
    def row(test: str, res, dof: int) -> dict:
        return {"test": test, "chi2": res.statistic, "dof": dof, "p": res.pvalue}

    rows = []
    for j, name in enumerate(FEATURES):
        res = stats.chisquare(np.bincount(winners[:, j], minlength=HEADS))
        rows.append(row(f"winner of {name} uniform", res, HEADS - 1))
    for i, j in ((0, 1), (0, 2), (1, 2)):
        table = np.zeros((HEADS, HEADS))
        np.add.at(table, (winners[:, i], winners[:, j]), 1)
        res = stats.chi2_contingency(table)
        rows.append(row(f"winners of {FEATURES[i]}, {FEATURES[j]} independent", res, res.dof))
    joint = np.bincount(np.ravel_multi_index(winners.T, (HEADS,) * 3), minlength=HEADS**3)
    rows.append(row("joint: uniform over 27 triples", stats.chisquare(joint), HEADS**3 - 1))
    return pd.DataFrame(rows).set_index("test")


def deletion_table(result: SimResult, mask: np.ndarray | None = None) -> pd.DataFrame:
    """Mean risks before and after deleting U's winner, on E and off E, in units of t^2."""
    keep = np.ones(result.config.seeds, bool) if mask is None else mask
    t2 = result.config.t ** 2
    groups = {"on E": keep & result.event_E, "off E": keep & ~result.event_E, "all": keep}
    rows = {}
    for label, sel in groups.items():
        rows[label] = {
            "seeds": int(sel.sum()),
            "R_A before": result.risk_A[sel].mean() / t2,
            "R_A after": result.risk_A_deleted[sel].mean() / t2,
            "R_B before": result.risk_B[sel].mean() / t2,
            "R_B after": result.risk_B_deleted[sel].mean() / t2,
            "change R_A": (result.risk_A_deleted[sel] - result.risk_A[sel]).mean() / t2,
            "change R_B": (result.risk_B_deleted[sel] - result.risk_B[sel]).mean() / t2,
        }
    return pd.DataFrame.from_dict(rows, orient="index")


def deletion_by_case(result: SimResult, mask: np.ndarray | None = None) -> pd.DataFrame:
    """Frequency and mean risk changes (units of t^2) by which other features U's winner also won.

    These are the four cases of `cel_utils.theory.deletion_cases`; (False, False) is event E.
    """
    keep = ~result.diverged if mask is None else mask
    t2 = result.config.t ** 2
    frame = pd.DataFrame(
        {
            "shares_V": result.winners[:, 0] == result.winners[:, 1],
            "shares_W": result.winners[:, 0] == result.winners[:, 2],
            "change R_A": (result.risk_A_deleted - result.risk_A) / t2,
            "change R_B": (result.risk_B_deleted - result.risk_B) / t2,
        }
    )[keep]
    grouped = frame.groupby(["shares_V", "shares_W"])
    out = grouped[["change R_A", "change R_B"]].mean()
    out.insert(0, "seeds", grouped.size())
    out.insert(1, "fraction", out["seeds"] / len(frame))
    return out


def summarize(result: SimResult, tol: float = 1e-6) -> dict[str, float]:
    """Headline numbers of one run: convergence, localization and the estimate of Pr(E)."""
    cfg = result.config
    k = int(result.event_E.sum())
    lo, hi = wilson_interval(k, cfg.seeds)
    on_e = result.event_E
    t2 = cfg.t**2
    d_a = result.risk_A_deleted - result.risk_A
    d_b = result.risk_B_deleted - result.risk_B
    return {
        "alpha": cfg.alpha,
        "lr": cfg.lr,
        "steps": cfg.steps,
        "seeds": cfg.seeds,
        "diverged": float(result.diverged.mean()),
        "converged": float(converged_mask(result, tol).mean()),
        "median loser ratio": float(np.nanmedian(result.loser_ratio)),
        "localized": float(result.localized.mean()),
        "P(E)": k / cfg.seeds,
        "P(E) lo": lo,
        "P(E) hi": hi,
        "dR_A on E / t^2": float(np.mean(d_a[on_e]) / t2),
        "dR_B on E / t^2": float(np.mean(d_b[on_e]) / t2),
        "P(dR_A < 0 | E)": float(np.mean(d_a[on_e] < 0)),
        "median escape step U": float(np.median(result.escape_step[:, 0])),
    }


def lr_for_alpha(alpha: float, lr: float, knee: float = 0.5) -> float:
    """Step size for the alpha sweep: lr up to alpha = knee, then shrunk like 1/alpha^2.

    A large initialisation starts with a large curvature; at alpha = 1 a step of 0.4 diverged on about
    one seed in a hundred (1,000 tried), a step of 0.1 on none of 2,000.
    """
    return lr * min(1.0, (knee / alpha) ** 2)


def steps_for_alpha(alpha: float, lr: float, reference: SimConfig = SimConfig(), minimum: int = 2_000) -> int:
    """Steps scaled like the plateau, whose length in steps grows as 1 / (lr * alpha^2)."""
    scale = (reference.alpha / alpha) ** 2 * (reference.lr / lr)
    return max(minimum, int(np.ceil(reference.steps * scale)))


def sweep_alpha(alphas: list[float], base: SimConfig) -> pd.DataFrame:
    """`summarize` for each alpha, with lr from `lr_for_alpha` and steps from `steps_for_alpha`."""
    rows = []
    for alpha in tqdm(alphas, disable=not base.progress):
        lr = lr_for_alpha(alpha, base.lr)
        config = replace(base, alpha=alpha, lr=lr, steps=steps_for_alpha(alpha, lr, base), n_traces=0)
        rows.append(summarize(train(config)))
    return pd.DataFrame(rows)


def help_vs_escape(result: SimResult) -> pd.DataFrame:
    """Per seed on E: when U escapes its plateau and when deleting U's winner starts to help A for good."""
    on_e = result.event_E & ~result.diverged
    return pd.DataFrame(
        {
            "escape step": result.escape_step[on_e, 0],
            "help step": result.help_step[on_e],
            "half help step": result.half_help_step[on_e],
            "localized": result.localized[on_e],
        }
    )
