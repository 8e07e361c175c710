"""scripts/gpu_bundle.sh and scripts/gpu_setup.sh on CPU: what the bundle packs from a lock file is what the setup
installs and exposes through the environment file (with a tiny local wheel standing in for the vLLM stack)."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def tiny_wheel(folder: Path, name: str, version: str) -> None:
    """A pure-Python wheel whose module records its own version."""
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{name}/__init__.py", f"VERSION = {version!r}\n")
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        wheel.writestr(f"{info}/WHEEL",
                       "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")


def test_the_bundle_carries_exactly_the_lock_file_and_the_setup_makes_it_importable(tmp_path):
    index = tmp_path / "index"
    index.mkdir()
    for name, version in [("tinyvllm", "0.26.0"), ("tinytrl", "1.16.0"), ("tinyextra", "9.9")]:
        tiny_wheel(index, name, version)
    lock = tmp_path / "lock.txt"
    lock.write_text("# the stack\ntinyvllm==0.26.0\ntinytrl==1.16.0\n")
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(index), "GPU_LOCK": str(lock),
           "BUNDLE_ASSETS": "0", "SEARCHR1_CACHE": str(tmp_path / "cache"), "PYTHON": sys.executable}
    pieces = tmp_path / "pieces"
    subprocess.run(["bash", str(ROOT / "scripts" / "gpu_bundle.sh"), str(pieces)], env=env, check=True, cwd=ROOT,
                   capture_output=True)
    assert sorted(p.name for p in pieces.iterdir()) == ["site.tar.xz.00"]
    assert all(p.stat().st_size <= 60 * 2**20 for p in pieces.iterdir())

    site, env_file = tmp_path / "site", tmp_path / "env.sh"
    setup = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_setup.sh"), str(pieces)], check=True, text=True,
                           capture_output=True, cwd=ROOT, env={**os.environ, "SEARCHR1_SITE": str(site),
                                                               "SEARCHR1_ENV_FILE": str(env_file),
                                                               "SEARCHR1_CACHE": str(tmp_path / "cache")})
    assert "tinyvllm-0.26.0" in setup.stdout and "tinytrl-1.16.0" in setup.stdout
    assert not (site / "tinyextra").exists()  # in the index, not in the lock: not carried
    probe = subprocess.run(["bash", "-c", f"source {env_file} && cd / && {sys.executable} -c "
                            "'import tinyvllm, tinytrl, searchr1_trl; print(tinyvllm.VERSION, tinytrl.VERSION)' "
                            "&& echo $VLLM_HOST_IP"], check=True, text=True, capture_output=True)
    assert probe.stdout.split() == ["0.26.0", "1.16.0", "127.0.0.1"]
