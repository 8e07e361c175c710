"""Download a model (or any Hub repo) into <local_dir>/<repo name>, the folder the recipes' model paths expect.

    python scripts/download_hf_assets.py --repo_id Qwen/Qwen3-8B --local_dir checkpoints          # weights + configs
    python scripts/download_hf_assets.py --repo_id Qwen/Qwen3-8B --local_dir checkpoints --all    # every file
"""

import argparse
from pathlib import Path

from huggingface_hub import snapshot_download

MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.py"]


def target_dir(repo_id: str, local_dir: str) -> Path:
    """`Qwen/Qwen3-8B` under `checkpoints` -> `checkpoints/Qwen3-8B`."""
    return Path(local_dir) / repo_id.split("/")[-1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo_id", required=True, help="Hub repository, e.g. Qwen/Qwen3-8B")
    parser.add_argument("--local_dir", required=True, help="parent folder; files land in <local_dir>/<repo name>")
    parser.add_argument("--all", action="store_true", help="every file, not only weights, configs and tokenizer")
    parser.add_argument("--repo_type", default="model", choices=["model", "dataset"])
    args = parser.parse_args(argv)
    folder = target_dir(args.repo_id, args.local_dir)
    snapshot_download(repo_id=args.repo_id, repo_type=args.repo_type, local_dir=folder,
                      allow_patterns=None if args.all else MODEL_FILES)
    print(folder)


if __name__ == "__main__":
    main()
