"""MoE backends experiment: routed experts whose compute backend is a config field.

``flavors`` registers the flavors, ``toml_keys`` the ``[moe]`` TOML keys, ``startup_checks``
and ``torchtitan_features`` the start-up checks, ``run_description`` the run metadata and
start-up note; the layer modules (experts, router, dispatcher, moe) import without
torchtitan's Trainer.

Shape suffixes (``x_TD`` is a [T, D] tensor), as in torchtitan's ``models/common/moe.py``:

- B batch, L sequence length (only ever the sequence), D model dim, F expert hidden dim,
  V vocabulary.
- E experts, e local experts (E / EP degree), K top_k, W ranks of the EP group.
- T tokens (B*L); S = T*K routed slots in token-major order (slot ``s = t*K + k``).
- R rows of an expert-grouped buffer (expert segments in expert order; under EP the rows
  this rank received; padding rows included where a backend pads); X rows of x as given
  to a kernel (T routed, R grouped); N rows of one expert's segment; M the largest
  expert's row count (padded batched matmul).
- G groups of a grouped buffer (one expert, or one (local expert, source rank) block);
  P the (source rank, token) pairs of the symmetric-memory exchange; J = min(K, W).
- A trailing 1 means one entry more (``block_start_G1``: [G + 1] boundaries).
- Index names say what they map: ``dest_row_S`` (slot -> grouped row), ``row_slot_S``
  (grouped row -> slot).
"""
