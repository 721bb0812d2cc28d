"""The folder the C kernels are built in is made, then checked: never checked, then made, which
lets another user make it in the shared /tmp between the two (no compiler run: `_compile` is
replaced, and only the folder it is given is looked at)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvscale.kernels import cpu_build


@pytest.fixture
def pod_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "pod-tmp"
    folder.mkdir()
    monkeypatch.setattr(cpu_build.tempfile, "tempdir", str(folder))
    return folder


@pytest.fixture
def built_in(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The folders a build would leave its library in."""
    folders: list[Path] = []

    def compile_nothing(compiler: str, source: bytes, version: str, target_cpu: str,
                        workdir: Path, directory: Path) -> Path:
        folders.append(directory)
        return directory / "kvscale-native.so"

    monkeypatch.setattr(cpu_build, "_compile", compile_nothing)
    return folders


def read_only_cache(tmp_path: Path) -> Path:
    blocker = tmp_path / "read-only"
    blocker.write_text("")
    return blocker / "native"  # under a regular file: not even root can make it


def test_a_folder_made_between_the_check_and_the_build_is_not_used(
    tmp_path: Path, pod_tmp: Path, built_in: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    private = pod_tmp / f"kvscale-native-{os.geteuid()}"
    check = cpu_build.untrusted

    def check_then_lose_the_race(directory: Path) -> str | None:
        why = check(directory)
        if directory == private and not directory.exists():
            directory.mkdir()  # another user's, right after the check
            directory.chmod(0o777)
        return why

    monkeypatch.setattr(cpu_build, "untrusted", check_then_lose_the_race)
    cpu_build.build(read_only_cache(tmp_path))
    [folder] = built_in
    info = folder.stat()
    assert info.st_uid == os.geteuid() and info.st_mode & 0o077 == 0, oct(info.st_mode)


def test_a_symbolic_link_in_place_of_the_folder_is_refused(
    tmp_path: Path, pod_tmp: Path, built_in: list[Path]
) -> None:
    elsewhere = tmp_path / "chosen-by-someone-else"
    elsewhere.mkdir(mode=0o700)
    (pod_tmp / f"kvscale-native-{os.geteuid()}").symlink_to(elsewhere)
    cpu_build.build(read_only_cache(tmp_path))
    [folder] = built_in
    assert elsewhere not in (folder, folder.resolve(), folder.parent)
