"""`ds41gate serve` (what `python -m engine.launcher` was): list, dry-run, and a real start that prints the URL,
serves until the engine exits, and then says so with the log tail and exit code 1."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# healthy for a moment, then gone: the command's serve loop must notice and end
BRIEF_SERVER = textwrap.dedent('''
    import http.server, json, sys, threading, time
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"object": "list", "data": [{"id": "fake"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *args):
            pass
    srv = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    print("brief server up", flush=True)
    time.sleep(3)
    print("brief server leaving", flush=True)
''')


def _serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ds41gates.cli", "serve", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def test_serve_lists_the_shipped_profiles():
    out = _serve("--list")
    assert out.returncode == 0, out.stderr
    assert {"vllm-cpu-fp32", "llamacpp-f32"} <= set(out.stdout.split())


def test_serve_starts_prints_the_url_and_ends_when_the_engine_does(tmp_path):
    script = tmp_path / "brief.py"
    script.write_text(BRIEF_SERVER)
    profile = tmp_path / "brief.toml"
    profile.write_text(f'command = ["{{python}}", "{script}", "{{port}}"]\nserved_model = "fake"\n'
                       f'start_timeout_s = 30\nstop_grace_s = 2\nlog_file = "{tmp_path / "brief.log"}"\n')
    dry = _serve(str(profile), "--dry-run", "--port", "45678")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.split("\n")[0].endswith(f"{script} 45678")
    out = _serve(str(profile))
    assert out.returncode == 1, out.stdout + out.stderr
    url, model, log = out.stdout.strip().split("  ")
    assert url.startswith("http://127.0.0.1:") and model == "model=fake" and log == f"log={tmp_path / 'brief.log'}"
    assert "server exited; log tail:" in out.stderr and "brief server leaving" in out.stderr
