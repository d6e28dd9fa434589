"""Publish the built book to a ``gh-pages`` branch with ghp-import: ``make publish REMOTE=<remote or URL>``.

GitHub Pages serves a project's site from that branch under ``https://<owner>.github.io/<repo>/``, a sub-path, which
the book's relative links handle. The branch gets a ``.nojekyll`` file: without it GitHub's Jekyll step would drop
every folder whose name starts with an underscore, ``_static/`` (the theme, MathJax, plotly.js) among them. Each
publication replaces the branch (no history: the site is rebuilt from ``main`` every time, and old builds are not
worth keeping in the repository).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

BRANCH = "gh-pages"


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed in {repo}: {done.stderr.strip()}")
    return done.stdout.strip()


def publish_command(site: Path, remote: str, branch: str = BRANCH, message: str = "") -> list[str]:
    """The ghp-import command line: import ``site`` as the whole of ``branch``, with .nojekyll, and force-push it."""
    return [sys.executable, "-m", "ghp_import", "--no-jekyll", "--push", "--force", "--no-history",
            "--remote", remote, "--branch", branch, "--message", message or "Publish the book", str(site)]


def publish(site: str | Path, remote: str, branch: str = BRANCH) -> str:
    """Push the built site in ``site`` to ``branch`` of ``remote`` (a remote's name or a URL) from the git repository
    that holds ``site``; returns the commit of the published branch."""
    site = Path(site).resolve()
    if not (site / "index.html").is_file():
        raise FileNotFoundError(f"no built book in {site} (no index.html): run `make book` first")
    if not remote:
        raise ValueError("name the remote to publish to: make publish REMOTE=<remote name or URL>")
    repo = Path(_git(site, "rev-parse", "--show-toplevel"))
    try:
        source = _git(repo, "describe", "--always", "--dirty")
    except RuntimeError:  # a repository with no commit yet
        source = "an uncommitted tree"
    # ghp-import drops the history only when it can read the remote's branch by name; with a URL it would stack the
    # new commit on the local branch of the last publication, so start that branch afresh.
    subprocess.run(["git", "update-ref", "-d", f"refs/heads/{branch}"], cwd=repo, capture_output=True)
    done = subprocess.run(publish_command(site, remote, branch, f"Publish the book built from {source}"), cwd=repo,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ghp-import failed (exit {done.returncode}): {(done.stderr or done.stdout).strip()}")
    return _git(repo, "rev-parse", branch)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cel_utils.book.publish", description=__doc__.splitlines()[0])
    parser.add_argument("--remote", required=True, help="git remote name or URL to push the site to")
    parser.add_argument("--site", default="_build/html", help="the built site (default: _build/html)")
    parser.add_argument("--branch", default=BRANCH, help=f"branch to publish to (default: {BRANCH})")
    args = parser.parse_args(argv)
    try:
        commit = publish(args.site, args.remote, args.branch)
    except (FileNotFoundError, ValueError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"published {args.site} to {args.branch} of {args.remote} (commit {commit[:12]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
