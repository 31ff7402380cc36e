"""``none``: no positional information (a bag of tokens; the baseline row of every table)."""

from fastpos.positional.base import Scheme


class NoPositional(Scheme):
  """No hooks; works with every kernel, causal or not, 1D and 2D."""

  scheme_name = "none"
  hooks = ()
  supports_2d = True
  packs = ("softmax", "linear")


SCHEMES = {"none": NoPositional}
