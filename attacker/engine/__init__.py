"""The optimization: victim jobs in, reconstructions out.

``inversion`` (the LightningModule: per-job losses and the step), ``state`` (each job's stopping,
best iterate and schedule state), ``unknowns`` (the stacked dummies and masks with their Adam rows),
``matching`` (the gradient or replayed-update match terms), ``gradients`` (per-job terms without
per-job weight gradients: ``layer_terms`` one batched formula per layer type, ``factoring`` low-rank
targets, ``recording`` the recorded pass, ``hybrid`` the per-job vjp), ``objectives`` (distances and
loss terms by name), ``optimizers`` (the attack optimizers as one table), ``masks`` (how an attack
treats the client's dropout), ``job_adam`` (Adam and the plateau rule row by row), ``replay`` (a
FedAvg round replayed differentiably) and ``runner`` (groups, Trainer, checkpoints).

Nothing is imported here: ``attacker.attacks`` reads the objective and mask tables while the engine
reads the attack presets, so each side imports the modules it needs.
"""
