"""Reference Flax models for zbjax's tests, benchmarks and training demo.

Every model module (``mlp``, ``gpt``, ``gpt_nnx``, ``gpt_scan``) has the same small surface::

    cfg = gpt.GPTConfig(num_layers=4, stage_boundaries=gpt.balanced_boundaries(cfg, 4))
    params = gpt.init_params(jax.random.key(0), cfg)          # plain pytree (nested dict) of arrays
    batch = gpt.make_batch(jax.random.key(1), cfg, batch_size=8)  # dict, leading axis = batch
    loss_fn = gpt.make_loss_fn(cfg)                           # loss_fn(params, batch, key=None)
    loss = loss_fn(params, batch)                             # float32 scalar, mean over the batch
    print(gpt.describe(cfg))

Conventions:

- The config is a frozen dataclass with tiny defaults, so that a jitted ``value_and_grad`` compiles
  in about a second on CPU. Everything is float32.
- ``make_loss_fn(cfg)`` returns ``loss_fn(params, batch, key=None)``. ``key`` (a PRNG key) is
  required exactly when ``cfg.dropout_rate > 0``; with dropout off the function is the two-argument
  ``loss_fn(params, batch)`` that ``zbjax.pipeline`` traces. The loss is the mean over the batch
  (and over tokens for the GPTs), so the mean over microbatches equals the loss of the full batch.
- ``cfg.stage_boundaries`` lists layer (block) indices after which ``zbjax.stage_boundary`` is
  placed on the activations; ``balanced_boundaries(cfg, num_stages)`` chooses them so that the
  stages, embedding and head included, have about equal forward cost. ``gpt_scan`` runs its
  blocks in one ``nn.scan`` and takes no markers: it is the model for the auto-partitioner.
- ``models.mlp`` also holds the chain helpers the others share (``balanced_cuts``,
  ``check_boundaries``). This file only documents: with an editable install made before it
  existed, ``models`` may import as a namespace package that never runs it, so nothing here
  may be needed at run time.
- Data are synthetic and generated from a fixed "teacher" (``cfg.data_seed``), so that a model can
  learn them and a demo's loss goes down; nothing is downloaded.
- The multi-branch models (``multimodal``, ``two_tower``, ``dlrm``, ``candle_uno``) share this
  surface but take ``branch_boundaries``/``layers_per_stage``/``head_stage`` instead of
  ``stage_boundaries``: cut at the markers, each branch is its own stage(s) and the fusion head a
  last stage; ``num_marker_stages(cfg)`` and ``stage_owners(cfg)`` say how many and which params
  each reads (rules and helpers in ``models.two_tower``).
"""
