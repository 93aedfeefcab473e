"""Every command shown in README.md and docs/ is run or parsed here, so none drifts from the code.

- A transcript block (lines starting ``$ rlx-mpi plan``, each followed by its output) is run in
  process and its output compared line for line: the numbers a user sizes an allocation with
  are the planner's own.
- Every other ``rlx-mpi ...`` line in a fenced block (under ``mpiexec``/``srun`` or not) is parsed
  by the CLI's own parser, and the repository files it names (job files, prompt files, sbatch
  scripts) must exist.
- README's test command is the one ``.ci/run`` runs.
- Every relative link in README and docs/ points at a file that exists.
- Every command of the parser has its row in docs/commands.md, and the row names every flag.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from rlx_mpi import cli

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.S | re.M)


def _blocks(page: Path) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(page.read_text())]


def _logical_lines(text: str) -> list[str]:
    """Join backslash continuations; drop comments and blank lines."""
    out, cur = [], ""
    for line in text.splitlines():
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        cur += line
        if cur.strip() and not cur.lstrip().startswith("#"):
            out.append(cur.strip())
        cur = ""
    return out


def _transcripts() -> list[tuple[str, list[str], list[str]]]:
    """(page, argv, expected output lines) of every ``$ rlx-mpi ...`` shown with its output."""
    found = []
    for page in PAGES:
        for _, body in _blocks(page):
            if not body.startswith("$ rlx-mpi "):
                continue
            chunks = re.split(r"^\$ ", body, flags=re.M)[1:]
            for chunk in chunks:
                lines = chunk.splitlines()
                cmd = []
                while lines and lines[0].rstrip().endswith("\\"):
                    cmd.append(lines.pop(0).rstrip()[:-1])
                cmd.append(lines.pop(0))
                argv = shlex.split(" ".join(cmd))[1:]  # drop "rlx-mpi"
                want = [ln.rstrip() for ln in lines if ln.strip()]
                found.append((page.name, argv, want))
    return found


def _command_lines() -> list[tuple[str, str]]:
    """(page, shell line) of every other line that runs rlx-mpi, sbatch or the tests."""
    found = []
    for page in PAGES:
        for lang, body in _blocks(page):
            if lang not in ("bash", "sh", "") or body.startswith("$ "):
                continue
            for line in _logical_lines(body):
                if re.search(r"rlx-mpi |rlx_mpi |sbatch |pytest", line):
                    found.append((page.name, line))
    return found


TRANSCRIPTS = _transcripts()
COMMANDS = _command_lines()


def test_the_pages_show_commands_at_all():
    assert len(TRANSCRIPTS) >= 4 and len(COMMANDS) >= 6, (len(TRANSCRIPTS), len(COMMANDS))


@pytest.mark.parametrize("page, argv, want", TRANSCRIPTS, ids=[f"{p}:{' '.join(a[:3])}" for p, a, _ in TRANSCRIPTS])
def test_a_shown_plan_prints_what_the_page_says(page, argv, want):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(argv)
    assert code == 0, f"{page}: {' '.join(argv)} exited {code}"
    got = [ln.rstrip() for ln in out.getvalue().splitlines() if ln.strip()]
    assert got == want, f"{page}: the output shown for `rlx-mpi {' '.join(argv)}` is not what it prints now"


def _rlx_argv(words: list[str]) -> list[str] | None:
    """The arguments after the rlx-mpi program word (rlx-mpi, .venv/bin/rlx-mpi, python -m rlx_mpi)."""
    for i, w in enumerate(words):
        if w.endswith("rlx-mpi"):
            return words[i + 1:]
        if w == "rlx_mpi" and i and words[i - 1] == "-m":
            return words[i + 1:]
    return None


@pytest.mark.parametrize("page, line", COMMANDS, ids=[f"{p}:{ln[:40]}" for p, ln in COMMANDS])
def test_a_shown_command_parses_and_names_files_that_exist(page, line):
    for part in re.split(r"&&|;|\|", line):
        words = shlex.split(part, comments=True)
        if not words:
            continue
        if "pytest" in words:
            if "pip" in line:  # the quick start's test command: CI runs exactly it
                assert line in (ROOT / ".ci" / "run").read_text(), f"{page}: `{line}` is not what .ci/run runs"
            for expr in (words[i + 1] for i, w in enumerate(words) if w == "-m" and words[i + 1] != "pytest"):
                names = set(re.findall(r"\w+", expr)) - {"and", "or", "not"}
                registered = set(re.findall(r'"(\w+):', (ROOT / "pyproject.toml").read_text()))
                assert names <= registered, f"{page}: marker(s) {names - registered} are not registered in pyproject.toml"
            continue
        if words[0] == "sbatch":
            assert (ROOT / words[1]).is_file(), f"{page}: {words[1]} does not exist"
            rest = words[2:]
        else:
            rest = _rlx_argv(words)
            if rest is None:
                continue
            if " : " in line:  # an MPMD launch shown on purpose as a refused command line
                continue
            try:
                cli._parser().parse_args(rest)
            except SystemExit as e:  # argparse's way of refusing
                pytest.fail(f"{page}: `rlx-mpi {' '.join(rest)}` does not parse ({e})")
        for word in rest:
            if re.match(r"^(jobs|slurm|data|bench|tests)/", word) and not word.startswith("data/"):
                assert (ROOT / word).exists(), f"{page}: {word} does not exist"


def test_relative_links_point_at_files_that_exist():
    bad = []
    for page in PAGES + [ROOT / "bench" / "README.md"]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if re.match(r"^[a-z]+:", target):
                continue
            if not (page.parent / target).exists():
                bad.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not bad, bad


def _subcommands() -> dict:
    """command name -> its argparse subparser."""
    sub = next(a for a in cli._parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    return dict(sub.choices)


def test_every_flag_of_the_parser_is_in_the_commands_page():
    """A flag the page does not list is one a user cannot find (--shard, --adopt-output and
    --ignore-eos were missing once): each command's row in the table names all of its flags."""
    page = (ROOT / "docs" / "commands.md").read_text()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `rlx-mpi ([a-z-]+)\b.*$", page, re.M)}
    missing = []
    for name, parser in _subcommands().items():
        if name not in rows:
            missing.append(f"the command {name} has no row")
            continue
        for action in parser._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help" and not re.search(re.escape(flag) + r"(?![\w-])", rows[name]):
                    missing.append(f"{name} {flag}")
    for action in cli._parser()._actions:  # the flags before the command (--debug)
        for flag in action.option_strings:
            if flag.startswith("--") and flag != "--help" and f"`{flag}`" not in page:
                missing.append(f"rlx-mpi {flag}")
    assert not missing, f"docs/commands.md does not list: {', '.join(missing)}"


def _update() -> None:
    """Rewrite every transcript's output with what the command prints now (then read the diff)."""
    for page in PAGES:
        text = page.read_text()
        for _, body in _blocks(page):
            if not body.startswith("$ rlx-mpi "):
                continue
            new = []
            for chunk in re.split(r"^\$ ", body, flags=re.M)[1:]:
                lines = chunk.splitlines()
                cmd = []
                while lines and lines[0].rstrip().endswith("\\"):
                    cmd.append(lines.pop(0))
                cmd.append(lines.pop(0))
                argv = shlex.split(" ".join(c.rstrip().rstrip("\\") for c in cmd))[1:]
                out = io.StringIO()
                with contextlib.redirect_stdout(out):
                    cli.main(argv)
                new.append("$ " + "\n".join(cmd) + "\n" + out.getvalue().rstrip("\n") + "\n")
            text = text.replace(body, "\n".join(new))
        page.write_text(text)


if __name__ == "__main__":  # python tests/test_docs.py: refresh the transcripts, then review git diff
    _update()
