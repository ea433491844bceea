"""What ships: the wheel is the library and its Lua scripts, and it works on its own."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(path.name for path in (ROOT / "lua").glob("*.lua"))

# Run in a bare interpreter whose sys.path is the install target, the standard library and the
# dependencies' site-packages (no .pth files, so no editable install and no checkout).
DECIDE = """
import asyncio
import importlib.resources

import aiolimit
from aiolimit import Limit, Limiter


async def main():
    async with Limiter("memory://", [Limit(1, per=60)], prefix="wheel") as limiter:
        first = await limiter.try_acquire("user:1")
        second = await limiter.try_acquire("user:1")
    print(aiolimit.__file__)
    print(importlib.resources.files("aiolimit") / "lua" / "decide.lua")
    print(first.allowed, second.allowed)


asyncio.run(main())
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from this checkout (offline when the dev extra's hatchling is here)."""
    out = tmp_path_factory.mktemp("wheel")
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check"]
    if importlib.util.find_spec("hatchling") is not None:
        command += ["--no-build-isolation", "--no-index"]
    subprocess.run([*command, "-q", "-w", str(out), str(ROOT)], check=True, timeout=120)
    (built,) = out.glob("aiolimit_redis-*.whl")
    return built


def test_wheel_holds_the_library_and_its_scripts_only(wheel: Path) -> None:
    """The wheel has aiolimit, py.typed and the scripts as real files; no repository tooling."""
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        for script in SCRIPTS:
            text = archive.read(f"aiolimit/lua/{script}")
            assert text == (ROOT / "lua" / script).read_bytes(), script
    assert "aiolimit/py.typed" in names
    assert {"decide.lua", "prelude.lua"} <= set(SCRIPTS)
    top_level = {name.split("/", 1)[0] for name in names}
    assert {name for name in top_level if not name.endswith(".dist-info")} == {"aiolimit"}
    assert not [name for name in names if "/tests/" in name or "/test_" in name]


def test_installed_wheel_decides_without_the_checkout(wheel: Path, tmp_path: Path) -> None:
    """Installed alone, the wheel loads its scripts from its own files and admits a request."""
    target = tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index"]
    install += ["--disable-pip-version-check", "-q", "--target", str(target), str(wheel)]
    subprocess.run(install, check=True, timeout=60)
    dependencies = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    setup = f"import sys; sys.path[:0] = [{str(target)!r}]; sys.path += {dependencies!r}\n"
    run = subprocess.run(
        [sys.executable, "-I", "-S", "-c", setup + DECIDE],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    package, script, verdicts = run.stdout.splitlines()
    assert Path(package).is_relative_to(target)
    assert Path(script).is_relative_to(target) and not Path(script).is_symlink()
    assert verdicts == "True False"


def test_wheel_metadata_names_the_distribution_extras_license_and_one_version(
    wheel: Path,
) -> None:
    """aiolimit-redis (the free name; import aiolimit), the framework extras, the MIT
    LICENSE file, project URLs, and the version taken from aiolimit.__version__ alone."""
    import aiolimit

    with zipfile.ZipFile(wheel) as archive:
        (metadata_name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = archive.read(metadata_name).decode()
        licenses = [n for n in archive.namelist() if n.endswith("/LICENSE")]
    fields = [line.split(": ", 1) for line in metadata.splitlines() if ": " in line]
    assert ["Name", "aiolimit-redis"] in fields
    assert ["Version", aiolimit.__version__] in fields
    extras = {value for key, value in fields if key == "Provides-Extra"}
    assert {"fastapi", "starlette", "aiohttp", "embedded", "all"} <= extras
    urls = {value.split(",")[0] for key, value in fields if key == "Project-URL"}
    assert {"Homepage", "Source", "Issues", "Changelog"} <= urls
    assert licenses and "MIT License" in (ROOT / "LICENSE").read_text()
    assert wheel.name.startswith(f"aiolimit_redis-{aiolimit.__version__}-")
