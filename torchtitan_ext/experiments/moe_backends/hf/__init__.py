"""Hugging Face model families: their torchtitan model configs and checkpoint conversion.

A model is described by its Hugging Face ``config.json`` (a dict). ``architectures`` turns
such a config into a torchtitan ``ModelSpec`` that computes what transformers computes for
it (Qwen3-MoE, OLMoE, Mixtral, DeepSeek-V3), refusing a flag it cannot honour;
``state_dict_adapters`` converts between the Hugging Face and the torchtitan state dicts
(torchtitan's ``CheckpointManager`` uses them for ``checkpoint.initial_load_in_hf`` and
``checkpoint.last_save_in_hf``); ``checkpoint_files`` inspects a checkpoint folder (shards,
tensor names and shapes) without reading any weight. ``torchtitan_features`` registers the
start-up checks and the checkpoint manager that writes ``config.json`` beside a saved model.
"""
