"""Run a test body on N gloo ranks on CPU, the way torchrun would launch it.

    from _dist import run_ranks, grid_groups   # pytest puts tests/ on sys.path

    def _body(rank, world_size, n):             # module level: spawn pickles it by name
        tp_group, cp_group = grid_groups((2, 2))  # rank = cp_rank * 2 + tp_rank
        ...                                     # raise (assert) to fail the test

    def test_thing():
        run_ranks(_body, 4, 123)

run_ranks raises if any rank raises (with that rank's traceback), and the other ranks are killed
so a rank stuck in a collective cannot hang the suite.
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port():
    # the OS picks an unused port; it is released again before the ranks bind it, which is a
    # small race but fine for tests that each start one group
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank, fn, world_size, port, args):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    # the CPU suite stays on CPU on a GPU machine (CUDA starts lazily)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(1)  # the ranks share a couple of cores: avoid oversubscription
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        if dist.is_initialized():
            # rank 0 hosts the store every group is built through: a body with no collective at
            # its end (a by-hand check) could let rank 0 exit while another rank still reads the
            # store, which fails that rank with "Connection reset by peer"
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # The body passed: leave without Python's shutdown. Groups its meshes and FSDP modules still
    # reference keep gloo threads alive, and one of them freeing a tensor during interpreter
    # shutdown can abort a rank that passed ("terminate called without an active exception",
    # seen under load). train_ppo.main frees its own (model_parallel.release_mesh).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def gloo_threads():
    """Names of this process's live gloo threads (Linux): none once every group is freed."""
    names = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/comm") as f:
            names.append(f.read().strip())
    return [name for name in names if "gloo" in name]


def run_ranks(fn, world_size, *args):
    """Call fn(rank, world_size, *args) on world_size spawned gloo ranks; raise if any fails."""
    mp.spawn(_worker, args=(fn, world_size, _free_port(), args), nprocs=world_size, join=True)


def grid_groups(shape):
    """This rank's process group along each dim of a rank grid of the given shape.

    Ranks fill the grid row-major, last dim innermost (like init_device_mesh, so shape (cp, tp)
    means rank = cp_rank * tp + tp_rank). Collective: every rank must call it with the same shape.
    Returns a list with one group per dim (a size-1 dim gives a group of one rank)."""
    grid = torch.arange(dist.get_world_size()).reshape(shape)
    mine = []
    for dim, size in enumerate(shape):
        for line in grid.movedim(dim, -1).reshape(-1, size).tolist():
            group = dist.new_group(line)  # every rank creates every group, in the same order
            if dist.get_rank() in line:
                mine.append(group)
    return mine
