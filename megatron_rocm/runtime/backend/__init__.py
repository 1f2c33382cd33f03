"""The native backend behind upstream's TransformerEngine spec.

Upstream's default ``--transformer-impl transformer_engine`` builds every layer from the
wrappers in ``megatron/core/extensions/transformer_engine.py`` (``TENorm``, ``TELinear``,
``TELayerNormColumnParallelLinear``, ``TEDotProductAttention``, the grouped linears) and picks
them through ``TESpecProvider``. Without TransformerEngine those wrappers are defined on a
``MagicMock`` and model build dies. The ``te-spec-backend`` patch binds the same names to the
modules here whenever ``import transformer_engine`` fails (``HAVE_TE`` stays False: it means
"TE is installed"), so upstream's own command lines, examples and unit tests run on plain
PyTorch + Triton. Where TE is installed (TE-ROCm, say) upstream's TE path is used unchanged.

One module per TE family: ``norm`` (TENorm), ``linear`` (TELinear and the column/row parallel
linears), ``layernorm_linear`` (the norm in front of a column-parallel linear), ``attention``
(TEDotProductAttention over SDPA, with ``context_parallel`` and ``packed_attention`` behind
it), ``grouped_linear`` (MoE experts), ``spec_provider`` (the TESpecProvider stand-in),
``options`` (TE-only options rejected at argument validation), and ``te_names`` (the names the
patch binds).

Everything here imports upstream's ``megatron.core`` lazily or at class-definition time only:
the module is imported from inside the patched tree, never by the patch tool.
"""
