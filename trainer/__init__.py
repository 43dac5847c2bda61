"""The embedded hybrid-parallel trainer (data x tensor x pipeline parallel on torch.distributed).

Stable entry points:

* ``trainer.config.TrainConfig`` (torch-free): ``from_dict``/``to_dict``/``from_json``; errors name
  the key. ``ParallelConfig.check_world(n)``; ``config_from_cli(...)`` for ``trainguard train``.
* ``python -m trainguard.trainer.worker``: one rank, configured by RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/
  MASTER_PORT and ``$TRAINGUARD_JOB_SPEC`` (TrainConfig JSON or a path to it).
* ``trainer.launch.run_standalone(cfg, nproc, json_out) -> int``: fork ``nproc`` local ranks.
* ``trainer.checkpoint.save_checkpoint(trainer, dir)`` / ``load_checkpoint(trainer, dir)`` /
  ``latest_checkpoint(ckpt_dir)`` / ``load_full_model_state(dir)``.

Modules: config (settings), model (GPT and its pipeline stages), data (stdlib byte corpus,
sampler), parallel (mesh, TP/FSDP2/DDP/pipelining), train (the loop), metrics (telemetry
measurements), checkpoint (DCP), worker/launch (processes);
compression and faults are hooks the loop calls; the agent contract is trainguard.run.link and trainguard.agent.wire.
"""
