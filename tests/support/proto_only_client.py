"""A scheduler client that uses nothing of Gyre's Python package: grpcio plus stubs it generates
itself from the repository's .proto files into a temporary directory (what a client in any
language does with protos/). Run as a script by tests/e2e/test_job_api.py:

    python -I tests/support/proto_only_client.py PROTO_ROOT SCHEDULER_ADDR JOB_JSON

It submits the job, follows WatchJob to the end (resuming after stream breaks), then prints one
JSON line: the job id, its final state and weight version, the kinds of events seen, the
evaluation events, and the modules it imported from the repository (must be none).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def generate(proto_root: Path, out: Path) -> None:
    protos = sorted(str(p.relative_to(proto_root)) for p in (proto_root / "protos" / "gyre" / "v1").glob("*.proto"))
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{proto_root}", f"--python_out={out}",
                    f"--grpc_python_out={out}", *protos], check=True, cwd=proto_root)
    for pkg in ("protos", "protos/gyre", "protos/gyre/v1"):  # regular packages: found before any other copy
        (out / pkg / "__init__.py").touch()


def main() -> int:
    proto_root, address, job = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    out = Path(tempfile.mkdtemp(prefix="gyre-stubs-"))
    generate(proto_root, out)
    sys.path.insert(0, str(out))
    import grpc
    from protos.gyre.v1 import scheduler_pb2 as pb
    from protos.gyre.v1 import scheduler_pb2_grpc as rpc

    stub = rpc.SchedulerStub(grpc.insecure_channel(address))
    spec = pb.JobSpec(
        model=job["model"], num_steps=job["num_steps"], groups_per_step=job["groups_per_step"],
        group_size=job["group_size"], mode=pb.SCHEDULING_MODE_ELASTIC, staleness_bound=1,
        execution_timeout_s=job["execution_timeout_s"],
        tasks=pb.TaskSource(generator=pb.TaskGenerator(name=job["generator"], params=job["params"])),
        algorithm=pb.Algorithm(learning_rate=job["learning_rate"]),
        evaluation=pb.Evaluation(tasks=job["eval_tasks"], every=job["eval_every"]))
    job_id = stub.SubmitJob(pb.SubmitJobRequest(spec=spec), timeout=30).job.spec.job_id
    kinds: dict[str, int] = {}
    evaluations = []
    last = ""
    deadline = time.time() + job["timeout_s"]
    state = ""
    while time.time() < deadline:
        try:
            for ev in stub.WatchJob(pb.WatchJobRequest(job_id=job_id, after_event_id=last, follow=True), timeout=10):
                last = ev.event_id
                kinds[ev.kind] = kinds.get(ev.kind, 0) + 1
                if ev.kind == "evaluation":
                    evaluations.append(dict(ev.attrs))
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
        got = stub.GetJob(pb.GetJobRequest(job_id=job_id), timeout=10).job
        state = pb.JobState.Name(got.state)
        if got.state in (pb.JOB_STATE_COMPLETED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED):
            break
    got = stub.GetJob(pb.GetJobRequest(job_id=job_id), timeout=10).job
    repo_modules = sorted(m for m in sys.modules if m.split(".")[0] in ("services", "tests"))
    protos_from = str(Path(sys.modules["protos.gyre.v1.scheduler_pb2"].__file__ or "").parent)
    print(json.dumps({"job_id": job_id, "state": state, "weight_version": got.weight_version,
                      "message": got.message, "kinds": kinds, "evaluations": evaluations,
                      "repo_modules": repo_modules, "stubs_dir": str(out), "protos_from": protos_from}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
