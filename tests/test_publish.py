"""`python -m harness publish` against a real HTTP server on loopback that records every request.

The server (`FakeGitHub`, a test double of the few GitHub REST endpoints publishing uses) keeps an issue's
comments in memory, so a second night must find its own comment by the marker and PATCH it.
"""

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from harness.cli import main
from harness.commands import publish

REPO, ISSUE, TOKEN = "octo/bits", 7, "test-token-123"
LIST = f"/repos/{REPO}/issues/{ISSUE}/comments?per_page=100&page="
HEADERS = {"Accept": "application/vnd.github+json", "Authorization": f"Bearer {TOKEN}",
           "X-GitHub-Api-Version": "2022-11-28", "User-Agent": "bitwise-harness"}
JSON_HEADERS = {**HEADERS, "Content-Type": "application/json"}
MARK = "<!-- bitwise-harness: nightly-cpu -->\n"


class FakeGitHub:
    """Issue comments in memory; every request recorded as (method, path, headers, JSON body)."""

    def __init__(self):
        self.comments, self.requests, self.next_id = [], [], 1
        self.fail_status, self.fail_methods = None, {"GET", "POST", "PATCH"}
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                headers = {k: self.headers[k] for k in (*HEADERS, "Content-Type") if k in self.headers}
                fake.requests.append((self.command, self.path, headers, body))
                status, answer = fake.answer(self.command, self.path, body)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PATCH = _handle

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    def answer(self, method, path, body):
        if self.fail_status and method in self.fail_methods:
            return self.fail_status, {"message": "Server Error"}
        if method == "GET" and path.startswith(LIST):
            page = int(path.rsplit("=", 1)[1])
            return 200, self.comments[(page - 1) * 100: page * 100]
        if method == "POST" and path == f"/repos/{REPO}/issues/{ISSUE}/comments":
            comment = {"id": self.next_id, "body": body["body"], "html_url": f"https://example.test/c/{self.next_id}"}
            self.next_id += 1
            self.comments.append(comment)
            return 201, comment
        if method == "PATCH" and path.startswith(f"/repos/{REPO}/issues/comments/"):
            comment = next(c for c in self.comments if c["id"] == int(path.rsplit("/", 1)[1]))
            comment["body"] = body["body"]
            return 200, comment
        return 404, {"message": "Not Found"}


@pytest.fixture
def github(monkeypatch):
    monkeypatch.setenv("GITHUB_TOKEN", TOKEN)
    fake = FakeGitHub()
    fake.thread.start()
    yield fake
    fake.server.shutdown()
    fake.server.server_close()


def night_dir(tmp_path, name, markdown):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "report.md").write_text(markdown)
    (folder / "report.json").write_text(json.dumps({"kind": "nightly", "device": "cpu"}))
    return folder


def publish_cli(folder, github, *extra):
    return main(["publish", str(folder), "--repo", REPO, "--issue", str(ISSUE), "--api-url", github.url, *extra])


def test_first_night_posts_one_comment(github, tmp_path):
    folder = night_dir(tmp_path, "night1", "# night 1\n")
    assert publish_cli(folder, github) == 0
    assert github.requests == [
        ("GET", LIST + "1", HEADERS, None),
        ("POST", f"/repos/{REPO}/issues/{ISSUE}/comments", JSON_HEADERS, {"body": MARK + "# night 1\n"}),
    ]
    assert [c["body"] for c in github.comments] == [MARK + "# night 1\n"]
    assert "created comment 1 on octo/bits#7" in (folder / "publish.log").read_text()


def test_second_night_updates_the_same_comment(github, tmp_path):
    github.comments.append({"id": 50, "body": "a person's comment", "html_url": ""})
    github.next_id = 51
    assert publish_cli(night_dir(tmp_path, "night1", "# night 1\n"), github) == 0
    github.requests.clear()
    assert publish_cli(night_dir(tmp_path, "night2", "# night 2\n"), github) == 0
    assert github.requests == [
        ("GET", LIST + "1", HEADERS, None),
        ("PATCH", f"/repos/{REPO}/issues/comments/51", JSON_HEADERS, {"body": MARK + "# night 2\n"}),
    ]
    assert [c["body"] for c in github.comments] == ["a person's comment", MARK + "# night 2\n"]


def test_marker_found_on_a_later_page(github, tmp_path):
    github.comments = [{"id": i, "body": f"chatter {i}"} for i in range(1, 101)] + [{"id": 200, "body": MARK + "old"}]
    assert publish_cli(night_dir(tmp_path, "night", "# new\n"), github) == 0
    assert [(m, p) for m, p, _, _ in github.requests] == [
        ("GET", LIST + "1"), ("GET", LIST + "2"), ("PATCH", f"/repos/{REPO}/issues/comments/200")]


def test_oversized_report_is_trimmed_with_a_link(github, tmp_path):
    lines = [f"| case_{i:05d} | pass | {'x' * 60} |" for i in range(1200)]
    markdown = "# big night\n\n```\nlog\n" + "\n".join(lines) + "\n```\n"
    assert len(markdown) > publish.COMMENT_LIMIT
    artifact = "https://github.com/octo/bits/actions/runs/1/artifacts/2"
    assert publish_cli(night_dir(tmp_path, "big", markdown), github, "--artifact-url", artifact) == 0
    (method, path, headers, body), = github.requests[1:]
    assert (method, path, headers) == ("POST", f"/repos/{REPO}/issues/{ISSUE}/comments", JSON_HEADERS)
    text = body["body"]
    assert len(text) <= publish.COMMENT_LIMIT
    kept = text[len(MARK): text.index("\n```\n\n---\n**Report trimmed**")]
    assert text.startswith(MARK) and markdown.startswith(kept) and kept.endswith("|")  # cut at a line end
    assert text.endswith(f"{len(kept)} of {len(markdown)} characters shown. Full report: "
                         f"[the run's artifact]({artifact}).\n")
    assert text.count("```") % 2 == 0  # the open code block is closed


@pytest.mark.parametrize("failing, status, sent", [
    ({"GET", "POST", "PATCH"}, 500, ["GET"]), ({"POST"}, 502, ["GET", "POST"])])
def test_server_error_keeps_the_report_and_fails(github, tmp_path, capsys, failing, status, sent):
    github.fail_status, github.fail_methods = status, failing
    folder = night_dir(tmp_path, "night", "# night\n")
    assert publish_cli(folder, github) == publish.EXIT_POST_FAILED
    assert [method for method, *_ in github.requests] == sent and github.comments == []
    assert (folder / "report.md").read_text() == "# night\n"
    err = capsys.readouterr().err
    assert f"HTTP {status}" in err and "the report is kept" in err
    assert "error: could not post" in (folder / "publish.log").read_text()


def test_unreachable_server_fails_cleanly(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("GITHUB_TOKEN", TOKEN)
    server = HTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    url = f"http://127.0.0.1:{server.server_port}"
    server.server_close()  # nothing listens there any more
    folder = night_dir(tmp_path, "night", "# night\n")
    assert main(["publish", str(folder), "--repo", REPO, "--issue", "7", "--api-url", url]) == 1
    assert "could not post" in capsys.readouterr().err and (folder / "report.md").exists()


def test_a_single_case_report_gets_its_own_marker(github, tmp_path):
    folder = night_dir(tmp_path, "case", "# fc1\n")
    (folder / "report.json").write_text(json.dumps({"schema": 1, "case_name": "fc1", "device": "gpu"}))
    assert publish_cli(folder, github) == 0
    assert github.comments[0]["body"] == "<!-- bitwise-harness: case-fc1-gpu -->\n# fc1\n"


def test_missing_token_or_report_is_bad_input(github, monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("GITHUB_TOKEN")
    assert publish_cli(night_dir(tmp_path, "night", "# n\n"), github) == publish.EXIT_BAD_INPUT
    assert "GITHUB_TOKEN is not set" in capsys.readouterr().err
    monkeypatch.setenv("GITHUB_TOKEN", TOKEN)
    assert publish_cli(tmp_path / "nowhere", github) == publish.EXIT_BAD_INPUT
    assert "no report to publish" in capsys.readouterr().err
    assert github.requests == []
