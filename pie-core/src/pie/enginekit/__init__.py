"""The engine kit: what every engine would otherwise write its own way, kept here once.

- :mod:`~pie.enginekit.engine`: the hook implementations an engine object inherits (``DeviceEngine``: page
  hooks, transfers, weight uploads over one backend per device; ``PassPlanEngine``: plus the pass plan;
  ``ShaderEngine``: plus the Slang kernels).
- :mod:`~pie.enginekit.catalogue`: the host side of catalogue kernels every device engine's launchers share
  (projection and embedding argument order, attention's options, a page pool's layer, eta epilogues' checks).
- :mod:`~pie.enginekit.regions`, :mod:`~pie.enginekit.blocks`: described regions and decoder layers read once
  for an engine that runs them as one unit (argument positions; a layer's roles, weight shapes and reads).
- :mod:`~pie.enginekit.tensor`: device tensors and the size-classed ``BufferPool``.
- :mod:`~pie.enginekit.transfers`: downloads and page reads, writes and copies over two copy primitives.
- :mod:`~pie.enginekit.compile_cache`: the checksummed, atomic cache of compiled kernels, keyed on every input;
  :mod:`~pie.enginekit.host_compiler`: host shared libraries built through it.
- :mod:`~pie.enginekit.devices`, :mod:`~pie.enginekit.host`: device ordering and host facts for probing.
- :mod:`pie.enginekit.shaders`: the shared Slang kernels (SPIR-V and WGSL), their compiler and launchers.
"""
