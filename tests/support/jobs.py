"""The shape e2e tests give deploy/config/job.toml's default job: `make run`'s is XLong-shaped
(8-module tasks, a heavy tail of 32-module ones cut by a 15 s deadline), these tests' is small
(4-module tasks, no tail, a deadline no execution meets on a loaded CI machine)."""

SMALL_TASKS = ("--tasks.params.num_modules", "4", "--tasks.params.long_pct", "0", "--execution_timeout_s", "120")
