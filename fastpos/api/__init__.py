"""The modules behind the public names of ``fastpos`` (``fastpos.__all__``): the flat layer
constructors, ``load``, ``generate``, ``CachedDecoding``, scheme registration. Import them from
``fastpos`` itself; this package is the layer that may use every other one (tests/test_layers.py).
"""
