"""A full disk or a read-only folder: exit 5 with one paragraph naming the output, nothing
half-written, the previous version kept (on real file systems: small tmpfs mounts)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from conftest import run_stage_script
from safetensors.torch import save_file

from rlhf_pipeline.cli import main
from rlhf_pipeline.errors import DataContractError, PipelineError, SettingsError, StorageError, storage_failure
from rlhf_pipeline.io import atomic_dir, read_table, write_json


def mount_tmpfs(where: Path, options: str) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True, text=True
    )
    if result.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {result.stderr.strip()}")
    return where


@pytest.fixture
def small_disk(tmp_path):
    disk = mount_tmpfs(tmp_path / "disk", "size=256k")
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


def _error_of(write) -> BaseException:
    with pytest.raises(Exception) as caught:
        write()
    return caught.value


def test_real_write_failures_are_recognised(small_disk):
    """The errors each writer really raises on a full disk: the plain OSError, torch.save's
    RuntimeError raised while handling it, safetensors' own error type."""

    def plain():
        with open(small_disk / "plain.txt", "w") as handle:
            handle.write("x" * 1_000_000)

    def torch_save():
        with open(small_disk / "state.pt", "wb") as handle:
            torch.save({"x": torch.zeros(1_000_000)}, handle)

    errors = []
    for write in (
        plain,
        torch_save,
        lambda: save_file({"x": torch.zeros(1_000_000)}, str(small_disk / "x.safetensors")),
    ):
        errors.append(_error_of(write))
        for leftover in small_disk.iterdir():  # each writer starts on an empty disk
            leftover.unlink()
    assert [type(e).__name__ for e in errors] == ["OSError", "RuntimeError", "SafetensorError"]
    assert all(storage_failure(e) == "No space left on device" for e in errors)
    assert (
        storage_failure(ValueError("a bug")) is None and storage_failure(FileNotFoundError(2, "No such file")) is None
    )


def test_full_disk_keeps_the_previous_output(small_disk):
    target = small_disk / "model"
    with atomic_dir(target) as tmp:
        (tmp / "weights.bin").write_bytes(b"previous")
    with pytest.raises(
        StorageError, match=rf"could not write {target}: No space left on device\. Nothing half-written"
    ):
        with atomic_dir(target) as tmp:
            (tmp / "weights.bin").write_bytes(b"\0" * 1_000_000)
    assert (target / "weights.bin").read_bytes() == b"previous"
    assert sorted(p.name for p in small_disk.iterdir()) == ["model"], "a temporary was left behind"
    with pytest.raises(StorageError, match="metrics.json: No space left on device"):
        write_json(small_disk / "metrics.json", {"x": "y" * 1_000_000})
    assert sorted(p.name for p in small_disk.iterdir()) == ["model"]


@pytest.mark.e2e
def test_stage_with_a_read_only_output_folder_exits_5(project, capsys, tmp_path):
    assert run_stage_script("corpus") == 0
    mount_tmpfs(project / "metrics", "size=64k,ro")
    try:
        code = run_stage_script("queries")
    finally:
        subprocess.run(["umount", str(project / "metrics")], check=True)
    err = capsys.readouterr().err
    assert code == StorageError.exit_code == 5
    assert "stage queries: error: could not write metrics/queries.json: Read-only file system." in err
    assert "Traceback" not in err


def test_a_folder_output_never_replaces_a_file(tmp_path, capsys):
    """`rlhf validate-preferences prefs.jsonl --docs prefs.jsonl`: the Data Docs folder used to take the
    file's place, and the file went to a hidden `.prefs.jsonl.old-PID`; now nothing moves."""
    target = tmp_path / "prefs.jsonl"
    target.write_text("".join(f'{{"query": "q{i}", "sample0": "x", "sample1": "y", "best": 0}}\n' for i in range(4)))
    with pytest.raises(StorageError, match=rf"{target} is a file, not a folder: .* Nothing was written\."):
        with atomic_dir(target) as tmp:
            (tmp / "index.html").write_text("docs")
    with pytest.raises(SystemExit) as exit_:
        main(["validate-preferences", str(target), "--docs", str(target)])
    assert exit_.value.code == SettingsError.exit_code  # refused before the contract runs, so no verdict printed
    out, err = capsys.readouterr()
    assert f"{target} is a file, not a folder" in err and out == ""
    assert [p.name for p in tmp_path.iterdir()] == ["prefs.jsonl"] and target.read_text().startswith('{"query": "q0"')


def test_a_folder_given_for_a_file_is_called_a_folder_not_missing(tmp_path):
    with pytest.raises(PipelineError, match=rf"^{tmp_path} is a folder; give a .jsonl or .parquet file\.$"):
        read_table(tmp_path)


def test_an_unreadable_parquet_file_is_a_malformed_data_file_named_in_one_line(tmp_path):
    """Exit 3 (a malformed file, which the retrain flow does not retry), not 1; one line, not Arrow's schema
    dump; and a file with two columns of one name (Arrow writes it) is named as such."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    twice = tmp_path / "twice.parquet"
    texts = pa.array(["a b c", "d e f"])
    pq.write_table(pa.Table.from_arrays([texts, texts, texts], names=["prompt", "chosen", "chosen"]), twice)
    with pytest.raises(DataContractError, match=r"twice\.parquet has two columns named 'chosen', so which one"):
        read_table(twice)
    for name, content in {"random.parquet": bytes(range(256)) * 8, "empty.parquet": b""}.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(DataContractError, match=rf"^{tmp_path / name} is not a readable Parquet file: [^\n]+$"):
            read_table(tmp_path / name)


def test_an_output_folder_is_readable_by_everyone(tmp_path):
    """safetensors writes its files 0600; a folder written through atomic_dir ends 0644 / 0755,
    so a colleague, a server or a container running as another user can read a model."""
    import stat

    target = tmp_path / "models" / "policy"
    with atomic_dir(target, checksums=True) as tmp:
        save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))
        (tmp / "backbone").mkdir()
        save_file({"w": torch.zeros(2)}, str(tmp / "backbone" / "model.safetensors"))
    modes = {p.relative_to(target).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in [target, *target.rglob("*")]}
    assert modes == {
        ".": 0o755,
        "backbone": 0o755,
        "backbone/model.safetensors": 0o644,
        "model.safetensors": 0o644,
        "SHA256SUMS": 0o644,
    }, {k: oct(v) for k, v in modes.items()}
