"""The GPU path's weight-sync checks (experiments/sync_checks.py), checked on CPU through --dry_run: each push runs
against a server placed where that push works."""

import json

import pytest

from experiments.sync_checks import main


def plan(capsys, *flags: str) -> dict:
    main(["--model", "/models/m", "--questions", "q.parquet", "--out", "runs/weight_sync.jsonl", "--dry_run", *flags])
    return json.loads(capsys.readouterr().out)


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_the_nccl_push_crosses_gpus_and_the_reload_push_shares_the_trainers(capsys):
    checks = plan(capsys)
    # two processes on one GPU cannot form an NCCL pair; the reload push is the one that works beside the trainer
    nccl, reload = checks["nccl"], checks["reload"]
    assert nccl["server"]["env"] != nccl["check"]["env"] == {"CUDA_VISIBLE_DEVICES": "1"}
    assert reload["server"]["env"] == reload["check"]["env"] == {"CUDA_VISIBLE_DEVICES": "1"}
    for sync, check in checks.items():
        server, command = check["server"]["command"], check["check"]["command"]
        assert server[2:4] == ["trl.cli.main", "vllm-serve"] and flag(server, "--host") == "127.0.0.1"
        assert command[1:3] == ["-m", "experiments.weight_sync"] and flag(command, "--sync") == sync
        assert flag(command, "--server_url") == f"http://127.0.0.1:{flag(server, '--port')}"
        assert flag(command, "--out") == "runs/weight_sync.jsonl"
    assert flag(nccl["server"]["command"], "--port") != flag(reload["server"]["command"], "--port")


def test_the_ipc_push_goes_to_the_server_on_the_trainers_gpu_which_has_the_ipc_loader(capsys):
    checks = plan(capsys)
    ipc, reload, nccl = checks["ipc"], checks["reload"], checks["nccl"]
    assert ipc["server"] == reload["server"] and ipc["server"]["env"] == ipc["check"]["env"]
    assert flag(ipc["server"]["command"], "--worker-extension-cls") == (
        "searchr1_trl.serving.weight_sync.IpcWeightLoader")
    assert "--worker-extension-cls" not in nccl["server"]["command"]
    assert flag(ipc["check"]["command"], "--push_dtype") == "bfloat16"
    # the reload check ran first on that server: it goes back to the checkpoint, or the IPC check would meet the
    # weights its own update step leads to already served
    assert ipc["reloads_the_checkpoint_first"] and not reload["reloads_the_checkpoint_first"]
    assert not nccl["reloads_the_checkpoint_first"]


def test_one_server_runs_eager_and_one_with_cuda_graphs_so_their_start_up_times_compare(capsys):
    checks = plan(capsys)
    assert flag(checks["nccl"]["server"]["command"], "--enforce_eager") == "true"
    assert "--enforce_eager" not in checks["reload"]["server"]["command"]


def test_a_one_gpu_host_checks_the_reload_and_ipc_pushes_beside_the_trainer(capsys):
    checks = plan(capsys, "--checks", "reload", "ipc", "--trainer_gpu", "0")
    assert set(checks) == {"reload", "ipc"}
    assert checks["ipc"]["server"]["env"] == checks["ipc"]["check"]["env"] == {"CUDA_VISIBLE_DEVICES": "0"}
    with pytest.raises(SystemExit):
        plan(capsys, "--trainer_gpu", "0")  # nccl's server would share the trainer's GPU
    assert "the nccl check needs the server on another GPU than the trainer" in capsys.readouterr().err
