"""The `fineslab` console script: usage, pass-through subcommands, `launch --dry-run`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fineslab.cli import main

REPO = Path(__file__).resolve().parents[2]


def test_usage_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("launch", "slabs", "models", "profile", "ctl", "top"):
        assert name in out


def test_unknown_subcommand_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["frobnicate"]) == 2
    assert "unknown subcommand 'frobnicate'" in capsys.readouterr().err


def test_models_list_passes_through(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "list"]) == 0
    assert "llama-tiny" in capsys.readouterr().out


def test_console_script_runs_launch_dry_run() -> None:
    script = shutil.which("fineslab") or str(Path(sys.executable).parent / "fineslab")
    result = subprocess.run([script, "launch", "--config", "examples/cpu-demo.yaml",
                             "--dry-run"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert "placement by mme" in result.stdout


@pytest.mark.parametrize("tool", ["ctl", "top"])
def test_ctl_and_top_refuse_a_bad_url_or_a_server_that_is_not_a_router(
        tool: str, capsys: pytest.CaptureFixture[str]) -> None:
    import http.server
    import threading

    class NotARouter(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b'{"status": "ok"}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotARouter)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    args = ["list"] if tool == "ctl" else ["--once"]
    try:
        for url, said in (("notaurl", "not an http:// URL"),
                          ("http://127.0.0.1:9", "cannot reach the router"),
                          (f"http://127.0.0.1:{server.server_port}", "as a fineslab router")):
            assert main([tool, "--url", url, *args]) == 1, url
            err = capsys.readouterr().err
            assert said in err and "Traceback" not in err, err
    finally:
        server.shutdown()


@pytest.mark.parametrize(("text", "expected"), [
    ("512M", 512 << 20), ("1.5g", 3 << 29), ("2GiB", 2 << 30), ("64KB", 64 << 10),
    ("1048576", 1 << 20), ("0", 0), ("none", None), ("OFF", None)])
def test_ctl_limit_sizes_parse_in_binary_units(text: str, expected: int | None) -> None:
    from fineslab.ctl import parse_size

    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["12x", "-1M", "nanG", "infG", "", "M", "1e30", "8388608T"])
def test_ctl_limit_refuses_what_is_not_a_size_with_usage_exit_2(
        bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    from fineslab.ctl import main as ctl_main

    with pytest.raises(SystemExit) as exit_info:
        ctl_main(["limit", "some-model", bad])
    assert exit_info.value.code == 2
    assert "size" in capsys.readouterr().err


@pytest.mark.parametrize("body", [b'{"kv_bytes": 9223372036854775808}',
                                  b'{"kv_bytes": 1000000000000000000000000000000}'])
def test_a_limit_over_int64_is_refused_in_words_not_a_500(body: bytes) -> None:
    # It was an OverflowError in the slab table: 500 text/plain (`ctl limit llama-a 1e30`).
    from fineslab.router.admin import BadLimit, parse_limit

    with pytest.raises(BadLimit, match="at most 9223372036854775807"):
        parse_limit(body)
    assert parse_limit(b'{"kv_bytes": 9223372036854775807}') == (1 << 63) - 1


def test_ctl_limit_reads_a_negative_size_as_a_size_and_refuses_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    # Issue #39: `ctl limit llama-a -5M` was read as an option ("size is required").
    from fineslab.ctl import main as ctl_main

    with pytest.raises(SystemExit) as exit_info:
        ctl_main(["limit", "llama-a", "-5M"])
    assert exit_info.value.code == 2
    assert "size '-5M' must be a finite size >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("tool", ["ctl", "top"])
def test_the_help_describes_the_tool_in_a_whole_sentence(
        tool: str, capsys: pytest.CaptureFixture[str]) -> None:
    # Issue #39: `ctl --help`'s description stopped at "(the router's".
    import importlib

    module = importlib.import_module(f"fineslab.{tool}")
    with pytest.raises(SystemExit):
        module.build_parser().parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    first = " ".join(module.__doc__.split("\n\n")[0].split())
    assert first in out and first.endswith((".", ")")), first


def test_python_dash_m_fineslab_is_the_fineslab_command() -> None:
    # Issue #39: `python -m fineslab` did not run.
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "fineslab", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "usage: fineslab {launch," in done.stdout, done.stderr


def _record(shm: Path, fleet: str, launcher: list[int], router: str | None) -> None:
    body: dict[str, object] = {"launcher": launcher, "runtimes": {}, "folders": []}
    if router is not None:
        body["router"] = router
    (shm / f"fineslab-{fleet}.run").write_text(json.dumps(body))


def test_ctl_finds_the_one_running_fleet_without_url(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`fineslab ctl` and `top` needed --url once a fleet's port was not 8000 (#39 finding 5):
    they now read the running launchers' records."""
    from fineslab.ctl import DEFAULT_URL, CtlError, router_url
    from fineslab.proctree import ProcessIdentity

    monkeypatch.delenv("FINESLAB_FLEET_URL", raising=False)
    me = ProcessIdentity.current()
    assert router_url(None, tmp_path) == DEFAULT_URL, "nothing running: the default port"
    _record(tmp_path, "gone", [me.pid, me.start_ticks + 1], "http://127.0.0.1:1")  # pid reused
    _record(tmp_path, "starting", [me.pid, me.start_ticks], None)  # no router yet
    assert router_url(None, tmp_path) == DEFAULT_URL
    _record(tmp_path, "demo", [me.pid, me.start_ticks], "http://127.0.0.1:8123")
    assert router_url(None, tmp_path) == "http://127.0.0.1:8123"
    assert router_url("http://x:1", tmp_path) == "http://x:1", "--url wins"
    monkeypatch.setenv("FINESLAB_FLEET_URL", "http://y:2")
    assert router_url(None, tmp_path) == "http://y:2", "then $FINESLAB_FLEET_URL"
    monkeypatch.delenv("FINESLAB_FLEET_URL")
    _record(tmp_path, "other", [me.pid, me.start_ticks], "http://127.0.0.1:8124")
    with pytest.raises(CtlError, match="several fleets") as refused:
        router_url(None, tmp_path)
    assert "demo http://127.0.0.1:8123" in str(refused.value)
    assert "other http://127.0.0.1:8124" in str(refused.value)
