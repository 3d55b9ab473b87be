"""The RL algorithm's one module (services/algorithm.py): the job section's checks, its mapping to
the trainer's loss, and loss aggregation adding up to the mean over executions."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from services.algorithm import Algorithm, ObjectiveConfig, group_advantages, token_weight
from services.scheduler.convert import algorithm_from_proto
from services.scheduler.jobs import JobSpec


def test_the_job_section_validates_and_maps_to_the_trainers_loss() -> None:
    a = Algorithm(clip_low=0.1, clip_high=0.3, kl_coef=0.01, entropy_coef=0.02, tis_cap=2.0,
                  normalize_advantages=True, advantage_eps=1e-4, dual_clip=0.0, kl_reference="initial",
                  kl_estimator="k2")
    assert a.objective() == ObjectiveConfig(eps_low=0.1, eps_high=0.3, kl_coef=0.01, entropy_coef=0.02, tis_cap=2.0,
                                            kl_estimator="k2")
    assert Algorithm().objective().tis_cap is None  # 0 = off
    assert Algorithm().objective().dual_clip == 3.0  # on by default (verl's clip_ratio_c)
    for bad, why in [({"advantage_eps": 0.0}, "advantage_eps"), ({"loss_aggregation": "sum"}, "loss_aggregation"),
                     ({"clip_low": 1.0}, "clip_low"), ({"dual_clip": 1.0}, "dual_clip"),
                     ({"kl_reference": "reference"}, "kl_reference"), ({"kl_estimator": "k4"}, "kl_estimator")]:
        with pytest.raises(ValueError, match=why):
            Algorithm(**bad)  # type: ignore[arg-type]
    # through the job API's proto: the new fields round-trip, an unset eps reads as the default
    from services.scheduler.convert import spec_from_proto, spec_to_proto
    from tests.service.scheduler_support import job_spec

    spec: JobSpec = job_spec("alg", algorithm=a)
    assert spec_from_proto(spec_to_proto(spec), "alg").algorithm == a
    msg = spec_to_proto(spec).algorithm
    msg.advantage_eps = 0.0
    assert algorithm_from_proto(msg).advantage_eps == Algorithm().advantage_eps
    assert algorithm_from_proto(msg).dual_clip == 0.0  # set to 0: off, kept
    msg.ClearField("dual_clip")  # a client that predates the field: the default
    assert algorithm_from_proto(msg).dual_clip == Algorithm().dual_clip == 3.0
    msg.kl_reference = ""  # unset: the behaviour policy
    assert algorithm_from_proto(msg).kl_reference == "behaviour"
    msg.kl_estimator = ""  # unset: k3
    assert algorithm_from_proto(msg).kl_estimator == "k3"


def test_the_trainer_gets_the_jobs_kl_anchor() -> None:
    """The scheduler's mapping to the trainer's ObjectiveParams, read back as the trainer reads it."""
    from services.scheduler.controller import trainer_objective
    from services.trainer.wire import job_from_proto

    from protos.gyre.v1 import trainer_pb2

    for a in (Algorithm(kl_coef=0.05, kl_reference="initial", kl_estimator="low_var_kl"), Algorithm(kl_coef=0.05)):
        msg = trainer_pb2.TrainerJobSpec(job_id="j", model="tiny", source="synthetic", objective=trainer_objective(a))
        job = job_from_proto(msg)
        assert (job.kl_reference, job.objective.kl_coef) == (a.kl_reference, 0.05)
        assert job.objective == a.objective()


def test_aggregation_weights_add_up_to_the_mean_over_executions() -> None:
    lengths = [3, 10, 1, 250]
    losses = [[0.5] * 3, [1.0] * 10, [2.0], [0.1] * 250]  # per-token losses of four executions
    total = sum(token_weight(n, len(lengths)) * sum(ls) for n, ls in zip(lengths, losses))
    assert total == pytest.approx((0.5 + 1.0 + 2.0 + 0.1) / 4)
    with pytest.raises(ValueError):
        token_weight(0, 4)
    assert group_advantages({"a": 1.0, "b": 0.0}, normalize_std=True)["a"] == pytest.approx(1.0, rel=1e-5)


def test_the_module_imports_neither_torch_nor_numpy() -> None:
    code = "import sys, services.algorithm; assert not {'torch', 'numpy'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_dual_clip_reaches_the_trainer() -> None:
    """The job's dual clip travels in the trainer's job spec; a spec without it (an older scheduler)
    means off, as before the field existed."""
    from protos.gyre.v1 import trainer_pb2
    from services.trainer.job import TrainerJob
    from services.trainer.wire import job_from_proto, job_to_proto

    job = TrainerJob(job_id="d", source="synthetic", objective=Algorithm().objective())
    assert job_from_proto(job_to_proto(job)).objective.dual_clip == 3.0
    assert job_from_proto(trainer_pb2.TrainerJobSpec(job_id="d", source="synthetic")).objective.dual_clip is None


def test_the_learning_rate_warms_up_over_the_jobs_first_steps() -> None:
    """``lr_warmup_steps`` reaches the trainer's optimizer through the job API's mapping; step s < N
    updates with lr * (s + 1) / (N + 1), counted in job steps (a resumed job goes on where it was),
    and the update's size follows it: Adam's first update moves each parameter by about its lr."""
    import torch

    from protos.gyre.v1 import trainer_pb2
    from services.scheduler.controller import trainer_objective, trainer_optim
    from services.trainer.learner import Updater
    from services.trainer.wire import job_from_proto, job_to_proto

    a = Algorithm(learning_rate=1e-2, lr_warmup_steps=3)
    msg = trainer_pb2.TrainerJobSpec(job_id="w", source="synthetic", objective=trainer_objective(a),
                                     optim=trainer_optim(a))
    optim = job_from_proto(msg).optim
    assert job_from_proto(job_to_proto(job_from_proto(msg))).optim == optim
    assert [optim.lr_at(s) for s in range(5)] == pytest.approx([2.5e-3, 5e-3, 7.5e-3, 1e-2, 1e-2])
    assert job_from_proto(trainer_pb2.TrainerJobSpec(job_id="w", source="synthetic")).optim.warmup_steps == 0

    moved = []
    for step in (0, 3):  # a fresh optimizer each time: the first update's size is lr per parameter
        model = torch.nn.Linear(4, 1, bias=False)
        before = model.weight.detach().clone()
        model.weight.grad = torch.tensor([[1.0, -2.0, 0.5, 3.0]])
        Updater(model, optim).apply(step)
        moved.append(float((model.weight.detach() - before).abs().max()))
    assert moved == pytest.approx([2.5e-3, 1e-2], rel=1e-3)
    with pytest.raises(ValueError, match="lr_warmup_steps"):
        Algorithm(lr_warmup_steps=-1)
    from services.scheduler.convert import spec_from_proto, spec_to_proto
    from tests.service.scheduler_support import job_spec

    assert spec_from_proto(spec_to_proto(job_spec("w", algorithm=a)), "w").algorithm.lr_warmup_steps == 3


def test_the_cosine_schedule_falls_to_its_floor_at_the_jobs_last_step() -> None:
    """``lr_schedule = "cosine"`` reaches the trainer through the job API with the job's step count
    as its horizon: full rate after the warmup, ``lr * lr_min_ratio`` at the last step, monotone in
    between; the update's size follows it."""
    import math

    import torch

    from protos.gyre.v1 import trainer_pb2
    from services.scheduler.controller import trainer_objective, trainer_optim
    from services.scheduler.convert import spec_from_proto, spec_to_proto
    from services.trainer.learner import Updater
    from services.trainer.wire import job_from_proto, job_to_proto
    from tests.service.scheduler_support import job_spec

    a = Algorithm(learning_rate=1e-2, lr_warmup_steps=1, lr_schedule="cosine", lr_min_ratio=0.2)
    msg = trainer_pb2.TrainerJobSpec(job_id="c", source="synthetic", num_steps=6, objective=trainer_objective(a),
                                     optim=trainer_optim(a))
    optim = job_from_proto(msg).optim
    assert (optim.schedule, optim.min_lr_ratio, optim.total_steps) == ("cosine", 0.2, 6)
    assert job_from_proto(job_to_proto(job_from_proto(msg))).optim == optim
    lrs = [optim.lr_at(s) for s in range(6)]
    # step 0: warmup (half); steps 1..5: cosine from 1e-2 down to 2e-3, the midpoint at step 3
    assert lrs == pytest.approx([5e-3, 1e-2, 1e-2 * (0.2 + 0.8 * (1 + math.cos(math.pi / 4)) / 2), 6e-3,
                                 1e-2 * (0.2 + 0.8 * (1 + math.cos(3 * math.pi / 4)) / 2), 2e-3])
    assert optim.lr_at(9) == pytest.approx(2e-3)  # past the horizon (a longer resumed job): the floor
    model = torch.nn.Linear(2, 1, bias=False)
    before = model.weight.detach().clone()
    model.weight.grad = torch.tensor([[1.0, -1.0]])
    Updater(model, optim).apply(5)
    assert float((model.weight.detach() - before).abs().max()) == pytest.approx(2e-3, rel=1e-3)
    # the default stays constant; a 1-step cosine job updates at the full rate
    assert [job_from_proto(trainer_pb2.TrainerJobSpec(job_id="c", source="synthetic", num_steps=4)).optim.lr_at(s)
            for s in range(4)] == [1e-5] * 4
    one = Algorithm(learning_rate=1e-2, lr_schedule="cosine")
    assert job_from_proto(trainer_pb2.TrainerJobSpec(job_id="c", source="synthetic", num_steps=1,
                                                     optim=trainer_optim(one))).optim.lr_at(0) == 1e-2
    for bad, why in [({"lr_schedule": "linear"}, "lr_schedule"), ({"lr_min_ratio": 1.5}, "lr_min_ratio")]:
        with pytest.raises(ValueError, match=why):
            Algorithm(**bad)  # type: ignore[arg-type]
    # over the job API: the fields round-trip; an unset schedule and an absent floor read as the defaults
    back = spec_from_proto(spec_to_proto(job_spec("c", algorithm=a)), "c").algorithm
    assert (back.lr_schedule, back.lr_min_ratio) == ("cosine", 0.2)
    zero_floor = Algorithm(lr_schedule="cosine", lr_min_ratio=0.0)
    assert spec_from_proto(spec_to_proto(job_spec("c", algorithm=zero_floor)), "c").algorithm.lr_min_ratio == 0.0
    from protos.gyre.v1 import scheduler_pb2

    old_client = algorithm_from_proto(scheduler_pb2.Algorithm(learning_rate=1e-3))
    assert (old_client.lr_schedule, old_client.lr_min_ratio) == ("constant", 0.1)


def test_adams_betas_and_epsilon_reach_the_trainers_optimizer() -> None:
    """``adam_beta1``/``adam_beta2``/``adam_eps`` reach the trainer through the job API. With the
    default epsilon the first update moves every parameter by the learning rate, whatever the size
    of its gradient. With an epsilon far above a parameter's gradient it moves in proportion to
    that gradient."""
    import torch

    from protos.gyre.v1 import scheduler_pb2, trainer_pb2
    from services.scheduler.controller import trainer_objective, trainer_optim
    from services.scheduler.convert import spec_from_proto, spec_to_proto
    from services.trainer.learner import Updater
    from services.trainer.wire import job_from_proto, job_to_proto
    from tests.service.scheduler_support import job_spec

    a = Algorithm(learning_rate=1e-2, adam_beta1=0.8, adam_beta2=0.99, adam_eps=1e-3)
    msg = trainer_pb2.TrainerJobSpec(job_id="e", source="synthetic", objective=trainer_objective(a),
                                     optim=trainer_optim(a))
    optim = job_from_proto(msg).optim
    assert (optim.betas, optim.eps) == ((0.8, 0.99), 1e-3)
    assert job_from_proto(job_to_proto(job_from_proto(msg))).optim == optim
    default = job_from_proto(trainer_pb2.TrainerJobSpec(job_id="e", source="synthetic")).optim
    assert (default.betas, default.eps) == ((0.9, 0.999), 1e-8)

    grad = torch.tensor([[1e-5, 1e-4, 1e-2]])
    moved = {}
    for eps in (1e-8, 1e-3):
        model = torch.nn.Linear(3, 1, bias=False)
        before = model.weight.detach().clone()
        model.weight.grad = grad.clone()
        Updater(model, dataclasses.replace(optim, eps=eps)).apply(0)
        moved[eps] = (before - model.weight.detach()).flatten().tolist()
    assert moved[1e-8] == pytest.approx([1e-2] * 3, rel=1e-3)
    assert moved[1e-3] == pytest.approx([1e-2 * g / (g + 1e-3) for g in grad.flatten().tolist()], rel=1e-3)

    for bad, why in [({"adam_beta1": 1.0}, "adam_beta1"), ({"adam_beta2": -0.1}, "adam_beta2"),
                     ({"adam_eps": 0.0}, "adam_eps"), ({"adam_eps": float("inf")}, "adam_eps")]:
        with pytest.raises(ValueError, match=why):
            Algorithm(**bad)  # type: ignore[arg-type]
    back = spec_from_proto(spec_to_proto(job_spec("e", algorithm=a)), "e").algorithm
    assert (back.adam_beta1, back.adam_beta2, back.adam_eps) == (0.8, 0.99, 1e-3)
    # an older client, which sends none of them: the defaults
    old_client = algorithm_from_proto(scheduler_pb2.Algorithm(learning_rate=1e-3))
    assert (old_client.adam_beta1, old_client.adam_beta2, old_client.adam_eps) == (0.9, 0.999, 1e-8)
    # a zero beta is a valid choice, not "unset"
    assert spec_from_proto(spec_to_proto(job_spec("e", algorithm=Algorithm(adam_beta1=0.0))), "e").algorithm.adam_beta1 == 0.0
