"""A harness process that leases one execution, preserves some progress, and then only
heartbeats -- until the test SIGKILLs it (a harness host that disappears).

    python -m tests.support.vanishing_harness SCHEDULER REWARD JOB_ID OUT_JSON

Writes the lease (execution id, token, attempt, group, step) to OUT_JSON once its workspace
snapshot (one of ``harness_scorer.PARTS`` parts done) is stored in the reward service.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from services.reward.client import RewardClient
from services.scheduler.client import SchedulerClient


def main() -> None:
    scheduler, reward, job_id, out = sys.argv[1:5]
    with SchedulerClient(scheduler, timeout_s=30) as sched, RewardClient(reward, timeout_s=30) as rew:
        lease = sched.lease("vanishing-harness", job_id=job_id, wait_s=30)
        if lease is None:
            raise SystemExit("no execution to lease")
        rew.submit_workspace(job_id, lease.execution_id, {"part-1.txt": b"done\n"}, task_id="t")
        tmp = Path(out + ".tmp")
        tmp.write_text(json.dumps({"execution_id": lease.execution_id, "lease_token": lease.lease_token,
                                   "attempt": lease.attempt, "group_id": lease.group_id, "step": lease.step}))
        tmp.replace(out)
        while True:  # alive until killed: the lease stays ours only while this runs
            sched.heartbeat(lease.execution_id, lease.lease_token)
            time.sleep(0.3)


if __name__ == "__main__":
    main()
