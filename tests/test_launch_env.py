"""The environment parabench gives its ranks: threads as a user's own torchrun launch would get."""

from parabench.launch import LaunchOwner


def test_cpu_ranks_get_one_thread_and_gpu_ranks_get_torchruns_default(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    owner = LaunchOwner(tmp_path / "run")
    assert owner.launch_env("cpu")["OMP_NUM_THREADS"] == "1"
    assert owner.launch_env("auto")["OMP_NUM_THREADS"] == "1"
    # torchrun itself sets 1 per rank when several share a node, and leaves one rank at torch's default
    assert "OMP_NUM_THREADS" not in owner.launch_env("cuda")


def test_a_users_thread_setting_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "6")
    owner = LaunchOwner(tmp_path / "run")
    assert owner.launch_env("cpu")["OMP_NUM_THREADS"] == "6"
    assert owner.launch_env("cuda")["OMP_NUM_THREADS"] == "6"
