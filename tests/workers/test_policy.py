"""The driver's decisions without a cluster: per-rank causes, the restart budget, the rerun exit
codes (16: resume elsewhere, 17: exclude a node or fail with the diagnosis), and the spec the
ranks get (paths, checkpoint namespace, the sizes an elastic job may take)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.jobspec import JobSpecError, parse_job
from engine.jobspec.demand import run_sizes
from engine.rerun.state_machine import RerunExit
from workers.driver import run_job
from workers.policy import EXIT_CANCELLED, EXIT_FAILED, Outcome, RestartPolicy, classify
from workers.spec_on_ray import JobInputError, load_spec, prepare_spec


class ActorDiedError(Exception):  # what Ray raises for a dead rank, by name
    pass


class WorkerHealthCheckFailedError(Exception):
    pass


class UserExceptionWithTraceback(Exception):  # Ray's wrapper around a rank's own exception
    def __init__(self, exc):
        self._base_exc = exc


RANKS = {0: {"node_id": "node-a" * 4, "pid": 100}, 1: {"node_id": "node-b" * 4, "pid": 200}}
RAY_DEATH = (
    "A worker health check failed.\nWorker info: ...\nThe actor died unexpectedly before finishing this "
    "task.\nThe actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker "
    "exit detail: Worker unexpectedly exits with a connection error code 2. End of file. Some common ..."
)
GLOO = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242")


def policy(max_restarts=2, room=True):
    return RestartPolicy(max_restarts, room if callable(room) else (lambda blocked: room))


def test_causes_put_the_dead_rank_first_and_the_peer_it_took_down_last():
    causes = classify(
        {0: GLOO, 1: WorkerHealthCheckFailedError(RAY_DEATH)},
        RANKS,
    )
    assert [(c.rank, c.kind) for c in causes] == [(1, "died"), (0, "peer")]
    assert causes[0].pid == 200 and causes[0].line().startswith("rank 1 (node node-bnode-b, pid 200): ")
    assert "its worker process has died (Worker unexpectedly exits" in causes[0].message


def test_a_rank_ray_did_not_list_is_named_when_its_peers_only_lost_it():
    died, peer = classify({0: GLOO}, RANKS)
    assert (died.rank, died.kind, peer.kind) == (1, "died", "peer") and "no report" in died.message
    causes = classify({0: GLOO}, RANKS, dead_nodes={"node-b" * 4})
    assert causes[0].rank == 1 and "left the cluster" in causes[0].message
    # A rank that raised is the cause; the unlisted rank was only waiting for it.
    assert [c.rank for c in classify({0: ValueError("bad")}, RANKS)] == [0]


def test_rerun_exit_is_unwrapped_and_carries_code_and_diagnosis():
    err = UserExceptionWithTraceback(RerunExit(17, "iteration 3: persistent error", "persistent_error"))
    (cause,) = classify({0: err}, RANKS)
    assert (cause.kind, cause.exit_code, cause.diagnosis) == ("rerun", 17, "persistent_error")


def test_a_watchdog_message_replaces_process_died():
    causes = classify({1: ActorDiedError("died")}, RANKS, {1: "watchdog: step 7 (phase 'grads-finalize')"})
    assert causes[0].kind == "watchdog" and "grads-finalize" in causes[0].message


def test_failures_restart_within_the_budget_then_fail_with_the_cause():
    p = policy(max_restarts=1)
    died = Outcome(causes=classify({1: ActorDiedError("died")}, RANKS))
    first = p.decide(died)
    assert first.action == "restart" and first.counted and p.restarts_used == 1 and first.cause == "died"
    second = p.decide(Outcome(causes=classify({0: ValueError("bad data")}, RANKS)))
    assert second.action == "fail" and second.exit_code == EXIT_FAILED
    assert "max_restarts = 1" in second.reason and "rank 0" in second.reason and "bad data" in second.reason


def test_replacements_inside_an_attempt_spend_the_same_budget():
    """replace_replica: Ray Train replaced replicas within the attempt until its max_failures
    (the restarts left) ran out; the attempt's failure then finds the budget spent, not renewed."""
    p = policy(max_restarts=3)
    died = classify({1: ActorDiedError("died")}, RANKS)
    first = p.decide(Outcome(causes=died, restarts_spent=1))  # one replacement, then a failure
    assert first.action == "restart" and p.restarts_used == 2
    spent = p.decide(Outcome(causes=died, restarts_spent=1))  # Ray spent the one left
    assert spent.action == "fail" and "max_restarts = 3" in spent.reason


def test_checkpoint_storage_failing_fails_the_job_without_a_restart():
    """Issue 34: the engine already retried and skipped; a restart would save, fail and restart
    again (a crash loop). The reason names the storage error; peers' losses come after it."""
    from engine.checkpointing.save_failures import CheckpointStorageError

    p = policy(max_restarts=5)
    err = CheckpointStorageError(
        "3 checkpoint saves in a row failed: OSError: [Errno 28] No space left on device",
        storage_error="OSError: [Errno 28] No space left on device",
        failures=3,
    )
    causes = classify({0: err, 1: RuntimeError("Connection closed by peer")}, RANKS)
    assert [c.kind for c in causes] == ["storage", "peer"]
    decision = p.decide(Outcome(causes=causes))
    assert decision.action == "fail" and decision.exit_code == EXIT_FAILED and p.restarts_used == 0
    assert "No space left on device" in decision.reason


def test_a_checkpoint_of_the_old_pickled_format_fails_the_job_without_a_restart():
    """Issue 61: every resume of a raw-v1 checkpoint is refused the same way; a restart would
    only be refused again. The reason names the admin's conversion command."""
    from engine.checkpointing.metadata_json import OldCheckpointFormatError, old_format_message

    p = policy(max_restarts=5)
    causes = classify({0: OldCheckpointFormatError(old_format_message("s3://b/job/iter_0000010"))}, RANKS)
    decision = p.decide(Outcome(causes=causes))
    assert decision.action == "fail" and p.restarts_used == 0
    assert "elastron checkpoint convert s3://b/job/iter_0000010" in decision.reason


def test_exit_16_resumes_away_from_its_nodes_without_charging_the_budget():
    p = policy(max_restarts=0)
    out = Outcome(causes=classify({0: RerunExit(16, "reproduced in place")}, RANKS), nodes={"a", "b"})
    decision = p.decide(out)
    assert decision.action == "restart" and not decision.counted and decision.cause == "rerun_elsewhere"
    assert p.avoid == {"a", "b"} and p.blocked == {"a", "b"}
    assert decision.events[0][0] == "rerun_elsewhere"


def test_exit_16_fails_when_there_is_no_other_hardware():
    p = policy(room=False)
    decision = p.decide(Outcome(causes=classify({0: RerunExit(16, "reproduced")}, RANKS), nodes={"a"}))
    assert decision.action == "fail" and decision.exit_code == 16
    assert "no room for the job outside a" in decision.reason


def test_exit_17_persistent_excludes_the_nodes_of_the_16_and_resumes():
    rooms = []
    p = policy(max_restarts=0, room=lambda blocked: rooms.append(set(blocked)) or True)
    p.decide(Outcome(causes=classify({0: RerunExit(16, "reproduced")}, RANKS), nodes={"a"}))
    decision = p.decide(
        Outcome(
            causes=classify({0: RerunExit(17, "persistent error of node a", "persistent_error")}, RANKS),
            nodes={"b"},
        )
    )
    assert decision.action == "restart" and p.excluded == {"a"} and p.avoid == set()
    assert decision.cause == "node_excluded"
    assert decision.events == [
        (
            "node_excluded",
            {"nodes": ["a"], "diagnosis": "persistent_error", "message": decision.events[0][1]["message"]},
        )
    ]
    assert rooms[-1] == {"a"}


def test_exit_17_persistent_fails_when_no_healthy_hardware_is_left():
    cluster = {"b"}  # the nodes outside "a"
    p = policy(room=lambda blocked: bool(cluster - blocked))
    assert p.decide(Outcome(causes=classify({0: RerunExit(16, "x")}, RANKS), nodes={"a"})).action == "restart"
    cluster.clear()  # node b is gone by the time the diagnosis comes back
    decision = p.decide(Outcome(causes=classify({0: RerunExit(17, "y", "persistent_error")}, RANKS)))
    assert decision.action == "fail" and decision.exit_code == 17


def test_exit_17_correct_result_fails_with_the_diagnosis():
    p = policy()
    decision = p.decide(
        Outcome(causes=classify({0: RerunExit(17, "the data produces it", "correct_result")}, RANKS))
    )
    assert decision.action == "fail" and decision.exit_code == 17
    assert "correct_result" in decision.reason and "the data produces it" in decision.reason


def test_success_and_cancel():
    assert policy().decide(Outcome(succeeded=True)).action == "done"
    cancel = policy().decide(Outcome(cancelled=True))
    assert cancel.action == "cancelled" and cancel.exit_code == EXIT_CANCELLED


# ---------------------------------------------------------------- the spec the ranks get

SPEC = {
    "name": "j",
    "data": {"source": "text", "path": "corpus.txt"},
    "checkpoint": {"path": "ckpts", "resume_from": "old/iter_0000004"},
    "resources": {"ranks": 2},
}


def test_paths_become_absolute_and_checkpoints_are_namespaced_by_job(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = prepare_spec("job-7", parse_job(SPEC))
    assert data["checkpoint"]["path"] == str(tmp_path / "ckpts" / "job-7")
    assert data["checkpoint"]["resume_from"] == str(tmp_path / "old" / "iter_0000004")
    assert data["data"]["path"] == str(tmp_path / "corpus.txt")
    s3 = parse_job({**SPEC, "checkpoint": {"path": "s3://bucket/ck"}})
    assert prepare_spec("job-7", s3)["checkpoint"]["path"] == "s3://bucket/ck/job-7"
    none = parse_job({**SPEC, "checkpoint": {}})
    assert prepare_spec("job-7", none, "/runs")["checkpoint"]["path"] == str(Path("/runs/job-7/checkpoints"))


def test_bad_job_ids_are_refused():
    with pytest.raises(JobInputError, match="job id"):
        prepare_spec("../etc", parse_job(SPEC))


def test_elastic_sizes_keep_the_layout_and_the_global_batch():
    spec = parse_job(
        {
            "parallel": {"tensor": 2},
            "training": {"global_batch_size": 8, "micro_batch_size": 1},
            "resources": {"ranks": 4, "min_ranks": 2, "max_ranks": 8},
        }
    )
    assert run_sizes(spec) == [2, 4, 8]  # 6 ranks = DP 3 does not split a batch of 8
    assert run_sizes(parse_job({"resources": {"ranks": 2}})) == [2]


@pytest.mark.parametrize(
    ("resources", "parallel", "message"),
    [
        ({"ranks": 4, "min_ranks": 3, "max_ranks": 4}, {"tensor": 2}, "min_ranks (3) is not a multiple"),
        ({"ranks": 4, "max_ranks": 6}, {"tensor": 4}, "use 4 or 8"),
        ({"ranks": 2, "min_ranks": 4}, {}, "min_ranks (4) <= resources.ranks (2)"),
        ({"ranks": 2, "max_ranks": 3}, {}, "global_batch_size (8) is not divisible"),
    ],
)
def test_elastic_sizes_are_checked_at_submit_time(resources, parallel, message):
    with pytest.raises(JobSpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_job({"resources": resources, "parallel": parallel, "training": {"global_batch_size": 8}})


def test_the_spec_comes_from_a_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTRON_JOB_SPEC", '{"name": "from-env", "resources": {"ranks": 2}}')
    assert load_spec(None).name == "from-env"
    (tmp_path / "job.yaml").write_text("name: from-file\n")
    assert load_spec(tmp_path / "job.yaml").name == "from-file"  # --spec wins
    monkeypatch.setenv("ELASTRON_JOB_SPEC", "{not json")
    with pytest.raises(JobSpecError, match="ELASTRON_JOB_SPEC is not valid JSON"):
        load_spec(None)
    monkeypatch.delenv("ELASTRON_JOB_SPEC")
    with pytest.raises(JobInputError, match="--spec FILE or set ELASTRON_JOB_SPEC"):
        load_spec(None)


def test_bad_input_is_refused_before_any_ray_call():
    result = run_job("bad/id", parse_job(SPEC))
    assert result.exit_code == 2 and "job id" in result.reason and result.attempts == 0


def test_worker_run_refuses_a_bad_spec_with_exit_2():
    env = {
        **os.environ,
        "ELASTRON_JOB_SPEC": '{"parallel": {"tensor": 2}, "resources": {"ranks": 2, "max_ranks": 3}}',
    }
    proc = subprocess.run(
        [sys.executable, "-m", "elastron.cli", "worker-run", "job-1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 2, proc.stderr
    assert (
        "resources.max_ranks (3) is not a multiple of parallel.tensor x pipeline x context (2)" in proc.stderr
    )


def test_lost_nodes_are_the_dead_the_missing_and_those_whose_raylet_does_not_answer(monkeypatch):
    import socket

    import ray

    from engine.launcher import free_port
    from workers.driver import lost_nodes

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        here = listening.getsockname()[1]
        nodes = [
            {"NodeID": "up", "Alive": True, "NodeManagerAddress": "127.0.0.1", "NodeManagerPort": here},
            {
                "NodeID": "gone",
                "Alive": True,
                "NodeManagerAddress": "127.0.0.1",
                "NodeManagerPort": free_port(),
            },
            {"NodeID": "dead", "Alive": False, "NodeManagerAddress": "127.0.0.1", "NodeManagerPort": here},
        ]
        monkeypatch.setattr(ray, "nodes", lambda: nodes)
        assert lost_nodes({"up", "gone", "dead", "unknown"}) == {"gone", "dead", "unknown"}
