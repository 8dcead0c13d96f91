"""Asynchronous rollouts (docs/async.md): the last `rollout_ranks` ranks of the torchrun world only
generate, the trainer's mesh is built over the others, and the two sides overlap. The batch
trained at step s was sampled by the policy after at least s - max_staleness updates: at 0 the
rollout ranks wait for every update (the synchronous schedule on separate ranks); at 1 they sample
step s+1's batch while step s trains (verl's one_step_off_policy). Past 0 the trainer's pi_old is
the proximal policy and the engine's the behaviour policy, and the off-policy correction
(offpolicy.py) weighs the lag, pi_old / pi_behaviour: the decoupled PPO objective (Hilton et al.
2021, "Batch size-invariance for policy optimization"; AReaL).

The design, in three choices:
  - two worlds. Every rank joins torchrun's store, then a default process group of its own side:
    the trainer's ranks one, the rollout ranks another (split_world). Every collective the core
    runs over "the world" (rank0_decides, the stop handler, the rollouts' gather, finish_run, the
    checkpoint's and DCP's groups) then runs over its own side, unchanged: no collective of the
    core had to learn of the other side;
  - a bridge: a process group of the trainer's rank 0 and every rollout rank (gloo here, NCCL on
    GPUs), over which the trainer broadcasts the full weights after each step, one tensor at a
    time; the rollout ranks load them in buckets through rollout.refit, which resets vLLM's prefix
    cache (rollout.reset_prefix_cache: never stale KV);
  - batches through the store: rollout rank 0 sets each step's samples under the step's key (in
    pieces: the store takes at most 8 MiB a value), the trainer's ranks wait for it (within
    collective_timeout_s: a dead generator is one line, not a hang). The rollout ranks take
    version v of the policy only when the bound needs it (before sampling step
    v + max_staleness's batch); the trainer announces each version in the store before the bridge
    carries it, so a rollout rank waits in the store (bounded; the trainer's end or a task error
    is seen there) and never in a bridge collective with no sender.
A checkpoint keeps the batches already sampled for the steps after it (their policy's weights are
not the checkpoint's), and a resumed run hands them back: it equals the straight run.

Where the core calls it: model_parallel.init_distributed and setup (split_world), train_ppo.main
(a rollout rank runs `serve` and returns; `start`; the batches in flight before a save),
rollout.make_engine (the trainer's engine is a `Remote`), rollout.rollouts (Remote.receive: the
step's batch), train_ppo.refit (Remote.send). Peers: offpolicy.py, whose correction a
max_staleness past 0 requires (without offpolicy.py only max_staleness=0 runs).
"""
import dataclasses
import datetime
import json
import os
import signal
import time

import torch
import torch.distributed as dist

import model_parallel
import rollout
from config import ConfigError


@dataclasses.dataclass
class Options:
    """This file's options, a part of config.Config: config.py runs this class and `check` alone,
    from this file's text, before torch loads (README, "Extensions")."""

    # ---- asynchronous rollouts (async_rollout.py; docs/async.md) ----
    # the last rollout_ranks ranks of the torchrun world only generate (each rollout_tp_size of
    # them one engine), while the trainer's mesh (dp x cp x tp) is built over the others.
    # 0 = colocated: every rank generates, then trains
    rollout_ranks: int = 0
    # the batch trained at step s was sampled by the policy after >= s - max_staleness updates.
    # 0: the rollout ranks wait for each update (the synchronous schedule, on separate ranks);
    # 1: they sample step s+1's batch while step s trains (one step off-policy). Past 0 it needs
    # the off-policy correction: offpolicy_is with old_logprobs=trainer
    max_staleness: int = 0


def check(cfg):
    """This file's refusals, one line each (config.validate runs it, before torch loads; the world's
    sizes are config._validate_sizes's)."""
    if not cfg.rollout_ranks:
        return
    # the correction is offpolicy.py's (which refuses it under old_logprobs=engine): without that
    # file, its option reads as off
    if cfg.max_staleness and getattr(cfg, "offpolicy_is", "off") == "off":
        raise ConfigError(f"max_staleness={cfg.max_staleness} trains on samples of an older "
                          f"policy, which runs collapse on without the off-policy correction: "
                          f"set offpolicy_is=token (or sequence, geometric) with "
                          f"old_logprobs=trainer, or max_staleness=0")
    refused = {"replay_rollouts": "a replay generates nothing",
               "eval_every": "validation samples on the trainer's ranks, which hold no engine",
               "lora_rank": "the adapters would travel as tensors (not built: docs/async.md)"}
    for key, why in refused.items():
        if getattr(cfg, key, None):
            raise ConfigError(f"{key}={getattr(cfg, key)} cannot run with rollout_ranks="
                              f"{cfg.rollout_ranks}: {why}")


def idle(cfg):
    """This file's options that do nothing in this run, as (key, why)."""
    if not cfg.rollout_ranks:
        yield "max_staleness", ("does nothing with rollout_ranks=0 (every rank generates, then "
                                "trains)")
    elif cfg.max_staleness > 1:
        yield "max_staleness", ("adds only lag above 1: each version's transfer is a meeting of "
                                "both sides, so a step takes what it takes at 1 (docs/async.md)")


# -----------------------------------------------------------------------------
# Two worlds and the bridge. torchrun's store (or rank 0's, launched otherwise) is shared by both
# sides: each side's default group is built through a prefix of its own, the batches and the
# start of the run travel through another.

_SIDE = {}  # store: this run's keys; bridge: the group that carries the weights (else None)


def split_world(rollout_ranks, backend, timeout_s):
    """Every rank, before init_process_group (model_parallel.init_distributed): the arguments of
    its side's default group, the trainer's ranks 0..T-1 or the rollout ranks T..world-1 (there
    renumbered from 0). The trainer's rank 0 and the rollout ranks also build the bridge."""
    store, rank, world = next(dist.rendezvous("env://"))
    trainers = world - rollout_ranks
    generates = rank >= trainers
    # (a restarted run reads no key of the dead round: restarts need a fresh store a round,
    # config._validate_launch's TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as the core's groups do)
    run = dist.PrefixStore("async/", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    _SIDE.update(store=run, bridge=None, timeout=timeout, generates=generates)
    if rank == 0 or generates:  # bridge rank 0 is the trainer's rank 0
        members = dist.PrefixStore("bridge/", run)
        at = rank - trainers + 1 if generates else 0
        if "nccl" in backend:  # GPU only: the weights go GPU to GPU, timed out as gloo's
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout  # (private in torch 2.13: new_group sets it so)
            _SIDE["bridge"] = dist.ProcessGroupNCCL(members, at, rollout_ranks + 1, options)
        else:
            _SIDE["bridge"] = dist.ProcessGroupGloo(members, at, rollout_ranks + 1, timeout)
    if generates:  # what vLLM's external launcher reads: the rollout side's world
        os.environ.update(RANK=str(rank - trainers), WORLD_SIZE=str(rollout_ranks))
    side = "rollout" if generates else "trainer"
    return dict(store=dist.PrefixStore(side, run), rank=rank - trainers * generates,
                world_size=rollout_ranks if generates else trainers)


def generates_only(cfg):
    """Whether this rank is one of the rollout ranks (the last rollout_ranks of the world)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return int(os.environ.get("RANK", "0")) >= world - cfg.rollout_ranks


def _stop(line):
    """Stop this rank: rank 0 of its side with `line`, the others with exit 1."""
    raise SystemExit(line if dist.get_rank() == 0 else 1)


def _late(what):
    seconds = _SIDE["timeout"].total_seconds()
    _stop(f"async rollouts: {what} within collective_timeout_s={seconds:g}: a rank of the other "
          f"side died or hangs (its log says why)")


def _waited(key, what):
    """The store's value under `key`, waiting at most the run's collective_timeout_s: one line
    if the other side sent nothing by then."""
    try:
        _SIDE["store"].wait([key], _SIDE["timeout"])
    except (RuntimeError, dist.DistError):
        _late(what)
    return _SIDE["store"].get(key)


# torch 2.13's TCPStore refuses a value over 8 MiB: a batch goes in pieces, their count last
CHUNK = 4 * 2**20


def _put(key, text):
    """`text` under `key` (one rank of a side sets it), in pieces of at most CHUNK bytes."""
    data = text.encode()
    pieces = range(0, max(len(data), 1), CHUNK)
    for i, at in enumerate(pieces):
        _SIDE["store"].set(f"{key}/{i}", data[at:at + CHUNK])
    _SIDE["store"].set(key, str(len(pieces)))


def _got(key, what):
    """What _put set under `key`, once it is all there (within collective_timeout_s)."""
    count = int(_waited(key, what))
    return b"".join(_SIDE["store"].get(f"{key}/{i}") for i in range(count)).decode()


def _dropped(key):
    for i in range(int(_SIDE["store"].get(key))):
        _SIDE["store"].delete_key(f"{key}/{i}")
    _SIDE["store"].delete_key(key)


def _error():
    """The rollout ranks' error line, if they stopped on one (a bad prompt or observation)."""
    return _SIDE["store"].get("error").decode() if _SIDE["store"].check(["error"]) else None


def _bridged(op, what):
    """Run one transfer over the bridge, or stop with one line if the other side is gone (the
    rollout ranks' own error, where they stopped on one)."""
    try:
        op().wait()
    except (RuntimeError, dist.DistError) as e:
        _stop(_error() or f"async rollouts: {what} failed, the other side is gone ({e})"
              .splitlines()[0])


def _handshake(device):
    """Both ends of the bridge, at the start of a version's transfer: a barrier (an all-reduce of
    one number), so that the sender's wait for the rollout ranks is measured apart."""
    _bridged(lambda: _SIDE["bridge"].allreduce([torch.zeros(1, device=device)]),
             "the weight transfer")


def _broadcast_text(text, device):
    """Bridge rank 0's `text` (None elsewhere), on every bridge rank: its length, then its bytes."""
    data = torch.tensor(list(text.encode()) if text is not None else [], dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    _bridged(lambda: _SIDE["bridge"].broadcast(size, 0), "the weight transfer")
    data = data.to(device) if text is not None else torch.empty(size.item(), dtype=torch.uint8,
                                                                device=device)
    _bridged(lambda: _SIDE["bridge"].broadcast(data, 0), "the weight transfer")
    return bytes(data.tolist()).decode()


# -----------------------------------------------------------------------------
# The trainer's side: a stand-in for the engine, which the core hands the weights and asks for
# batches.

def start(cfg, model_dir, progress):
    """Every trainer rank, once the run knows where it starts (train_ppo.main): `progress`, the
    steps done and the prompt stream's position, with the batches in flight a resumed run's
    checkpoint kept. Rank 0 hands those back to the store, then tells the rollout ranks where to
    start: the model dir (after any SFT warm-up), the first step they sample, the stream's position
    there, and whether the resumed policy comes first (train_ppo.announce sends it)."""
    # the batches of the steps right after the checkpoint's (a run resumed without rollout ranks
    # and saved again carries older ones: those are not its)
    kept = []
    for payload in progress.get("in_flight", []):
        if json.loads(payload)["step"] == progress["step"] + len(kept):
            kept.append(payload)
    _SIDE.update(start=progress["step"], version=progress["step"] or 1)
    if dist.get_rank() != 0:
        return
    print(f"async rollouts: {cfg.rollout_ranks} more rank(s) generate, at most "
          f"{cfg.max_staleness} step(s) ahead of this mesh", flush=True)
    for k, payload in enumerate(kept):
        _put(f"batch{progress['step'] + k}", payload)
    drawn = progress["prompts_drawn"] + sum(json.loads(p)["drawn"] for p in kept)
    # the dtype as model_parallel.setup resolved it ("auto": bf16 on a GPU), for the engine's
    _SIDE["store"].set("start", json.dumps(dict(
        model_dir=model_dir, step=progress["step"], first=progress["step"] + len(kept),
        prompts_drawn=drawn, resumed=0 < progress["step"] < cfg.steps, dtype=cfg.dtype)))


class Remote:
    """The trainer's engine under rollout_ranks (rollout.make_engine): receive(step) is the step's
    batch, sampled by the rollout ranks; send(policy) the update's weights, to them. Every trainer
    rank has one; rank 0 holds the bridge."""
    serves_adapters = False  # every weight is sent (check refuses LoRA)

    def __init__(self, cfg, device):
        self.cfg, self.device = cfg, device
        self.dtype = rollout.engine_dtype(cfg)  # the rollout ranks' engine's

    def receive(self, step):
        """Collective in effect (every trainer rank reads it): the step's samples {global index:
        sample}, the prompts drawn and the rollout's metrics, with the batch's staleness (steps
        between the policy that trains and the one that sampled) and each side's seconds."""
        t = time.time()
        batch = json.loads(_got(f"batch{step}", f"no batch for step {step + 1} came"))
        if "error" in batch:  # the rollout ranks met a bad prompt or observation
            raise SystemExit(batch["error"] if dist.get_rank() == 0 else 1)
        lag = step - batch["version"]  # all of a batch is sampled by one version
        found = dict(batch["found"], async_staleness_mean=lag, async_staleness_max=lag,
                     async_generate_s=batch["busy_s"], async_generate_wait_s=batch["wait_s"],
                     async_trainer_wait_s=time.time() - t)
        if dist.get_rank() == 0 and step > _SIDE["start"]:  # every rank has read the step before
            _dropped(f"batch{step - 1}")
        return {s["index"]: s for s in batch["samples"]}, batch["drawn"], found

    def in_flight(self, done):
        """The batches sampled for the steps after `done` that a resumed run could not sample
        again (their policy's weights are not the checkpoint's), for the checkpoint: those of
        steps done .. done + max_staleness - 1, as the store holds them."""
        last = min(done + self.cfg.max_staleness, self.cfg.steps)
        return [_got(f"batch{s}", f"no batch for step {s + 1} came") for s in range(done, last)]

    def send(self, policy):
        """Collective (every trainer rank: the full weights are gathered). The policy after
        `version` updates to the rollout ranks, if they will take it: they take version v before
        sampling step v + max_staleness's batch, and none after the last step's. Returns the
        transfer's metrics: seconds waiting for the rollout ranks to take it, seconds sending,
        bytes."""
        # the version this one carries: a resumed run's first is the checkpoint's policy
        version = self.version = _SIDE["version"]
        _SIDE["version"] += 1
        if version != _SIDE["start"] and version > self.cfg.steps - 1 - self.cfg.max_staleness:
            return {}
        self.waited, self.sent_s = 0.0, 0.0
        found = rollout.refit(self, model_parallel.iter_full_params(policy, self.dtype),
                              self.cfg.refit_bucket_mb)
        return dict(found, async_send_wait_s=self.waited, async_send_s=self.sent_s)

    # rollout.refit's engine interface: the buckets go over the bridge as they come
    def load_weights(self, named_tensors):
        if _SIDE["bridge"] is None:  # trainer ranks other than 0 only gather
            return
        t = time.time()
        for name, tensor in named_tensors:
            dtype = str(tensor.dtype).removeprefix("torch.")
            _broadcast_text(json.dumps([name, list(tensor.shape), dtype]), self.device)
            _bridged(lambda: _SIDE["bridge"].broadcast(tensor.contiguous(), 0),
                     "the weight transfer")
        self.sent_s += time.time() - t

    def finish_refit(self):
        if _SIDE["bridge"] is not None:
            _broadcast_text("", self.device)  # the end of this version

    def wake_up(self, tags):
        if "weights" in tags and _SIDE["bridge"] is not None:  # a version's start
            if _error():  # the rollout ranks stopped on a task error: say it, not the transfer
                _stop(_error())
            # announced in the store, where the rollout ranks wait for it (bounded, and a run
            # that ends instead says so: `done`); then both ends meet on the bridge
            _SIDE["store"].set(f"version{self.version}", "1")
            t = time.time()
            _handshake(self.device)
            self.waited = time.time() - t

    def sleep(self):
        pass

    def shutdown(self):
        """The run's end (rollout.close): the rollout ranks may go (they take no more versions),
        then the trainer's default group goes."""
        if dist.get_rank() == 0:
            _SIDE["store"].set("done", "1")
        _SIDE["bridge"] = None
        dist.destroy_process_group()


# -----------------------------------------------------------------------------
# The rollout ranks' side: sample each step's batch with the newest policy the bound asks for.

def _announced(version):
    """A rollout rank, before taking `version` over the bridge: wait in the store for the trainer
    to announce it (within collective_timeout_s); exit 0 if the trainer ended its run instead
    (a stop signal: no version is coming)."""
    deadline = time.time() + _SIDE["timeout"].total_seconds()
    while not _SIDE["store"].check([f"version{version}"]):
        if _SIDE["store"].check(["done"]):
            raise SystemExit(0)
        if time.time() > deadline:
            _late(f"the policy after {version} updates did not come")
        time.sleep(0.01)


def _received(device):
    """Yield (name, full tensor) as bridge rank 0 sends them, until the end of the version."""
    _handshake(device)
    while True:
        header = _broadcast_text(None, device)
        if not header:
            return
        name, shape, dtype = json.loads(header)
        tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        _bridged(lambda: _SIDE["bridge"].broadcast(tensor, 0), "the weight transfer")
        yield name, tensor


def serve(cfg, task):
    """A rollout rank's whole run (train_ppo.main calls it and returns): its side's world, then the
    trainer's start (the model dir after any SFT warm-up, the step, the prompt stream's position),
    its engine, and then each step's batch, sampled with the policy version the bound needs."""
    # a stop signal (preemption) lets the batch in flight finish: the trainer's checkpoint keeps it
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _, _, device = model_parallel.init_distributed(cfg.collective_timeout_s, cfg.rollout_ranks)
    start = json.loads(_waited("start", "the trainer did not start"))
    task = rollout.make_task(cfg, start["model_dir"]) if task is None else task
    # this side is a colocated run of rollout_ranks ranks (its own world) that never trains
    cfg = dataclasses.replace(cfg, rollout_ranks=0, dtype=start["dtype"])
    engine = rollout.make_engine(cfg, start["model_dir"], device, task.eos_id)
    # GPU: no training shares this device, so the engine stays awake (rollout.rollouts puts it to
    # sleep for the update; vLLM's sleep drops the weights, and the next batch may come before
    # the next version)
    engine.sleep = lambda: None
    version, position = start["step"], start["prompts_drawn"]
    if start["resumed"]:  # the checkpoint's policy first
        _announced(version)
        rollout.refit(engine, _received(device), cfg.refit_bucket_mb)
    for step in range(start["first"], cfg.steps):
        t = time.time()
        while version < step - cfg.max_staleness:  # the bound: take the next version first
            _announced(version + 1)
            rollout.refit(engine, _received(device), cfg.refit_bucket_mb)
            version += 1
        waited, t = time.time() - t, time.time()
        try:
            every, drawn, found = rollout.rollouts(engine, task, cfg, step, position)
            batch = dict(step=step, samples=list(every.values()), drawn=drawn, found=found,
                         version=version, wait_s=waited, busy_s=time.time() - t)
        except SystemExit as e:  # rollout.gather_or_stop's task error: the trainer stops on it
            batch = dict(error=str(e.code))
            if dist.get_rank() == 0:  # also where the trainer looks before sending weights
                _SIDE["store"].set("error", str(e.code))
        if dist.get_rank() == 0:
            _put(f"batch{step}", json.dumps(batch))
        if "error" in batch:
            break
        position += drawn
    _SIDE["bridge"] = None
    rollout.close(engine)
