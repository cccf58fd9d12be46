"""How the suite's two xdist workers share the work (tests/conftest.py): the files on the session's
Ray cluster in two units, the other integration files in one, each unit test alone; and a test on a
cluster that would make a worker start a second cluster for one unit fails, naming its file."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import conftest


def test_files_on_the_ray_cluster_share_a_unit_and_the_other_integration_files_another():
    unit = conftest._work_unit
    # test_vllm_engine's parametrized test takes the module's engines by name, not by fixture argument
    assert unit("tests/integration/test_vllm_engine.py::test_abort_ends_a_running_request[abort_server]") == "ray-cluster"
    assert unit("tests/integration/test_end_to_end.py::test_readme_composition_example_runs") == "ray-cluster"
    assert unit("tests/integration/test_resume.py::test_resume_at_an_epoch_boundary_trains_the_next_epoch_and_at_the_last_step_trains_nothing") == "ray-cluster-2"
    assert unit("tests/integration/test_ray_up.py::test_ray_up_job_submit_ray_down") == "own-processes"
    assert unit("tests/integration/test_driver_reaper.py::test_a_killed_driver_takes_its_local_ray_instance_with_it") == "own-processes"
    alone = "tests/test_config.py::test_defaults_load"
    assert unit(alone) == alone
    # every file named as the second unit's is one on the cluster
    assert all("ray_cluster" in (conftest.REPO / "tests" / "integration" / name).read_text() for name in conftest.SECOND_CLUSTER)


def _worker(name: str, run: str = "r1"):
    return SimpleNamespace(workerinput={"testrunuid": run, "workerid": name})


def test_a_second_worker_on_one_cluster_unit_fails_naming_the_file_and_both_workers(tmp_path):
    on_cluster = "tests/integration/test_end_to_end.py::test_readme_composition_example_runs"
    claim = conftest._claim_cluster_unit(_worker("gw0"), on_cluster, tmp_path)
    assert claim == tmp_path / "ray-cluster" and claim.read_text() == "gw0"
    assert conftest._claim_cluster_unit(_worker("gw0"), on_cluster, tmp_path) is None  # its own unit again
    with pytest.raises(RuntimeError, match=r"tests/integration/test_end_to_end.py: gw1 runs a test of work unit ray-cluster, which gw0 runs"):
        conftest._claim_cluster_unit(_worker("gw1"), on_cluster, tmp_path)
    # the other cluster unit is free for the other worker
    second = "tests/integration/test_resume.py::test_x"
    assert conftest._claim_cluster_unit(_worker("gw1"), second, tmp_path).read_text() == "gw1"
    # a unit test that somehow took the cluster (e.g. through a fixture that uses it)
    with pytest.raises(RuntimeError, match=r"tests/sandbox_security/test_hostile_cells.py uses ray_cluster but is not in a cluster work unit"):
        conftest._claim_cluster_unit(_worker("gw1"), "tests/sandbox_security/test_hostile_cells.py::test_x", tmp_path)
    assert conftest._claim_cluster_unit(SimpleNamespace(), on_cluster, tmp_path) is None  # no xdist: one process, one cluster
