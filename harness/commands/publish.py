"""Post a report's Markdown to a GitHub issue or pull request as ONE comment that each night updates.

The comment carries a hidden HTML marker (``<!-- bitwise-harness: MARKER -->``, by default one per device);
a later run finds it in the issue's comments and PATCHes it instead of adding another. A report longer
than GitHub's comment limit is trimmed at a line, with a note and a link to the full report (the artifact).
Posting never touches the report: on an HTTP or network error the Markdown stays on disk, the error goes
to stderr and ``publish.log`` beside the report, and the exit code is nonzero.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

COMMENT_LIMIT = 65536  # GitHub's maximum comment body, in characters
PAGE_SIZE = 100
MAX_PAGES = 50  # 5,000 comments: bounded, so a misbehaving server cannot loop us forever
EXIT_POST_FAILED, EXIT_BAD_INPUT = 1, 2
API_VERSION = "2022-11-28"


class PublishError(Exception):
    """Posting failed; the message names the request and what the server or network said."""


def add_parser(commands) -> None:
    parser = commands.add_parser("publish", help="post a report's Markdown to a GitHub issue or PR (one comment)")
    parser.add_argument("report_dir", type=Path, help="a run directory holding report.md (or the file itself)")
    parser.add_argument("--repo", required=True, help="OWNER/NAME")
    parser.add_argument("--issue", required=True, type=int, help="issue or pull request number")
    parser.add_argument("--api-url", default=os.environ.get("GITHUB_API_URL") or "https://api.github.com")
    parser.add_argument("--artifact-url", help="where the full report lives (linked when the comment is trimmed)")
    parser.add_argument("--marker", help="which comment to keep updating "
                                         "(default: nightly-<device>, or case-<case>-<device>)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per HTTP request")


def main(args) -> int:
    report = args.report_dir / "report.md" if args.report_dir.is_dir() else args.report_dir
    log = Log(report.parent / "publish.log")
    problem = _check_input(args, report)
    if problem:
        log.error(problem)
        return EXIT_BAD_INPUT
    marker = args.marker or _default_marker(report.parent)
    body = comment_body(report.read_text(), marker, args.artifact_url)
    api = GitHubAPI(args.api_url, os.environ["GITHUB_TOKEN"], args.timeout)
    try:
        action, comment = post_or_update(api, args.repo, args.issue, marker, body)
    except PublishError as error:
        log.error(f"could not post {report} to {args.repo}#{args.issue} (the report is kept): {error}")
        return EXIT_POST_FAILED
    log.info(f"{action} comment {comment.get('id')} on {args.repo}#{args.issue}: {comment.get('html_url', '')} "
             f"({len(body)} characters, marker {marker!r})")
    return 0


def comment_body(markdown: str, marker: str, artifact_url: str | None, limit: int = COMMENT_LIMIT) -> str:
    """The marker line, then the report; trimmed at a line boundary (closing any open code block) to fit."""
    head = f"{marker_tag(marker)}\n"
    if len(head) + len(markdown) <= limit:
        return head + markdown
    where = f"[the run's artifact]({artifact_url})" if artifact_url else "the workflow run's artifact"
    note = (f"\n\n---\n**Report trimmed** to fit GitHub's {limit}-character comment limit: "
            f"{{shown}} of {len(markdown)} characters shown. Full report: {where}.\n")
    budget = limit - len(head) - len(note) - len("```\n") - 20  # room for the numbers and a closing fence
    cut = markdown.rfind("\n", 0, budget)
    kept = markdown[: cut if cut > 0 else budget]
    fence = "\n```" if kept.count("```") % 2 else ""
    return head + kept + fence + note.replace("{shown}", str(len(kept)))


def marker_tag(marker: str) -> str:
    return f"<!-- bitwise-harness: {marker} -->"


def post_or_update(api: GitHubAPI, repo: str, issue: int, marker: str, body: str) -> tuple[str, dict]:
    existing = find_comment(api, repo, issue, marker)
    if existing:
        return "updated", api.request("PATCH", f"/repos/{repo}/issues/comments/{existing['id']}", {"body": body})
    return "created", api.request("POST", f"/repos/{repo}/issues/{issue}/comments", {"body": body})


def find_comment(api: GitHubAPI, repo: str, issue: int, marker: str) -> dict | None:
    """The newest comment on the issue carrying the marker, or None."""
    tag, found = marker_tag(marker), None
    for page in range(1, MAX_PAGES + 1):
        comments = api.request("GET", f"/repos/{repo}/issues/{issue}/comments?per_page={PAGE_SIZE}&page={page}")
        if not isinstance(comments, list):
            raise PublishError(f"listing comments of {repo}#{issue}: expected a JSON list (got {comments!r:.200})")
        found = next((c for c in reversed(comments) if tag in (c.get("body") or "")), found)
        if len(comments) < PAGE_SIZE:
            break
    return found


class GitHubAPI:
    """The few REST calls publishing needs, over urllib (no extra dependency)."""

    def __init__(self, base_url: str, token: str, timeout: float):
        self.base_url, self.token, self.timeout = base_url.rstrip("/"), token, timeout

    def request(self, method: str, path: str, payload: dict | None = None):
        headers = {"Accept": "application/vnd.github+json", "Authorization": f"Bearer {self.token}",
                   "X-GitHub-Api-Version": API_VERSION, "User-Agent": "bitwise-harness"}
        data = None
        if payload is not None:
            data = json.dumps(payload).encode()
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(self.base_url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:300]
            raise PublishError(f"{method} {path}: HTTP {error.code} {error.reason}: {detail}") from None
        except (urllib.error.URLError, OSError) as error:
            raise PublishError(f"{method} {self.base_url}{path}: {getattr(error, 'reason', error)}") from None
        try:
            return json.loads(text) if text else {}
        except json.JSONDecodeError:
            raise PublishError(f"{method} {path}: the answer is not JSON: {text[:200]!r}") from None


class Log:
    """Lines to stderr/stdout and appended to publish.log beside the report (best effort: the log is optional)."""

    def __init__(self, path: Path):
        self.path = path

    def info(self, line: str) -> None:
        print(line)
        self._append("ok", line)

    def error(self, line: str) -> None:
        print(f"error: {line}", file=sys.stderr)
        self._append("error", line)

    def _append(self, level: str, line: str) -> None:
        try:
            with open(self.path, "a") as log:
                log.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} {level}: {line}\n")
        except OSError as error:
            print(f"note: cannot write {self.path}: {error}", file=sys.stderr)


def _check_input(args, report: Path) -> str | None:
    if not report.is_file():
        return f"{report}: no report to publish (run `python -m harness nightly` first)"
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", args.repo):
        return f"--repo must be OWNER/NAME (got {args.repo!r})"
    if args.issue <= 0:
        return f"--issue must be a positive issue or pull request number (got {args.issue})"
    if not os.environ.get("GITHUB_TOKEN"):
        return "GITHUB_TOKEN is not set: give a token allowed to write issues (and pull requests)"
    return None


def _default_marker(run_dir: Path) -> str:
    """One comment per device for nightly reports, one per case and device for a single comparison."""
    try:
        report = json.loads((run_dir / "report.json").read_text())
    except (OSError, json.JSONDecodeError):
        return "report"
    if not isinstance(report, dict):
        return "report"
    if report.get("kind") == "nightly":
        return f"nightly-{report.get('device')}"
    return f"case-{report.get('case_name')}-{report.get('device')}"
