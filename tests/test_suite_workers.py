"""How the suite's two xdist workers share the work (tests/conftest.py): the files on the session's
Ray cluster in one unit, the other integration files in another, the sandbox security tests in a
third, each other unit test alone; and a test on the cluster that would make a second worker start
a cluster fails, naming its file."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest


@pytest.fixture
def conftest(pytestconfig):
    """tests/conftest.py as pytest loaded it (`import conftest` may find another directory's)."""
    return pytestconfig.pluginmanager.get_plugin(str(Path(__file__).with_name("conftest.py")))


def test_files_on_the_ray_cluster_share_a_unit_and_the_other_integration_files_another(conftest):
    unit = conftest._work_unit
    # test_vllm_engine's parametrized test takes the module's engines by name, not by fixture argument
    assert unit("tests/integration/test_vllm_engine.py::test_abort_ends_a_running_request[abort_server]") == "ray-cluster"
    assert unit("tests/integration/test_end_to_end.py::test_readme_composition_example_runs") == "ray-cluster"
    assert unit("tests/integration/test_resume.py::test_resume_at_an_epoch_boundary_trains_the_next_epoch_and_at_the_last_step_trains_nothing") == "ray-cluster"
    assert unit("tests/integration/test_ray_up.py::test_ray_up_job_submit_ray_down") == "own-processes"
    assert unit("tests/integration/test_driver_reaper.py::test_a_killed_driver_takes_its_local_ray_instance_with_it") == "own-processes"
    # their own Ray instances: off the cluster's worker, the critical path
    assert unit("tests/integration/test_default_run.py::test_the_default_run_tells_its_story_on_the_console") == "own-processes"
    assert unit("tests/integration/test_multinode_placement.py::test_npu_requests_land_on_the_ascend_node_with_hccl_settings_and_visible_devices") == "own-processes"
    assert unit("tests/integration/test_tinker.py::test_a_wrong_key_is_refused") == "own-processes"
    # host-wide process markers: the security tests never run beside each other
    assert unit("tests/sandbox_security/test_hostile_cells.py::test_a_sessions_processes_die_when_it_is_closed[root]") == "sandbox-security"
    assert unit("tests/sandbox_security/test_hostile_cells.py::test_a_sessions_processes_die_when_it_is_closed[userns]") == "sandbox-security"
    alone = "tests/test_config.py::test_defaults_load"
    assert unit(alone) == alone


def test_the_cluster_files_that_wait_run_first_and_every_other_test_keeps_its_place(conftest):
    repo = Path(__file__).resolve().parents[1]
    order = ["tests/integration/test_async.py::a", "tests/test_config.py::x", "tests/integration/test_faults.py::b",
             "tests/integration/test_async.py::c", "tests/integration/test_vllm_engine.py::d", "tests/test_config.py::y"]
    items = [SimpleNamespace(nodeid=nodeid, path=repo / nodeid.split("::")[0]) for nodeid in order]
    conftest._cluster_files_waiting_first(items)
    assert [item.nodeid for item in items] == ["tests/integration/test_vllm_engine.py::d", "tests/test_config.py::x", "tests/integration/test_faults.py::b",
                                               "tests/integration/test_async.py::a", "tests/integration/test_async.py::c", "tests/test_config.py::y"]
    for name in conftest.CLUSTER_FILES_FIRST:  # a renamed file would silently lose its place
        assert conftest._work_unit(f"tests/integration/{name}::t") == "ray-cluster", name


def _worker(name: str, run: str = "r1"):
    return SimpleNamespace(workerinput={"testrunuid": run, "workerid": name})


def test_a_second_worker_on_the_cluster_unit_fails_naming_the_file_and_both_workers(conftest, tmp_path):
    on_cluster = "tests/integration/test_end_to_end.py::test_readme_composition_example_runs"
    claim = conftest._claim_cluster_unit(_worker("gw0"), on_cluster, tmp_path)
    assert claim == tmp_path / "ray-cluster" and claim.read_text() == "gw0"
    assert conftest._claim_cluster_unit(_worker("gw0"), on_cluster, tmp_path) is None  # its own unit again
    with pytest.raises(RuntimeError, match=r"tests/integration/test_end_to_end.py: gw1 runs a test of work unit ray-cluster, which gw0 runs"):
        conftest._claim_cluster_unit(_worker("gw1"), on_cluster, tmp_path)
    # ... and so does a replacement of a crashed worker, whose cluster went with it
    with pytest.raises(RuntimeError, match=r"tests/integration/test_resume.py: gw2 runs a test of work unit ray-cluster, which gw0 runs"):
        conftest._claim_cluster_unit(_worker("gw2"), "tests/integration/test_resume.py::test_x", tmp_path)
    # another run starts its own
    assert conftest._claim_cluster_unit(_worker("gw1", run="r2"), on_cluster, tmp_path / "r2").read_text() == "gw1"
    # a unit test that somehow took the cluster (e.g. through a fixture that uses it)
    with pytest.raises(RuntimeError, match=r"tests/sandbox_security/test_hostile_cells.py uses ray_cluster but is not in the cluster's work unit"):
        conftest._claim_cluster_unit(_worker("gw1"), "tests/sandbox_security/test_hostile_cells.py::test_x", tmp_path)
    assert conftest._claim_cluster_unit(SimpleNamespace(), on_cluster, tmp_path) is None  # no xdist: one process, one cluster
