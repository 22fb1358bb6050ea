"""The ``cryptd`` command itself: --version, help on a bare ``cryptd``, shell completion,
refusal of options an operation does not take, the hint where no credential file is found,
and optional dependencies checked before any work."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from service import __version__
from service.cli import main
from service.cli.call import KEY_COMMANDS, OPERATIONS, OPTIONS

ROOT = Path(__file__).resolve().parents[1]


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"cryptd {__version__}"


def test_bare_cryptd_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2  # argparse's status for a usage without a command
    out, err = capsys.readouterr()
    assert err == ""
    assert out.startswith("usage: cryptd")
    for command in ("serve", "keys", "call", "bench", "completion"):
        assert f"    {command}" in out


@pytest.mark.parametrize(("group", "action"), [("keys", "rotate"), ("clients", "add")])
def test_a_command_group_alone_prints_its_help(
    group: str, action: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([group]) == 2
    out, err = capsys.readouterr()
    assert err == ""
    assert out.startswith(f"usage: cryptd {group}")
    assert action in out


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["random", "--data", "x"], "'random' does not take --data (its options: --bytes)"),
        (["encrypt", "k", "--bits", "128"], "'encrypt' does not take --bits"),
        (["keys", "--type", "aes256-gcm"], "'keys' does not take --type (its options: none)"),
        (["decrypt", "k", "--digest", "00"], "'decrypt' does not take --digest"),
        (["create", "k", "--type", "aes256-gcm", "--raw"], "'create' does not take --raw"),
        (["rotate", "k", "--deletion-allowed", "false"], "--deletion-allowed"),
        (["random", "extra", "--bytes", "8"], "'random' takes no key name (got 'extra')"),
    ],
)
def test_call_refuses_what_the_operation_does_not_take(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["call", *argv, "--credential", str(tmp_path / "unused.json")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert named in err
    assert err.count("\n") <= 3  # a short usage line and the error, not the full help


def test_every_operation_has_its_option_list() -> None:
    with_options = set(OPTIONS)
    assert with_options <= set(OPERATIONS + KEY_COMMANDS)
    # Operations missing from OPTIONS take no option at all: each is one that reads nothing.
    assert set(OPERATIONS + KEY_COMMANDS) - with_options == {
        "keys",
        "key",
        "delete",
        "cancel-deletion",
        "rotate",
        "wrapping-key",
        "backup",
        "encapsulate",
    }


def test_missing_credential_names_where_and_how(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CRYPTD_DEV_DIR", raising=False)
    monkeypatch.delenv("CRYPTD_CREDENTIAL", raising=False)
    assert main(["call", "random"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "No such file" not in err
    assert f"{tmp_path}/.cryptd-dev/client.json" in err  # where it looked, in full
    for hint in ("--credential", "CRYPTD_CREDENTIAL", "CRYPTD_DEV_DIR", "cryptd serve --dev"):
        assert hint in err

    monkeypatch.setenv("CRYPTD_CREDENTIAL", str(tmp_path / "named.json"))
    assert main(["call", "random"]) == 2
    assert f"no credential file at {tmp_path}/named.json" in capsys.readouterr().err


def test_call_reports_a_broken_credential_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    cases = {
        '{"url": "localhost:8080", "client_id": "a", "secret": "AAAA"}': "http:// or https://",
        '{"url": "http://h:1", "client_id": "a", "secret": "not base64!"}': "not valid base64",
        '{"url": "http://h:1", "secret": "AAAA"}': "no client_id",
        "[1, 2]": "not a JSON object",
        "{": "not a JSON credential file",
    }
    for number, (text, message) in enumerate(cases.items()):
        path = tmp_path / f"credential-{number}.json"
        path.write_text(text)
        assert main(["call", "random", "--credential", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"cryptd: error: {path}: ")
        assert message in err
        assert err.count("\n") == 1
        assert "not base64!" not in err  # a secret is never echoed


def test_completion_scripts(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("shtab")  # the completion extra; the test extra has it
    for shell in ("bash", "zsh", "tcsh"):
        assert main(["completion", shell]) == 0
        script = capsys.readouterr().out
        for word in ("serve", "call", "encrypt", "wrapping-key", "--credential", "--chart"):
            assert word in script, (shell, word)


@pytest.mark.slow  # runs bash and the command
def test_bash_completion_completes_commands_and_operations(tmp_path: Path) -> None:
    pytest.importorskip("shtab")
    bash = shutil.which("bash")
    assert bash is not None
    script = tmp_path / "cryptd.bash"
    done = subprocess.run(
        [sys.executable, "-m", "service", "completion", "bash"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    script.write_text(done.stdout)
    probe = f"""
source {script}
complete_words() {{ COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1)); COMP_LINE="$*"
  COMP_POINT=${{#COMP_LINE}}; COMPREPLY=(); _shtab_cryptd; printf '%s\\n' "${{COMPREPLY[@]}}"; }}
echo "--- commands"; complete_words cryptd ca
echo "--- operations"; complete_words cryptd call wr
echo "--- options"; complete_words cryptd call encrypt k --cred
"""
    answer = subprocess.run(
        [bash, "-c", probe], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    commands, operations, options = answer.split("--- ")[1:]
    assert commands.split()[1:] == ["call"]
    assert operations.split()[1:] == ["wrapping-key"]
    assert options.split()[1:] == ["--credential"]


def test_completion_without_shtab_names_the_extra(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "shtab", None)  # what a missing module does to import
    assert main(["completion", "bash"]) == 2
    err = capsys.readouterr().err
    assert err == "cryptd: error: shell completion needs shtab: pip install 'cryptd[completion]'\n"


# A real process in which matplotlib cannot be imported: a module of that name earlier on
# PYTHONPATH that raises ImportError, as an environment without the charts extra does.
def _without_matplotlib(tmp_path: Path) -> dict[str, str]:
    shadow = tmp_path / "shadow" / "matplotlib"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    path = os.pathsep.join(filter(None, [str(shadow.parent), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


@pytest.mark.slow
@pytest.mark.parametrize(
    "command",
    [
        ["-m", "service", "bench", "--chart", "{out}"],
        ["-m", "loadtest.algorithms", "--chart", "{out}"],
        ["-m", "loadtest.run", "--chart", "{out}"],
        ["-m", "loadtest.charts", "results.json", "{out}"],
    ],
    ids=["cryptd-bench", "loadtest.algorithms", "loadtest.run", "loadtest.charts"],
)
def test_chart_commands_check_matplotlib_first(command: list[str], tmp_path: Path) -> None:
    out = tmp_path / "chart.png"
    env = _without_matplotlib(tmp_path)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, *(part.format(out=out) for part in command)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    elapsed = time.monotonic() - started
    assert done.returncode == 2, done.stdout + done.stderr
    error = done.stderr.strip().splitlines()[-1]
    assert "needs matplotlib" in error
    assert "pip install 'cryptd[charts]'" in error
    assert "Traceback" not in done.stderr
    assert done.stdout == ""  # nothing was measured
    assert not out.exists()
    assert elapsed < 30  # refused before the work (the benchmark itself takes minutes)
