"""The worker's JobTable: the buffered and running jobs that the loop, intake and results share."""
from __future__ import annotations

from pagestream.producer.protocol.schema import JobRequest
from pagestream.worker.consumer import Delivery
from pagestream.worker.job_table import JobTable
from pagestream.worker.jobs import ActiveJob


def _job(n: int) -> ActiveJob:
    return ActiveJob(Delivery("ps:jobs:default", f"1-{n}", {}), JobRequest(job_id=f"job-{n}", prompt="p", max_tokens=4))


def test_buffered_jobs_enter_the_engine_in_order_and_leave_when_finished():
    t = JobTable()
    assert not t and t.num_in_flight() == 0
    a, b, c = _job(1), _job(2), _job(3)
    for j in (a, b, c):
        t.buffer(j)
    assert t and t.num_buffered() == 3 and t.num_running() == 0
    assert t.next_buffered() is a  # peeked, still buffered
    assert t.num_buffered() == 3
    t.start(t.pop_buffered())
    assert t.get("job-1") is a and t.get("job-2") is None  # get: running jobs only (the step's outputs)
    assert t.find("job-2") is b and t.find("job-1") is a  # find: running or buffered (a second entry of a job)
    assert t.num_in_flight() == 3
    assert t.finish("job-1") is a and t.finish("job-1") is None  # finishing twice is harmless
    assert t.get("job-1") is None and t.num_running() == 0


def test_running_is_a_snapshot_jobs_can_be_finished_while_iterating():
    t = JobTable()
    for n in range(4):
        t.start(_job(n))
    for a in t.running():
        t.finish(a.job_id)
    assert t.num_running() == 0 and not t


def test_keep_and_take_buffered():
    t = JobTable()
    for n in range(5):
        t.buffer(_job(n))
    t.keep_buffered(lambda a: a.job_id != "job-2")
    assert [a.job_id for a in t.buffered()] == ["job-0", "job-1", "job-3", "job-4"]
    taken = t.take_buffered()
    assert [a.job_id for a in taken] == ["job-0", "job-1", "job-3", "job-4"]
    assert t.num_buffered() == 0 and t.next_buffered() is None and not t
