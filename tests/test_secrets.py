"""Secrets kept off the command line (issue 54): `--auth-file`, `--api-token-file` and their environment variables
give the login and the token as `--auth` and `--api-token` do, a secret given in argv (where every user of the
machine reads it in `ps`) is used with a warning, and every bad file gets a message naming it and the fix."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from app.cli import build_parser
from app.cli.serve import _check_serve_arguments, _secrets_from_files
from moco.errors import UserError

ROOT = Path(__file__).resolve().parents[1]


def _secret(tmp_path: Path, name: str, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / name
    path.write_text(text)
    path.chmod(mode)
    return path


@pytest.mark.parametrize("command", [["serve", "IDX"], ["run", "PHOTOS"]])
def test_files_give_the_login_and_the_token_without_a_warning(tmp_path, capsys, monkeypatch, command):
    for env in ("MOCO_AUTH", "MOCO_API_TOKEN", "MOCO_AUTH_FILE", "MOCO_API_TOKEN_FILE"):
        monkeypatch.delenv(env, raising=False)
    login = _secret(tmp_path, "login", "alice:pass:with:colons\n")
    token = _secret(tmp_path, "token", "tok-0123456789abcdef\r\nsecond line ignored\n")
    args = build_parser().parse_args([*command, "--auth-file", str(login), "--api-token-file", str(token)])
    assert _check_serve_arguments(args) == ("alice", "pass:with:colons")
    assert args.api_token == "tok-0123456789abcdef"
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("MOCO_AUTH_FILE", str(login))  # the environment names the file (a Docker secret)
    monkeypatch.setenv("MOCO_API_TOKEN_FILE", str(token))
    args = build_parser().parse_args(command)
    assert _check_serve_arguments(args) == ("alice", "pass:with:colons") and args.api_token == "tok-0123456789abcdef"


def test_a_secret_in_argv_works_and_warns_and_one_in_the_environment_does_not(capsys, monkeypatch):
    monkeypatch.delenv("MOCO_AUTH_FILE", raising=False)
    monkeypatch.delenv("MOCO_API_TOKEN_FILE", raising=False)
    monkeypatch.setenv("MOCO_API_TOKEN", "env-token-0123456789")
    args = build_parser().parse_args(["serve", "IDX", "--auth", "bob:secret-123"])
    assert _check_serve_arguments(args) == ("bob", "secret-123") and args.api_token == "env-token-0123456789"
    err = capsys.readouterr().err
    assert "WARNING: --auth on the command line" in err and "--auth-file FILE" in err and "--api-token" not in err
    args = build_parser().parse_args(["serve", "IDX", "--api-token", "argv-token-0123456789"])
    _secrets_from_files(args)
    assert "WARNING: --api-token on the command line" in capsys.readouterr().err


def test_bad_secret_files_are_refused_naming_the_file_and_the_fix(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MOCO_AUTH", raising=False)
    monkeypatch.delenv("MOCO_AUTH_FILE", raising=False)
    cases = [(str(tmp_path / "missing"), "cannot read it"),
             (str(_secret(tmp_path, "empty", "\nalice:pass\n")), "its first line is empty"),
             (str(tmp_path), "cannot read it")]  # a folder
    for path, words in cases:
        args = build_parser().parse_args(["serve", "IDX", "--auth-file", path])
        with pytest.raises(UserError, match=re.escape(f"--auth-file {path}: {words}")):
            _check_serve_arguments(args)
    both = build_parser().parse_args(["serve", "IDX", "--auth", "a:b", "--auth-file",
                                      str(_secret(tmp_path, "ok", "a:b"))])
    with pytest.raises(UserError, match="--auth and --auth-file both give the secret"):
        _check_serve_arguments(both)
    shared = _secret(tmp_path, "shared", "alice:pass\n", mode=0o644)
    args = build_parser().parse_args(["serve", "IDX", "--auth-file", str(shared)])
    assert _check_serve_arguments(args) == ("alice", "pass")  # used, but said
    assert f"--auth-file {shared} can be read by other users (mode 644): chmod 600" in capsys.readouterr().err
    assert os.stat(shared).st_mode & 0o777 == 0o644  # the user's file is left as it was


def test_no_secret_is_put_on_a_command_line_in_the_readme_or_the_dockerfile():
    for name in ("README.md", "Dockerfile", *[p.name for p in ROOT.glob("compose*.y*ml")]):
        text = (ROOT / name).read_text()
        assert not re.findall(r"--(?:auth|api-token)[ =](?!FILE)\S+", text), name
        assert not re.findall(r"-e MOCO_(?:AUTH|API_TOKEN)=", text), name  # docker run -e shows in ps too
