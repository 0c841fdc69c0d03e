"""Oracles and checks shared by fastarch's tests and benchmarks: the seed guides' own code
(:mod:`fastarch.testing.guides`) and drop-in checks against it (:mod:`fastarch.testing.dropin`)."""
