"""What a clone carries (issue 28): no tracked file over 15 MB, no pickle (a checkpoint, an optimizer state),
and training runs that write their checkpoints outside the checkout.

Six 72 MB pickled checkpoints once went into the history; every clone still downloads them. These tests
keep new ones out: they read what git tracks, so a file ignored by .gitignore but force-added fails too."""

from __future__ import annotations

import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_BYTES = 15 * 1024 * 1024
PICKLE_SUFFIXES = {".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt"}


def tracked_files(repo: Path) -> list[str]:
    out = subprocess.run(["git", "-C", str(repo), "ls-files", "-z"], capture_output=True, check=True)
    return [p for p in out.stdout.decode("utf-8", "surrogateescape").split("\0") if p]


def pickle_kind(path: Path) -> str | None:
    """Why this file is a pickle, or None: its name, the pickle opcode stream of protocol 2 and later
    (PROTO 0x80 and the protocol number first), or a zip that holds a pickle (torch.save's format)."""
    if path.suffix.lower() in PICKLE_SUFFIXES:
        return f"a {path.suffix} file"
    with open(path, "rb") as f:
        head = f.read(4)
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return f"a pickle (protocol {head[1]})"
    if head == b"PK\x03\x04":
        try:
            with zipfile.ZipFile(path) as z:
                inside = [n for n in z.namelist() if n.endswith((".pkl", "data.pkl"))]
        except zipfile.BadZipFile:
            return None
        if inside:
            return f"a zip holding a pickle ({inside[0]}): torch.save's format"
    return None


def problems(repo: Path) -> list[str]:
    found = []
    for rel in tracked_files(repo):
        path = repo / rel
        if not path.is_file() or path.is_symlink():
            continue  # deleted in the work tree, or a link (git stores its target, a few bytes)
        size = path.stat().st_size
        if size > MAX_BYTES:
            found.append(f"{rel}: {size / 2**20:.1f} MB (over 15 MB)")
        kind = pickle_kind(path)
        if kind:
            found.append(f"{rel}: {kind}")
    return found


needs_git = pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                               reason="not a git checkout (an unpacked sdist): nothing is tracked")


@needs_git
def test_no_tracked_file_is_large_or_a_pickle():
    found = problems(ROOT)
    assert not found, ("tracked files that must leave the repository (checkpoints belong in a run directory "
                       "outside the checkout):\n" + "\n".join(found))


@needs_git
def test_the_check_catches_planted_files(tmp_path):
    """A repository with a torch checkpoint (zip with data.pkl, under an innocent name), a raw pickle,
    a .pt by name and a 16 MB file: each is named; the same repository without them passes."""
    import pickle

    torch = pytest.importorskip("torch")
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    (repo / "README.md").write_text("fine\n")
    (repo / "weights.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    subprocess.run(git + ["add", "."], check=True)
    assert problems(repo) == []

    torch.save({"step": 1, "w": torch.zeros(2)}, repo / "state.dat")
    (repo / "optimizer").write_bytes(pickle.dumps({"lr": 0.1}, protocol=4))
    (repo / "old.pt").write_bytes(b"not even a pickle inside")
    with open(repo / "big.npy", "wb") as f:
        f.truncate(16 * 1024 * 1024)
    subprocess.run(git + ["add", "-f", "."], check=True)
    found = problems(repo)
    assert len(found) == 4, found
    text = "\n".join(found)
    assert "state.dat: a zip holding a pickle" in text
    assert "optimizer: a pickle (protocol 4)" in text
    assert "old.pt: a .pt file" in text
    assert "big.npy: 16.0 MB (over 15 MB)" in text


@needs_git
def test_gitignore_keeps_checkpoints_out():
    names = ["models/training/v2/ckpt.pt", "runs/x/ckpt.pth", "a/state.pkl", "w.bin", "last.ckpt"]
    out = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "--no-index", *names], capture_output=True, text=True)
    assert sorted(out.stdout.split()) == sorted(names)


# --- training writes its checkpoints where the user says, outside the checkout --------------------------------


def test_training_needs_a_run_directory_the_user_names(capsys):
    from completiond.models.training.train_default import main

    assert main(["--max-steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "--run-dir" in err and "outside the checkout" in err


@needs_git
def test_training_refuses_a_run_directory_inside_the_checkout(capsys, tmp_path):
    from completiond.models.training.train_default import checkout_root, main, run_dir_problem

    assert checkout_root() == ROOT
    inside = ROOT / "runs" / "h7-never-created"
    for mode in ([], ["--resume"], ["--export"], ["--probe"]):
        assert main(mode + ["--run-dir", str(inside)]) == 2
        assert "inside the checkout" in capsys.readouterr().err
    assert not inside.exists()
    assert run_dir_problem(ROOT, allow_checkout=False) is not None
    assert run_dir_problem(inside, allow_checkout=True) is None
    assert run_dir_problem(tmp_path / "run", allow_checkout=False) is None


# --- the README a new user reads ------------------------------------------------------------------------------


def test_readme_is_short_and_starts_from_a_shallow_clone():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.encode()) <= 15 * 1024, f"README.md is {len(readme.encode())} bytes; details go to docs/"
    first_block = readme.split("```sh\n", 1)[1].split("```", 1)[0]
    assert first_block.startswith("git clone --depth 1 "), first_block
    # CI runs the test command the README gives, character for character
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    command = next(line for line in ci.splitlines() if line.startswith("pip install") and "pytest" in line)
    assert f"```sh\n{command}\n```" in readme, command


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    kept = "".join(c for c in heading.strip().lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = path.read_text(encoding="utf-8")
    return {_slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#") and " " in line}


DOCS = ["README.md", "docs/HOW_IT_WORKS.md", "docs/PERFORMANCE.md", "docs/TEAMS.md", "docs/TROUBLESHOOTING.md",
        "docs/ARCHITECTURE.md", "docs/ENGINE_API.md", "models/training/RESUME.md",
        "models/completiond-py-mini/MODEL_CARD.md"]


def test_links_between_the_docs_resolve():
    """Moving text out of the README must not leave links to files or sections that are gone."""
    import re

    broken = []
    for doc in DOCS:
        path = ROOT / doc
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{doc}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{doc}: {target} (no such section)")
    assert not broken, "\n".join(broken)
