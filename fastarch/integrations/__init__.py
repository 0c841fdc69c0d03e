"""Bridges from other frameworks onto fastarch's ops. Each submodule needs its framework, installed through an
optional extra (``fastarch[hf]`` for :mod:`fastarch.integrations.transformers`); importing this package
imports none of them."""
