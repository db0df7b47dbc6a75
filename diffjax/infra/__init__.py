"""How a run executes: :mod:`.runtime` (the ``Runtime``, decided once), :mod:`.sharding` (meshes
and the sharding rules), :mod:`.storage` (local paths and ``gs://``), :mod:`.compile_options`,
:mod:`.flops` (model FLOPs and MFU) and :mod:`.machine` (the machine record of a run)."""
