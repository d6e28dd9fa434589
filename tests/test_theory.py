"""Tests of the toy-model derivation (cel_utils.theory.derivation) and its simulator (cel_utils.theory.simulation).

The expected closed forms below are written out by hand from the model's definition, not taken from
the code under test.
"""
import math

import numpy as np
import pytest
import sympy as sp
from sympy.stats import E as expectation
from sympy.stats import Rademacher

from cel_utils.theory import derivation as th
from cel_utils.theory import simulation as ts

a, b, c = th.a, th.b, th.c
w1, w2, w3 = th.W_SYMBOLS


def same(x: sp.Expr, y: sp.Expr) -> bool:
    return sp.simplify(sp.expand(x - y)) == 0


# --- symbolic derivation ------------------------------------------------------------------------


def test_task_risks_closed_form():
    risk_a, risk_b = th.task_risks()
    assert same(risk_a, w1**2 + (w2 - b) ** 2)
    assert same(risk_b, (w1 - a) ** 2 + (w3 - c) ** 2)


def test_task_risks_agree_with_sympy_stats_expectation():
    u, v, w = Rademacher("U"), Rademacher("V"), Rademacher("W")
    risk_a, risk_b = th.task_risks()
    assert same(risk_a, expectation((w1 * u + w2 * v - b * v) ** 2))
    assert same(risk_b, expectation((w1 * u + w3 * w - a * u - c * w) ** 2))


def test_objective_gradient_hessian_and_optimum():
    assert same(th.joint_objective(), (w1**2 + (w2 - b) ** 2 + (w1 - a) ** 2 + (w3 - c) ** 2) / 4)
    grad = th.objective_gradient()
    for got, want in zip(grad, (w1 - a / 2, (w2 - b) / 2, (w3 - c) / 2)):
        assert same(got, want)
    assert th.objective_hessian() == sp.diag(1, sp.Rational(1, 2), sp.Rational(1, 2))
    assert th.optimum() == {w1: a / 2, w2: b, w3: c}


def test_risks_at_optimum_are_t_squared():
    risks = th.risks_at(th.optimum_vector())
    assert same(risks["R_A"], a**2 / 4)
    assert same(risks["R_B"], a**2 / 4)
    assert same(risks["objective"], a**2 / 8)
    t = th.t_symbol
    assert th.in_terms_of_t(risks["R_A"]) == t**2
    assert th.in_terms_of_t(risks["objective"]) == t**2 / 2


@pytest.mark.parametrize("heads", [2, 3, 4])
def test_deletion_case_probabilities_count_the_winner_triples(heads):
    # U's winner also wins V with probability 1/H, and W independently with 1/H (each winner uniform over H heads).
    share, avoid = sp.Rational(1, heads), sp.Rational(heads - 1, heads)
    cases = {(cs["shares_V"], cs["shares_W"]): cs for cs in th.deletion_cases(heads)}
    for (shares_v, shares_w), cs in cases.items():
        assert cs["probability"] == (share if shares_v else avoid) * (share if shares_w else avoid)
        assert cs["event_E"] == (not shares_v and not shares_w)
    # E's case carries exactly the probability of E, computed two other ways
    assert cases[(False, False)]["probability"] == th.prob_E_enumeration(heads) == th.prob_E_stats(heads)


def test_deletion_cases():
    cases = {(cs["shares_V"], cs["shares_W"]): cs for cs in th.deletion_cases()}
    on_e = cases[(False, False)]
    # On E: w goes from (a/2, b, c) to (0, b, c).
    assert on_e["R_A_after"] == 0
    assert same(on_e["R_B_after"], a**2)
    assert same(on_e["delta_R_A"], -(a**2) / 4)  # -t^2
    assert same(on_e["delta_R_B"], 3 * a**2 / 4)  # +3 t^2
    assert same(on_e["delta_objective"], a**2 / 8)  # +t^2 / 2
    # Sharing V as well: w -> (0, 0, c), so R_A = b^2.
    assert same(cases[(True, False)]["R_A_after"], b**2)
    # Sharing W as well: w -> (0, b, 0), so R_B = a^2 + c^2.
    assert same(cases[(False, True)]["R_B_after"], a**2 + c**2)


def test_deletion_effects_with_losers():
    out = th.deletion_effects_with_losers()
    eps, d2, d3 = out["symbols"]
    assert same(out["delta_R_A"], eps**2 + d2**2 - a**2 / 4)
    assert same(out["delta_R_B"], (eps - a) ** 2 + d3**2 - a**2 / 4)


def test_readout_identities():
    assert th.readout_identity_residual() == 0
    assert th.pair_readout_residual() == 0
    # And numerically, against softmax written out directly.
    qv, kv, vv = 0.7, -1.3, 2.1
    p_plus = math.exp(qv * kv) / (math.exp(qv * kv) + math.exp(-qv * kv))
    direct = vv * p_plus - vv * (1 - p_plus)
    assert float(th.pair_softmax_readout(qv, kv, vv)) == pytest.approx(direct, rel=1e-12)
    assert direct == pytest.approx(vv * math.tanh(qv * kv), rel=1e-12)


@pytest.mark.parametrize("heads", [2, 3, 4])
def test_prob_E(heads):
    # U's winner must avoid V's and W's winners, each independently: ((H - 1) / H)^2.
    want = sp.Rational(heads - 1, heads) ** 2
    assert th.prob_E_enumeration(heads) == want
    assert th.prob_E_stats(heads) == want


def test_balanced_race():
    sol = th.balanced_factor_solution()
    tau, x0 = sp.Symbol("tau", nonnegative=True), sp.Symbol("x_0", positive=True)
    x = sol.rhs
    assert sp.simplify(sp.diff(x, tau) - x**3) == 0
    assert sp.simplify(x.subs(tau, 0) - x0) == 0
    y = sp.Symbol("y", positive=True)
    assert sp.simplify(th.escape_time(y) - 1 / (2 * y**2)) == 0
    alpha, xw, xl = sp.symbols("alpha xi_w xi_l", positive=True)
    got = th.loser_coefficient_at_escape(alpha * xw, alpha * xl)
    assert sp.simplify(got - alpha**4 * xw**4 * xl**4 / (xw**2 - xl**2) ** 2) == 0


# --- numerical pieces against the algebra and against autograd ------------------------------------


def test_numeric_risks_match_sympy():
    rng = np.random.default_rng(1)
    w = rng.normal(size=(5, 3))
    av, bv, cv = 1.3, 0.4, 2.2
    risk_a, risk_b = th.task_risks()
    f_a = sp.lambdify((w1, w2, w3, a, b, c), risk_a)
    f_b = sp.lambdify((w1, w2, w3, a, b, c), risk_b)
    got_a, got_b = ts.task_risks(w, av, bv, cv)
    np.testing.assert_allclose(got_a, f_a(*w.T, av, bv, cv), rtol=1e-12)
    np.testing.assert_allclose(got_b, f_b(*w.T, av, bv, cv), rtol=1e-12)


def test_population_gradient_matches_autograd():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    params = rng.normal(scale=0.8, size=(4, 6, 3, 3))
    av, bv, cv = 1.1, 0.7, 1.9
    p = torch.tensor(params, dtype=torch.float64, requires_grad=True)
    q, k, v, o = p
    w = (o * v * torch.tanh(q * k)).sum(dim=1)
    loss = (w[:, 0] ** 2 + (w[:, 1] - bv) ** 2 + (w[:, 0] - av) ** 2 + (w[:, 2] - cv) ** 2) / 4
    loss.sum().backward()
    got = ts.population_gradient(params, av, bv, cv)
    np.testing.assert_allclose(got, p.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_population_gradient_matches_finite_differences():
    rng = np.random.default_rng(3)
    params = rng.normal(scale=0.5, size=(4, 2, 3, 3))
    av, bv, cv = 1.0, 1.5, 2.0
    grad = ts.population_gradient(params, av, bv, cv)
    h = 1e-6
    for idx in [(0, 0, 1, 2), (1, 1, 0, 0), (2, 0, 2, 1), (3, 1, 1, 2)]:
        up, down = params.copy(), params.copy()
        up[idx] += h
        down[idx] -= h
        seed = idx[1]
        f = lambda pr: ts.joint_objective(ts.coefficients(pr).sum(axis=1), av, bv, cv)[seed]
        assert grad[idx] == pytest.approx((f(up) - f(down)) / (2 * h), rel=1e-6, abs=1e-9)


def test_one_training_step_is_gradient_descent():
    cfg = ts.SimConfig(seeds=7, steps=1, lr=0.3)
    start = ts.init_params(cfg.seeds, cfg.alpha, np.random.default_rng(cfg.random_seed))
    result = ts.train(cfg)
    want = start - cfg.lr * ts.population_gradient(start, cfg.a, cfg.b, cfg.c)
    np.testing.assert_allclose(result.params, want, rtol=1e-13, atol=1e-16)


def test_wilson_interval_known_value():
    # Wilson 95% interval for 50 of 100: 0.4038 to 0.5962 (standard tables).
    lo, hi = ts.wilson_interval(50, 100)
    assert lo == pytest.approx(0.4038, abs=1e-4)
    assert hi == pytest.approx(0.5962, abs=1e-4)


def test_winner_tests_detect_dependence():
    rng = np.random.default_rng(4)
    independent = rng.integers(0, 3, size=(3000, 3))
    assert ts.winner_tests(independent)["p"].min() > 1e-4
    tied = np.repeat(rng.integers(0, 3, size=(3000, 1)), 3, axis=1)
    assert ts.winner_tests(tied).loc["winners of U, V independent", "p"] < 1e-10


# --- the simulator reproduces the theory ---------------------------------------------------------


@pytest.fixture(scope="module")
def sim() -> ts.SimResult:
    return ts.train(ts.SimConfig(seeds=600, random_seed=11))


def test_simulation_converges_to_optimum(sim):
    cfg = sim.config
    assert not sim.diverged.any()
    assert ts.converged_mask(sim).mean() > 0.99
    np.testing.assert_allclose(np.median(sim.w, axis=0), [cfg.a / 2, cfg.b, cfg.c], atol=1e-8)
    assert np.median(sim.grad_norm) < 1e-10
    # Theorem 4.2: the runner-up head stays near the alpha^4 scale (median, not every seed).
    assert np.median(sim.loser_ratio) < 10 * cfg.alpha**4


def test_simulation_event_rate_matches_four_ninths(sim):
    lo, hi = ts.wilson_interval(int(sim.event_E.sum()), sim.config.seeds)
    assert lo < 4 / 9 < hi


def test_simulation_deletion_effects_on_E(sim):
    t2 = sim.config.t ** 2
    sel = sim.event_E & ts.converged_mask(sim)
    np.testing.assert_allclose(sim.risk_A[sel], t2, rtol=1e-6)
    np.testing.assert_allclose(sim.risk_B[sel], t2, rtol=1e-6)
    assert np.median(sim.risk_A_deleted[sel] - sim.risk_A[sel]) == pytest.approx(-t2, rel=1e-3)
    assert np.median(sim.risk_B_deleted[sel] - sim.risk_B[sel]) == pytest.approx(3 * t2, rel=1e-2)


def test_simulation_is_deterministic():
    cfg = ts.SimConfig(seeds=50, steps=300, n_traces=2)
    first, second = ts.train(cfg), ts.train(cfg)
    np.testing.assert_array_equal(first.params, second.params)
    np.testing.assert_array_equal(first.trace, second.trace)
    np.testing.assert_array_equal(first.escape_step, second.escape_step)
    other = ts.train(ts.SimConfig(seeds=50, steps=300, random_seed=1))
    assert not np.array_equal(first.params, other.params)
