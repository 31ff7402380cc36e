"""The options of the attention kernels, declared: ``OPTIONS`` (name -> ``fastpos.fields.Field``,
its default, valid values and comment).

The kernel registry ``fastpos.ops.features`` reads them (``features.OPTIONS``,
``features.OPTION_DEFAULTS``, the option fields of ``features.Kernel``); the config's schema
reads them as ``model.kernel_options`` (``fastpos.config_schema``). They sit apart from the
registry's jax code so that a config can be built without importing jax. A new option is one
line here (and the ``Kernel`` field and map that read it).
"""

from __future__ import annotations

import types

from fastpos import fields

OPTIONS = types.MappingProxyType(
    {
        "num_features": fields.integer(64, 1),  # m, the random features (favor, prf, trf, ...)
        "nu": fields.integer(1, 1),  # DPFP's nu
        "eps": fields.number(1e-6, 0, low_open=True),  # the denominator guard
        "redraw": fields.boolean(False),  # redraw the random projections every training step
        "seed": fields.seed(),  # seeds the random projections
    }
)
