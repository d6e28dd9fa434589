"""Symbolic derivation of the toy model of capability enhancement localization (paper, section 4).

Two regression tasks share one attention layer with three heads:

* task A: input (U, V, 0), target b*V;
* task B: input (U, 0, W), target a*U + c*W;

with U, V, W independent Rademacher signs and a, b, c > 0.  Head h contributes the coefficient
c_hj = o_hj * v_hj * tanh(q_hj * k_hj) to feature j, the prediction is <w, x> with w_j = sum_h c_hj,
and training minimises the joint objective (R_A + R_B) / 4.  Feature 1 (U) is the conflicting one:
task A wants its weight at 0, task B at a, and the compromise t = a/2 leaves both tasks with risk t^2.

Everything here is exact sympy algebra; the numerical counterpart is `cel_utils.theory.simulation`.
"""
from __future__ import annotations

import itertools

import sympy as sp
from sympy.stats import DiscreteUniform, P

a, b, c = sp.symbols("a b c", positive=True)
t = a / 2
# A separate symbol for displaying results in the paper's variable t = a/2.
t_symbol = sp.Symbol("t", positive=True)
w1, w2, w3 = W_SYMBOLS = sp.symbols("w1:4", real=True)
q, k, v, o = sp.symbols("q k v o", real=True)

HEADS = (0, 1, 2)
# All equally likely sign patterns of (U, V, W); the risks are finite averages over them.
SIGN_PATTERNS = tuple(itertools.product((-1, 1), repeat=3))


def sigmoid(x: sp.Expr) -> sp.Expr:
    """The logistic function 1 / (1 + exp(-x))."""
    return 1 / (1 + sp.exp(-x))


def pair_softmax_readout(q: sp.Expr, k: sp.Expr, v: sp.Expr) -> sp.Expr:
    """Softmax attention of a query q (scaled by key k) over the memory pair (+e_j, -e_j).

    The two scores are +q*k and -q*k and the two values +v and -v, so the readout is
    v * (softmax weight on +e_j - softmax weight on -e_j).
    """
    scores = (q * k, -q * k)
    weights = [sp.exp(s) / sum(sp.exp(r) for r in scores) for s in scores]
    return v * weights[0] - v * weights[1]


def readout_identity_residual() -> sp.Expr:
    """sigma(2x) - sigma(-2x) - tanh(x), simplified; it is 0, which is why a head reads out v*tanh(qk)."""
    x = sp.Symbol("x", real=True)
    return sp.simplify((sigmoid(2 * x) - sigmoid(-2 * x) - sp.tanh(x)).rewrite(sp.exp))


def pair_readout_residual() -> sp.Expr:
    """pair_softmax_readout(q, k, v) - v*tanh(q*k), simplified; it is 0."""
    return sp.simplify((pair_softmax_readout(q, k, v) - v * sp.tanh(q * k)).rewrite(sp.exp))


def in_terms_of_t(expr: sp.Expr) -> sp.Expr:
    """Rewrite an expression in a as one in t = a/2, the paper's variable."""
    return sp.factor(sp.expand(sp.sympify(expr).subs(a, 2 * t_symbol)))


def head_coefficient(q: sp.Expr, k: sp.Expr, v: sp.Expr, o: sp.Expr) -> sp.Expr:
    """Effective coefficient c = o * v * tanh(q*k) of one head on one feature."""
    return o * v * sp.tanh(q * k)


def task_risks(w: tuple[sp.Expr, sp.Expr, sp.Expr] = W_SYMBOLS) -> tuple[sp.Expr, sp.Expr]:
    """Population squared risks (R_A, R_B) of the linear read-out w, as exact averages over signs."""
    wu, wv, ww = w
    risk_a = sum((wu * u + wv * vv - b * vv) ** 2 for u, vv, _ in SIGN_PATTERNS)
    risk_b = sum((wu * u + ww * z - a * u - c * z) ** 2 for u, _, z in SIGN_PATTERNS)
    n = len(SIGN_PATTERNS)
    return sp.expand(risk_a / n), sp.expand(risk_b / n)


def joint_objective(w: tuple[sp.Expr, sp.Expr, sp.Expr] = W_SYMBOLS) -> sp.Expr:
    """The training objective (R_A + R_B) / 4."""
    risk_a, risk_b = task_risks(w)
    return sp.expand((risk_a + risk_b) / 4)


def objective_gradient() -> sp.Matrix:
    """Gradient of the joint objective in w; the simulator's chain rule starts from this vector."""
    return sp.Matrix([sp.diff(joint_objective(), wj) for wj in W_SYMBOLS])


def objective_hessian() -> sp.Matrix:
    """Hessian of the joint objective in w (constant: the objective is quadratic in w)."""
    return sp.hessian(joint_objective(), W_SYMBOLS)


def optimum() -> dict[sp.Symbol, sp.Expr]:
    """The unique minimiser of the joint objective in w (the Hessian is positive definite)."""
    (solution,) = sp.solve(list(objective_gradient()), W_SYMBOLS, dict=True)
    return solution


def risks_at(w: tuple[sp.Expr, sp.Expr, sp.Expr]) -> dict[str, sp.Expr]:
    """R_A, R_B and the joint objective at the read-out w, simplified."""
    risk_a, risk_b = task_risks(w)
    return {
        "R_A": sp.factor(risk_a),
        "R_B": sp.factor(risk_b),
        "objective": sp.factor((risk_a + risk_b) / 4),
    }


def optimum_vector() -> tuple[sp.Expr, sp.Expr, sp.Expr]:
    """The minimiser as a tuple (w1, w2, w3) = (a/2, b, c)."""
    sol = optimum()
    return tuple(sol[wj] for wj in W_SYMBOLS)


def readout_after_deletion(shares_v: bool, shares_w: bool) -> tuple[sp.Expr, sp.Expr, sp.Expr]:
    """Limiting read-out after deleting the winner of feature 1 (U), with the losers at exactly 0.

    The deleted head takes all of w1 and, if it also won feature 2 (V) or 3 (W), that weight too.
    """
    w_opt = optimum_vector()
    return (sp.S(0), sp.S(0) if shares_v else w_opt[1], sp.S(0) if shares_w else w_opt[2])


def deletion_cases(heads: int = 3) -> list[dict[str, object]]:
    """Risk changes from deleting feature 1's winner, for each way it can share features 2 and 3.

    Each case's probability counts the equally likely winner triples (h_U, h_V, h_W) in which U's winner does or does
    not also win V and W; event E (:func:`event_E`) is the case where it wins neither.
    """
    before = risks_at(optimum_vector())
    triples = list(itertools.product(range(heads), repeat=3))
    cases = []
    for shares_v, shares_w in itertools.product((False, True), repeat=2):
        members = [tr for tr in triples if (tr[0] == tr[1]) == shares_v and (tr[0] == tr[2]) == shares_w]
        after = risks_at(readout_after_deletion(shares_v, shares_w))
        cases.append(
            {
                "shares_V": shares_v,
                "shares_W": shares_w,
                "event_E": all(event_E(tr) for tr in members),
                "probability": sp.Rational(len(members), len(triples)),
                "R_A_after": after["R_A"],
                "R_B_after": after["R_B"],
                "delta_R_A": sp.factor(after["R_A"] - before["R_A"]),
                "delta_R_B": sp.factor(after["R_B"] - before["R_B"]),
                "delta_objective": sp.factor(after["objective"] - before["objective"]),
            }
        )
    return cases


def deletion_effects_with_losers() -> dict[str, sp.Expr]:
    """Exact risk changes on E when the losers are not exactly zero.

    At the exact optimum, deleting the winner h* of feature 1 leaves
    w = (eps, b - d2, c - d3): eps is the other heads' total on feature 1 and d2, d3 are h*'s
    own (losing) coefficients on features 2 and 3.  All three are O(alpha^4) by Theorem 4.2.
    """
    eps, d2, d3 = sp.symbols("epsilon delta_2 delta_3", real=True)
    w_opt = optimum_vector()
    before = risks_at(w_opt)
    after = risks_at((eps, w_opt[1] - d2, w_opt[2] - d3))
    return {
        "delta_R_A": sp.expand(after["R_A"] - before["R_A"]),
        "delta_R_B": sp.expand(after["R_B"] - before["R_B"]),
        "symbols": (eps, d2, d3),
    }


def event_E(winners: tuple[int, int, int]) -> bool:
    """E: the winner of the conflicting feature (U) wins neither V nor W."""
    return winners[0] not in (winners[1], winners[2])


def prob_E_enumeration(heads: int = 3) -> sp.Rational:
    """Pr(E) by counting the equally likely winner triples."""
    triples = list(itertools.product(range(heads), repeat=3))
    return sp.Rational(sum(event_E(tr) for tr in triples), len(triples))


def prob_E_stats(heads: int = 3) -> sp.Expr:
    """Pr(E) with sympy.stats, the winners as independent uniform random variables."""
    h_u, h_v, h_w = (DiscreteUniform(name, list(range(heads))) for name in ("H_U", "H_V", "H_W"))
    return P(sp.And(sp.Ne(h_u, h_v), sp.Ne(h_u, h_w)))


def balanced_factor_solution() -> sp.Eq:
    """Solution of dx/dtau = x^3, x(0) = x0: one head's factor in the small-weight regime.

    For small weights tanh(qk) ~ qk, so a head with four equal factors x has c = x^4 and gradient flow
    gives dx/dt = r(t) x^3, with r the feature's residual times its rate.  On the clock
    tau = integral of r dt that all heads of a feature share, dx/dtau = x^3.
    """
    tau = sp.Symbol("tau", nonnegative=True)
    x0 = sp.Symbol("x_0", positive=True)
    x = sp.Function("x")
    sol = sp.dsolve(sp.Eq(x(tau).diff(tau), x(tau) ** 3), x(tau), ics={x(0): x0})
    # dsolve returns both branches of the square root; keep the one through x0 > 0.
    sols = sol if isinstance(sol, list) else [sol]
    (positive,) = [s for s in sols if sp.simplify(s.rhs.subs(tau, 0) - x0) == 0]
    return positive


def escape_time(x0: sp.Expr) -> sp.Expr:
    """Blow-up clock time tau* = 1 / (2 x0^2) of the balanced factor: the end of the plateau."""
    tau = sp.Symbol("tau", nonnegative=True)
    x0_sym = sp.Symbol("x_0", positive=True)
    rhs = balanced_factor_solution().rhs
    (tau_star,) = sp.solve(sp.Eq(1 / rhs**2, 0), tau)
    return tau_star.subs(x0_sym, x0)


def loser_coefficient_at_escape(x_win: sp.Expr, x_lose: sp.Expr) -> sp.Expr:
    """A losing head's c = x^4 at the clock time when the winner (larger x0) escapes.

    With x0 = alpha * xi this is alpha^4 times a function of the xi's that blows up only as the two
    heads tie, which is Theorem 4.2's order alpha^4 and its near-tie caveat.
    """
    tau = sp.Symbol("tau", nonnegative=True)
    x0_sym = sp.Symbol("x_0", positive=True)
    rhs = balanced_factor_solution().rhs.subs(x0_sym, x_lose)
    return sp.simplify((rhs**4).subs(tau, escape_time(x_win)))
