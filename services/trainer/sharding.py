"""A policy model sharded over the ranks of a trainer group with torch FSDP2 (``fully_shard``).

Units: every decoder layer, then the root (embeddings, final norm and head: tied embeddings stay
one parameter, in one unit). Gradient shards are *sums*, as everywhere in the trainer (the
trajectory service normalizes the loss weights over the whole step): no division by the world size,
and a plain SUM reduce-scatter (gloo has no PREMUL_SUM). ``TreePolicy`` runs the decoder through
``gyre_decode``, a forward method FSDP knows of, so the root's parameters are gathered before the
embeddings run and its gradients reduced after the head's backward.

Needs the default process group (``services.trainer.group`` builds it).
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import torch


def _decode(self: torch.nn.Module, **kwargs: Any) -> Any:
    return self.get_decoder()(**kwargs)  # type: ignore[operator]


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a transformers causal LM (the ``ModuleList`` of its decoder)."""
    lists = [m for m in model.get_decoder().children() if isinstance(m, torch.nn.ModuleList)]  # type: ignore[operator]
    if len(lists) != 1 or not len(lists[0]):
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard")
    return list(lists[0])


def shard_model(model: torch.nn.Module, *, device: torch.device, bf16: bool = False) -> torch.nn.Module:
    """Shard ``model`` in place over the default process group (one FSDP unit per decoder layer plus
    the root); ``bf16``: bfloat16 parameters in forward and backward, gradients reduced in fp32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    import torch.distributed as dist

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kwargs: dict[str, Any] = {"mesh": mesh}
    if bf16:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # sums, not means
            module.set_force_sum_reduction_for_comms(True)
    setattr(model, "gyre_decode", types.MethodType(_decode, model))
    register_fsdp_forward_method(model, "gyre_decode")
    return model


def _my_shard(whole: torch.Tensor, like: Any) -> torch.Tensor:
    """This rank's shard of ``whole`` as rank 0 holds it (broadcast first; every rank calls this in
    step), laid out like the DTensor ``like``."""
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    dist.broadcast(whole, src=0)
    return distribute_tensor(whole, like.device_mesh, like.placements, src_data_rank=None).to_local()


def send_from_rank0(model: torch.nn.Module, full: dict[str, torch.Tensor] | None, *, device: torch.device) -> None:
    """Give every rank its shards of rank 0's weights, one tensor at a time (``full``: rank 0's whole
    state dict, None on the others), so no rank but 0 ever holds more than one whole tensor. Ranks
    whose model has only its shapes (built on the meta device) get storage first. Also loads a new
    version into a sharded model (a replica group's next weights). Buffers (rotary frequencies) too."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if any(p.device.type == "meta" for p in model.parameters()):
        model.to_empty(device=device)
    for name, value in model.state_dict().items():
        if not isinstance(value, DTensor):
            continue
        whole = full[name].to(device) if full is not None else torch.empty(value.shape, dtype=value.dtype,
                                                                            device=device)
        with torch.no_grad():
            value.to_local().copy_(_my_shard(whole, value))
        del whole
    for _, buffer in model.named_buffers():
        dist.broadcast(buffer, src=0)


def add_full_grads(model: torch.nn.Module, grads: dict[str, torch.Tensor] | None, *, device: torch.device) -> None:
    """Add a whole-model gradient sum (``grads`` on rank 0: one a leaving replica handed off, by
    parameter name; None on the others) to every rank's gradient shards, one tensor at a time.
    A parameter the sum leaves out adds nothing."""
    from torch.distributed.tensor import DTensor

    for name, p in model.named_parameters():
        grad = p.grad
        assert isinstance(grad, DTensor), f"{name} has no sharded gradient (begin the step first)"
        whole = torch.zeros(grad.shape, dtype=grad.dtype, device=device)
        if grads is not None and name in grads:
            whole.copy_(grads[name])
        grad.to_local().add_(_my_shard(whole, grad))
        del whole


def gather_grads(model: torch.nn.Module, *, keep: bool) -> dict[str, torch.Tensor]:
    """The whole gradient sums by parameter name, one tensor at a time (every rank calls this);
    ``keep``: this rank keeps CPU copies (rank 0, for a hand-off), the others drop each at once."""
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        full = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        if keep:
            out[name] = full.detach().to("cpu", copy=True).contiguous()
        del full
    return out


def write_full_state(model: torch.nn.Module, path: Path | None) -> None:
    """The full state dict, gathered one tensor at a time (every rank of the group calls this, in
    step): rank 0 (``path``) writes each tensor into a safetensors file there as it comes, the others
    drop each at once; no rank holds more than one whole tensor."""
    from torch.distributed.tensor import DTensor

    from services.trainer.weights import SafetensorsWriter

    state = model.state_dict()
    writer = SafetensorsWriter(path, [(n, v.dtype, tuple(v.shape)) for n, v in state.items()]) if path else None
    try:
        for name, value in state.items():
            full = value.full_tensor() if isinstance(value, DTensor) else value
            if writer is not None:
                writer.write(name, full)
            del full
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    if writer is not None:
        writer.close()


__all__ = ["add_full_grads", "decoder_layers", "gather_grads", "send_from_rank0", "shard_model", "write_full_state"]
